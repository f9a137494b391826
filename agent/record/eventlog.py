"""Append-only event log in numbered parts: msgpack records in one zstd stream per part,
flushed as a complete block at least once a second.

Every record the session sees is appended as it arrives, so an agent killed
with SIGKILL loses at most the last second: every flush ends a zstd block, and a
stream cut anywhere decodes up to its last whole block. ``perfmon-agent summarize``
rebuilds the summary from what is left (see perfmon.parsers.events for the records
and the reading). Records repeat themselves (the same pids, kinds and names, times a
step apart), so compressed they take a few bytes each.

Parts: the log starts as ``perf_events_<ts>.msgpack``; once a part holds
``part_bytes`` (default 256 MiB) the next record goes to
``perf_events_<ts>.part<N>.msgpack`` (N = 1, 2, ...), which begins with a
``log_part`` record. A week-long run thus leaves files of bounded size, and
``summarize`` reads the parts of one log together.

A cap on all the parts together (``max_bytes``, default 2 GiB): when a new part
begins and the parts hold more, the oldest part not yet made coarser is rewritten
coarser in a background thread (perfmon.agent.record.coarsen: every iteration's
row kept, samples merged to one a minute, spans and raw markers dropped), never
deleted; ``take_coarsened`` hands its ``coarsened`` record to the session, whose
summary says so. Once every closed part is coarser the log grows on (``over_cap``).

Write failures (a full disk or quota, a filesystem gone read-only) never stop
the session: records wait in memory uncompressed (up to ``backlog_bytes``, then the
oldest are dropped and counted; a block already compressed is never dropped, as
the stream's later blocks refer to it) and every flush tries again; ``error`` says
what failed last, ``dropped_records`` what was lost.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any

import msgpack
import zstandard
from perfmon.agent.record.coarsen import coarsen_part
from perfmon.agent.record.layout import log_part
from perfmon.agent.record.outputs import OutputDir, refused
from perfmon.parsers.errors import EventLogError
from perfmon.probes.sampler import monotonic_ns

FLUSH_INTERVAL_NS = 1_000_000_000
DEFAULT_PART_BYTES = 256 << 20
DEFAULT_BACKLOG_BYTES = 64 << 20
DEFAULT_MAX_BYTES = 2048 << 20
COARSEN_JOIN_S = 60.0  # at close, how long a coarsening under way may take to finish
# zstd level 9 with a 4 MiB window (a second of records is a few KiB: level 9 costs
# nothing here and finds ~15% more than level 3); readers refuse larger windows
# (perfmon.parsers.log_stream.MAX_ZSTD_WINDOW_BYTES), so a crafted log cannot make them
# allocate more.
_ZSTD = zstandard.ZstdCompressionParameters.from_level(9, window_log=22)


class EventLogWriter:
    """Writes one session's records into ``out``; the first part must not exist yet.

    Raises FileExistsError (name taken) or OSError from the constructor only.
    """

    def __init__(self, out: OutputDir, stem: str, *, part_bytes: int = DEFAULT_PART_BYTES,
                 backlog_bytes: int = DEFAULT_BACKLOG_BYTES,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.out = out
        self.stem = stem
        self.part_bytes = part_bytes
        self.backlog_bytes = backlog_bytes
        self.max_bytes = max_bytes
        self.part = 0
        self.error: OSError | None = None
        self.dropped_records = 0
        self.over_cap = False  # every closed part is coarser, and the log is over its cap
        self.coarsen_error: str | None = None
        self._fd = out.create_append(log_part(stem, 0))
        self._sizes = [0]  # bytes of each part (the last: the one being written)
        self._coarser: set[int] = set()  # parts rewritten coarser (or being)
        self._coarsening: threading.Thread | None = None
        self._coarsened: deque[dict[str, Any]] = deque()  # for take_coarsened
        self._packer = msgpack.Packer()
        self._pending: deque[bytes] = deque()  # packed records not yet compressed
        self._pending_bytes = 0
        self._stream = self._new_stream()
        self._out = b""  # compressed, not yet written: written before anything else
        self._last_flush_ns = monotonic_ns()

    @staticmethod
    def _new_stream() -> zstandard.ZstdCompressionObj:
        return zstandard.ZstdCompressor(compression_params=_ZSTD).compressobj()

    @property
    def name(self) -> str:
        return log_part(self.stem, 0)

    def append(self, record: dict[str, Any]) -> None:
        packed = self._packer.pack(record)
        self._pending.append(packed)
        self._pending_bytes += len(packed)
        # Bounded while the disk refuses: drop whole records, oldest first.
        while self._pending_bytes > self.backlog_bytes and len(self._pending) > 1:
            self._pending_bytes -= len(self._pending.popleft())
            self.dropped_records += 1

    def flush_if_due(self, now_ns: int | None = None) -> None:
        """Hand buffered records to the kernel when a second has passed since the last flush."""
        now_ns = monotonic_ns() if now_ns is None else now_ns
        if self._pending and now_ns - self._last_flush_ns >= FLUSH_INTERVAL_NS:
            self.flush()

    def flush(self) -> bool:
        """Write what is buffered; False (with ``error`` set) when the disk refused."""
        self._last_flush_ns = monotonic_ns()
        try:
            while self._out or self._pending:
                if not self._out:
                    if self._sizes[-1] >= self.part_bytes:
                        self._next_part()
                    # One complete block: what a reader decodes if the agent dies now.
                    self._out = (self._stream.compress(b"".join(self._pending))
                                 + self._stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
                    self._pending.clear()
                    self._pending_bytes = 0
                written = os.write(self._fd, self._out)
                self._sizes[-1] += written
                self._out = self._out[written:]
        except OSError as err:
            self.error = refused(err)
            return False
        self.error = None
        # (and at every flush, not only when a part closes: a coarsening still under way
        # then, its machine busy, left the next part's for the next close, and the log
        # grew past its cap while parts came faster than they were rewritten)
        self._coarsen_if_over()
        return True

    def _next_part(self) -> None:
        fd = self.out.create_append(log_part(self.stem, self.part + 1))
        try:
            self._end_stream()
            os.fsync(self._fd)
        except OSError:
            pass  # readers do without the frame's end; the next part is what matters
        os.close(self._fd)
        self._fd = fd
        self._sizes.append(0)
        self._stream = self._new_stream()
        self.part += 1
        self._coarsen_if_over()
        marker = self._packer.pack({"type": "log_part", "t_mono_ns": monotonic_ns(),
                                    "part": self.part})
        self._pending.appendleft(marker)
        self._pending_bytes += len(marker)

    # -- the cap -------------------------------------------------------------------------

    def _coarsen_if_over(self) -> None:
        """Over the cap: rewrite the oldest closed part not yet coarser (one at a time)."""
        if self._coarsening is not None and self._coarsening.is_alive():
            return
        if sum(self._sizes) <= self.max_bytes:
            return
        todo = [i for i in range(len(self._sizes) - 1) if i not in self._coarser]
        self.over_cap = not todo
        if todo:
            self._coarser.add(todo[0])
            self._coarsening = threading.Thread(target=self._coarsen, args=(todo[0],),
                                                name="perfmon-coarsen", daemon=True)
            self._coarsening.start()

    def _coarsen(self, part: int) -> None:
        try:
            record, size = coarsen_part(self.out, log_part(self.stem, part), part, monotonic_ns,
                                        self._new_stream)
        except (OSError, EventLogError) as err:
            self.coarsen_error = f"{log_part(self.stem, part)}: {err}"
            return
        self._sizes[part] = size
        self._coarsened.append(record)

    def take_coarsened(self) -> list[dict[str, Any]]:
        """The ``coarsened`` records of the parts rewritten since the last call."""
        taken = []
        while self._coarsened:
            taken.append(self._coarsened.popleft())
        return taken

    @property
    def total_bytes(self) -> int:
        return sum(self._sizes)

    def _end_stream(self) -> None:
        """The zstd frame's end (a few bytes; readers do without it: a killed agent's
        stream has none). Raises OSError."""
        end = self._stream.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH)
        while end:
            written = os.write(self._fd, end)
            self._sizes[-1] += written
            end = end[written:]

    def close(self) -> bool:
        """Flush, fsync and close; False when records could not be written."""
        if self._fd < 0:
            return self.error is None
        ok = self.flush()
        try:
            if ok:
                self._end_stream()
            os.fsync(self._fd)
        except OSError as err:
            self.error, ok = refused(err), False
        os.close(self._fd)
        self._fd = -1
        if self._coarsening is not None:
            self._coarsening.join(COARSEN_JOIN_S)
        return ok
