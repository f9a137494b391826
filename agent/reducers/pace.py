"""The job's pace, its noise, and what a stall is (docs/metrics.md, "Goodput").

The pace is the median of the primary's last PACE_STEPS steps that were no stall; its
noise, a robust sigma of log(step / pace) over the last NOISE_STEPS of them. A stall
is an iteration longer than its pace by STALL_PACES paces, STALL_MIN_NS and
STALL_SIGMAS of that noise, all three: far outside the job's own spread (a 25 s wait
in the backward, a data loader that stopped, a checkpoint), whatever the step. A
slowdown of the pace, even of 100%, is never a stall: the goodput ledger counts stalls
as hang and fail-slow leaves them out of its blocks (a stall is no shift of the pace).
A pace that moved by more than that (a job gone from 10 ms to 400 ms steps) shows as
NEW_PACE_STALLS stalls in a row that agree (within NEW_PACE_SPREAD of each other:
stalls, a 4 s then a 7 s one, do not): the pace starts again from them.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from perfmon.agent.reducers.ranks import MAD_TO_SIGMA

PACE_STEPS = 9
NOISE_STEPS = 64
NOISE_EVERY = 8  # steps between two reckonings of the noise
STALL_PACES = 2.0
STALL_MIN_NS = 250_000_000
STALL_SIGMAS = 6.0
NEW_PACE_STALLS = 4
NEW_PACE_SPREAD = 1.25


class Pace:
    """The job's pace (the median of its last steps that were no stall) and its noise (a
    robust sigma of log(step / pace)), and the stall rule over them."""

    def __init__(self) -> None:
        self._steps: deque[int] = deque(maxlen=PACE_STEPS)
        self._noise: deque[float] = deque(maxlen=NOISE_STEPS)
        self._in_a_row: list[int] = []  # the last stalls in a row (a new pace?)
        self._taken = 0
        self.sigma = 0.0

    @property
    def ns(self) -> float | None:
        """The median of the last steps (statistics.median without its generality: this
        runs for every iteration of a replayed week, twice)."""
        n = len(self._steps)
        if n < 3:
            return None
        ordered = sorted(self._steps)
        return float(ordered[n // 2]) if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2

    def stall_ns(self, pace_ns: float) -> float:
        """The least a stall adds to an iteration at ``pace_ns``."""
        return max(STALL_PACES * pace_ns, STALL_MIN_NS,
                   pace_ns * math.expm1(STALL_SIGMAS * self.sigma))

    def take(self, step_ns: int) -> tuple[float, int]:
        """(the pace ``step_ns`` was judged against, its stall: 0 when none)."""
        pace = self.ns
        if pace is not None and step_ns - pace >= self.stall_ns(pace):
            row = self._in_a_row = [*self._in_a_row[1 - NEW_PACE_STALLS:], step_ns]
            if len(row) < NEW_PACE_STALLS or max(row) > NEW_PACE_SPREAD * min(row):
                return pace, int(step_ns - pace)
            self._steps.clear()  # (this one, and those before it, are the pace now)
            self._steps.extend(self._in_a_row[:-1])
            pace = None
        self._in_a_row.clear()
        if pace is not None:
            self._noise.append(math.log(max(step_ns, 1) / pace))
            self._taken += 1
            if self._taken % NOISE_EVERY == 0:  # (a median of 64 a step would cost)
                self.sigma = MAD_TO_SIGMA * statistics.median(map(abs, self._noise))
        self._steps.append(step_ns)
        return (pace if pace is not None else float(step_ns)), 0

    def seed(self, steps: list[int]) -> None:
        """Start from held steps (their median the pace, their spread the noise), so the
        first ones are judged against the job's own pace, not against themselves."""
        centre = statistics.median(steps)
        logs = [math.log(max(s, 1) / centre) for s in steps]
        self.sigma = MAD_TO_SIGMA * statistics.median(abs(x) for x in logs)
        self._steps.extend(s for s in steps if s - centre < self.stall_ns(centre))
        if len(self._steps) < 3:
            self._steps.extend([int(centre)] * 3)
