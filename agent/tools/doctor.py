"""``perfmon-agent doctor``: what the agent can do on this host, and for one job.

The host's checks are perfmon.probes.capabilities'; with ``--pid`` the job's are made
here of the agent's own functions, so they see what ``attach`` would: its ranks
(launcher expansion), the symbols the iteration probes need in its libtorch_cpu, the
CUDA/NCCL libraries it mapped, whether py-spy reads it, where its model dimensions
would come from. Libraries are opened as attach opens them (the very file the job
mapped); torch's version.py is read as the job's user; nothing of its environment is
printed. The rule from checks to exit status: perfmon.parsers.host_facts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Any

from perfmon.agent.argtypes import Command, pid
from perfmon.agent.console import PipeConsole, printable
from perfmon.agent.measure.model import explicit_model_fields, resolve_model
from perfmon.parsers.elf_symbols import ElfError, find_function_symbols
from perfmon.parsers.errors import PerfmonError
from perfmon.parsers.host_facts import (
    ABSENT,
    DEGRADED,
    FAILED,
    JOB,
    OK,
    PYSPY_PYTHON_RANGE,
    Check,
    doctor_document,
    error_document,
    exit_code,
    overall_status,
    pyspy_supports,
    python_version,
    soname_version,
    torch_version,
    torch_version_file,
)
from perfmon.parsers.procfs import MappedFile, parse_maps
from perfmon.parsers.wait_symbols import C10D_PREFIX, by_backend, wait_point
from perfmon.probes.capabilities import NO_UPROBES, host_checks
from perfmon.probes.cuda_libraries import (
    LIBRARIES,
    CudaLibrary,
    exact_symbols,
    find_libraries,
)
from perfmon.probes.errors import SymbolNotFound, UnsuitableTarget
from perfmon.probes.files import MappedLibrary, PathRefused
from perfmon.probes.job_files import JobFileError, read_job_file
from perfmon.probes.procfs import TargetProcess, read_proc, resolve_targets
from perfmon.probes.pyspy import dump_stacks
from perfmon.probes.torch_symbols import (
    ENGINE_EXECUTE_SYMBOL,
    RECORD_FUNCTION_SYMBOLS,
    open_torch_library,
)
from rich.markup import escape
from rich.table import Table

DOCTOR_DESCRIPTION = """\
What the agent can do on this host (and, with --pid, for one job): each capability
checked for real, with the fix and what the agent falls back to when it is missing
(docs/doctor.md). Changes nothing on the host.
"""
DOCTOR_EPILOG = """\
examples:
  sudo perfmon-agent doctor                   # the host: BPF, uprobes, tracefs, bcc, NVML, py-spy
  sudo perfmon-agent doctor --pid 12345       # and a job: ranks, libtorch symbols, CUDA, model
  sudo perfmon-agent doctor --pid $(pgrep -f torchrun) --json   # JSON (doctor.schema.json)

exit status: 0 everything works (or is not needed here), 1 something degrades (each
             line says what falls back), 2 bad arguments, 3 no such process or not a
             PyTorch job, 4 the job cannot be read
"""

# What the iteration probes look for in libtorch_cpu (perfmon.probes.uprobes), as shown,
# with the status and fallback when it is missing.
_TORCH_SYMBOLS: tuple[tuple[tuple[str, ...], str, str, str], ...] = (
    (RECORD_FUNCTION_SYMBOLS, "torch::autograd::profiler::record_function_enter_new "
     "(or record_function_enter)", FAILED, NO_UPROBES),
    ((ENGINE_EXECUTE_SYMBOL,), "torch::autograd::Engine::execute", DEGRADED,
     "micro-batches per step are not counted"),
)
_NO_WAITS = "a rank's wait on its process group is its CUDA synchronisation only"

_VERSION_FILE_BYTES = 64 << 10
_VERSION_SHOWN_CHARS = 64  # the job writes version.py: its __version__ is shown escaped, cut
_DUMP_TIMEOUT_S = 10.0


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``doctor`` options (--pid, --json, --model-config, --model-preset)."""
    parser.add_argument("--pid", type=pid, metavar="PID",
                        help="a training (or launcher) pid: check what the agent can do for it")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON instead of a table")
    parser.add_argument("--model-config", metavar="FILE",
                        help="model dimensions, as attach takes them (with --pid)")
    parser.add_argument("--model-preset", metavar="NAME",
                        help="a well-known model shape, as attach takes it (with --pid)")


def doctor_main(args: argparse.Namespace) -> int:
    """Run the checks from parsed arguments, print them; return the exit status.

    With ``--json`` stdout always holds a JSON document: the report, or, when no
    report can be made (no such process, not a PyTorch job), ``status: error``
    with the reason and the same exit status as the one line on stderr.
    """
    try:
        explicit = explicit_model_fields(args.model_config, args.model_preset)
        targets = _targets(args.pid) if args.pid is not None else []
        # The host first: two of its checks fork, best before anything else has run.
        uses_cuda = bool(targets) and bool(find_libraries(targets[0]).paths)
        checks = host_checks(job_uses_cuda=uses_cuda)
        if targets:
            checks += job_checks(args.pid, targets, explicit)
    except PerfmonError as err:
        if args.json:
            print(json.dumps(error_document(err.exit_code, str(err)), indent=2))
        raise
    host = {"name": socket.gethostname(), "kernel": os.uname().release,
            "machine": os.uname().machine}
    job = None if not targets else {
        "pid": args.pid, "ranks": [{"pid": t.pid, "rank": t.rank, "name": t.name}
                                   for t in targets]}
    if args.json:
        print(json.dumps(doctor_document(checks, host, job), indent=2))
    else:
        _print_table(checks, host)
    return exit_code(checks)


def _targets(pid_: int) -> list[TargetProcess]:
    """The job's processes as attach finds them; UnsuitableTarget says attach refuses it."""
    try:
        return resolve_targets(pid_)
    except UnsuitableTarget as err:
        raise UnsuitableTarget(f"{err}: nothing to measure (attach refuses it too)") from err


def job_checks(pid_: int, targets: list[TargetProcess],
               explicit: list[tuple[str, dict[str, Any]]]) -> list[Check]:
    """The job's checks, on its primary process (the one attach samples with py-spy)."""
    primary = targets[0]
    dump = pyspy_job_check(primary)
    return [ranks_check(pid_, targets), python_check(primary, dump.works), dump,
            torch_check(primary), *cuda_checks(primary), model_check(primary, explicit)]


def ranks_check(pid_: int, targets: list[TargetProcess]) -> Check:
    ranks = ", ".join(f"rank {t.rank} (pid {t.pid})" if t.rank is not None else f"pid {t.pid}"
                      for t in targets)
    if [t.pid for t in targets] == [pid_]:
        rank = targets[0].rank
        how = f"the training process itself ({f'rank {rank}' if rank is not None else 'no RANK'})"
    else:
        how = f"a launcher or wrapper of {len(targets)} process(es): {ranks}"
    return Check("ranks", OK, f"pid {pid_} is {how}", scope=JOB,
                 facts={"ranks": [t.rank for t in targets], "pids": [t.pid for t in targets]})


def python_check(target: TargetProcess, pyspy_reads_it: bool) -> Check:
    """Its CPython version (from the names of its executable and libraries) against the
    versions py-spy reads."""
    version = python_version(_mapped_names(target.pid))
    low, high = (".".join(map(str, v)) for v in PYSPY_PYTHON_RANGE)
    facts = {"version": ".".join(map(str, version)) if version else None}
    if version is not None and pyspy_supports(version):
        return Check("python", OK, f"CPython {facts['version']} (py-spy reads {low} to {high})",
                     scope=JOB, facts=facts)
    shown = (f"CPython {facts['version']}" if version
             else "a Python whose file names do not tell its version")
    if pyspy_reads_it:
        return Check("python", OK, f"{shown}; py-spy reads it (pyspy_job)", scope=JOB,
                     facts=facts)
    return Check("python", DEGRADED, f"{shown}: py-spy 0.4 documents {low} to {high}",
                 fix="pip install -U py-spy", scope=JOB, facts=facts,
                 fallback="no stack sampling; iterations only from uprobes")


def _mapped_names(pid_: int) -> list[str]:
    """Its executable's path and its mapped files' paths (names only: nothing is opened)."""
    names = []
    try:
        names.append(os.readlink(f"/proc/{pid_}/exe"))
    except OSError:
        pass
    try:
        return names + [m.path for m in parse_maps(str(read_proc(pid_, "maps")))]
    except PerfmonError:
        return names


def pyspy_job_check(target: TargetProcess) -> Check:
    try:
        stacks = dump_stacks(target.pid, timeout_s=_DUMP_TIMEOUT_S)
    except PerfmonError as err:
        return Check("pyspy_job", FAILED, str(err), scope=JOB,
                     fix="run as root with CAP_SYS_PTRACE; a py-spy that reads this Python",
                     fallback="no stack sampling of this job (phases, hang stacks, py-spy "
                              "iterations)")
    return Check("pyspy_job", OK, f"py-spy read {len(stacks)} Python thread(s) of pid "
                                  f"{target.pid} without stopping it", scope=JOB)


def torch_check(target: TargetProcess) -> Check:
    """Each symbol the iteration probes need, in the very libtorch_cpu the job mapped."""
    try:
        library = open_torch_library(target)
    except SymbolNotFound as err:
        return Check("libtorch", FAILED, str(err), scope=JOB, fallback=NO_UPROBES)
    try:
        found = find_function_symbols(
            library, [*(p for row in _TORCH_SYMBOLS for p in row[0]), C10D_PREFIX])
    except (OSError, ValueError, ElfError) as err:
        return Check("libtorch", FAILED, f"cannot read symbols of {target.torch_library}: {err}",
                     scope=JOB, fallback=NO_UPROBES)
    finally:
        library.close()
    present = {shown: any(found[p] for p in prefixes) for prefixes, shown, _, _ in _TORCH_SYMBOLS}
    # Every work object's wait the library exports, by backend: what the probes attach
    # (perfmon.parsers.wait_symbols; a release's new override among them).
    waits = by_backend([p for s in found[C10D_PREFIX] if (p := wait_point(s.name))])
    missing = [row[1:] for row in _TORCH_SYMBOLS if not present[row[1]]]
    if not waits:
        missing.append(("c10d work objects' wait", DEGRADED, _NO_WAITS))
    version = _torch_version(target)
    facts = {"path": target.torch_library, "torch_version": version, "symbols": present,
             "wait_probes": waits}
    where = f"{target.torch_library} (torch {version or 'version not read'})"
    probes = "; ".join(f"{backend}: {', '.join(names)}" for backend, names in waits.items())
    detail = f"wait probes by process group kind: {probes}" if waits else ""
    if not missing:
        return Check("libtorch", OK, f"{where}: every probed symbol exported; {detail}",
                     scope=JOB, facts=facts)
    status = FAILED if any(row[1] == FAILED for row in missing) else DEGRADED
    return Check("libtorch", status,
                 f"{where}: missing {', '.join(row[0] for row in missing)}"
                 + (f"; {detail}" if detail else ""), scope=JOB,
                 fix="a PyTorch >= 1.13 built with exported symbols (and distributed)",
                 fallback="; ".join(dict.fromkeys(row[2] for row in missing)), facts=facts)


def _torch_version(target: TargetProcess) -> str | None:
    """torch's version.py beside a pip-installed libtorch, read as the job's user."""
    path = torch_version_file(target.torch_library)
    if path is None:
        return None
    try:
        data = read_job_file(target.pid, path, max_bytes=_VERSION_FILE_BYTES)
    except JobFileError:
        return None
    version = torch_version(data.decode("utf-8", "replace"))
    if version is None:
        return None
    # The job owns the file: "2.1\x1b[2J" must not clear the operator's screen (issue 36).
    shown = printable(version)
    if len(shown) > _VERSION_SHOWN_CHARS:
        shown = shown[: _VERSION_SHOWN_CHARS - 3] + "..."
    return shown


def cuda_checks(target: TargetProcess) -> list[Check]:
    """The CUDA runtime, driver and NCCL libraries it mapped: their versions (from the file
    names) and how many of the functions the CUDA probe counts they export."""
    found = find_libraries(target)
    if not found.paths:
        return [Check("cuda", ABSENT, "no libcudart, libcuda or libnccl mapped: a CPU job (or "
                                      "CUDA not initialised yet)", scope=JOB)]
    checks = []
    for lib in LIBRARIES:
        for mapping in found.paths.get(lib.name, []):
            checks.append(_library_check(target, lib, mapping))
        if lib.name not in found.paths:
            checks.append(Check(lib.name, ABSENT, f"{lib.basename_prefix}* not loaded: "
                                                  f"{lib.measures} not used", scope=JOB))
    return checks


def _library_check(target: TargetProcess, lib: CudaLibrary, mapping: MappedFile) -> Check:
    name, measures = lib.name, lib.measures
    wanted = [probe[0] for probe in lib.probes]
    version = soname_version(mapping.path.rsplit("/", 1)[-1], lib.basename_prefix)
    facts = {"path": mapping.path, "version": version}
    try:
        library = MappedLibrary(target.pid, mapping)
    except (OSError, PathRefused) as err:
        return Check(name, FAILED, f"cannot open {mapping.path}: {err}", scope=JOB,
                     fallback=f"{measures} not counted", facts=facts)
    try:
        exported = exact_symbols(library, wanted)
    except (OSError, ValueError, ElfError) as err:
        return Check(name, FAILED, f"cannot read symbols of {mapping.path}: {err}", scope=JOB,
                     fallback=f"{measures} not counted", facts=facts)
    finally:
        library.close()
    facts["symbols"] = {s: s in exported for s in wanted}
    shown = f"{mapping.path} (version {version or 'not in its name'})"
    if not exported:
        return Check(name, FAILED, f"{shown} exports none of the probed functions", scope=JOB,
                     fallback=f"{measures} not counted", facts=facts)
    return Check(name, OK, f"{shown}: {len(exported)} of {len(wanted)} probed functions "
                           "exported (the rest are other versions' names)", scope=JOB,
                 facts=facts)


def model_check(target: TargetProcess, explicit: list[tuple[str, dict[str, Any]]]) -> Check:
    """Where attach would read the model's dimensions (resolve_model, as attach calls it)."""
    model = resolve_model(target, explicit)
    source = str(model.description.get("source", "none"))
    facts = {"source": source}
    if model.config is not None:
        return Check("model", OK, f"dimensions from {source}", scope=JOB, facts=facts)
    problem = model.description.get("problem") or (
        "no source names the model's dimensions (its command line, a config.json it names)")
    return Check("model", DEGRADED, f"{problem} (source: {source})", scope=JOB, facts=facts,
                 fix="give attach --model-config FILE or --model-preset NAME "
                     "(docs/model-config.md)",
                 fallback="no TFLOPS or MFU (step times and throughput are measured)")


_STYLE = {OK: "green", ABSENT: "dim", DEGRADED: "yellow", FAILED: "bold red"}


def _print_table(checks: list[Check], host: dict[str, str]) -> None:
    status = overall_status(checks)
    table = Table(title=f"perfmon-agent doctor: {status.upper()} ({host['name']}, "
                        f"kernel {host['kernel']})")
    for column in ("scope", "check", "status", "what was found", "fix / falls back to"):
        table.add_column(column)
    scope = None
    for check in checks:
        if scope is not None and check.scope != scope:
            table.add_section()
        scope = check.scope
        # Details hold what the job controls (its mapped paths, its version.py): control
        # characters are escaped so none reaches the operator's terminal (issue 36).
        advice = "\n".join(f"{label}: {printable(text)}" for label, text in
                           (("fix", check.fix), ("falls back to", check.fallback)) if text)
        table.add_row(check.scope, check.name, f"[{_STYLE[check.status]}]{check.status}[/]",
                      escape(printable(check.detail)), escape(advice))
    PipeConsole().print(table)


COMMAND = Command("doctor", "what the agent can do on this host (and for a job): checks, "
                            "fixes, fallbacks", add_doctor_arguments, doctor_main,
                  description=DOCTOR_DESCRIPTION, epilog=DOCTOR_EPILOG)
