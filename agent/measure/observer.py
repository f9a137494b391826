"""What a session tells as it goes, and to whom: one observer shape, and a group that fans
one session out to several (as dynolog's CompositeLogger does).

A session has one observer (SessionContext.observer). ``attach`` gives it a group
of the console's progress lines and the job's Prometheus metrics
(perfmon.agent.measure.metrics.JobMetrics); the node service only the metrics. What
they are told is the Summarizer's typed figures (perfmon.parsers.figures), never
another output's rendering of them. The session writes its summary file itself (a write
it cannot do is its exit status) and tells ``statistics`` after each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from perfmon.parsers.figures import IntervalFigures, Statistics

if TYPE_CHECKING:
    from perfmon.agent.measure.session import SessionResult


class SessionObserver:
    """What a session tells as it goes; every method is called from the session's own
    thread, and does nothing here."""

    def started(self, facts: dict[str, Any]) -> None:
        """Monitoring began: the session's facts (pids, ranks, model...)."""

    def iterations(self, step_times_s: list[float]) -> None:
        """Iterations measured since the last call, their step times (s)."""

    def interval(self, figures: IntervalFigures) -> None:
        """A completed log interval."""

    def statistics(self, stats: Statistics) -> None:
        """The session's figures as the summary just written has them (periodically, and
        at the end)."""

    def finished(self, result: SessionResult) -> None:
        """The session ended; its final summary is written (or failed to be)."""


class ObserverGroup(SessionObserver):
    """Every call to each of ``observers``, in order."""

    def __init__(self, observers: Sequence[SessionObserver]) -> None:
        self.observers = list(observers)

    def started(self, facts: dict[str, Any]) -> None:
        for o in self.observers:
            o.started(facts)

    def iterations(self, step_times_s: list[float]) -> None:
        for o in self.observers:
            o.iterations(step_times_s)

    def interval(self, figures: IntervalFigures) -> None:
        for o in self.observers:
            o.interval(figures)

    def statistics(self, stats: Statistics) -> None:
        for o in self.observers:
            o.statistics(stats)

    def finished(self, result: SessionResult) -> None:
        for o in self.observers:
            o.finished(result)


class ProgressLines(SessionObserver):
    """One line per completed log interval, through ``show`` (attach's console)."""

    def __init__(self, show: Callable[[IntervalFigures], None]) -> None:
        self.show = show

    def interval(self, figures: IntervalFigures) -> None:
        self.show(figures)
