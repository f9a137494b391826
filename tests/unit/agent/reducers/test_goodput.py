"""The goodput ledger on exact streams: every second of the wall time in one place, each
cause as injected; its window (attach or process start) and sessions that saw no
iteration (unobserved) over generated sessions (real jobs:
tests/e2e/test_goodput_jobs.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from perfmon.agent.reducers import Summarizer
from perfmon.agent.reducers.failslow import FailSlow
from perfmon.agent.reducers.goodput import (
    CAUSES,
    Goodput,
    Ledger,
    combined,
    recorded_ledger,
)
from perfmon.agent.reducers.pace import STALL_MIN_NS, STALL_PACES
from perfmon.parsers.figures import StragglerEpisode, render

from tests.eventlogs import START_NS, session_facts

S = 1_000_000_000
MS = 1_000_000


class Stream:
    """A primary rank's iterations fed to the fail-slow detector and the ledger."""

    def __init__(self, attach_ns: int = 0, process_start_ns: int | None = None, gpus: int = 8,
                 previous: dict | None = None, attach_only: bool = False) -> None:
        self.failslow = FailSlow(str)
        self.goodput = Goodput(attach_ns, process_start_ns, gpus, previous,
                               attach_only=attach_only)
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
               hung: bool = False, first_job_iteration: int | None = None,
               exited: bool = False) -> dict:
        self.failslow.resolve([], True)
        return render(self.goodput.summary(end_ns or self.t, self.failslow.events,
                                           stragglers or [], hung, first_job_iteration,
                                           exited=exited))


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
    episode = StragglerEpisode(pid=1, rank=1, since_ns=straggler_from, until_ns=s.t,
                               delay_per_step_s=0.025)
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
    # (less the iteration's own pace: that it would have taken, not seen)
    assert ledger["lost_seconds"]["hang"] == pytest.approx(24.9, abs=0.01)
    assert ledger["unobserved_seconds"] == pytest.approx(0.1 + 0.05, abs=0.01)
    # Not yet declared hung (the session ended first): a stall all the same.
    assert s.ledger(end_ns=s.t + 5 * S)["lost_seconds"]["hang"] == pytest.approx(4.9, abs=0.01)
    # A tail of less than a stall is the iteration that was running: not seen.
    short = s.ledger(end_ns=s.t + 120 * MS)
    assert short["lost_seconds"]["hang"] == 0
    assert short["unobserved_seconds"] == pytest.approx(0.05 + 0.12, abs=0.002)
    # The ranks' end (they exited): not a stall either.
    assert s.ledger(end_ns=end, exited=True)["lost_seconds"]["hang"] == 0


def test_a_restart_counts_the_gap_the_new_start_up_and_the_iterations_redone():
    first = Stream(attach_ns=0, process_start_ns=-1 * S)
    first.first(5 * S)
    first.steps(60, 100)
    # (a rank failed 2 s after the last iteration; the session ended then)
    before = {"ledger": first.ledger(end_ns=first.t + 2 * S, exited=True),
              "end_mono_ns": first.t + 2 * S,
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
    # (the first session's 2 s after its last iteration were not seen there: its ranks'
    # end; the job's ledger knows them for the restart's)
    assert before["ledger"]["unobserved_seconds"] == pytest.approx(2, abs=0.01)
    assert job["wall_seconds"] == pytest.approx(before["ledger"]["wall_seconds"]
                                                + 2 + 3 + ledger["wall_seconds"], abs=0.01)
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
    assert len(s.goodput._account.bins) <= 4096
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
    assert job.figures().ratio == pytest.approx((8 * 170 + 4 * 100) / (12 * 200))
    assert job.lost_s["hang"] == pytest.approx((8 * 5 + 4 * 80) / 12)
    assert job.figures().lost_gpu_hours["hang"] == pytest.approx((8 * 5 + 4 * 80) / 3600,
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


# -- the window: attach or process start; no iteration seen: unobserved ---------------------


def test_the_issues_attach_to_a_job_whose_iterations_it_could_not_see_is_unobserved():
    # Issue 37: attached for 30 s to a job that had trained for 48 s (a compiled optimizer
    # step: no marker). It said goodput 0.0 with 76.7 s lost to startup.
    for attach_only in (True, False):  # (attach; and a node service's session alike)
        s = Stream(attach_ns=0, process_start_ns=-48 * S, attach_only=attach_only)
        ledger = s.ledger(end_ns=30 * S)
        _adds_up(ledger)
        assert ledger["ratio"] is None and ledger["from"] == "attach"
        assert ledger["unobserved_seconds"] == 30
        assert ledger["unobserved_gpu_hours"] == pytest.approx(30 * 8 / 3600, abs=1e-6)
        assert ledger["wall_seconds"] == ledger["productive_seconds"] == 0
        assert not any(ledger["lost_seconds"].values()), ledger


def test_attached_to_a_job_in_its_start_up_lost_time_starts_at_the_attach():
    # Started 10 min before attach, its first iteration 40 s after it: the 40 s (less a
    # healthy step) are start-up, the 10 min before the attach are nobody's.
    s = Stream(attach_ns=0, process_start_ns=-600 * S, attach_only=True)
    s.first(40 * S)
    s.steps(60, 100)
    ledger = s.ledger()
    _adds_up(ledger)
    assert ledger["from"] == "attach"
    assert ledger["wall_seconds"] == pytest.approx(100, abs=0.2)
    assert ledger["lost_seconds"]["startup"] == pytest.approx(39.9, abs=0.01)
    # (the same job found by the node service: from its process start)
    s = Stream(attach_ns=0, process_start_ns=-600 * S)
    s.first(40 * S)
    s.steps(60, 100)
    assert s.ledger()["lost_seconds"]["startup"] == pytest.approx(639.9, abs=0.01)


def test_a_process_the_previous_session_watched_starts_the_window_at_its_end():
    # The node service's second session of the same process (it yielded its slot, or
    # new ranks came): the first session counted the time up to its end.
    before = {"ledger": render(Ledger(100, 90, gpus=8).figures()), "end_mono_ns": -50 * S}
    s = Stream(attach_ns=0, process_start_ns=-3600 * S, previous=before)
    s.first(30 * S)
    s.steps(60, 100)
    ledger = s.ledger()
    _adds_up(ledger)
    assert ledger["from"] == "previous_session"
    assert ledger["wall_seconds"] == pytest.approx(140, abs=0.2)
    assert ledger["job"]["wall_seconds"] == pytest.approx(240, abs=0.2)


def test_unobserved_time_adds_up_beside_the_wall_time_never_into_the_ratio():
    seen = Ledger(100, 80, gpus=8)
    seen.lost_s["unexplained"] = 20
    unseen = Ledger(gpus=4, unobserved_s=50)
    assert Ledger.from_dict(render(unseen.figures())) == unseen
    assert Ledger.from_dict(render(seen.figures())).unobserved_s == 0  # (and older ledgers: none)
    assert render(unseen.figures())["ratio"] is None
    total = recorded_ledger([render(unseen.figures()), render(seen.figures())])
    assert total is not None and total.figures().ratio == 0.8
    assert total.unobserved_s == 50 and total.wall_s == 100
    job = combined([seen, unseen])
    # (GPU-seconds: 8 x 80 productive of 8 x 100 observed; the 4 x 50 unseen beside them)
    assert job is not None and job.figures().ratio == pytest.approx(0.8)
    assert job.unobserved_s == pytest.approx(50 * 4 / 12)


def test_the_session_says_who_started_it_and_older_logs_replay_as_before():
    # (the goodput's window, from the facts the log starts with)
    for started_by, attach_only in (("attach", True), ("tracker", False), (None, False)):
        facts = {**session_facts(), "process_start_monotonic_ns": START_NS - 20 * S}
        if started_by is not None:
            facts["started_by"] = started_by
        summarizer = Summarizer.from_facts(facts)
        assert summarizer.goodput.attach_only is attach_only
        summarizer.feed({"type": "session_end", "t_mono_ns": START_NS + 30 * S,
                         "reason": "duration"})
        goodput = render(summarizer.statistics())["goodput"]
        assert goodput["ratio"] is None and goodput["unobserved_seconds"] == 30, goodput
        assert goodput["lost_seconds"]["startup"] == 0


@dataclass
class Case:
    """A generated session and its truth: when it attached and ended, who started it
    (``attach_only``), the primary's process start, its iterations (none: not seen)."""

    attach_ns: int
    end_ns: int
    attach_only: bool
    process_start_ns: int | None
    first_end_ns: int | None  # its first iteration's end; None: no iteration seen
    step_ns: int
    iterations: int
    baseline: bool  # whether the healthy pace had formed (the fail-slow baseline)
    previous_end_ns: int | None  # the job's previous session's end (node service)

    @property
    def healthy_ns(self) -> int:
        """The healthy step as the ledger knows it: the steps' (none measured: 0)."""
        return self.step_ns if self.iterations else 0

    def stall_ns(self) -> int:
        """The least a stall adds to a step (noise-free steps): the rule's floor."""
        return max(int(STALL_PACES * self.healthy_ns), STALL_MIN_NS)

    def late(self) -> bool:
        """Whether the job was not iterating at attach: its first iteration ended a
        healthy step and a stall or more after it, or (found by the node service) its
        process was younger at the attach than that lead."""
        if self.first_end_ns is None:
            return False
        lead = self.first_end_ns - self.attach_ns
        young = (not self.attach_only and self.process_start_ns is not None
                 and self.attach_ns - self.process_start_ns < lead)
        return young or lead - self.healthy_ns >= self.stall_ns()

    def tail_stalled(self) -> bool:
        """Whether the time after its last iteration is a stall (else not seen)."""
        return self.end_ns - self.last_end_ns - self.healthy_ns >= self.stall_ns()

    @property
    def last_end_ns(self) -> int:
        assert self.first_end_ns is not None
        return self.first_end_ns + self.iterations * self.step_ns

    def truth_start(self) -> int:
        """Where the window starts, by the rule: at the attach unless the node service or
        run found a job not iterating at attach, from its process start (not before the
        previous session's end); a session seeing no iteration at the attach."""
        start = self.process_start_ns
        if not self.late() or self.attach_only or start is None or start >= self.attach_ns:
            return self.attach_ns
        return max(start, self.previous_end_ns) if self.previous_end_ns is not None else start


@st.composite
def cases(draw: Any) -> Case:
    attach = draw(st.integers(0, 10**15))
    process_start = draw(st.one_of(
        st.none(),
        st.integers(attach - 7 * 86400 * S, attach - 1),  # before: attach to a running job
        st.integers(attach, attach + 5 * S)))  # just at or after (clocks: its start seen)
    step = draw(st.integers(10 * MS, 2 * S))
    seen = draw(st.booleans())
    first = attach + draw(st.integers(0, 300 * S)) if seen else None
    iterations = draw(st.integers(0, 200)) if seen else 0
    last = (first + iterations * step) if first is not None else attach
    end = last + draw(st.integers(0, 60 * S))
    previous = (attach - draw(st.integers(1, 3600 * S))
                if draw(st.booleans()) else None)
    return Case(attach, end, draw(st.booleans()), process_start, first, step, iterations,
                draw(st.booleans()), previous)


def _ledger_of(case: Case) -> dict[str, Any]:
    previous = None
    if case.previous_end_ns is not None:
        earlier = Ledger(60, 50, gpus=2)
        earlier.lost_s["hang"] = 10
        previous = {"ledger": render(earlier.figures()), "end_mono_ns": case.previous_end_ns}
    g = Goodput(case.attach_ns, case.process_start_ns, 2, previous,
                attach_only=case.attach_only)
    if case.first_end_ns is not None:
        g.on_first_end(case.first_end_ns)
        healthy = float(case.step_ns) if case.baseline else None
        for k in range(1, case.iterations + 1):
            g.on_iteration(case.first_end_ns + k * case.step_ns, case.step_ns, healthy)
    return render(g.summary(case.end_ns, [], [], False))


@settings(max_examples=400, deadline=None)
@given(cases())
def test_the_window_never_starts_before_an_attach_and_unseen_time_is_unobserved(case: Case):
    ledger = _ledger_of(case)
    _adds_up(ledger)
    session_s = (case.end_ns - case.attach_ns) / 1e9
    if case.first_end_ns is None:  # no iteration seen: not known, never startup
        assert ledger["unobserved_seconds"] == pytest.approx(session_s, abs=1e-3)
        assert ledger["ratio"] is None and ledger["from"] == "attach"
        assert ledger["wall_seconds"] == ledger["productive_seconds"] == 0
        assert not any(ledger["lost_seconds"].values()), ledger
        return
    # Not seen: the iteration running at the attach (the job iterating then), and after
    # the last end, the iteration running (less than a stall: else the stall is a hang,
    # and its own pace not seen).
    tail_ns = case.end_ns - case.last_end_ns
    unseen_ns = ((0 if case.late() else case.first_end_ns - case.attach_ns)
                 + (min(tail_ns, case.healthy_ns) if case.tail_stalled() else tail_ns))
    assert ledger["unobserved_seconds"] == pytest.approx(unseen_ns / 1e9, abs=2e-3)
    hang_ns = tail_ns - case.healthy_ns if case.tail_stalled() else 0
    assert ledger["lost_seconds"]["hang"] == pytest.approx(hang_ns / 1e9, abs=2e-3)
    assert ledger["ratio"] is None or 0 <= ledger["ratio"] <= 1
    start = case.truth_start()
    assert ledger["wall_seconds"] == pytest.approx((case.end_ns - start - unseen_ns) / 1e9,
                                                   abs=2e-3)
    if case.attach_only or (case.process_start_ns is not None
                            and case.process_start_ns >= case.attach_ns):
        # attach to a process already running, or one whose start it saw: from the attach
        assert ledger["from"] == "attach"
    expected_from = ("attach" if start == case.attach_ns else
                     "process_start" if start == case.process_start_ns else "previous_session")
    assert ledger["from"] == expected_from
    # Start-up only for a job not iterating at attach: to its first iteration's end from
    # the window's start, less a healthy step.
    startup_ns = max(0, case.first_end_ns - start - case.healthy_ns) if case.late() else 0
    assert ledger["lost_seconds"]["startup"] == pytest.approx(startup_ns / 1e9, abs=1e-3)
    if case.previous_end_ns is not None:  # the job's: the earlier 60 s, the gap, this one
        job = ledger["job"]
        _adds_up(job)
        gap_s = max(0, start - case.previous_end_ns) / 1e9
        assert job["wall_seconds"] == pytest.approx(60 + gap_s + ledger["wall_seconds"],
                                                    abs=2e-3)
        assert job["unobserved_seconds"] == ledger["unobserved_seconds"]


@pytest.mark.parametrize(("last", "read"), [(650, True), (None, True), (650, False)])
def test_a_restart_whose_redone_iterations_are_unknown_says_so(last: int | None, read: bool):
    # (issue 51: under load the job's counter was read in neither session, and the
    # restart's ledger quietly left out the iterations redone)
    before = {"ledger": render(Ledger(wall_s=60, productive_s=60, gpus=1).figures()),
              "end_mono_ns": 0, "last_end_mono_ns": 0, "last_job_iteration": last}
    summarizer = Summarizer.from_facts({**session_facts(), "job_before": before})
    if read:
        summarizer.clock.job.on_read({"t_mono_ns": 1, "end_mono_ns": 2, "value": 601,
                                      "name": "iteration"})
        summarizer.clock.job.resolve(None)
    quality = render(summarizer.statistics())["data_quality"]
    unknown = quality["sources"]["goodput"]["restart_redone_unknown"]
    assert unknown == (0 if last is not None and read else 1)
    assert any("restart_redone_unknown" in line for line in quality["losses"]) == bool(unknown)


@pytest.mark.parametrize("ended", [{"exit_code": 0}, {"signal": "SIGKILL"}],
                         ids=["exit_0", "killed"])
def test_ranks_slow_to_exit_after_their_last_iteration_are_ending_not_hung(ended: dict):
    # (issue 51: on a busy node a job's interpreter took 8-13 s to exit after its last
    # iteration; the hang record raised meanwhile booked them as hang. A clean exit was the
    # job ending: unobserved. One that ended in a kill was hung until then.)
    from tests.eventlogs import PID, START_NS, STEP_NS
    from tests.eventlogs import records as session_records

    summarizer = Summarizer.from_facts(session_facts())
    for record in session_records(300, end=False):
        if record["type"] != "session_start":
            summarizer.feed(record)
    last = START_NS + 300 * STEP_NS
    summarizer.feed({"type": "hang", "t_mono_ns": last + 5 * S, "last_iteration_mono_ns": last,
                     "threshold_s": 5.0, "frame": None, "report": None})
    summarizer.feed({"type": "rank_exit", "t_mono_ns": last + 12 * S, "pid": PID, "rank": 0,
                     "exit_code": None, "signal": None, "core_dumped": False,
                     "oom_killed": False, "log_tail_cause": None, "source": "proc_connector",
                     **ended})
    summarizer.feed({"type": "session_end", "t_mono_ns": last + 12 * S,
                     "reason": "target_exited"})
    ledger = render(summarizer.statistics())["goodput"]
    _adds_up(ledger)
    if "exit_code" in ended:
        assert ledger["lost_seconds"]["hang"] == 0 and ledger["unobserved_seconds"] >= 11.9
    else:
        assert ledger["lost_seconds"]["hang"] == pytest.approx(12, abs=0.3), ledger
