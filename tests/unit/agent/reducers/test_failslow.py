"""Fail-slow (perfmon.agent.reducers.failslow) on exact step streams: shifts, drifts, bumps,
warm-ups and recoveries, each with its stated truth (on real jobs:
tests/e2e/test_fail_slow.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from perfmon.agent.reducers.failslow import FailSlow, mark_moved
from perfmon.parsers.figures import RankShift, render

MS = 1_000_000


def shown(fail: FailSlow) -> list[dict[str, Any]]:
    """The reducer's events as the summary shows them."""
    return [render(e) for e in fail.events]


def _steps(fail: FailSlow, count: int, ms: float, t: int, noise: float, rng: random.Random
           ) -> int:
    for _ in range(count):
        step = int(ms * (1 + rng.gauss(0, noise)) * MS)
        t += step
        fail.on_iteration(t, step)
    return t


def test_fail_slow_on_a_noisy_steady_run_is_quiet_and_a_30pct_rise_and_return_are_seen():
    rng = random.Random(1)
    # 2 hours of 100 ms steps with 10% iteration noise: no event.
    fail = FailSlow(str)
    _steps(fail, 72_000, 100, 0, 0.10, rng)
    assert shown(fail) == []
    fail = FailSlow(str)
    t = _steps(fail, 3000, 100, 0, 0.10, rng)
    change = t
    t = _steps(fail, 1000, 130, t, 0.10, rng)
    back = t
    _steps(fail, 1000, 100, t, 0.10, rng)
    slow, recovered = shown(fail)
    assert slow["event"] == "fail_slow" and recovered["event"] == "recovered"
    assert abs(slow["t_mono_ns"] - change) < 5e9 and slow["detected_mono_ns"] - change < 60e9
    assert slow["change_pct"] == pytest.approx(30, abs=5)
    assert abs(recovered["t_mono_ns"] - back) < 5e9
    # A 3% rise is under the 5% floor: nothing.
    fail = FailSlow(str)
    t = _steps(fail, 3000, 100, 0, 0.0, rng)
    _steps(fail, 3000, 103, t, 0.0, rng)
    assert shown(fail) == []


def test_a_gradual_drift_is_reported_once_past_the_threshold_and_a_short_bump_is_not():
    rng = random.Random(5)
    fail = FailSlow(str)
    t = _steps(fail, 600, 100, 0, 0.05, rng)
    began = t
    for i in range(1800):  # +10% over 3 minutes (thermal creep): 0.006% per 100 ms step
        t = _steps(fail, 1, 100 * (1 + 0.1 * i / 1800), t, 0.05, rng)
    # Reported once past the 3% floor (54 s into the creep), as a drift dated from where
    # it left the healthy pace; as it goes on, a further rise may be another event.
    event, *further = shown(fail)
    assert event["event"] == "fail_slow" and event["drift"], event
    assert 54e9 <= event["detected_mono_ns"] - began <= 120e9
    assert 0 <= event["t_mono_ns"] - began <= 45e9, (event["t_mono_ns"] - began) / 1e9
    assert event["before_step_time_ms"] == pytest.approx(100, rel=0.02)
    assert all(e["event"] == "fail_slow" for e in further)
    # A bump of 7 s at +40% is not sustained (10 s): nothing.
    fail = FailSlow(str)
    t = _steps(fail, 600, 100, 0, 0.05, rng)
    t = _steps(fail, 50, 140, t, 0.05, rng)
    _steps(fail, 1200, 100, t, 0.05, rng)
    assert shown(fail) == []


@pytest.mark.parametrize("step_ms", [100, 250])
def test_a_shift_from_10s_after_the_first_iteration_is_reported_within_15s(step_ms):
    # (a 5% rise at 250 ms steps with 3% noise, 8 steps a block, is ~1.2 d: found later)
    for rise, within_s in ((0.30, 15), (0.10, 15), (0.05, 30 if step_ms < 250 else 40)):
        rng = random.Random(int(rise * 100) + step_ms)
        fail = FailSlow(str)
        # Warm-up: a few slow first steps, then the job's pace.
        t = _steps(fail, 5, step_ms * 3, 0, 0.03, rng)
        t = _steps(fail, round(10_000 / step_ms), step_ms, t, 0.03, rng)
        change = t
        t = _steps(fail, round(40_000 / step_ms), step_ms * (1 + rise), t, 0.03, rng)
        back = t
        _steps(fail, round(40_000 / step_ms), step_ms, t, 0.03, rng)
        kinds = [e["event"] for e in shown(fail)]
        assert kinds == ["fail_slow", "recovered"], (rise, step_ms, shown(fail))
        slow, recovered = shown(fail)
        assert slow["detected_mono_ns"] - change <= within_s * 1e9, (rise, step_ms)
        assert abs(slow["t_mono_ns"] - change) <= 3e9
        assert slow["change_pct"] == pytest.approx(100 * rise, abs=2)
        # Recovery: a fall of the same size, as quickly.
        assert recovered["detected_mono_ns"] - back <= within_s * 1e9, (rise, step_ms)
        # The slow first steps were warm-up, left out of the baseline.
        assert fail.warmup_until_ns is not None and fail.warmup_until_ns >= 5 * step_ms * 3e6
        assert slow["before_step_time_ms"] == pytest.approx(step_ms, rel=0.02)


def test_slowdowns_of_15s_15s_apart_are_each_reported_with_their_end_within_15s():
    # No blind seconds after a change: a slowdown's end comes 15 s after its start (5 s
    # after it was confirmed), the next one 15 s after that.
    rng = random.Random(11)
    fail = FailSlow(str)
    t = _steps(fail, 150, 130, 0, 0.03, rng)
    changes = []
    for _ in range(3):
        changes.append(t)
        t = _steps(fail, round(15_000 / 169), 169, t, 0.03, rng)
        changes.append(t)
        t = _steps(fail, round(15_000 / 130), 130, t, 0.03, rng)
    assert [e["event"] for e in shown(fail)] == ["fail_slow", "recovered"] * 3, shown(fail)
    for event, change in zip(shown(fail), changes, strict=True):
        assert abs(event["t_mono_ns"] - change) <= 3e9
        late_s = (event["detected_mono_ns"] - change) / 1e9
        assert late_s <= 15, late_s


def test_a_job_slow_from_its_first_iteration_has_no_event_from_its_warm_up():
    rng = random.Random(9)
    fail = FailSlow(str)
    t = 0
    for i in range(40):  # a warm-up that eases off over 4 s (compilation, caches)
        t = _steps(fail, 1, 300 - 5 * i, t, 0.02, rng)
    _steps(fail, 1500, 130, t, 0.05, rng)  # then slow all along: its own pace
    assert shown(fail) == [] and fail.baseline == pytest.approx(130 * MS, rel=0.05)


def test_a_job_that_speeds_up_after_warm_up_rebaselines_without_an_event():
    rng = random.Random(3)
    fail = FailSlow(str)
    t = _steps(fail, 600, 150, 0, 0.03, rng)  # warm-up: slower
    t = _steps(fail, 3000, 100, t, 0.03, rng)
    assert shown(fail) == [] and fail.baseline == pytest.approx(100 * MS, rel=0.05)
    _steps(fail, 1000, 120, t, 0.03, rng)
    (event,) = shown(fail)
    assert event["event"] == "fail_slow" and event["before_step_time_ms"] == pytest.approx(
        100, rel=0.05)


def _bursty_run(seed: int, busy: float, busy_s: float, quiet_s: float) -> list[dict[str, Any]]:
    """A GPU job's 124 ms steps (2% noise) on a node whose load comes and goes: the steps
    ``busy`` longer while it is busy, busy and quiet spells of exponential lengths
    (means ``busy_s``, ``quiet_s``); 30% slower from 17 to 32 s and from 47 to 62 s
    after its first step seen at 2.5 s (the scenario of tests/e2e/test_fail_slow.py)."""
    rng = random.Random(seed)
    fail = FailSlow(str)
    t, is_busy = int(2.5e9), False
    switch = t + int(rng.expovariate(1 / quiet_s) * 1e9)
    while t < 80e9:
        if t >= switch:
            is_busy = not is_busy
            switch = t + int(rng.expovariate(1 / (busy_s if is_busy else quiet_s)) * 1e9)
        slow = any(a * 1e9 <= t < b * 1e9 for a, b in SLOW_30)
        step = int(124 * MS * (1.3 if slow else 1) * (1 + rng.gauss(0, 0.02))
                   * (1 + busy if is_busy else 1))
        t += step
        fail.on_iteration(t, step)
    fail.resolve([], True)
    return shown(fail)


SLOW_30 = ((17, 32), (47, 62))


@pytest.mark.slow
@pytest.mark.parametrize(("busy_s", "quiet_s"), [(2, 6), (5, 5), (8, 4)])
def test_the_end_of_a_slowdown_on_a_node_whose_load_comes_and_goes_is_a_recovery(
        busy_s: float, quiet_s: float) -> None:
    # (issue 51: on a busy CI node the first slowdown's end was no `recovered`: the baseline
    # was the median of the 3 blocks of the first seconds, quiet ones, and the job came
    # back to a pace that was 3.1% above them half of the time: `recovered_partly`, though
    # some of its blocks since were back at the baseline)
    missed = []
    for seed in range(40):
        events = _bursty_run(seed, 0.03, busy_s, quiet_s)
        for a, b in SLOW_30:
            slow = [e for e in events if e["event"] == "fail_slow"
                    and abs(e["t_mono_ns"] - a * 1e9) < 5e9]
            back = [e for e in events if e["event"] == "recovered"
                    and abs(e["t_mono_ns"] - b * 1e9) < 5e9
                    and e["detected_mono_ns"] - b * 1e9 <= 15e9]
            if len(slow) != 1 or len(back) != 1:
                missed.append((seed, a, events))
    # (the load 8 s busy for 4 s quiet: in one run of 40 the job came back at +3% for
    # every block of 10 s, a node busier than in the first seconds: `recovered_partly`)
    assert len(missed) <= (1 if busy_s > quiet_s else 0), missed


@given(deltas_ms=st.lists(st.floats(-50, 50), min_size=1, max_size=16), rising=st.booleans(),
       base_ms=st.floats(5, 500))
def test_only_ranks_whose_compute_went_the_way_the_step_did_moved_it(deltas_ms, rising,
                                                                    base_ms):
    # Generated ranks whose compute changed by any amount either way: those marked moved
    # went with the step (up for a slowdown, down for a recovery), by at least half the
    # largest such change and 0.5 ms; the largest such is always marked. (On a loaded
    # node a fast rank's compute fell 13 ms as a slowed rank's rose 9: both were named.)
    shifts = [RankShift(100 + i, i, (base_ms / 1e3, (base_ms + d) / 1e3), (0.0, 0.0))
              for i, d in enumerate(deltas_ms)]
    marked = mark_moved(shifts, rising)
    toward = [d if rising else -d for d in deltas_ms]
    for o, d in zip(marked, toward, strict=True):
        assert o.moved == (d >= max(0.5 * max(toward), 0.5) and d > 0) or abs(
            d - max(0.5 * max(toward), 0.5)) < 1e-6
    if max(toward) >= 0.5 + 1e-6:
        assert marked[toward.index(max(toward))].moved
