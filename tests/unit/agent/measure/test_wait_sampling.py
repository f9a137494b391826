"""WaitSampling (perfmon.agent.measure.wait_sampling): the collective-wait probes on every
iteration while they are cheap, on one whole iteration in every N when they are not."""

from __future__ import annotations

import pytest
from perfmon.agent.measure.wait_sampling import WAIT_PROBE_NS, WaitSampling
from perfmon.agent.reducers.steps import StepRows

MS = 1_000_000


def _marker(t: int, pid: int, kind: str, tid: int | None = None) -> dict:
    return {"type": "marker", "t_mono_ns": t, "pid": pid, "tid": tid or pid, "kind": kind,
            "name": ""}


def test_costly_waits_are_probed_one_whole_iteration_in_every_n_and_cheap_ones_always():
    def job(waits_per_step: int, steps: int, budget: float = 0.005) -> tuple[WaitSampling, list]:
        rows, switches = StepRows(0), []
        sampling = WaitSampling(rows, switches.append, [1, 2], 1, budget)
        total = 0
        for i in range(steps):
            for pid in (1, 2):
                t = i * 100 * MS + pid
                rows.feed({"type": "waits", "t_mono_ns": t, "pid": pid, "wait_ns": total,
                           "waits": i * waits_per_step})
                rows.feed(_marker(t, pid, "optimizer_step"))
            total += MS
            sampling.schedule(keep_on=False)  # (a poll an iteration)
        return sampling, switches

    # 100 waits a 100 ms step: an estimated 1.6% > 0.5%, so one in 4.
    sampling, switches = job(100, 200)
    assert sampling.estimated_share == pytest.approx(100 * WAIT_PROBE_NS / (100 * MS))
    assert sampling.every == 4 and sampling.samples >= 10
    assert switches[:2] == [False, True] and len(switches) >= 20
    # 10 waits a step (0.16%), or a budget of 0: never detached.
    assert job(10, 100)[1] == [] and job(100, 100, budget=0)[1] == []
