"""Blocking probe calls (py-spy dumps) run in one worker thread, so a source's ``poll()``
and the session's 100 ms loop never block; their results come back on a later poll.

``close()`` sets ``cancel`` (which the calls honour: a py-spy dump is killed
within 0.1 s) and does not wait for the thread, so a session asked to stop during
a hang's native dump stops within a second.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BackgroundCalls:
    """One worker thread; ``submit`` queues a call, ``done`` returns finished ones."""

    def __init__(self, name: str) -> None:
        self.cancel = threading.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._futures: list[tuple[str, Future[Any]]] = []

    def submit(self, tag: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue ``call(*args, **kwargs)``; ``tag`` names it in ``done()``."""
        if self.cancel.is_set():
            return
        self._futures.append((tag, self._executor.submit(call, *args, **kwargs)))

    def busy(self, tag: str | None = None) -> bool:
        """Whether a call (of this tag) is queued or running."""
        return any(tag in (None, t) and not f.done() for t, f in self._futures)

    def done(self) -> list[tuple[str, Any, BaseException | None]]:
        """(tag, result, exception) of each call finished since the last time, in order."""
        finished = []
        while self._futures and self._futures[0][1].done():
            tag, future = self._futures.pop(0)
            error = future.exception()
            finished.append((tag, None if error else future.result(), error))
        return finished

    def close(self) -> None:
        """Cancel what is queued, tell what runs to stop, and do not wait for it."""
        self.cancel.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._futures = []
