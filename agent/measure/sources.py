"""Which sources a session runs, chosen in one place: the iteration source (eBPF through
bcc, else tracefs uprobes, else py-spy stack samples), stack sampling, CUDA/NCCL
counters, memory and GPUs.

``--iteration-source auto`` tries uprobes and falls back to py-spy with one
warning; ``--probe-backend auto`` tries bcc and falls back to tracefs with one
warning. Each source is started inside the caller's ExitStack, so whatever
started is closed whatever happens next.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING, TypeAlias

from perfmon.parsers.errors import PerfmonError
from perfmon.probes.cuda import CudaSource
from perfmon.probes.errors import PrerequisiteMissing, PrivilegeError, SymbolNotFound
from perfmon.probes.exits import ExitSource
from perfmon.probes.procfs import TargetProcess
from perfmon.probes.sampler import Source
from perfmon.probes.stacks import StackSource
from perfmon.probes.tracefs import TracefsMarkerProbe, check_tracefs_prerequisites
from perfmon.probes.uprobes import MarkerProbe, check_ebpf_prerequisites

if TYPE_CHECKING:
    from perfmon.agent.options import AttachOptions

# What makes an uprobe backend unusable, so that auto tries the next one.
UNAVAILABLE = (PrerequisiteMissing, PrivilegeError, SymbolNotFound)
BACKENDS = {"bcc": (MarkerProbe, check_ebpf_prerequisites),
            "tracefs": (TracefsMarkerProbe, check_tracefs_prerequisites)}


def started(stack: ExitStack, source: Source, warn: Callable[[str], None]) -> Source:
    """Start ``source`` with its close registered first (close is idempotent).

    A close that fails (bcc raises bare exceptions while detaching) is a
    warning, never a traceback, and the other sources are still closed.
    """
    def close() -> None:
        try:
            source.close()
        except Exception as err:
            warn(f"closing {source.name} failed: {err}")

    stack.callback(close)
    source.start()
    return source


def uprobe_backends(options: AttachOptions) -> list[str]:
    """The uprobe backends to try, in order."""
    return ["bcc", "tracefs"] if options.probe_backend == "auto" else [options.probe_backend]


def host_can_probe(options: AttachOptions, warn: Callable[[str], None]) -> bool:
    """Whether uprobes can be tried at all, checked before any process is read.

    With ``--iteration-source uprobe`` a host that cannot probe is an error
    (the first backend's reason); with auto it falls back with one warning.
    """
    if options.iteration_source == "pyspy":
        return False
    reasons = []
    for name in uprobe_backends(options):
        try:
            BACKENDS[name][1]()
            return True
        except UNAVAILABLE as err:
            if options.iteration_source == "uprobe" and len(uprobe_backends(options)) == 1:
                raise
            reasons.append((name, err))
    if options.iteration_source == "uprobe":
        raise reasons[0][1]
    warn("uprobes unavailable, iterations from py-spy stack samples: "
         + "; ".join(f"{name}: {err}" for name, err in reasons))
    return False


MarkerSource: TypeAlias = MarkerProbe | TracefsMarkerProbe  # the uprobe backends


def _warn_unseen_waits(probe: MarkerSource, targets: list[TargetProcess],
                      warn: Callable[[str], None]) -> None:
    """Ranks whose libtorch exports no wait point: their waits are not seen (never a
    silent 0: data_quality's ranks_without_wait_probes counts them too)."""
    bare = [t.pid for t in targets if t.rank is not None and probe.wait_points.get(t.pid) == []]
    if bare:
        warn(f"no wait probe in the libtorch of pid(s) {', '.join(map(str, bare))}: their "
             "waits on the process group are not seen, their compute is the whole step "
             "(doctor --pid)")


def open_iteration_source(options: AttachOptions, targets: list[TargetProcess],
                          stack: ExitStack, warn: Callable[[str], None], can_probe: bool
                          ) -> tuple[MarkerSource | None, str]:
    """The started uprobe source and its name ("bcc"/"tracefs"), or (None, "pyspy").

    ``can_probe``: what host_can_probe said, before any process was read.
    """
    if not can_probe:
        return None, "pyspy"
    failures: list[tuple[str, PerfmonError]] = []
    for name in uprobe_backends(options):
        cls, check = BACKENDS[name]
        try:
            check()
            # (raw waits, when asked for, switch on at the window's first poll: the
            # sources set up after this one (their compiles: ~1-2 s) would leave a
            # hundred a step of a tensor-parallel job in the ring buffer, overflowing it)
            micro = options.microbatches
            probe: MarkerSource = (MarkerProbe(targets, options.ring_pages,
                                               microbatches=micro)
                                   if cls is MarkerProbe
                                   else TracefsMarkerProbe(targets, microbatches=micro))
            started(stack, probe, warn)
            _warn_unseen_waits(probe, targets, warn)
        except UNAVAILABLE as err:
            failures.append((name, err))
            continue
        if failures:
            warn(f"{failures[0][0]} uprobes unavailable, markers from {name}: {failures[0][1]}")
        for text in probe.warnings:
            warn(text)
        return probe, name
    if options.iteration_source == "uprobe":
        raise failures[0][1]
    warn("uprobes unavailable, iterations from py-spy stack samples: "
         + "; ".join(f"{name}: {err}" for name, err in failures))
    return None, "pyspy"


def open_stack_source(options: AttachOptions, primary: TargetProcess, iterations: bool,
                      stack: ExitStack, warn: Callable[[str], None]) -> StackSource | None:
    """py-spy sampling of the primary rank: required for iterations in py-spy mode,
    else optional (phases and the job's numbering; unavailable is a warning)."""
    if not iterations and not options.stack_sampling:
        return None
    source = StackSource(primary, detect_iterations=iterations,
                         iteration_function=options.iteration_function,
                         iteration_variable=options.iteration_variable,
                         rate_hz=options.stack_rate_hz)
    try:
        started(stack, source, warn)
    except PerfmonError as err:
        if iterations:
            raise
        warn(f"stack sampling unavailable, phases from uprobes only: {err}")
        return None
    return source


def open_cuda_source(targets: list[TargetProcess], launches: str, stack: ExitStack,
                     warn: Callable[[str], None], note: Callable[[str], None],
                     ) -> tuple[CudaSource | None, dict[str, object]]:
    """CUDA/NCCL counters for jobs that loaded libcudart, libcuda or libnccl
    (``launches``: sampled, always or off; see perfmon.probes.cuda.CudaSource); the
    libraries a CPU job does not load are notes, not warnings."""
    source = CudaSource(targets, launches)
    try:
        started(stack, source, warn)
    except PerfmonError as err:
        warn(f"CUDA/NCCL counters unavailable: {err}")
        return None, {"available": False, "reason": str(err)}
    for text in source.warnings:
        warn(text)
    for text in source.notes:
        note(text)
    if not source.available:
        return None, {"available": False, "reason": source.reason}
    return source, {"available": True, "attached": source.attached, "launches": launches}


def open_exit_source(targets: list[TargetProcess], stack: ExitStack,
                     warn: Callable[[str], None], note: Callable[[str], None],
                     ) -> ExitSource | None:
    """How each rank ends (exit status from the kernel, OOM kills, last lines); without
    its kernel hooks it still records each end, with what can be known (a warning).
    Outputs that are no file (a terminal, a pipe, /dev/null) are notes."""
    source = ExitSource(targets)
    try:
        started(stack, source, warn)
    except PerfmonError as err:
        warn(f"rank exits not recorded: {err}")
        return None
    for text in source.warnings:
        warn(text)
    for text in source.notes:
        note(text)
    return source
