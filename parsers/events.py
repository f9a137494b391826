"""The event log's records: one frozen dataclass per type, and their decoding (pure).

Every source emits these records; the session logs them (``to_record``) as msgpack
maps and feeds the same maps to the reducers, and ``summarize`` reads them back:
one definition for the log, the reducers and the docs (docs/events.md is
checked against :func:`records_table`). The log is appended as events arrive,
so a killed agent leaves a log whose last record may be cut short; decoding
stops cleanly there and says so. Records are read one at a time from a stream
with a bounded buffer, so a log of any size is read in flat memory. A log is one
zstd stream of the records per part (perfmon.agent.record.eventlog; a cut stream
decodes up to its last whole block), or plain msgpack (older agents' logs).

Record order: the session sorts each poll's records from all sources by
``(t_mono_ns, TYPE_ORDER)`` before logging them (see ``sort_key``); replay feeds
them in log order, so live and replayed summaries are the same.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any, ClassVar

import msgpack
from perfmon.parsers.errors import EventLogError
from perfmon.parsers.log_stream import Decoded, ZstdError, open_log_stream

SCHEMA_VERSION = 3

MARKER_KINDS = (
    "optimizer_step",
    "zero_grad",
    "dataloader_next",
    "backward_enter",
    "backward_exit",
    "wait_enter",
    "wait_exit",
)


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

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Record:
        """The typed record of a map of this type; ValueError when it is malformed."""
        problem = record_problem(record)
        if problem is not None or record.get("type") != cls.TYPE:
            raise ValueError(problem or f"not a {cls.TYPE} record")
        return cls(**{f.name: record[f.name] for f in dataclasses.fields(cls)
                      if f.name in record})


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
    """A rank's time blocked on collectives so far (cumulative), at an Optimizer.step:
    the sum over its threads of each one's waits (nested calls once; the stepping
    thread's open wait ends at the step), and how many ended. Counted in the kernel
    (bcc) or by the probe (tracefs) and logged once a step, not every wait's entry and
    return (those are ``wait_*`` markers, only when asked for)."""

    TYPE: ClassVar[str] = "waits"
    pid: int
    wait_ns: int
    waits: int


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
    """One NVML sample of every GPU (one map per GPU: perfmon.probes.nvml.GpuSample)."""

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
    """No iteration for ``threshold_s``: where the ranks wait and the report's path."""

    TYPE: ClassVar[str] = "hang"
    last_iteration_mono_ns: int
    threshold_s: float
    frame: str
    report: str


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
class SessionEnd(Record):
    """The end of the window (``reason``: target_exited, duration, SIGTERM, ...)."""

    TYPE: ClassVar[str] = "session_end"
    reason: str


RECORD_TYPES: tuple[type[Record], ...] = (
    SessionStart, LogPart, Quality, CudaSnapshot, WaitTotals, Marker, JobIteration, Phase,
    ProcessSample, GpuSamples, Xid, Ecc, Hang, HangRecovered, RankExit, SessionEnd,
)
BY_TYPE: dict[str, type[Record]] = {cls.TYPE: cls for cls in RECORD_TYPES}
# Ties in time are ordered by type, as RECORD_TYPES lists them: a CUDA snapshot and
# the wait totals taken at an Optimizer.step before the marker of that step.
TYPE_ORDER = {cls.TYPE: rank for rank, cls in enumerate(RECORD_TYPES)}


def sort_key(record: dict[str, Any]) -> tuple[int, int]:
    """(t_mono_ns, rank of its type): the order records of one poll are logged in."""
    return record["t_mono_ns"], TYPE_ORDER.get(record["type"], len(TYPE_ORDER))


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
            namespace[f"T{len(namespace)}"] = accepted[0]
            usual = f"type(r.get({name!r})) is T{len(namespace) - 1}"
            tests.append(usual if required else f"({name!r} not in r or {usual})")
        if kind == "marker":
            tests.append("r['kind'] in MARKER_KINDS")
        lines.append(f"def check_{kind}(r):\n    return {' and '.join(tests)}\n")
    exec("\n".join(lines), namespace)  # our own constant field table
    return {kind: namespace[f"check_{kind}"] for kind in RECORD_FIELDS}


_FAST_CHECK = _fast_checks()
_MISSING = object()


def record_problem(record: object) -> str | None:
    """Why a decoded object is not a well-formed record of a known type, or None.

    Records of a type this version does not know are not a problem (a newer
    agent may add some): the caller skips them.
    """
    if type(record) is not dict:
        return f"a {type(record).__name__}, not a map"
    kind = record.get("type")
    fast = _FAST_CHECK.get(kind)  # type: ignore[arg-type]
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
    return _marker_kind_problem(record)


def _marker_kind_problem(record: dict[str, Any]) -> str | None:
    if record["type"] == "marker" and record["kind"] not in MARKER_KINDS:
        return "marker record of unknown kind"
    return None


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


# The largest record a log may hold; a record longer than this is corruption.
MAX_RECORD_BYTES = 16 << 20
_READ_BYTES = 1 << 20

class EventLogReader:
    """Records of one event log part, read from a binary stream one at a time.

    Iterating yields well-formed records of known types. Afterwards:
    ``records`` (yielded), ``skipped`` (wrong shape, with ``first_problem``),
    ``unknown`` (types this version does not know), ``tail_cut`` (the stream
    ended inside a record: the agent was killed while writing), ``corrupt``
    (a message when undecodable bytes stopped the reading early).
    The first record must be ``session_start`` or ``log_part``, else
    EventLogError is raised before anything is yielded.
    """

    def __init__(self, stream: IO[bytes], source: str, size_bytes: int | None = None) -> None:
        self.source = source
        self.size_bytes = size_bytes
        # A zstd stream (this agent's logs), else plain msgpack (older agents', tests').
        opened = open_log_stream(stream)
        self._decoded = opened if isinstance(opened, Decoded) else None
        self.records = 0
        self.skipped = 0
        self.unknown = 0
        self.first_problem: str | None = None
        self.tail_cut = False
        self.corrupt: str | None = None
        self.first: dict[str, Any] | None = None
        self.last_t_mono_ns = 0  # the latest time of a record read
        self._position = 0
        self._unpacker = msgpack.Unpacker(
            opened, raw=False, strict_map_key=False, read_size=_READ_BYTES, use_list=False,
            max_buffer_size=MAX_RECORD_BYTES)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        self.read_into(records.append, limit=1)
        yield from records
        while True:
            records.clear()
            done = self.read_into(records.append, limit=4096)
            yield from records
            if done:
                return

    def read_into(self, sink: Callable[[dict[str, Any]], object],
                  limit: int | None = None) -> bool:
        """Pass records to ``sink`` (the fast path of replaying a log: no generator
        between the decoder and the reducers); at most ``limit``; True at the end."""
        unpacker = self._unpacker
        tell = unpacker.tell
        fast = _FAST_CHECK
        count = 0
        last_t = self.last_t_mono_ns
        whole = tell()  # where the last record decoded whole ends
        try:
            for obj in unpacker:
                whole = tell()
                if self.first is None:
                    self._check_first(obj)
                    self.first = obj
                else:
                    # The common case in one dict lookup and one generated check.
                    check = fast.get(obj.get("type")) if type(obj) is dict else None  # type: ignore[arg-type]
                    if check is None or not check(obj):
                        problem = record_problem(obj)
                        if problem is not None:
                            self.skipped += 1
                            self.first_problem = self.first_problem or problem
                            continue
                        if obj["type"] not in RECORD_FIELDS:
                            self.unknown += 1
                            continue
                t = obj["t_mono_ns"]
                if t > last_t:  # noqa: PLR1730  (no call: once a record)
                    last_t = t
                sink(obj)
                count += 1
                if count == limit:
                    return False
        except (msgpack.UnpackException, ValueError, ZstdError) as err:
            if self.first is None:
                raise EventLogError(f"{self.source}: not a perfmon event log ({err})") from err
            # (a string that is no UTF-8 fails after the decoder has read past it: the
            # offset named is where the last record decoded whole ended)
            where = " of its decoded records" if self._decoded is not None else ""
            self.corrupt = f"undecodable data after byte {whole}{where}: {err}"
            return True
        finally:
            # Kept in locals while reading (this loop runs once a record).
            self.records += count
            self.last_t_mono_ns = last_t
            self._position = tell()
        if self.first is None:
            raise EventLogError(f"{self.source}: not a perfmon event log (empty)")
        size = self._decoded.count if self._decoded is not None else self.size_bytes
        if size is not None and self._position < size:
            self.tail_cut = True
        return True

    def _check_first(self, obj: object) -> None:
        if not isinstance(obj, dict) or obj.get("type") not in ("session_start", "log_part"):
            raise EventLogError(f"{self.source}: not a perfmon event log (no session_start record)")
        problem = record_problem(obj)
        if problem is not None:
            raise EventLogError(f"{self.source}: not a perfmon event log ({problem})")


if __name__ == "__main__":
    print(records_table(), end="")
