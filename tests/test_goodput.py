"""The goodput ledger on exact streams: every second of the wall time in one place, each
cause as injected (real jobs: test_goodput_jobs.py)."""

from __future__ import annotations

import random

import pytest
from perfmon.agent.reducers.failslow import FailSlow
from perfmon.agent.reducers.goodput import CAUSES, Goodput, combined, recorded_ledger

S = 1_000_000_000
MS = 1_000_000


class Stream:
    """A primary rank's iterations fed to the fail-slow detector and the ledger."""

    def __init__(self, attach_ns: int = 0, process_start_ns: int | None = None, gpus: int = 8,
                 previous: dict | None = None) -> None:
        self.failslow = FailSlow(str)
        self.goodput = Goodput(attach_ns, process_start_ns, gpus, previous)
        self.t = attach_ns
        self.rng = random.Random(4)

    def first(self, at_ns: int) -> None:
        self.t = at_ns
        self.goodput.on_first_end(at_ns)

    def steps(self, seconds: float, step_ms: float, noise: float = 0.02) -> None:
        end = self.t + seconds * S
        while self.t < end:
            step = int(step_ms * (1 + self.rng.gauss(0, noise)) * MS)
            self.t += step
            self.failslow.on_iteration(self.t, step)
            self.goodput.on_iteration(self.t, step, self.failslow.baseline)

    def hang(self, seconds: float) -> None:
        self.goodput.on_hang({"last_iteration_mono_ns": self.t})
        step = int(seconds * S)
        self.t += step
        self.failslow.on_iteration(self.t, step)
        self.goodput.on_iteration(self.t, step, self.failslow.baseline)

    def ledger(self, end_ns: int | None = None, stragglers: list | None = None,
               hung: bool = False, first_job_iteration: int | None = None) -> dict:
        self.failslow.resolve([], True)
        return self.goodput.summary(end_ns or self.t, self.failslow.summary(),
                                    stragglers or [], hung, first_job_iteration)


def _adds_up(ledger: dict) -> None:
    total = ledger["productive_seconds"] + sum(ledger["lost_seconds"].values())
    assert total == pytest.approx(ledger["wall_seconds"], abs=0.01)  # (rounded to ms)
    assert set(ledger["lost_seconds"]) == set(CAUSES)
    assert ledger["gpu_hours"] == pytest.approx(ledger["wall_seconds"] * ledger["gpus"] / 3600,
                                                abs=1e-5)


def test_a_healthy_job_seen_from_its_start_loses_its_start_up_and_little_else():
    # Started 20 s before attach, first iteration 10 s after it: 30 s of start-up.
    s = Stream(attach_ns=0, process_start_ns=-20 * S)
    s.first(10 * S + 100 * MS)
    s.steps(300, 100)
    ledger = s.ledger()
    _adds_up(ledger)
    assert ledger["from"] == "process_start"
    assert ledger["lost_seconds"]["startup"] == pytest.approx(30, abs=0.3)
    after = ledger["productive_seconds"] / (ledger["wall_seconds"] - 30)
    assert after >= 0.98, ledger
    assert ledger["lost_gpu_hours"]["startup"] == pytest.approx(30 * 8 / 3600, rel=0.02)


def test_attached_to_a_running_job_the_ledger_starts_at_attach():
    s = Stream(attach_ns=0, process_start_ns=-3600 * S)
    s.first(50 * MS)  # (iterating at attach)
    s.steps(120, 100)
    ledger = s.ledger()
    _adds_up(ledger)
    assert ledger["from"] == "attach" and ledger["lost_seconds"]["startup"] == 0
    assert ledger["wall_seconds"] == pytest.approx(120, abs=0.2) and ledger["ratio"] >= 0.98


def test_a_hang_a_slowdown_and_a_straggler_each_in_its_place():
    s = Stream(attach_ns=0, process_start_ns=-3600 * S)
    s.first(50 * MS)
    s.steps(60, 100)
    s.hang(20)  # 20 s without an iteration
    s.steps(40, 100)
    slow_from = s.t
    s.steps(30, 150)  # +50% for 30 s: 10 s lost
    s.steps(60, 100)
    straggler_from = s.t
    s.steps(30, 125)  # a rank 25 ms slower a step for 30 s: the job's step grows by it
    episode = {"since_mono_ns": straggler_from, "until_mono_ns": s.t, "delay_ms_per_step": 25.0}
    s.steps(40, 100)
    ledger = s.ledger(stragglers=[episode])
    _adds_up(ledger)
    lost = ledger["lost_seconds"]
    assert lost["hang"] == pytest.approx(20, rel=0.02)
    assert lost["straggler"] == pytest.approx(30 * 25 / 125, rel=0.1)
    assert lost["slowdown"] == pytest.approx(10, rel=0.1), (slow_from, ledger)
    assert lost["unexplained"] < 2, ledger


def test_a_session_that_ends_hung_counts_its_tail_as_the_hang():
    s = Stream(attach_ns=0, process_start_ns=-3600 * S)
    s.first(50 * MS)
    s.steps(30, 100)
    end = s.t + 25 * S
    ledger = s.ledger(end_ns=end, hung=True)
    _adds_up(ledger)
    assert ledger["lost_seconds"]["hang"] == pytest.approx(25, abs=0.01)


def test_a_restart_counts_the_gap_the_new_start_up_and_the_iterations_redone():
    first = Stream(attach_ns=0, process_start_ns=-1 * S)
    first.first(5 * S)
    first.steps(60, 100)
    # (a rank failed 2 s after the last iteration; the session ended then)
    before = {"ledger": first.ledger(end_ns=first.t + 2 * S), "end_mono_ns": first.t + 2 * S,
              "last_end_mono_ns": first.t, "last_job_iteration": 650}
    # The next incarnation starts 3 s after the last one ended, iterates 7 s later,
    # and resumes from iteration 601 (its last checkpoint): 50 iterations redone.
    start = before["end_mono_ns"] + 3 * S
    second = Stream(attach_ns=start + S, process_start_ns=start, previous=before)
    second.first(start + 7 * S)
    second.steps(60, 100)
    ledger = second.ledger(first_job_iteration=601)
    _adds_up(ledger)
    job = ledger["job"]
    _adds_up(job)
    assert job["wall_seconds"] == pytest.approx(before["ledger"]["wall_seconds"]
                                                + 3 + ledger["wall_seconds"], abs=0.01)
    # 2 s after the last iteration, 3 s between the incarnations, 7 s less a healthy step
    # of start-up, 50 x 100 ms redone; the first session's 2 s are no longer unexplained
    assert job["lost_seconds"]["restart"] == pytest.approx(2 + 3 + 6.9 + 5, abs=0.3), job
    assert job["lost_seconds"]["unexplained"] < 1
    assert job["lost_seconds"]["startup"] == before["ledger"]["lost_seconds"]["startup"]


def test_a_week_of_bins_stays_small_and_adds_up():
    s = Stream(attach_ns=0, process_start_ns=-3600 * S)
    s.first(50 * MS)
    for _ in range(50):  # (widened many times over)
        s.steps(3000, 1000, noise=0.0)
    assert len(s.goodput._bins) <= 4096
    _adds_up(s.ledger())


def test_a_hosts_sessions_and_the_jobs_hosts_add_up_in_gpu_seconds():
    def ledger(wall: float, productive: float, hang: float, gpus: int, **extra) -> dict:
        lost = dict.fromkeys(CAUSES, 0.0)
        lost["hang"], lost["unexplained"] = hang, wall - productive - hang
        return {"wall_seconds": wall, "productive_seconds": productive, "lost_seconds": lost,
                "gpus": gpus, **extra}

    # Host a: two sessions of the service, the second carrying the job's ledger; then
    # one more attach session, which knew of none before it.
    a = recorded_ledger([ledger(100, 90, 5, 8), ledger(60, 50, 0, 8, job=ledger(170, 140, 5, 8)),
                         ledger(30, 30, 0, 8)])
    assert a is not None and (a.wall_s, a.productive_s) == (200, 170)
    b = recorded_ledger([ledger(200, 100, 80, 4)])
    assert b is not None
    job = combined([a, b])
    assert job is not None and job.gpus == 12
    # GPU-seconds: 8 x 170 + 4 x 100 productive of 8 x 200 + 4 x 200.
    assert job.to_dict()["ratio"] == pytest.approx((8 * 170 + 4 * 100) / (12 * 200))
    assert job.lost_s["hang"] == pytest.approx((8 * 5 + 4 * 80) / 12)
    assert job.to_dict()["lost_gpu_hours"]["hang"] == pytest.approx((8 * 5 + 4 * 80) / 3600,
                                                                    abs=1e-6)


def test_a_hang_whose_record_comes_after_the_job_resumed_is_still_the_hangs():
    # The hang record comes once the ranks' stacks are dumped: a short hang may be over
    # (its iteration ended) by then.
    s = Stream(attach_ns=0, process_start_ns=-3600 * S)
    s.first(50 * MS)
    s.steps(60, 100)
    since = s.t
    s.t += 8 * S
    s.failslow.on_iteration(s.t, 8 * S)
    s.goodput.on_iteration(s.t, 8 * S, s.failslow.baseline)
    s.goodput.on_hang({"last_iteration_mono_ns": since})
    s.steps(30, 100)
    ledger = s.ledger()
    _adds_up(ledger)
    assert ledger["lost_seconds"]["hang"] == pytest.approx(7.9, rel=0.02)
