"""Stragglers and fail-slow on real torchrun jobs (gloo, CPU, DDP), plus the rules' edges
on exact record streams.

The slowed ranks burn CPU in a forward pre-hook (tests/targets/train_gpt.py
--slow-*): compute, as a throttled GPU's would be, not a sleep.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from perfmon.agent.reducers.failslow import FailSlow
from perfmon.agent.reducers.ranks import RankTimes

from tests import eventlogs
from tests.conftest import TRAIN_GPT, Target, _reap, load_summary

MS = 1_000_000


def torchrun(agent, tmp_path: Path, port: int, *args: str) -> tuple[subprocess.Popen, Target]:
    stamps, output = tmp_path / "stamps.txt", tmp_path / "torchrun.log"
    with open(output, "wb") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(port), str(TRAIN_GPT), "--ddp", "--timestamps", str(stamps),
             *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    agent.procs.append(launcher)  # reaped with its ranks by the agent fixture
    target = Target(launcher, stamps)
    try:
        target.wait_for_iterations(6, timeout_s=90)
    except AssertionError as err:
        raise AssertionError(f"{err}: {output.read_text()[-2000:]}") from None
    return launcher, target


@pytest.mark.usefixtures("ebpf")
def test_a_rank_slowed_in_its_compute_is_named_the_straggler_with_its_delay(
        agent, out_dir, tmp_path):
    _launcher, _ = torchrun(agent, tmp_path, 29571, "--slow-ranks", "1", "--slow-ms", "30")
    run = agent.run("attach", "--pid", str(_launcher.pid), "--duration", "20",
                    "--output-dir", str(out_dir), timeout_s=120)
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    info, stats = summary["session_info"], summary["final_statistics"]
    assert info["ranks"] == [0, 1]
    (episode,) = stats["stragglers"]
    assert episode["rank"] == 1 and episode["pid"] == info["pids"][1]
    # The delay it imposes is its excess compute: the injected 30 ms, within 20%.
    assert 24 <= episode["delay_ms_per_step"] <= 36, episode
    # Named within 30 s of the start of monitoring (it was slow from the start).
    assert episode["since_mono_ns"] <= episode["detected_mono_ns"]
    assert episode["detected_mono_ns"] - info["attach_monotonic_ns"] < 30e9
    assert episode["until"] is None  # still slow at the end
    assert "straggler: rank 1" in run.stderr
    # Per rank: the fast one waits for the slow one, which computes longer.
    ranks = {r["rank"]: r for r in stats["ranks"]}
    assert ranks[1]["straggler"] and not ranks[0]["straggler"]
    assert 24 <= ranks[1]["avg_compute_ms"] - ranks[0]["avg_compute_ms"] <= 36
    assert 24 <= ranks[0]["avg_wait_ms"] - ranks[1]["avg_wait_ms"] <= 36
    for r in ranks.values():
        assert r["avg_wait_ms"] + r["avg_compute_ms"] == pytest.approx(r["avg_step_time_ms"])
    # And per log interval.
    entry = summary["iteration_logs"][-1]
    assert {r["rank"] for r in entry["ranks"]} == {0, 1}
    assert stats["fail_slow"] == []


def _job_step_ms(target: Target, since_ns: float, until_ns: float) -> float:
    """The median step of the job by its own clock (the first rank to stamp each
    iteration) between two CLOCK_MONOTONIC instants."""
    first: dict[int, int] = {}
    for iteration, t in target.timestamps():
        first[iteration] = min(t, first.get(iteration, t))
    times = [first[i] for i in sorted(first)]
    steps = [b - a for a, b in itertools.pairwise(times) if since_ns <= a < until_ns]
    return statistics.median(steps) / MS


# The injected slowdowns (every rank's forward slower by half its step for 15 s), in
# seconds after the job started training: onsets ~15, ~50 and ~90 s after the agent
# attached (it attaches ~2 s after the job's first iterations). Half, not the 30% the
# exact streams test: under a full test run the job's own step wanders by 20% for
# seconds at a time on this shared 2-core VM, and d grows to match.
WINDOWS_S = ((17, 32), (52, 67), (92, 107))
SLOW_FACTOR = 0.5


def _slowdown_scenario(agent, tmp_path: Path, port: int) -> tuple[dict, str, Target, float]:
    tmp_path.mkdir()
    schedule = ",".join(f"{a}-{b}:{SLOW_FACTOR}" for a, b in WINDOWS_S)
    launcher, target = torchrun(agent, tmp_path, port, "--slow-ranks", "all",
                                "--slow-schedule", schedule)
    first_stamp = target.timestamps()[0][1]
    out = tmp_path / "out"
    out.mkdir()
    run = agent.run("attach", "--pid", str(launcher.pid), "--duration", "135",
                    "--output-dir", str(out), timeout_s=240)
    assert run.returncode == 0, run.stderr
    _reap(launcher)  # the job and its ranks: a second run must not share the CPUs
    return load_summary(out), run.stderr, target, first_stamp


def own_change_pct(target: Target, event: dict) -> float:
    """The change of the job's own step time (its clock) that ``event`` names: from the
    20 s before its change to the time between the change and its detection."""
    t, detected = event["t_mono_ns"], event["detected_mono_ns"]
    return 100 * (_job_step_ms(target, t, detected) / _job_step_ms(target, t - 20e9, t) - 1)


def _noise_s(event: dict) -> float:
    """How much longer than for a shift of 2 d or more the rule waits for ``event``'s."""
    d = math.log1p(event["min_shift_pct"] / 100)
    size = abs(math.log1p(event["change_pct"] / 100))
    return min(25.0, 10 * max(1.0, 2 * d / size)) - 10


def _found(events: list[dict], kind: str, at_ns: float) -> dict | None:
    """The ``kind`` event dated within 5 s of ``at_ns``, if any."""
    return next((e for e in events if e["event"] == kind and abs(e["t_mono_ns"] - at_ns) < 5e9),
                None)


def _check_slowdowns(stats: dict, stderr: str, target: Target, first_stamp: float) -> None:
    assert stats["stragglers"] == []  # no rank slower than the others
    events = list(stats["fail_slow"])
    whole = []  # the injected slowdowns found, with their ends, in time
    for a, b in WINDOWS_S:
        onset, end = first_stamp + a * 1e9, first_stamp + b * 1e9
        slow, recovered = _found(events, "fail_slow", onset), _found(events, "recovered", end)
        for e in (slow, recovered):
            if e is not None:
                events.remove(e)
        # Reported within 15 s of its start, and the longer a noisy job needs to call
        # it sustained (10 s x 2 d / shift, docs/stragglers.md: on this shared VM d is
        # 10-30%); its end as quickly.
        if (slow is None or recovered is None
                or slow["detected_mono_ns"] - onset > (15 + _noise_s(slow)) * 1e9
                or recovered["detected_mono_ns"] - end > (15 + _noise_s(recovered)) * 1e9):
            continue
        # The shift the job's own clock shows, within 15 points (a slower forward costs
        # the step more or less with the VM's load), and every rank moved.
        own = 100 * (_job_step_ms(target, onset, end)
                     / _job_step_ms(target, onset - 15e9, onset) - 1)
        assert own >= 20 and abs(slow["change_pct"] - own) <= 15, (a, slow, own)
        assert {r["rank"] for r in slow["ranks"] if r["moved"]} == {0, 1}
        whole.append(slow)
    # At least two of the three, start and end: the VM's own slowdowns (the job's first
    # seconds under the agent's start, above all) can hide one. The forward moved (the
    # slowdown is in a forward pre-hook; phases come from the primary's stack samples in
    # bursts, so another phase may come out ahead once).
    assert len(whole) >= 2, stats["fail_slow"]
    assert sum("forward" in [p["phase"] for p in e["phases"]] for e in whole) >= len(whole) - 1
    # Any other event is the job's own clock moving (the shared VM slows the job by
    # itself now and then), never the detector alone.
    for e in events:
        own = own_change_pct(target, e)
        assert own * e["change_pct"] > 0 and abs(own) >= 0.6 * abs(e["change_pct"]), (
            f"false {e['event']}: the job's own step moved {own:.1f}%", e)
    assert "fail-slow: step time" in stderr and "recovered: step time" in stderr


@pytest.mark.usefixtures("ebpf")
def test_slowdowns_from_15_45_and_90s_after_attach_are_reported_within_15s_with_recovery(
        agent, tmp_path):
    failures = []
    for attempt in (1, 2):
        summary, stderr, target, first_stamp = _slowdown_scenario(
            agent, tmp_path / f"try{attempt}", 29572 + attempt)
        info = summary["session_info"]
        # The first onset comes ~15 s after attach: no blind window before it.
        assert 12e9 <= first_stamp + WINDOWS_S[0][0] * 1e9 - info["attach_monotonic_ns"] <= 18e9
        try:
            _check_slowdowns(summary["final_statistics"], stderr, target, first_stamp)
            return
        except AssertionError as err:
            # The shared 2-core VM slows the job by itself at times (its own clock
            # shows it), and a slowdown of its own on top of an injected one moves that
            # one's figures: once more, and both runs must not fail.
            failures.append(f"run {attempt}: {err!r}"[:3000])
    pytest.fail("\n".join(failures))


# -- the rules on exact record streams --------------------------------------------------

def _marker(t: int, pid: int, kind: str, tid: int | None = None) -> dict:
    return {"type": "marker", "t_mono_ns": t, "pid": pid, "tid": tid or pid, "kind": kind,
            "name": ""}


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
    (episode,) = ranks.stragglers()
    assert episode["rank"] == 2 and episode["delay_ms_per_step"] == pytest.approx(25, rel=0.2)
    # Named within 30 s of its start (100 ms steps).
    assert t <= episode["since_mono_ns"] < episode["detected_mono_ns"] < t + 30e9
    # An effect under the minimum (10% of the step) is not a straggler.
    small = RankTimes({1: 0, 2: 1}, 1, 0, str)
    _job(small, 400, {1: 100, 2: 107})
    assert small.stragglers() == []


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
    assert fail.events == []
    fail = FailSlow(str)
    t = _steps(fail, 3000, 100, 0, 0.10, rng)
    change = t
    t = _steps(fail, 1000, 130, t, 0.10, rng)
    back = t
    _steps(fail, 1000, 100, t, 0.10, rng)
    slow, recovered = fail.events
    assert slow["event"] == "fail_slow" and recovered["event"] == "recovered"
    assert abs(slow["t_mono_ns"] - change) < 5e9 and slow["detected_mono_ns"] - change < 60e9
    assert slow["change_pct"] == pytest.approx(30, abs=5)
    assert abs(recovered["t_mono_ns"] - back) < 5e9
    # A 3% rise is under the 5% floor: nothing.
    fail = FailSlow(str)
    t = _steps(fail, 3000, 100, 0, 0.0, rng)
    _steps(fail, 3000, 103, t, 0.0, rng)
    assert fail.events == []


def test_a_gradual_drift_is_reported_once_past_the_threshold_and_a_short_bump_is_not():
    rng = random.Random(5)
    fail = FailSlow(str)
    t = _steps(fail, 600, 100, 0, 0.05, rng)
    began = t
    for i in range(1800):  # +10% over 3 minutes (thermal creep): 0.006% per 100 ms step
        t = _steps(fail, 1, 100 * (1 + 0.1 * i / 1800), t, 0.05, rng)
    # Reported once past the 3% floor (54 s into the creep), as a drift dated from where
    # it left the healthy pace; as it goes on, a further rise may be another event.
    event, *further = fail.events
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
    assert fail.events == []


@pytest.mark.parametrize("step_ms", [100, 250])
def test_a_shift_from_10s_after_the_first_iteration_is_reported_within_15s(step_ms):
    for rise, within_s in ((0.30, 15), (0.10, 15), (0.05, 30)):
        rng = random.Random(int(rise * 100) + step_ms)
        fail = FailSlow(str)
        # Warm-up: a few slow first steps, then the job's pace.
        t = _steps(fail, 5, step_ms * 3, 0, 0.03, rng)
        t = _steps(fail, round(10_000 / step_ms), step_ms, t, 0.03, rng)
        change = t
        t = _steps(fail, round(40_000 / step_ms), step_ms * (1 + rise), t, 0.03, rng)
        back = t
        _steps(fail, round(40_000 / step_ms), step_ms, t, 0.03, rng)
        kinds = [e["event"] for e in fail.events]
        assert kinds == ["fail_slow", "recovered"], (rise, step_ms, fail.events)
        slow, recovered = fail.events
        assert slow["detected_mono_ns"] - change <= within_s * 1e9, (rise, step_ms)
        assert abs(slow["t_mono_ns"] - change) <= 3e9
        assert slow["change_pct"] == pytest.approx(100 * rise, abs=2)
        # Recovery: a fall of the same size, as quickly.
        assert recovered["detected_mono_ns"] - back <= within_s * 1e9, (rise, step_ms)
        # The slow first steps were warm-up, left out of the baseline.
        assert fail.warmup_until_ns is not None and fail.warmup_until_ns >= 5 * step_ms * 3e6
        assert slow["before_step_time_ms"] == pytest.approx(step_ms, rel=0.02)


def test_a_job_slow_from_its_first_iteration_has_no_event_from_its_warm_up():
    rng = random.Random(9)
    fail = FailSlow(str)
    t = 0
    for i in range(40):  # a warm-up that eases off over 4 s (compilation, caches)
        t = _steps(fail, 1, 300 - 5 * i, t, 0.02, rng)
    _steps(fail, 1500, 130, t, 0.05, rng)  # then slow all along: its own pace
    assert fail.events == [] and fail.baseline == pytest.approx(130 * MS, rel=0.05)


def test_a_job_that_speeds_up_after_warm_up_rebaselines_without_an_event():
    rng = random.Random(3)
    fail = FailSlow(str)
    t = _steps(fail, 600, 150, 0, 0.03, rng)  # warm-up: slower
    t = _steps(fail, 3000, 100, t, 0.03, rng)
    assert fail.events == [] and fail.baseline == pytest.approx(100 * MS, rel=0.05)
    _steps(fail, 1000, 120, t, 0.03, rng)
    (event,) = fail.events
    assert event["event"] == "fail_slow" and event["before_step_time_ms"] == pytest.approx(
        100, rel=0.05)

