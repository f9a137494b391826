"""The agent's CPU budget: its own CPU and its py-spy children's, per monitored rank.

Phase shares and the job's iteration number are statistics, so the stacks need
not be sampled all the time: py-spy runs in bursts (one 1 s window every 1/duty
s), the duty chosen so that the agent as a whole stays within ``budget_pct`` of
one core per rank. Every PERIOD_S the controller measures what the agent used
(``getrusage``: itself, and its reaped children: py-spy windows and dumps),
splits it into a base (everything but sampling) and the sampling's cost per
unit of duty, and sets the duty that fits. While a hang is suspected it samples
continuously (the stacks are the evidence).
"""

from __future__ import annotations

import resource
import threading
from typing import Any

from perfmon.probes.pyspy import MIN_DUTY
from perfmon.probes.sampler import monotonic_ns
from perfmon.probes.stacks import StackSource

PERIOD_S = 10.0
# The controller aims a little under the budget: its measure is of the last
# period, and the job's own pace (hence the agent's work) varies.
AIM = 0.9
# py-spy at 100 Hz on one PyTorch process, continuously: ~4-5% of a core (docs/pyspy.md).
SAMPLING_PCT_GUESS = 5.0
BASE_PCT_GUESS = 0.3


def _cpu_s() -> tuple[float, float]:
    """(this process's CPU seconds, its reaped children's)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


class BudgetPool:
    """One CPU budget for every session of the process (``serve`` and ``run`` watch several
    jobs from one process, whose ``getrusage`` counts them all).

    Each session gets the share of the process's CPU that its ranks are of all
    ranks watched, and a per-rank budget of ``total_pct`` over all ranks, at
    most ``per_rank_pct``.
    """

    def __init__(self, total_pct: float, per_rank_pct: float) -> None:
        self.total_pct = total_pct
        self.per_rank_pct = per_rank_pct
        self._ranks: dict[int, int] = {}  # id(budget) -> its ranks
        self._lock = threading.Lock()

    def configure(self, total_pct: float, per_rank_pct: float) -> None:
        """New limits (a reloaded config); sessions follow at their next period."""
        self.total_pct, self.per_rank_pct = total_pct, per_rank_pct

    def join(self, member: object, ranks: int) -> None:
        with self._lock:
            self._ranks[id(member)] = ranks

    def leave(self, member: object) -> None:
        with self._lock:
            self._ranks.pop(id(member), None)

    @property
    def ranks(self) -> int:
        with self._lock:
            return max(1, sum(self._ranks.values()))

    def budget_pct_per_rank(self) -> float:
        return min(self.per_rank_pct, self.total_pct / self.ranks)

    def share(self, ranks: int) -> float:
        """The part of the process's CPU that ``ranks`` ranks account for."""
        return min(1.0, ranks / self.ranks)


class CpuBudget:
    """Adapts the stack sampling's duty to the budget; ``state()`` says where it stands."""

    def __init__(self, budget_pct: float, ranks: int, stacks: StackSource | None,
                 pool: BudgetPool | None = None) -> None:
        self.pool = pool
        self.ranks = max(1, ranks)
        if pool is not None:
            pool.join(self, self.ranks)
            budget_pct = pool.budget_pct_per_rank()
        self.budget_pct = budget_pct
        self.stacks = stacks
        self.agent_pct_per_rank: float | None = None  # over the last period
        self._mark = (monotonic_ns(), *_cpu_s())
        self._hang = False
        if stacks is not None:
            allowed = AIM * budget_pct * self.ranks - BASE_PCT_GUESS
            stacks.set_duty(allowed / SAMPLING_PCT_GUESS)

    def update(self, now_ns: int, hang_suspected: bool) -> None:
        if self.stacks is not None and hang_suspected != self._hang:
            self._hang = hang_suspected
            if hang_suspected:
                self.stacks.set_duty(1.0)
        wall_ns, me_s, kids_s = self._mark
        if now_ns - wall_ns < PERIOD_S * 1e9:
            return
        me, kids = _cpu_s()
        self._mark = (now_ns, me, kids)
        wall = (now_ns - wall_ns) / 1e9
        share = 1.0
        if self.pool is not None:
            self.budget_pct = self.pool.budget_pct_per_rank()
            share = self.pool.share(self.ranks)
        base_pct = share * 100 * (me - me_s) / wall
        sampling_pct = share * 100 * (kids - kids_s) / wall
        self.agent_pct_per_rank = (base_pct + sampling_pct) / self.ranks
        if self.stacks is None or self._hang:
            return
        duty = self.stacks.duty
        per_duty = sampling_pct / duty if sampling_pct > 0 and duty > 0 else SAMPLING_PCT_GUESS
        allowed = AIM * self.budget_pct * self.ranks - base_pct
        target = max(MIN_DUTY, min(1.0, allowed / per_duty))
        # Halfway there each period (geometrically): no oscillation on noisy measures.
        self.stacks.set_duty((duty * target) ** 0.5)

    def close(self) -> None:
        """The session ended: its ranks leave the pool."""
        if self.pool is not None:
            self.pool.leave(self)

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"budget_pct_per_rank": self.budget_pct}
        if self.agent_pct_per_rank is not None:
            state["cpu_pct_per_rank"] = round(self.agent_pct_per_rank, 2)
        if self.stacks is not None:
            state["stack_duty_pct"] = round(100 * self.stacks.duty, 1)
        return state
