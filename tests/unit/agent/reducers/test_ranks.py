"""RankTimes (perfmon.agent.reducers.ranks) on exact record streams: each rank's step, wait
and compute, and the straggler rule (on a real torchrun job: tests/e2e/test_stragglers.py)."""

from __future__ import annotations

import random

import pytest
from perfmon.agent.reducers.ranks import RankTimes
from perfmon.parsers.events import Steps
from perfmon.parsers.figures import render
from perfmon.parsers.step_rows import decode_steps

from tests import eventlogs

MS = 1_000_000


def _marker(t: int, pid: int, kind: str, tid: int | None = None) -> dict:
    return {"type": "marker", "t_mono_ns": t, "pid": pid, "tid": tid or pid, "kind": kind,
            "name": ""}


def test_the_reducer_takes_each_iterations_wait_from_the_totals_and_ignores_raw_beside_them():
    ranks = RankTimes({1: 0}, 1, 0, str)
    feed = eventlogs.rank_feed(ranks)

    def step(t: int, total_ms: int) -> None:
        feed({"type": "waits", "t_mono_ns": t, "pid": 1, "wait_ns": total_ms * MS, "waits": 0})
        feed(_marker(t, 1, "optimizer_step"))

    step(0, 5)
    feed(_marker(10 * MS, 1, "wait_enter"))  # raw, beside the totals
    feed(_marker(40 * MS, 1, "wait_exit"))
    step(50 * MS, 35)
    step(100 * MS, 35)
    step(150 * MS, 500)  # more than the step: at most the step
    assert list(ranks.all()[0].recent) == [(50 * MS, 50 * MS, 30 * MS),
                                           (100 * MS, 50 * MS, 0),
                                           (150 * MS, 50 * MS, 50 * MS)]


def test_a_straggler_is_named_from_sampled_waits_alone():
    # Three ranks at 100 ms steps; rank 2 computes 30 ms longer, so the others wait for
    # it. Only one iteration in 8 has its wait probed (fewer than `least` in a window of
    # 50): the rule compares the last 10 probed rows of each rank.
    ranks = RankTimes({1: 0, 2: 1, 3: 2}, 1, 0, str)
    for block in range(40):  # 40 s, a block a second
        rows = []
        for k in range(10):
            i = block * 10 + k
            for pid in (1, 2, 3):
                probed = i % 8 == 0
                wait = (10 if pid == 3 else 40) * MS if probed else 0
                rows.append((pid, i * 100 * MS, 1, wait, 5 if probed else -1, 0, 0,
                             i * 100 * MS, i * 100 * MS, 0))
        ranks.on_rows(decode_steps(Steps.encode(rows[0][1], rows, ["uprobe"]).to_record()))
        for k in range(10):
            ranks.on_primary_iteration((block * 10 + k) * 100 * MS)
    (episode,) = [render(e) for e in ranks.stragglers()]
    assert episode["pid"] == 3 and episode["delay_ms_per_step"] == pytest.approx(30)
    assert ranks.summary()[3].waits_probed == 50 - 1  # (its first row opens the window)


def test_wait_is_the_union_of_nested_and_concurrent_waits_and_a_lost_exit_ends_at_the_step():
    ranks = RankTimes({1: 0}, 1, 0, str)
    feed = eventlogs.rank_feed(ranks)
    feed(_marker(0, 1, "optimizer_step"))
    feed(_marker(10 * MS, 1, "wait_enter"))  # nested: Reducer::finalize_backward ...
    feed(_marker(12 * MS, 1, "wait_enter"))  # ... and a Work::wait inside it
    feed(_marker(15 * MS, 1, "wait_enter", tid=2))  # another thread, overlapping
    feed(_marker(18 * MS, 1, "wait_exit"))
    feed(_marker(25 * MS, 1, "wait_exit", tid=2))
    feed(_marker(30 * MS, 1, "wait_exit"))  # 10..30 ms: 20 ms blocked
    feed(_marker(35 * MS, 1, "wait_exit"))  # an exit of a wait entered before: ignored
    feed(_marker(40 * MS, 1, "wait_enter"))  # its exit lost: ends at the next step
    feed(_marker(50 * MS, 1, "optimizer_step"))
    feed(_marker(100 * MS, 1, "optimizer_step"))
    (first, second) = list(ranks.all()[0].recent)
    assert first == (50 * MS, 50 * MS, 30 * MS)
    assert second == (100 * MS, 50 * MS, 0)


def _job(ranks: RankTimes, steps: int, compute_ms: dict[int, float], t0: int = 0,
         noise: float = 0.0) -> int:
    """Feed a synchronous job: every rank steps together; each waits for the slowest."""
    rng = random.Random(7)
    feed = eventlogs.rank_feed(ranks, t0)
    t = t0
    for _ in range(steps):
        computed = {pid: ms * (1 + rng.uniform(-noise, noise)) for pid, ms in compute_ms.items()}
        step = max(computed.values())
        for pid, ms in computed.items():
            feed(_marker(t + int(ms * MS), pid, "wait_enter"))
            feed(_marker(t + int(step * MS), pid, "wait_exit"))
        t += int(step * MS)
        for pid in compute_ms:
            feed(_marker(t, pid, "optimizer_step"))
    return t


def test_no_straggler_among_equal_ranks_and_one_with_its_delay_when_one_is_slow():
    ranks = RankTimes({1: 0, 2: 1, 3: 2, 4: 3}, 1, 0, str)
    t = _job(ranks, 300, {1: 100, 2: 100, 3: 100, 4: 100}, noise=0.05)
    assert ranks.stragglers() == []
    _job(ranks, 300, {1: 100, 2: 100, 3: 125, 4: 100}, t0=t, noise=0.05)
    (episode,) = [render(e) for e in ranks.stragglers()]
    assert episode["rank"] == 2 and episode["delay_ms_per_step"] == pytest.approx(25, rel=0.2)
    # Named within 10 s of its start (100 ms steps): half the window, then 5 s.
    assert t <= episode["since_mono_ns"] < episode["detected_mono_ns"] <= t + 10e9, (
        (episode["detected_mono_ns"] - t) / 1e9)
    # An effect under the minimum (10% of the step) is not a straggler.
    small = RankTimes({1: 0, 2: 1}, 1, 0, str)
    _job(small, 400, {1: 100, 2: 107})
    assert small.stragglers() == []
