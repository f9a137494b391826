"""When the collective-wait probes are on: every iteration while they are cheap, one
iteration in every N when they are not (``--wait-probe-budget``).

Each wait probed costs the job two uprobe traps, its entry and its return, so a job
of hundreds of collectives a step (tensor parallelism: a few per layer) pays for the
probes in every step. The probes are on from attach; once MIN_ROWS probed rows are
in, the cost of probing a step is estimated as the median waits of a probed row
times WAIT_PROBE_NS, against the median step of those rows. At most the budget
(0.5% by default), they stay on. Beyond it they are on for one whole iteration of
every rank in every N (N = estimated share / budget, rounded up) and detached
between, so an unprobed iteration costs nothing; rows then say which iterations had
their wait measured (perfmon.agent.reducers.steps), and per-rank waits and the
straggler rule rest on those. The estimate is renewed from every sample's rows.
While raw waits are asked for (a suspected hang, a fail-slow window,
``--raw-markers``) the probes stay on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

from perfmon.agent.reducers.steps import StepRows
from perfmon.probes.duty_cycle import DutyCycle

# One wait probed: an entry trap and a return trap, ~8 µs each on a virtual machine
# (docs/metrics.md, "Overhead"); a bare-metal host traps in ~1-3 µs, so this errs
# towards sampling.
WAIT_PROBE_NS = 16_000
MIN_ROWS = 8  # probed rows before the first estimate
MAX_EVERY = 1000
# A sample ends once every rank has ended two iterations inside it (one whole), or
# the primary rank has ended this many (a rank that stopped does not hold it open).
PRIMARY_ENDS_MAX = 4


class WaitSampling:
    """Decides, once a poll (``schedule``), whether the wait probes are on, from the
    rows made so far; ``set_on`` attaches or detaches them (a
    perfmon.probes.duty_cycle.DutyCycle, on from attach)."""

    def __init__(self, rows: StepRows, set_on: Callable[[bool], None], pids: list[int],
                 primary: int, budget: float) -> None:
        self.rows = rows
        self.pids, self.primary = pids, primary
        self.budget = budget  # share of the step (0: always on)
        self.every = 1  # one probed sample of iterations in every N
        self.estimated_share: float | None = None
        self._cycle = DutyCycle(set_on, on=True)
        self._estimated_from = 0  # rows.recent's additions at the last estimate
        self._ends_at_on: dict[int, int] = {}
        self._primary_probed = 0  # the primary's ends in the last sample

    @property
    def samples(self) -> int:
        """Times the probes were attached for a sample."""
        return self._cycle.begun

    def schedule(self, keep_on: bool) -> None:
        self._estimate()
        ends = self.rows.ends_of
        if keep_on or self.every == 1:
            if not self._cycle.on:
                self._cycle.switch(True, ends(self.primary))
                self._switched(True)
            return
        whole = all(ends(p) - self._ends_at_on.get(p, 0) >= 2 for p in self.pids)
        primary = ends(self.primary) - self._ends_at_on.get(self.primary, 0)
        switched = self._cycle.cycle(ends(self.primary), whole or primary >= PRIMARY_ENDS_MAX,
                                     (self.every - 1) * self._primary_probed)
        if switched is False:
            # (the first time, the probes were on since attach: counted as a sample)
            self._primary_probed = max(1, min(primary, PRIMARY_ENDS_MAX))
        if switched is not None:
            self._switched(switched)

    def _estimate(self) -> None:
        recent = self.rows.recent
        if (self.budget <= 0 or len(recent) < MIN_ROWS
                or self.rows.probed_rows == self._estimated_from):
            return
        self._estimated_from = self.rows.probed_rows
        step = statistics.median(s for s, _ in recent)
        waits = statistics.median(w for _, w in recent)
        if step <= 0:
            return
        self.estimated_share = waits * WAIT_PROBE_NS / step
        self.every = min(MAX_EVERY, max(1, math.ceil(self.estimated_share / self.budget)))

    def _switched(self, on: bool) -> None:
        # Rows are measured only inside [attached, detaching): the cycle's times.
        assert self._cycle.switched_ns is not None
        self.rows.waits_probed(on, self._cycle.switched_ns)
        if on:
            self._ends_at_on = {p: self.rows.ends_of(p) for p in self.pids}

    def quality(self) -> dict[str, Any]:
        """For data_quality (source ``wait_probes``): how often the waits were probed."""
        share = self.estimated_share
        return {"probed_one_in": self.every, "samples": self.samples,
                "budget_pct": round(self.budget * 100, 3),
                "estimated_cost_pct": round(share * 100, 3) if share is not None else None}
