"""The event log's records and their decoding from a stream (pure: no files opened here).

The log is a stream of msgpack maps, each with a ``type``. It is appended as
events arrive, so a killed agent leaves a log whose last record may be cut
short; decoding stops cleanly there and says so. Records are read one at a
time from the stream with a bounded buffer, so a log of any size is read in
flat memory.

Record types and the fields each must have (more may follow):
- ``session_start``: ``t_mono_ns``, ``session`` (the static session facts: pids,
  command line, host, model, batch, world size, ...)
- ``log_part``: ``t_mono_ns``, ``part``: first record of each later part of a
  rotated log (perf_events_<ts>.part<N>.msgpack)
- ``marker``: ``t_mono_ns``, ``pid``, ``tid``, ``kind`` (one of MARKER_KINDS), ``name``
- ``phase``: ``t_mono_ns``, ``end_mono_ns``, ``pid``, ``phase``
- ``process``: ``t_mono_ns``, ``pid``, ``rss_bytes``, ``peak_rss_bytes`` (int or null)
- ``gpu``: ``t_mono_ns``, ``gpus`` (one map per GPU)
- ``xid``: ``t_mono_ns``, ``gpu_index``, ``xid``
- ``ecc``: ``t_mono_ns``, ``gpu_index``, ``kind``, ``count``
- ``cuda``: ``t_mono_ns``, ``pid``, ``at_step``, ``kernel_launches``, ``sync_wait_ns``,
  ``graph_launches``, ``nccl_calls``, ``nccl_bytes``
- ``job_iteration``: ``t_mono_ns``, ``end_mono_ns``, ``pid``, ``value``, ``name``
- ``hang``: ``t_mono_ns``, ``last_iteration_mono_ns``, ``threshold_s``, ``frame``, ``report``
- ``hang_recovered``: ``t_mono_ns``
- ``lost``: ``t_mono_ns``, ``count`` (events the kernel could not deliver)
- ``session_end``: ``t_mono_ns``, ``reason``
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, Any

import msgpack
from perfmon.parsers.errors import EventLogError

MARKER_KINDS = (
    "optimizer_step",
    "zero_grad",
    "dataloader_next",
    "backward_enter",
    "backward_exit",
)

# The largest record a log may hold; a record longer than this is corruption.
MAX_RECORD_BYTES = 16 << 20
_READ_BYTES = 1 << 20

_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_OPT_INT = (int, type(None))
RECORD_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "session_start": {"t_mono_ns": _INT, "session": (dict,)},
    "log_part": {"t_mono_ns": _INT, "part": _INT},
    "marker": {"t_mono_ns": _INT, "pid": _INT, "tid": _INT, "kind": _STR, "name": _STR},
    "phase": {"t_mono_ns": _INT, "end_mono_ns": _INT, "pid": _INT, "phase": _STR},
    "process": {"t_mono_ns": _INT, "pid": _INT, "rss_bytes": _INT, "peak_rss_bytes": _OPT_INT},
    "gpu": {"t_mono_ns": _INT, "gpus": (list,)},
    "xid": {"t_mono_ns": _INT, "gpu_index": _INT, "xid": _INT},
    "ecc": {"t_mono_ns": _INT, "gpu_index": _INT, "kind": _STR, "count": _INT},
    "cuda": {"t_mono_ns": _INT, "pid": _INT, "at_step": (bool,), "kernel_launches": _INT,
             "sync_wait_ns": _INT, "graph_launches": _INT, "nccl_calls": (dict,),
             "nccl_bytes": (dict,)},
    "job_iteration": {"t_mono_ns": _INT, "end_mono_ns": _INT, "pid": _INT, "value": _INT,
                      "name": _STR},
    "hang": {"t_mono_ns": _INT, "last_iteration_mono_ns": _INT, "threshold_s": _NUM,
             "frame": _STR, "report": _STR},
    "hang_recovered": {"t_mono_ns": _INT},
    "lost": {"t_mono_ns": _INT, "count": _INT},
    "session_end": {"t_mono_ns": _INT, "reason": _STR},
}


def _fast_checks() -> dict[str, Any]:
    """Per record type, a function true when every field has its usual type.

    Generated once (as namedtuple generates its classes): one boolean expression
    per type, so a well-formed record (nearly all) is checked in a few hundred
    nanoseconds; any other goes through record_problem's field-by-field check.
    """
    namespace: dict[str, Any] = {}
    lines = []
    for kind, fields in RECORD_FIELDS.items():
        tests = []
        for name, types in fields.items():
            namespace[f"T{len(namespace)}"] = types[0]
            tests.append(f"type(r.get({name!r})) is T{len(namespace) - 1}")
        lines.append(f"def check_{kind}(r):\n    return {' and '.join(tests)}\n")
    exec("\n".join(lines), namespace)  # our own constant field table
    return {kind: namespace[f"check_{kind}"] for kind in RECORD_FIELDS}


_FAST_CHECK = _fast_checks()


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
        return _marker_kind_problem(record)
    if not isinstance(kind, str):
        return "no 'type'"
    fields = RECORD_FIELDS.get(kind)
    if fields is None:
        return None
    for name, types in fields.items():
        value = record.get(name, _MISSING)
        if value is _MISSING:
            return f"{kind} record without {name!r}"
        # bool is an int in Python; an int field must not take one.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"{kind} record with {name!r} of type {type(value).__name__}"
    return _marker_kind_problem(record)


def _marker_kind_problem(record: dict[str, Any]) -> str | None:
    if record["type"] == "marker" and record["kind"] not in MARKER_KINDS:
        return "marker record of unknown kind"
    return None


_MISSING = object()


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
        self.records = 0
        self.skipped = 0
        self.unknown = 0
        self.first_problem: str | None = None
        self.tail_cut = False
        self.corrupt: str | None = None
        self.first: dict[str, Any] | None = None
        self._unpacker = msgpack.Unpacker(
            stream, raw=False, strict_map_key=False, read_size=_READ_BYTES,
            max_buffer_size=MAX_RECORD_BYTES)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        unpacker = self._unpacker
        position = 0
        try:
            for obj in unpacker:
                position = unpacker.tell()
                if self.first is None:
                    self._check_first(obj)
                    self.first = obj
                    self.records += 1
                    yield obj
                    continue
                problem = record_problem(obj)
                if problem is not None:
                    self.skipped += 1
                    self.first_problem = self.first_problem or problem
                    continue
                if obj["type"] not in RECORD_FIELDS:
                    self.unknown += 1
                    continue
                self.records += 1
                yield obj
        except (msgpack.UnpackException, ValueError) as err:
            if self.first is None:
                raise EventLogError(f"{self.source}: not a perfmon event log ({err})") from err
            self.corrupt = f"undecodable data after byte {position}: {err}"
            return
        if self.first is None:
            raise EventLogError(f"{self.source}: not a perfmon event log (empty)")
        if self.size_bytes is not None and position < self.size_bytes:
            self.tail_cut = True

    def _check_first(self, obj: object) -> None:
        if not isinstance(obj, dict) or obj.get("type") not in ("session_start", "log_part"):
            raise EventLogError(f"{self.source}: not a perfmon event log (no session_start record)")
        problem = record_problem(obj)
        if problem is not None:
            raise EventLogError(f"{self.source}: not a perfmon event log ({problem})")
