"""The ELF reader against libraries an ordinary user crafted (issue 36), end to end.

The real libtorch_cpu.so still gives what readelf lists, as fast as before. An
ordinary user's process maps a 2 GiB sparse crafted libtorch_cpu.so and the root
doctor refuses it in one line, in seconds, in little memory; a job-owned
torch/version.py with terminal escapes is shown escaped; a crafted libcudart.so is
that library's failed check. (The reader on crafted buffers:
tests/unit/parsers/test_elf_symbols_hostile.py.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from perfmon.parsers.elf_symbols import find_function_symbols, load_segments

from tests.conftest import _reap, wait_for
from tests.e2e.test_security import as_job_user, ordinary_user
from tests.unit.parsers.test_elf_symbols_hostile import GIB2, CraftedElf, mapped, sparse_elf

ELF_USER = "perfmon-testelf"  # its own name: test_security's users come and go in parallel
TORCH_SPEC = importlib.util.find_spec("torch")
LIBTORCH = (Path(TORCH_SPEC.origin).parent / "lib" / "libtorch_cpu.so"
            if TORCH_SPEC is not None and TORCH_SPEC.origin else None)


def readelf_functions(path: Path, prefixes: tuple[str, ...]) -> dict[str, set[tuple]]:
    """Defined FUNC symbols of `readelf --dyn-syms -W` starting with each prefix."""
    out = subprocess.run(["readelf", "--dyn-syms", "-W", str(path)], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    found: dict[str, set[tuple]] = {p: set() for p in prefixes}
    for fields in (line.split() for line in out.splitlines()):
        if len(fields) < 8 or fields[3] != "FUNC" or fields[6] == "UND":
            continue
        for prefix in prefixes:
            if fields[7].startswith(prefix):
                found[prefix].add((fields[7], int(fields[1], 16), int(fields[2], 0)))
    return found


@pytest.mark.skipif(LIBTORCH is None, reason="torch is not installed")
def test_the_installed_libtorch_gives_what_readelf_lists_as_fast_as_before() -> None:
    from perfmon.parsers.wait_symbols import C10D_PREFIX
    from perfmon.probes.torch_symbols import ENGINE_EXECUTE_SYMBOL, RECORD_FUNCTION_SYMBOLS

    assert LIBTORCH is not None
    prefixes = (*RECORD_FUNCTION_SYMBOLS, ENGINE_EXECUTE_SYMBOL, C10D_PREFIX,
                "_ZN5torch8autograd6Engine")  # wider ones: dozens and hundreds of symbols
    with mapped(LIBTORCH) as buf:
        find_function_symbols(buf, prefixes)  # its pages in the page cache
        started = time.monotonic()
        found = find_function_symbols(buf, prefixes)
        elapsed_s = time.monotonic() - started
        assert load_segments(buf)
    expected = readelf_functions(LIBTORCH, prefixes)
    assert {p: {(s.name, s.address, s.size_bytes) for s in v} for p, v in found.items()} \
        == expected
    assert len(expected["_ZN5torch8autograd6Engine"]) > 10
    assert elapsed_s < 0.5  # about 10 ms on an idle core, as before the checks


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates a user and reads its job")
MAP_AND_SLEEP = ("import mmap, sys, time; files = [open(p, 'rb') for p in sys.argv[1:]]; "
                 "maps = [mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) for f in files]; "
                 "print('ok', flush=True); time.sleep(120)")
# Runs a command, then writes the peak RSS (KiB) of its largest descendant to argv[1].
PEAK_RSS = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[2:]).returncode; "
            "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN)"
            ".ru_maxrss)); sys.exit(rc)")
AGENT = Path(sys.executable).parent / "perfmon-agent"


@pytest.fixture(scope="module")
def elf_user() -> Iterator[pwd.struct_passwd]:
    with ordinary_user(ELF_USER) as user:
        yield user


@pytest.fixture
def user_dir(elf_user: pwd.struct_passwd) -> Iterator[Path]:
    """A folder the ordinary user owns."""
    home = Path(tempfile.mkdtemp(prefix="perfmon-elf-", dir="/tmp"))
    os.chown(home, elf_user.pw_uid, elf_user.pw_gid)
    home.chmod(0o755)
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def mapping_process(elf_user: pwd.struct_passwd) -> Iterator[Callable[..., int]]:
    """Start, as the ordinary user, a Python process that maps files and sleeps."""
    started: list[subprocess.Popen] = []

    def start(*paths: Path) -> int:
        for path in paths:
            for p in (path, *path.parents):
                if p == Path("/tmp"):
                    break
                os.chown(p, elf_user.pw_uid, elf_user.pw_gid)
        proc = subprocess.Popen(as_job_user(elf_user, sys.executable, "-c", MAP_AND_SLEEP,
                                            *map(str, paths)),
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        started.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ok"
        wait_for(lambda: all(str(p) in Path(f"/proc/{proc.pid}/maps").read_text()
                             for p in paths), 10, "the files to be mapped")
        return proc.pid

    yield start
    for proc in started:
        _reap(proc)


def run_doctor(*args: str, peak_file: Path | None = None) -> subprocess.CompletedProcess:
    """`perfmon-agent doctor ARGS` as root, on a wide table; reaped whatever happens."""
    prefix = (sys.executable, "-c", PEAK_RSS, str(peak_file)) if peak_file else ()
    proc = subprocess.Popen([*prefix, str(AGENT), "doctor", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "COLUMNS": "1000"})
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        _reap(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@needs_root
def test_a_users_2_gib_sparse_libtorch_is_refused_by_the_doctor_in_one_line(
        user_dir, mapping_process, tmp_path) -> None:
    library = sparse_elf(user_dir / "libtorch_cpu.so", ".dynstr")
    pid = mapping_process(library)
    peak_file = tmp_path / "peak_kib"
    started = time.monotonic()
    run = run_doctor("--pid", str(pid), peak_file=peak_file)
    elapsed_s = time.monotonic() - started
    assert run.returncode == 1, run.stderr  # its normal "something degrades"
    assert "Traceback" not in run.stdout + run.stderr
    [line] = [li for li in run.stdout.splitlines() if ".dynstr" in li]
    assert (f"cannot read symbols of {library}: .dynstr is {GIB2 - 4096} bytes, over the cap "
            "of 67108864 (64 MiB): symbol table not read") in line
    assert elapsed_s < 20  # 26.8 s before; py-spy's dump of the job is most of it now
    peak_rss_mib = int(peak_file.read_text()) / 1024
    assert peak_rss_mib < 300, peak_rss_mib  # 4.37 GB before


@needs_root
def test_a_job_owned_torch_version_with_terminal_escapes_is_shown_escaped(
        elf_user, user_dir, mapping_process) -> None:
    # A pip-like layout the user owns: torch/lib/libtorch_cpu.so beside torch/version.py.
    lib = user_dir / "site" / "torch" / "lib"
    lib.mkdir(parents=True)
    (lib / "libtorch_cpu.so").write_bytes(CraftedElf().buf)
    (lib.parent / "version.py").write_text('__version__ = "2.1\x1b[2J\x1b]0;owned\x07"\n')
    os.chown(lib.parent / "version.py", elf_user.pw_uid, elf_user.pw_gid)
    pid = mapping_process(lib / "libtorch_cpu.so")
    shown = "2.1\\x1b[2J\\x1b]0;owned\\x07"
    table = run_doctor("--pid", str(pid))
    assert "\x1b" not in table.stdout and "\x07" not in table.stdout
    assert f"(torch {shown})" in table.stdout
    document = json.loads(run_doctor("--pid", str(pid), "--json").stdout)
    [torch] = [c for c in document["checks"] if c["name"] == "libtorch"]
    assert torch["facts"]["torch_version"] == shown


@needs_root
def test_a_users_crafted_cuda_library_is_that_librarys_failed_check(
        user_dir, mapping_process) -> None:
    # libcudart.so.12 whose .dynsym links past the section table: an IndexError before.
    torch_lib = user_dir / "libtorch_cpu.so"
    torch_lib.write_bytes(CraftedElf().buf)
    cudart = user_dir / "libcudart.so.12"
    cudart.write_bytes(CraftedElf().set(CraftedElf().section(1) + 40, "I", 0xFFFFFFFF).buf)
    pid = mapping_process(torch_lib, cudart)
    run = run_doctor("--pid", str(pid), "--json")
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    found = {c["name"]: c for c in json.loads(run.stdout)["checks"]}
    assert found["libcudart"]["status"] == "failed"
    assert found["libcudart"]["detail"] == (
        f"cannot read symbols of {cudart}: .dynsym links to section 4294967295, not a string "
        "table of the 3 sections")
    assert found["libtorch"]["status"] == "failed"  # read: it lacks torch's symbols
    assert "missing" in found["libtorch"]["detail"]
