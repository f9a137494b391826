"""Append-only msgpack event log, flushed at least once a second.

Every record the session sees is appended as it arrives, so an agent killed
with SIGKILL loses at most the last second; ``perfmon-agent summarize`` rebuilds
the summary from what is left (see perfmon.parsers.events for the records).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgpack
from perfmon.probes.sampler import monotonic_ns

FLUSH_INTERVAL_NS = 1_000_000_000


class EventLogWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        # O_APPEND: records are only ever added at the end, even if two writers race.
        self._file = open(path, "ab", buffering=1 << 16)
        self._packer = msgpack.Packer()
        self._last_flush_ns = monotonic_ns()
        self._dirty = False

    def append(self, record: dict[str, Any]) -> None:
        self._file.write(self._packer.pack(record))
        self._dirty = True

    def flush_if_due(self, now_ns: int | None = None) -> None:
        """Hand buffered records to the kernel when a second has passed since the last flush."""
        now_ns = monotonic_ns() if now_ns is None else now_ns
        if self._dirty and now_ns - self._last_flush_ns >= FLUSH_INTERVAL_NS:
            self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._dirty = False
        self._last_flush_ns = monotonic_ns()

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
