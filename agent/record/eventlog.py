"""Append-only msgpack event log in numbered parts, flushed at least once a second.

Every record the session sees is appended as it arrives, so an agent killed
with SIGKILL loses at most the last second; ``perfmon-agent summarize`` rebuilds
the summary from what is left (see perfmon.parsers.events for the records).

Parts: the log starts as ``perf_events_<ts>.msgpack``; once a part holds
``part_bytes`` (default 256 MiB) the next record goes to
``perf_events_<ts>.part<N>.msgpack`` (N = 1, 2, ...), which begins with a
``log_part`` record. A week-long run thus leaves files of bounded size, and
``summarize`` reads the parts of one log together.

Write failures (a full disk or quota, a filesystem gone read-only) never stop
the session: records wait in memory (up to ``backlog_bytes``, then the oldest
are dropped and counted) and every flush tries again; ``error`` says what
failed last, ``dropped_records`` what was lost.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import msgpack
from perfmon.agent.record.layout import log_part
from perfmon.agent.record.outputs import WRITE_ERRNOS, OutputDir
from perfmon.probes.sampler import monotonic_ns

FLUSH_INTERVAL_NS = 1_000_000_000
DEFAULT_PART_BYTES = 256 << 20
DEFAULT_BACKLOG_BYTES = 64 << 20


class EventLogWriter:
    """Writes one session's records into ``out``; the first part must not exist yet.

    Raises FileExistsError (name taken) or OSError from the constructor only.
    """

    def __init__(self, out: OutputDir, stem: str, *, part_bytes: int = DEFAULT_PART_BYTES,
                 backlog_bytes: int = DEFAULT_BACKLOG_BYTES) -> None:
        self.out = out
        self.stem = stem
        self.part_bytes = part_bytes
        self.backlog_bytes = backlog_bytes
        self.part = 0
        self.error: OSError | None = None
        self.dropped_records = 0
        self._fd = out.create_append(log_part(stem, 0))
        self._part_size = 0
        self._packer = msgpack.Packer()
        self._pending: deque[bytes] = deque()  # packed records not yet written
        self._pending_bytes = 0
        self._written_of_first = 0  # bytes of _pending[0] already in the file
        self._last_flush_ns = monotonic_ns()

    @property
    def name(self) -> str:
        return log_part(self.stem, 0)

    def append(self, record: dict[str, Any]) -> None:
        packed = self._packer.pack(record)
        self._pending.append(packed)
        self._pending_bytes += len(packed)
        # Bounded while the disk refuses: drop whole records, oldest first (never
        # the one partly written already).
        while self._pending_bytes > self.backlog_bytes and len(self._pending) > 1:
            index = 1 if self._written_of_first else 0
            dropped = self._pending[index]
            del self._pending[index]
            self._pending_bytes -= len(dropped)
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
            while self._pending:
                if self._written_of_first == 0 and self._part_size >= self.part_bytes:
                    self._next_part()
                head = self._pending[0]
                written = os.write(self._fd, memoryview(head)[self._written_of_first:])
                self._part_size += written
                self._written_of_first += written
                if self._written_of_first == len(head):
                    self._pending.popleft()
                    self._pending_bytes -= len(head)
                    self._written_of_first = 0
        except OSError as err:
            if err.errno not in WRITE_ERRNOS:
                raise
            self.error = err
            return False
        self.error = None
        return True

    def _next_part(self) -> None:
        fd = self.out.create_append(log_part(self.stem, self.part + 1))
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd, self._part_size = fd, 0
        self.part += 1
        marker = self._packer.pack({"type": "log_part", "t_mono_ns": monotonic_ns(),
                                    "part": self.part})
        self._pending.appendleft(marker)
        self._pending_bytes += len(marker)

    def close(self) -> bool:
        """Flush, fsync and close; False when records could not be written."""
        if self._fd < 0:
            return self.error is None
        ok = self.flush()
        try:
            os.fsync(self._fd)
        except OSError as err:
            if err.errno not in WRITE_ERRNOS:
                raise
            self.error, ok = err, False
        os.close(self._fd)
        self._fd = -1
        return ok
