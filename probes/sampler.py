"""The one shape every probe has: ``start()``, non-blocking ``poll()``, idempotent ``close()``.

Timestamps are CLOCK_MONOTONIC nanoseconds (``time.monotonic_ns`` on Linux), the
clock ``bpf_ktime_get_ns`` reads too, so records from every probe and the
target's own timestamps compare directly.
"""

from __future__ import annotations

import time
from typing import Generic, TypeVar

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
