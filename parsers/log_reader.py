"""Reading an event log part (pure): its records one at a time from a stream, with a
bounded buffer, so a log of any size is read in flat memory, checked against the
record types of perfmon.parsers.events. A log is one zstd stream of the records per
part (a cut stream decodes up to its last whole block), or plain msgpack (older
agents' logs); a killed agent leaves a log whose last record may be cut short, and
decoding stops cleanly there and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import IO, Any

import msgpack
from perfmon.parsers.errors import EventLogError
from perfmon.parsers.events import FAST_CHECKS, RECORD_FIELDS, record_problem
from perfmon.parsers.log_stream import Decoded, ZstdError, open_log_stream

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
        fast = FAST_CHECKS
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
