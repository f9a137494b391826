"""The one shape every probe has: ``start()``, non-blocking ``poll()``, idempotent ``close()``.

A :class:`Sampler` yields raw samples (py-spy stacks, NVML readings); a
:class:`Source` is a sampler whose records are the event log's
(perfmon.parsers.events), and that says what it saw and missed
(``quality()``): every source of a session has this one shape, so the session
starts them all under one ``contextlib.ExitStack`` and polls, logs and closes
them the same way.

Timestamps are CLOCK_MONOTONIC nanoseconds (``time.monotonic_ns`` on Linux), the
clock ``bpf_ktime_get_ns`` reads too, so records from every probe and the
target's own timestamps compare directly.
"""

from __future__ import annotations

import time
from typing import Any, Generic, TypeVar

from perfmon.parsers.events import Record

R = TypeVar("R")


def monotonic_ns() -> int:
    """CLOCK_MONOTONIC in nanoseconds (same clock as bpf_ktime_get_ns)."""
    return time.monotonic_ns()


class Sampler(Generic[R]):
    """Base class: subclasses implement ``_start``, ``_poll`` and ``_close``.

    Set-up failures raise from ``start``; per-sample failures are data, counted
    by the subclass and reported through its records or counters.
    """

    def __init__(self) -> None:
        self._started = False
        self._closed = False

    def start(self) -> None:
        if self._started:
            return
        self._start()
        self._started = True

    def poll(self) -> list[R]:
        """Records gathered since the previous call; never blocks for long."""
        if not self._started or self._closed:
            return []
        return self._poll()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started:
            self._close()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        raise NotImplementedError

    def _poll(self) -> list[R]:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


class Source(Sampler[Record]):
    """A sampler of event-log records.

    ``name`` names it in ``data_quality``; ``available`` is False (with
    ``reason``) when ``start`` found nothing to measure (e.g. no CUDA library
    loaded) — a quiet source, not a failure; ``warnings`` lists degraded
    features found at start, ``notes`` what the job does not use (nothing to act
    on). ``quality()`` returns cumulative counters of what it saw and missed
    (names listed in perfmon.agent.reducers.quality.HINTS for the losses), read at
    any time without blocking.
    """

    name = "source"

    def __init__(self) -> None:
        super().__init__()
        self.available = True
        self.reason: str | None = None
        self.warnings: list[str] = []
        self.notes: list[str] = []

    def quality(self) -> dict[str, Any]:
        return {}
