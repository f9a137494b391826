"""The root agent against a hostile job: what an ordinary user on the node can try.

A real user is created for the job, its training process runs under that user
(setpriv), and that user plants the links, FIFOs, devices and root-only files.
Each test shows that no file outside the output dir changes, no root-only
content reaches any output or message, and every case ends in time with one
line and its exit code. docs/security.md lists every case and what the agent does.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests import eventlogs
from tests.conftest import TRAIN_GPT, Target, _reap, load_summary

JOB_USER = "perfmon-testjob"
OTHER_USER = "perfmon-testother"
SECRET = "ROOTSECRET-d41d8cd9"
ENV_SECRET = "hf_ENVSECRET0123456789"
TIMEOUT_S = 60


@contextmanager
def ordinary_user(name: str) -> Iterator[pwd.struct_passwd]:
    """An ordinary user (created for the test run and removed after, unless it was there);
    its name is the worker's own when the suite runs in parallel (pytest-xdist), so that
    no worker removes a user another one's jobs run as."""
    name += os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    created = False
    try:
        user = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", name], check=True)
        created = True
        user = pwd.getpwnam(name)
    try:
        yield user
    finally:
        if created:
            subprocess.run(["userdel", name], check=False)


@pytest.fixture(scope="module")
def job_user() -> Iterator[pwd.struct_passwd]:
    """An ordinary user for the job."""
    with ordinary_user(JOB_USER) as user:
        yield user


@pytest.fixture(scope="module")
def other_user() -> Iterator[pwd.struct_passwd]:
    """A second ordinary user on the node: the one who tries to reach the job's user."""
    with ordinary_user(OTHER_USER) as user:
        yield user


@pytest.fixture
def job_home(job_user: pwd.struct_passwd) -> Iterator[Path]:
    """A folder the job's user owns (its working folder)."""
    home = Path(tempfile.mkdtemp(prefix="perfmon-job-", dir="/tmp"))
    os.chown(home, job_user.pw_uid, job_user.pw_gid)
    home.chmod(0o755)
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A root-only folder with a config.json whose values must never be seen."""
    folder = tmp_path / "rootonly"
    folder.mkdir(mode=0o700)
    config = folder / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": SECRET, "hidden_size": SECRET,
                                  "num_attention_heads": 4, "vocab_size": 512}))
    config.chmod(0o600)
    return folder


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[Path]:
    """A root-owned file outside every output dir; planted links point here."""
    path = tmp_path / "root-owned-target"
    path.write_text("untouched\n")
    path.chmod(0o600)
    before = path.stat()
    yield path
    after = path.stat()
    assert path.read_text() == "untouched\n"
    assert (after.st_size, after.st_mtime_ns, after.st_mode) == (
        before.st_size, before.st_mtime_ns, before.st_mode)


def own_file(path: Path, content: str | bytes, own) -> Path:
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return own(path)


def as_job_user(user: pwd.struct_passwd, *argv: str) -> list[str]:
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups",
            *argv]


# A refusal that blocked (an open of a FIFO, a read of a device) would never end: the
# run's timeout fails the test. Not seconds of its own: an agent's start alone took 16 s
# on a loaded machine.
BLOCKED_S = 60


def run_as(user: pwd.struct_passwd, *argv: str) -> None:
    subprocess.run(as_job_user(user, *argv), check=True, timeout=30)


@pytest.fixture
def start_job(job_user: pwd.struct_passwd, job_home: Path) -> Iterator:
    """Start train_gpt.py as the job's user, in its home, with a secret in its environment."""
    started: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Target:
        stamps = job_home / f"stamps_{len(started)}.txt"
        environ = {"PATH": os.environ["PATH"], "HOME": str(job_home), "HF_TOKEN": ENV_SECRET,
                   **(env or {})}
        proc = subprocess.Popen(
            as_job_user(job_user, sys.executable, str(TRAIN_GPT), "--timestamps", str(stamps),
                        *args),
            cwd=job_home, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        started.append(proc)
        target = Target(proc, stamps)
        target.wait_for_iterations(2)
        return target

    yield start
    for proc in started:
        _reap(proc)


def attach(agent, pid: int, out_dir: Path, *args: str, duration: str = "3"
           ) -> subprocess.CompletedProcess:
    started = time.monotonic()
    run = agent.run("attach", "--pid", str(pid), "--duration", duration, "--output-dir",
                    str(out_dir), "--no-stack-sampling", *args, timeout_s=TIMEOUT_S)
    run.elapsed_s = time.monotonic() - started  # type: ignore[attr-defined]
    return run


def everything_written(out_dir: Path, run: subprocess.CompletedProcess) -> str:
    """stdout, stderr and every file in the output dir, as text (msgpack decoded)."""
    parts = [run.stdout, run.stderr]
    for path in sorted(out_dir.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if path.suffix == ".msgpack":
                parts += [repr(r) for r in eventlogs.read_records(path)]
            parts.append(data.decode("utf-8", "replace"))
    return "\n".join(parts)


def warnings_of(run: subprocess.CompletedProcess) -> list[str]:
    return [li for li in run.stderr.splitlines() if li.startswith("perfmon-agent: warning: ")]


def assert_one_line(run: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == code, run.stderr
    assert len(lines) == 1 and lines[0].startswith("perfmon-agent"), run.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# -- files the job names: read with the job's credentials, never as root -------------------

def test_files_the_job_names_are_read_as_its_user_and_never_leak(
    start_job, agent, out_dir, job_user, job_home, secret, sentinel
):
    home = job_home
    uid, gid = job_user.pw_uid, job_user.pw_gid

    def own(path: Path) -> Path:  # as if the job's user had made it
        os.lchown(path, uid, gid)
        return path

    (home / "good").mkdir()
    own(home / "good")
    own_file(home / "good" / "config.json", json.dumps(
        {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 512, "n_positions": 64}), own)
    (home / "linked.json").symlink_to(secret / "config.json")
    own(home / "linked.json")
    os.mkfifo(home / "fifo.json")
    own(home / "fifo.json")
    with open(own_file(home / "huge.json", "", own), "wb") as f:
        f.truncate(100 << 20)  # 100 MiB, sparse
    own_file(home / "deep.json", "[" * 2000, own)
    own_file(home / "binary.json", b"\x80\xff\x00PK\x03\x04" * 8, own)
    own_file(home / "digits.json", '{"n_layer": 12345678901234567890123456, "n_embd": 8, '
             '"n_head": 1, "vocab_size": 8}', own)
    os.mkfifo(home / "esc\x1b[2J.json")
    own(home / "esc\x1b[2J.json")
    cases = {  # the file the job names -> what the one warning about it says
        "linked.json": "symbolic link", "fifo.json": "a FIFO", "huge.json": "larger than 4 MiB",
        "deep.json": "nested deeper", "binary.json": "not UTF-8",
        "digits.json": "'num_layers' must be at most 100,000, got a int",
        "esc\x1b[2J.json": "esc\\x1b[2J.json",
    }
    # Also: a root-only folder, a device, and a file that only root may read.
    named = [f"{home}/{name}" for name in cases] + [str(secret), "/dev/zero", "/etc/shadow"]
    # argparse takes the last --config_name: the agent tries them last to first,
    # so the readable one (first on the line) is used once every other is refused.
    args = ["--config_name", "good"]
    for path in named:
        args += ["--config_name", path]
    target = start_job(*args)
    run = attach(agent, target.pid, out_dir)
    assert run.returncode == 0, run.stderr
    assert run.elapsed_s < 30
    warned = warnings_of(run)
    for name, words in cases.items():
        assert any(words in w for w in warned), (name, warned)
    assert any("rootonly/config.json" in w and "Permission denied" in w for w in warned), warned
    assert any("/dev/zero" in w and "a device" in w for w in warned), warned
    assert any("/etc/shadow" in w and "Permission denied" in w for w in warned), warned
    assert not any("\x1b" in w for w in run.stderr)
    written = everything_written(out_dir, run)
    assert SECRET not in written and "12345678901234567890123456" not in written
    assert ENV_SECRET not in written  # the job's environment is never stored
    assert "root:" not in written  # nothing of /etc/shadow
    model = load_summary(out_dir)["session_info"]["model"]
    assert model["source"] == "hf_config:good"
    assert model["dimensions"]["num_layers"] == 2


def test_hostile_values_on_the_job_command_line_and_environment_are_bounded(
    start_job, agent, out_dir
):
    huge_argument = "x" * 120_000  # near the kernel's 128 KiB limit for one argument
    target = start_job("--num-query-groups", "12345678901234567890123456", huge_argument,
                       env={"WORLD_SIZE": "9" * 40, "RANK": "1" * 30})
    run = attach(agent, target.pid, out_dir)
    assert run.returncode == 0, run.stderr
    (warning,) = [w for w in warnings_of(run) if "model dimensions unknown" in w]
    assert "'num_query_groups' must be at most 1,000,000" in warning
    info = load_summary(out_dir)["session_info"]
    assert max(len(a) for a in info["command_line"]) < 5000  # kept bounded in the summary
    assert info["ranks"] == [None]
    assert info["workload"]["world_size"] == 1  # an absurd WORLD_SIZE is not believed


# -- the output dir: only one the job's user cannot touch ------------------------------

@pytest.mark.parametrize("case", ["owned_by_job_user", "world_writable", "through_job_link",
                                  "is_a_file"])
def test_output_dir_the_job_user_controls_is_refused_before_anything(
    agent, job_user, job_home, tmp_path, sentinel, case
):
    if case == "owned_by_job_user":
        target = job_home / "out"
        run_as(job_user, "mkdir", str(target))
        needle = f"owned by uid {job_user.pw_uid}"
    elif case == "world_writable":
        target = tmp_path / "open"
        target.mkdir()
        target.chmod(0o777)
        needle = "writable by group or others without the sticky bit"
    elif case == "through_job_link":
        run_as(job_user, "ln", "-s", str(sentinel.parent), str(job_home / "link"))
        target = job_home / "link" / "out"
        needle = "symbolic link owned by uid"
    else:
        target = sentinel
        needle = "not a directory"
    run = agent.run("attach", "--pid", "999999999", "--output-dir", str(target),
                    timeout_s=BLOCKED_S)
    assert_one_line(run, 2, "output dir", needle)
    assert not (sentinel.parent / "out").exists()


def test_planted_links_and_fifos_in_a_shared_dir_are_never_opened(
    start_job, agent, job_user, sentinel, job_home
):
    shared = job_home / "shared"  # reachable by the job's user
    shared.mkdir()
    shared.chmod(0o1777)  # root's, sticky and writable by all, like /tmp
    target = start_job()
    # The job's user plants every name the agent could pick in the next minute (its
    # start takes seconds more on a busy machine), in one process of its own.
    plant = ("import os, sys, time\n"
             "shared, sentinel, now = sys.argv[1], sys.argv[2], float(sys.argv[3])\n"
             "for second in range(60):\n"
             "    stamp = time.strftime('%Y%m%d_%H%M%S', time.localtime(now + second))\n"
             "    for name in (f'perf_summary_{stamp}.json', f'perf_events_{stamp}.msgpack'):\n"
             "        os.symlink(sentinel, os.path.join(shared, name))\n"
             "    os.mkfifo(os.path.join(shared, f'perf_summary_{stamp}_1.json'))\n")
    run_as(job_user, sys.executable, "-I", "-c", plant, str(shared), str(sentinel),
           str(time.time()))
    run = attach(agent, target.pid, shared, "--allow-shared-output-dir", duration="2")
    assert run.returncode == 0, run.stderr
    mine = sorted(p for p in shared.iterdir() if not p.is_symlink()
                  and stat.S_ISREG(p.lstat().st_mode))
    summaries = [p for p in mine if p.name.startswith("perf_summary_")]
    (summary_path,) = summaries
    assert summary_path.name.endswith("_2.json")  # _0 (plain) is a link, _1 a FIFO
    info = json.loads(summary_path.read_text())["session_info"]
    events = shared / info["event_log"]
    assert events.name == summary_path.name.replace("perf_summary_", "perf_events_").replace(
        ".json", ".msgpack")
    for path in (summary_path, events):
        st = path.lstat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0


def test_two_agents_in_one_dir_in_one_second_each_write_their_own_pair(
    start_job, agent, out_dir
):
    target = start_job()
    procs = [agent.start("attach", "--pid", str(target.pid), "--duration", "3",
                         "--no-stack-sampling", "--output-dir", str(out_dir))
             for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, err
    summaries = sorted(out_dir.glob("perf_summary_*.json"))
    assert len(summaries) == 2
    logs = {json.loads(p.read_text())["session_info"]["event_log"] for p in summaries}
    assert len(logs) == 2 and all((out_dir / name).is_file() for name in logs)


# -- files the user names: never blocking, never through another user's link -----------

@pytest.fixture
def event_log(tmp_path: Path) -> Path:
    return eventlogs.write_log(tmp_path / "perf_events_20261130_120000.msgpack")


@pytest.mark.parametrize("case", ["fifo", "device", "job_link", "directory"])
def test_summarize_refuses_inputs_that_would_block_or_mislead(
    agent, job_user, job_home, secret, case
):
    if case == "fifo":
        path, needle = job_home / "events.msgpack", "a FIFO, not a regular file"
        run_as(job_user, "mkfifo", str(path))
    elif case == "device":
        path, needle = Path("/dev/zero"), "a device, not a regular file"
    elif case == "job_link":
        path, needle = job_home / "events.msgpack", "symbolic link owned by uid"
        run_as(job_user, "ln", "-s", str(secret / "config.json"), str(path))
    else:
        path, needle = job_home, "a directory, not a regular file"
    run = agent.run("summarize", str(path), timeout_s=BLOCKED_S)
    assert_one_line(run, 2, "event log", needle)
    assert SECRET not in run.stderr + run.stdout


@pytest.mark.parametrize("case", ["job_link", "dev_null", "directory", "missing_dir", "fifo"])
def test_summarize_refuses_outputs_that_are_not_plain_files(
    agent, event_log, job_user, job_home, sentinel, case
):
    if case == "job_link":
        output, needle = job_home / "summary.json", "not a regular file"
        run_as(job_user, "ln", "-s", str(sentinel), str(output))
    elif case == "dev_null":
        output, needle = Path("/dev/null"), "not a regular file"
    elif case == "directory":
        output, needle = job_home, "a directory"
    elif case == "missing_dir":
        output, needle = job_home / "nowhere" / "summary.json", "does not exist"
    else:
        output, needle = job_home / "fifo.json", "not a regular file"
        run_as(job_user, "mkfifo", str(output))
    run = agent.run("summarize", str(event_log), "--output", str(output), timeout_s=20)
    assert_one_line(run, 2, str(output.name) if case != "dev_null" else "/dev/null", needle)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("case", ["job_link", "fifo", "device"])
def test_model_config_the_user_names_is_refused_when_it_would_block_or_mislead(
    agent, out_dir, job_user, job_home, secret, case
):
    if case == "job_link":
        path, needle = job_home / "model.yaml", "symbolic link owned by uid"
        run_as(job_user, "ln", "-s", str(secret / "config.json"), str(path))
    elif case == "fifo":
        path, needle = job_home / "model.yaml", "a FIFO, not a regular file"
        run_as(job_user, "mkfifo", str(path))
    else:
        path, needle = Path("/dev/zero"), "a device, not a regular file"
    run = agent.run("attach", "--pid", "999999999", "--model-config", str(path),
                    "--output-dir", str(out_dir), timeout_s=BLOCKED_S)
    assert_one_line(run, 2, "model config", needle)
    assert SECRET not in run.stderr


def test_zombie_pid_is_named_as_one(agent, out_dir):
    # A child that exits and is never reaped by its parent (this sleep) stays a zombie.
    parent = subprocess.Popen(
        ["sh", "-c", "sleep 0.1 & exec sleep 30"], start_new_session=True)
    try:
        time.sleep(1.0)
        import psutil

        (child,) = psutil.Process(parent.pid).children()
        assert child.status() == psutil.STATUS_ZOMBIE
        run = agent.run("attach", "--pid", str(child.pid), "--output-dir", str(out_dir))
        assert_one_line(run, 3, f"pid {child.pid}", "is a zombie")
    finally:
        _reap(parent)


def test_a_mapped_library_is_read_by_inode_even_after_its_path_becomes_a_fifo(
    job_user, job_home
):
    from perfmon.parsers.procfs import mapped_file, parse_maps
    from perfmon.probes.files import MappedLibrary

    library = job_home / "libfake.so"
    library.write_bytes(b"\x7fELF-original-content")
    os.chown(library, job_user.pw_uid, job_user.pw_gid)
    code = ("import mmap, os, sys, time; f = open(sys.argv[1], 'rb'); "
            "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); print('ok', flush=True); "
            "time.sleep(60)")
    proc = subprocess.Popen(as_job_user(job_user, sys.executable, "-c", code, str(library)),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ok"
        mapping = mapped_file(parse_maps(Path(f"/proc/{proc.pid}/maps").read_text()), "libfake")
        assert mapping is not None
        # The job swaps the path for a FIFO: opening the path would block the root agent.
        run_as(job_user, "sh", "-c", f"rm {library} && mkfifo {library}")
        started = time.monotonic()
        held = MappedLibrary(proc.pid, mapping)
        try:
            assert os.pread(held.fd, 22, 0) == b"\x7fELF-original-content"
        finally:
            held.close()
        assert time.monotonic() - started < 1
    finally:
        _reap(proc)
