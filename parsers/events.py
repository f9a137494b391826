"""The event log's records: one frozen dataclass per type, and their checks (pure).

Every source emits these records; the session logs them (``to_record``) as msgpack
maps and feeds the same maps to the reducers, and ``summarize`` reads them back
(perfmon.parsers.log_reader): one definition for the log, the reducers and the docs
(docs/events.md is checked against :func:`records_table`).

Record order: the session sorts each poll's records from all sources by
``(t_mono_ns, TYPE_ORDER)`` before logging them (see ``sort_key``); replay feeds
them in log order, so live and replayed summaries are the same.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from perfmon.parsers.step_rows import (
    StepBlock,
    block_of,
    encode_block,
    steps_problem,
)

SCHEMA_VERSION = 4

MARKER_KINDS = (
    "optimizer_step",
    "zero_grad",
    "dataloader_next",
    "backward_enter",
    "backward_exit",
    "wait_enter",
    "wait_exit",
    "grad_read",
    "p2p_wait_enter",  # a wait on a point-to-point send or receive
    "p2p_wait_exit",
)
# The markers of a wait's entry and return (collective, point-to-point): logged only
# while asked for, the totals (``waits``) hold them.
WAIT_MARKERS = ("wait_enter", "wait_exit", "p2p_wait_enter", "p2p_wait_exit")


@dataclass(frozen=True)
class Record:
    """Base of every record: a CLOCK_MONOTONIC time in nanoseconds."""

    TYPE: ClassVar[str] = ""
    t_mono_ns: int

    def to_record(self) -> dict[str, Any]:
        """The msgpack map logged for this record (shallow: nested values as they are).

        (Fields in definition order; a frozen dataclass keeps them in __dict__,
        copied in C: this runs for every marker of a busy job.)
        """
        return {"type": self.TYPE, **self.__dict__}


@dataclass(frozen=True)
class SessionStart(Record):
    """The session's static facts (session_info at attach: pids, model, workload...)."""

    TYPE: ClassVar[str] = "session_start"
    session: dict[str, Any]
    schema_version: int = SCHEMA_VERSION


@dataclass(frozen=True)
class LogPart(Record):
    """First record of each later part of a rotated log (perf_events_<ts>.part<N>.msgpack)."""

    TYPE: ClassVar[str] = "log_part"
    part: int


@dataclass(frozen=True)
class WaitTotals(Record):
    """A rank's time blocked on its process group so far (cumulative), at an
    Optimizer.step (or an update's first gradient read, ``grad_read``): the sum over its
    threads of each one's waits (nested calls once; the stepping thread's open wait ends
    at the step), and how many ended; of them, those on point-to-point sends and
    receives (``p2p_*``: a pipeline's). Counted in the kernel
    (bcc) or by the probe (tracefs), once a step, not every wait's entry and return
    (those are ``wait_*`` markers, only when asked for); the session folds them into the
    rank's ``steps`` row (older logs hold them as records)."""

    TYPE: ClassVar[str] = "waits"
    pid: int
    wait_ns: int
    waits: int
    p2p_wait_ns: int = 0
    p2p_waits: int = 0


@dataclass(frozen=True)
class Steps(Record):
    """Iteration ends of the ranks, one row each, logged once a second instead of their
    markers and wait totals: ``rows``, int64 columns as ``columns`` names them
    (perfmon.parsers.step_rows): ``pid``; ``end_ns``, ``backward_from_ns`` and
    ``backward_to_ns`` (the first backward() entry and last return since the previous
    end, else the end), relative to ``t_mono_ns``, and ``backward_ns`` (the time in it);
    ``micro`` (backward() calls, -1: none ever); ``wait_ns`` and ``waits`` (blocked on
    the process group since the previous end, how many ended; ``waits`` -1: not probed
    in that iteration, the wait probes being sampled), ``p2p_wait_ns`` (of that wait, on
    point-to-point sends and receives; absent where none in the block, and in an older
    agent's log: zeros); ``how``
    (index into ``hows``:
    uprobe (the Optimizer.step marker), grad_read (an update's first gradient read) or
    py-spy's estimator). A rank's first row after attach only opens its window."""

    TYPE: ClassVar[str] = "steps"
    columns: list[str]
    rows: bytes
    hows: list[str]

    @classmethod
    def encode(cls, t_mono_ns: int, rows: list[tuple[int, ...]], hows: list[str]) -> Steps:
        """The record of ``rows`` (tuples in STEP_COLUMNS order, absolute times)."""
        return cls.of_block(block_of(rows, hows), t_mono_ns)

    @classmethod
    def of_block(cls, block: StepBlock, t_mono_ns: int | None = None) -> Steps:
        """The record of a block of rows (at ``t_mono_ns``, else its first end)."""
        if t_mono_ns is None:
            t_mono_ns = int(block.end_ns.min())
        columns, rows = encode_block(t_mono_ns, block)
        return cls(t_mono_ns, columns, rows, list(block.hows))


@dataclass(frozen=True)
class Marker(Record):
    """A training-step marker of one thread: ``kind`` one of MARKER_KINDS; ``name`` the
    record_function name (uprobes) or ``pyspy:<estimator>`` (stack samples)."""

    TYPE: ClassVar[str] = "marker"
    pid: int
    tid: int
    kind: str
    name: str


@dataclass(frozen=True)
class Phase(Record):
    """A span of the primary rank's training thread in one phase (py-spy samples)."""

    TYPE: ClassVar[str] = "phase"
    end_mono_ns: int
    pid: int
    phase: str


@dataclass(frozen=True)
class StackWindow(Record):
    """One py-spy window of the primary rank: ``samples_in`` false when it is started
    (``t_mono_ns`` = ``start_mono_ns``, the earliest its samples can be), true once its
    phase spans are logged (``t_mono_ns``: after them). An iteration_logs entry that ends
    after a window started waits for its samples (stack samples in bursts come ~1 s late)."""

    TYPE: ClassVar[str] = "stack_window"
    pid: int
    start_mono_ns: int
    samples_in: bool


@dataclass(frozen=True)
class ProcessSample(Record):
    """Resident memory of one rank; ``peak_rss_bytes`` its lifetime peak (VmHWM);
    ``cpu_ns`` and ``run_delay_ns`` its threads' CPU time and time spent runnable but
    waiting for a CPU (/proc/PID/schedstat, cumulative; None where unavailable)."""

    TYPE: ClassVar[str] = "process"
    pid: int
    rss_bytes: int
    peak_rss_bytes: int | None
    cpu_ns: int | None = None
    run_delay_ns: int | None = None


@dataclass(frozen=True)
class GpuSamples(Record):
    """One NVML sample of every GPU (one map per GPU: perfmon.probes.gpu_sampling.GpuSample)."""

    TYPE: ClassVar[str] = "gpu"
    gpus: list[dict[str, Any]]


@dataclass(frozen=True)
class Xid(Record):
    """An XID event NVML reported."""

    TYPE: ClassVar[str] = "xid"
    gpu_index: int
    xid: int


@dataclass(frozen=True)
class Ecc(Record):
    """New volatile ECC errors (``kind`` corrected or uncorrected) since the last read."""

    TYPE: ClassVar[str] = "ecc"
    gpu_index: int
    kind: str
    count: int


@dataclass(frozen=True)
class CudaSnapshot(Record):
    """A rank's cumulative CUDA/NCCL counters, copied in the kernel at an Optimizer.step
    entry (``at_step``); ``launches_probed``: the launch probes were attached since the
    previous snapshot (perfmon.probes.cuda, sampled launch counting)."""

    TYPE: ClassVar[str] = "cuda"
    pid: int
    at_step: bool
    kernel_launches: int
    sync_wait_ns: int
    graph_launches: int
    nccl_calls: dict[str, int]
    nccl_bytes: dict[str, int]
    runtime_launches: int = 0
    driver_launches: int = 0
    forwarded_launches: int = 0
    sync_calls: int = 0
    sync_untracked: int = 0
    nccl_unknown_dtype_calls: int = 0
    launches_probed: bool = True


@dataclass(frozen=True)
class JobIteration(Record):
    """A read of the job's own iteration counter (a local variable) between
    ``t_mono_ns`` and ``end_mono_ns``."""

    TYPE: ClassVar[str] = "job_iteration"
    end_mono_ns: int
    pid: int
    value: int
    name: str


@dataclass(frozen=True)
class Hang(Record):
    """No iteration for ``threshold_s``: where the ranks wait, the report's path, and
    ``phase``: the training phase most ranks' main threads are in (data_loading,
    forward, backward, optimizer, other; null: no stacks)."""

    TYPE: ClassVar[str] = "hang"
    last_iteration_mono_ns: int
    threshold_s: float
    frame: str
    report: str
    phase: str | None = None


@dataclass(frozen=True)
class HangRecovered(Record):
    """Iterations resumed after a hang."""

    TYPE: ClassVar[str] = "hang_recovered"


@dataclass(frozen=True)
class RankExit(Record):
    """A rank's end: ``t_mono_ns`` the kernel's time of its exit (else when the agent saw it
    gone); `exit_code` or `signal` (with `core_dumped`) from its exit status, null when not
    observed; `oom_killed`: the kernel's OOM killer chose it (null: OOM kills not watched);
    `log_tail_cause`: the known failure in the last lines of its stdout/stderr
    (perfmon.parsers.exit_causes); `source`: proc_connector, proc_stat or unobserved
    (perfmon.probes.exits)."""

    TYPE: ClassVar[str] = "rank_exit"
    pid: int
    exit_code: int | None
    signal: str | None
    core_dumped: bool | None
    oom_killed: bool | None
    log_tail_cause: dict[str, Any] | None
    source: str
    rank: int | None = None


@dataclass(frozen=True)
class Quality(Record):
    """What a source saw and missed so far (cumulative counters, by name)."""

    TYPE: ClassVar[str] = "quality"
    source: str
    counters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Coarsened(Record):
    """A part of the log made coarser once the log outgrew its cap (``--event-log-max-mib``,
    perfmon.agent.record.coarsen): the span of its records, and per type how many were
    merged (in, out: one per rank and ``interval_s``) and dropped; the rows are whole."""

    TYPE: ClassVar[str] = "coarsened"
    part: int
    from_mono_ns: int
    until_mono_ns: int
    interval_s: int
    merged: dict[str, Any]
    dropped: dict[str, Any]


@dataclass(frozen=True)
class SessionEnd(Record):
    """The end of the window (``reason``: target_exited, duration, SIGTERM, ...)."""

    TYPE: ClassVar[str] = "session_end"
    reason: str


RECORD_TYPES: tuple[type[Record], ...] = (
    SessionStart, LogPart, Quality, CudaSnapshot, WaitTotals, Marker, Steps, JobIteration, Phase,
    StackWindow, ProcessSample, GpuSamples, Xid, Ecc, Hang, HangRecovered, RankExit, Coarsened,
    SessionEnd,
)
BY_TYPE: dict[str, type[Record]] = {cls.TYPE: cls for cls in RECORD_TYPES}
# Ties in time are ordered by type, as RECORD_TYPES lists them: a CUDA snapshot and
# the wait totals taken at an Optimizer.step before the marker of that step.
TYPE_ORDER = {cls.TYPE: rank for rank, cls in enumerate(RECORD_TYPES)}


def sort_key(record: dict[str, Any]) -> tuple[int, int]:
    """(t_mono_ns, rank of its type): the order records of one poll are logged in."""
    return record["t_mono_ns"], TYPE_ORDER.get(record["type"], len(TYPE_ORDER))


def cut_to_window(records: list[dict[str, Any]], until_ns: int) -> list[dict[str, Any]]:
    """``records`` as a window ending at ``until_ns`` has them: markers after it
    dropped, ``phase`` spans cut to it."""
    kept = []
    for r in records:
        if r["type"] == "marker" and r["t_mono_ns"] > until_ns:
            continue
        if r["type"] == "phase":
            if r["t_mono_ns"] >= until_ns:
                continue
            kept.append({**r, "end_mono_ns": min(r["end_mono_ns"], until_ns)})
            continue
        kept.append(r)
    return kept


def _runtime_types(annotation: Any) -> tuple[type, ...]:
    """Accepted runtime types of a field annotation; the usual one first."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(annotation) for t in _runtime_types(arg))
    if annotation is type(None):
        return (type(None),)
    if annotation is float:
        return (float, int)
    if origin is not None:
        return (origin,) if origin is not list else (list, tuple)
    return (annotation,)


def _fields(cls: type[Record]) -> dict[str, tuple[tuple[type, ...], bool]]:
    """name -> (accepted types, required) for a record class (t_mono_ns first)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (_runtime_types(hints[f.name]),
                     f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)  # type: ignore[misc]
            for f in dataclasses.fields(cls)}


RECORD_FIELDS = {cls.TYPE: _fields(cls) for cls in RECORD_TYPES}


def _fast_checks() -> dict[str, Any]:
    """Per record type, a function true when every field present has its usual type.

    Generated once (as namedtuple generates its classes): one boolean expression
    per type, so a well-formed record (nearly all) is checked in a few hundred
    nanoseconds; any other goes through record_problem's field-by-field check.
    """
    namespace: dict[str, Any] = {"MARKER_KINDS": frozenset(MARKER_KINDS)}
    lines = []
    for kind, fields in RECORD_FIELDS.items():
        tests = ["True"]
        for name, (accepted, required) in fields.items():
            # (the reader decodes arrays as tuples: a field may accept either)
            one = len(accepted) == 1
            namespace[f"T{len(namespace)}"] = accepted[0] if one else accepted
            usual = f"type(r.get({name!r})) {'is' if one else 'in'} T{len(namespace) - 1}"
            if required and type(None) in accepted:
                usual = f"{name!r} in r and {usual}"
            tests.append(usual if required else f"({name!r} not in r or {usual})")
        if kind == "marker":
            tests.append("r['kind'] in MARKER_KINDS")
        lines.append(f"def check_{kind}(r):\n    return {' and '.join(tests)}\n")
    exec("\n".join(lines), namespace)  # our own constant field table
    return {kind: namespace[f"check_{kind}"] for kind in RECORD_FIELDS}


FAST_CHECKS = _fast_checks()
del FAST_CHECKS["steps"]  # (once a second: its columns are checked by record_problem)
_MISSING = object()


def record_problem(record: object) -> str | None:
    """Why a decoded object is not a well-formed record of a known type, or None.

    Records of a type this version does not know are not a problem (a newer
    agent may add some): the caller skips them.
    """
    if type(record) is not dict:
        return f"a {type(record).__name__}, not a map"
    kind = record.get("type")
    fast = FAST_CHECKS.get(kind)  # type: ignore[arg-type]
    if fast is not None and fast(record):
        return None
    if not isinstance(kind, str):
        return "no 'type'"
    fields = RECORD_FIELDS.get(kind)
    if fields is None:
        return None
    for name, (accepted, required) in fields.items():
        value = record.get(name, _MISSING)
        if value is _MISSING:
            if required:
                return f"{kind} record without {name!r}"
            continue
        # bool is an int in Python; an int field must not take one.
        if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
            return f"{kind} record with {name!r} of type {type(value).__name__}"
    if kind == "steps":
        return steps_problem(record)
    return "marker record of unknown kind" if kind == "marker" and (
        record["kind"] not in MARKER_KINDS) else None


def records_table() -> str:
    """The Markdown table of every record type and its fields (docs/events.md holds it)."""
    rows = ["| type | fields | what |", "|---|---|---|"]
    for cls in RECORD_TYPES:
        names = []
        for name, (accepted, required) in RECORD_FIELDS[cls.TYPE].items():
            kinds = "/".join("null" if t is type(None) else t.__name__ for t in accepted)
            names.append(f"`{name}` ({kinds}{'' if required else ', optional'})")
        what = " ".join((cls.__doc__ or "").split()).replace("``", "`")
        rows.append(f"| `{cls.TYPE}` | {', '.join(names)} | {what} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(records_table(), end="")
