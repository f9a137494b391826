"""Generated step streams with their truth, for the judgements: the goodput ledger and
fail-slow (issue 38). Each case is a primary rank's iterations as the probes give them
(ends, step times), drawn from a family of shapes: healthy noise, stalls anywhere,
slowdowns that come back to a level near the old one, creeps, restarts. The truth is
what was injected; ``judge`` feeds the reducers as the Summarizer does (live and
replayed alike) and ``check`` says where they and the truth part by more than the
bounds below, each bound stated with its reason.
tests/unit/agent/reducers/test_judgements_generated.py runs a fixed-seed sample in
``make test``; benchmarks/judgements_generated.py runs
10,000 a family and reports the worst error of each figure.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from perfmon.agent.reducers.failslow import EPISODE_CLOSES, FailSlow, FailSlowRule
from perfmon.agent.reducers.goodput import MIN_SHIFT, Goodput
from perfmon.agent.reducers.pace import STALL_MIN_NS, STALL_PACES, STALL_SIGMAS
from perfmon.parsers.figures import render

S = 1_000_000_000
FAMILIES = ("healthy", "stalls", "slowdowns", "drifts", "restarts")
HANG_TIMEOUT_S = 8.0  # the hang detector's threshold in these streams (as the tests set it)
HANG_FACTOR = 10.0
PHASES = ("data_loading", "forward", "backward", "optimizer", "other")


@dataclass
class Stall:
    at_s: float  # when it begins (seconds after the attach)
    seconds: float
    phase: str  # where the ranks wait (a hang record says so when it is long enough)


@dataclass
class Segment:
    """``seconds`` of steps at ``level`` times the healthy step (``to_level``: rising
    linearly to it over the segment: a creep)."""

    seconds: float
    level: float
    to_level: float | None = None


@dataclass
class Case:
    family: str
    step_s: float  # the healthy step
    noise: float  # sigma of log(step): the job's own noise
    seed: int
    lead: float  # the share of a step already run at the attach
    segments: list[Segment]
    stalls: list[Stall] = field(default_factory=list)
    tail: float = 0.5  # the share of the last step run when the window closes
    # restarts: the previous incarnation's session, its end after its last iteration,
    # the gap to the next process, its start-up, the iterations it redoes
    restart: dict[str, float] | None = None


@dataclass
class Fed:
    """A stream as fed: its iterations and what the truth needs of them."""

    ends: list[int]
    steps: list[int]
    stall_ns: list[int]  # the stall each step holds (0: none)
    base_ns: list[float]  # each step's level without noise or stall
    first_end_ns: int
    end_ns: int
    hangs: list[tuple[int, int, str]]  # (record time, since, phase)
    tail_stall_ns: int  # a stall still running when the window closed


@dataclass
class Judged:
    ledger: dict[str, Any]
    events: list[dict[str, Any]]
    fed: Fed
    open_now: bool = False  # a fail-slow episode open at the end (the Prometheus gauge)
    job: dict[str, Any] | None = None  # restarts: the job's ledger


# -- drawing ------------------------------------------------------------------------------


@st.composite
def cases(draw: Any, family: str) -> Case:
    step_s = math.exp(draw(st.floats(math.log(0.01), math.log(2.0))))
    noise = draw(st.floats(0.0, 0.10))
    seed = draw(st.integers(0, 2**31))
    lead = draw(st.floats(0.0, 0.999))
    tail = draw(st.floats(0.0, 0.999))
    healthy = draw(st.floats(30.0, 90.0))
    case = Case(family, step_s, noise, seed, lead, [Segment(healthy, 1.0)], tail=tail)
    if family == "healthy":
        case.segments = [Segment(draw(st.floats(20.0, 300.0)), 1.0)]
    elif family == "stalls":
        total = draw(st.floats(30.0, 180.0))
        case.segments = [Segment(total, 1.0)]
        for _ in range(draw(st.integers(1, 3))):
            seconds = math.exp(draw(st.floats(math.log(0.5), math.log(60.0))))
            # (anywhere: before the baseline formed, in the last iteration: the window
            # may close during it)
            case.stalls.append(Stall(draw(st.floats(0.0, total)), seconds,
                                     draw(st.sampled_from(PHASES))))
    elif family == "slowdowns":
        for _ in range(draw(st.integers(1, 2))):  # (a second episode right after the first)
            rise = draw(st.floats(0.05, 1.0))
            case.segments.append(Segment(draw(st.floats(5.0, 120.0)), 1.0 + rise))
            back = 1.0 + draw(st.floats(-0.10, 0.10))
            case.segments.append(Segment(draw(st.floats(40.0, 90.0)), back))
    elif family == "drifts":
        top = 1.0 + draw(st.floats(0.10, 0.50))
        case.segments.append(Segment(draw(st.floats(20.0, 120.0)), 1.0, to_level=top))
        case.segments.append(Segment(draw(st.floats(30.0, 60.0)), top))
    elif family == "restarts":
        case.segments = [Segment(draw(st.floats(20.0, 120.0)), 1.0)]
        case.restart = {"after_s": draw(st.floats(0.0, 5.0)), "gap_s": draw(st.floats(1.0, 60.0)),
                        "startup_s": draw(st.floats(2.0, 60.0)),
                        "redone": float(draw(st.integers(0, 50))),
                        "second_s": draw(st.floats(20.0, 120.0))}
    return case


# -- feeding --------------------------------------------------------------------------------


def stream(case: Case, origin_ns: int = 0) -> Fed:
    """The iterations of ``case``'s segments from the attach at ``origin_ns``."""
    rng = random.Random(case.seed)
    h = case.step_s * S
    stalls = sorted(case.stalls, key=lambda x: x.at_s)
    t = origin_ns + int((1 - case.lead) * h * math.exp(rng.gauss(0, case.noise)))
    fed = Fed([], [], [], [], t, t, [], 0)
    for seg in case.segments:
        seg_end = t + seg.seconds * S
        seg_start = t
        while t < seg_end:
            level = seg.level
            if seg.to_level is not None:
                level += (seg.to_level - seg.level) * (t - seg_start) / (seg.seconds * S)
            base = level * h
            step = base * math.exp(rng.gauss(0, case.noise))
            stall = 0.0
            while stalls and origin_ns + stalls[0].at_s * S < t + step:
                s = stalls.pop(0)
                stall += s.seconds * S
                # (the hang detector: no iteration for its threshold; its record once the
                # stacks are in, the job perhaps resumed by then)
                threshold = max(HANG_TIMEOUT_S * S, HANG_FACTOR * h)
                if s.seconds * S >= threshold:
                    fed.hangs.append((int(t + threshold + rng.uniform(0.5, 5) * S), t, s.phase))
            seg_end += stall  # (a segment's seconds are its steps', stalls beside them)
            end = int(t + step + stall)
            fed.ends.append(end)
            fed.steps.append(end - t)
            fed.stall_ns.append(int(stall))
            fed.base_ns.append(base)
            t = end
    fed.end_ns = int(t + case.tail * h)
    if stalls:  # (the window closes during a stall: its time so far)
        at = origin_ns + stalls[0].at_s * S
        fed.end_ns = int(max(fed.end_ns, at + stalls[0].seconds * S * case.tail))
        fed.tail_stall_ns = int(fed.end_ns - max(at, t))
        threshold = max(HANG_TIMEOUT_S * S, HANG_FACTOR * h)
        if fed.end_ns - t >= threshold:
            fed.hangs.append((int(t + threshold), t, stalls[0].phase))
    return fed


def judge(case: Case) -> Judged:
    """Feed the stream to the reducers as the Summarizer does; the session's summary."""
    if case.restart is not None:
        return _judge_restart(case)
    fed = stream(case)
    ledger, events, open_now = _feed(fed, 0, None, None, attach_only=True)
    return Judged(ledger, events, fed, open_now)


def _feed(fed: Fed, attach_ns: int, process_start_ns: int | None,
          previous: dict[str, Any] | None, *, attach_only: bool, exited: bool = False,
          first_job_iteration: int | None = None
          ) -> tuple[dict[str, Any], list[dict], bool]:
    failslow = FailSlow(str)
    goodput = Goodput(attach_ns, process_start_ns, 1, previous, attach_only=attach_only)
    goodput.on_first_end(fed.first_end_ns)
    hangs = sorted(fed.hangs)
    hung = False
    for end, step in zip(fed.ends, fed.steps, strict=True):
        while hangs and hangs[0][0] <= end:
            _, since, phase = hangs.pop(0)
            goodput.on_hang({"last_iteration_mono_ns": since, "phase": phase})
        failslow.on_iteration(end, step)
        goodput.on_iteration(end, step, failslow.baseline)
    for at, since, phase in hangs:  # (the window closed hung)
        if at <= fed.end_ns:
            goodput.on_hang({"last_iteration_mono_ns": since, "phase": phase})
            hung = True
    failslow.resolve([], True)
    return (render(goodput.summary(fed.end_ns, failslow.events, [], hung, first_job_iteration,
                                   exited=exited)), [render(e) for e in failslow.events],
            failslow.now() is not None)


def _judge_restart(case: Case) -> Judged:
    r = case.restart
    assert r is not None
    first = stream(case)
    first.end_ns = first.ends[-1] + int(r["after_s"] * S)  # (its ranks exited then)
    first.tail_stall_ns = 0
    ledger, _, _ = _feed(first, 0, -S, None, attach_only=False, exited=True)
    iterations = len(first.ends)
    before = {"ledger": ledger, "end_mono_ns": first.end_ns,
              "last_end_mono_ns": first.ends[-1], "last_job_iteration": iterations}
    process_start = first.end_ns + int(r["gap_s"] * S)
    second_case = Case(case.family, case.step_s, case.noise, case.seed + 1, 0.0,
                       [Segment(r["second_s"], 1.0)], tail=case.tail)
    second = stream(second_case, process_start + int(r["startup_s"] * S))
    # (found by the node service a moment after its start: the window from there)
    attach = process_start + int(0.5 * S)
    # (it redoes what it runs first: never more iterations than this session ran)
    redone = r["redone"] = min(int(r["redone"]), len(second.ends))
    ledger2, events, open_now = _feed(second, attach, process_start, before,
                                      attach_only=False,
                                      first_job_iteration=iterations + 1 - redone)
    return Judged(ledger2, events, second, open_now, ledger2["job"])


# -- the truth and its bounds ----------------------------------------------------------------


def _block_s(case: Case) -> float:
    rule = FailSlowRule()
    steps = min(rule.max_block, max(rule.min_block, math.ceil(rule.block_s / case.step_s)))
    return steps * case.step_s


def _shift(case: Case) -> float:
    """d, the fail-slow detector's smallest shift for this job's noise (its rule)."""
    rule = FailSlowRule()
    steps = max(1.0, _block_s(case) / case.step_s)
    return max(math.log1p(rule.threshold), rule.z * 1.2533 * case.noise / math.sqrt(steps))


def _stall_floor_ns(case: Case) -> float:
    h = case.step_s * S
    return max(STALL_PACES * h, STALL_MIN_NS, h * math.expm1(STALL_SIGMAS * case.noise))


def detect_bound_s(case: Case) -> float:
    """How long after a change it is found at the latest: the rule's longest sustain,
    and the blocks around it (the change's own block, three to confirm, one late)."""
    return FailSlowRule().sustain_max_s + 5 * _block_s(case)


@dataclass
class Errors:
    """What ``check`` found in one case: each figure's error and its bound, and the
    properties that failed (hard: every case; ``false_alarm``: counted, a rate)."""

    figures: dict[str, tuple[float, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    false_alarm: bool = False

    def within(self, name: str, got: float, want: float, bound: float) -> None:
        error = abs(got - want)
        self.figures[name] = (error, bound)
        if error > bound:
            self.failures.append(f"{name}: {got:.3f} against {want:.3f} (bound {bound:.3f})")

    def holds(self, name: str, ok: bool, detail: str = "") -> None:
        if not ok:
            self.failures.append(f"{name}: {detail}")


@dataclass
class Report:
    """A family's cases: the worst error of each figure (and of error / bound), the
    failures with their cases, the false alarms."""

    family: str
    cases: int = 0
    iterations: int = 0
    worst: dict[str, tuple[float, float, Case | None]] = field(default_factory=dict)
    failures: list[tuple[str, Case]] = field(default_factory=list)
    false_alarms: int = 0

    def add(self, case: Case, judged: Judged, errors: Errors) -> None:
        self.cases += 1
        self.iterations += len(judged.fed.ends)
        for name, (error, bound) in errors.figures.items():
            ratio = error / bound if bound > 0 else 0.0
            if name not in self.worst or ratio > self.worst[name][1]:
                self.worst[name] = (error, ratio, case)
        self.failures.extend((f, case) for f in errors.failures)
        self.false_alarms += errors.false_alarm

    def lines(self) -> list[str]:
        out = [f"{self.family}: {self.cases} cases, {self.iterations} iterations, "
               f"{len(self.failures)} failures, false fail-slow in {self.false_alarms} "
               f"({100 * self.false_alarms / max(1, self.cases):.2f}%)"]
        for name, (error, ratio, case) in sorted(self.worst.items()):
            out.append(f"  worst {name}: error {error:.4f} ({100 * ratio:.0f}% of its bound)"
                       f" in {case}")
        out.extend(f"  FAILED {f} in {c}" for f, c in self.failures[:5])
        return out


def check(case: Case, judged: Judged) -> Errors:
    errors = Errors()
    ledger, fed = judged.ledger, judged.fed
    lost = ledger["lost_seconds"]
    h = case.step_s
    total = ledger["productive_seconds"] + sum(lost.values())
    errors.within("adds_up_s", total, ledger["wall_seconds"], 0.01)
    if judged.job is not None:
        _check_restart(case, judged, errors)
        return errors
    # Not seen: the iteration running at the attach (the job iterates then), and the one
    # running when the window closed unless it is a stall.
    lead_s = fed.first_end_ns / S
    tail_s = (fed.end_ns - fed.ends[-1]) / S
    unseen = lead_s + (tail_s if not fed.tail_stall_ns else min(tail_s, h))
    # (a tail stall's own pace: the job's pace at the end, its noise and level within)
    errors.within("unobserved_s", ledger["unobserved_seconds"], unseen,
                  0.002 + (3 * case.noise * h + 0.1 * h if fed.tail_stall_ns else 0))
    _check_stalls(case, fed, lost, errors)
    if case.family in ("slowdowns", "drifts"):
        _check_slowdowns(case, judged, errors)
    else:
        # No shift, no fail-slow (a stall is no shift of the pace): a rate, the detector
        # being statistical (a shift of its smallest size d is found by chance on long,
        # noisy steps, where a block holds few of them)
        errors.false_alarm = bool(judged.events)
    if case.family == "healthy" and not judged.events:
        # (the noise around the healthy pace is productive: at least 98% of what it saw)
        errors.within("healthy_ratio", ledger["ratio"] or 0.0, 1.0, 0.02)
    return errors


def _check_stalls(case: Case, fed: Fed, lost: dict[str, float], errors: Errors) -> None:
    """Each stall of a stall's length or more lands in hang (data_stall where its hang
    record found the ranks loading data) within 5% of its length, or the step's noise
    (3 sigma of a step, and the pace it is judged against, the median of 9), whichever
    is larger; a shorter one never does. In between (the rule's floor, give or take the
    noise), either."""
    h = case.step_s * S
    floor = _stall_floor_ns(case)
    noise_ns = 3 * case.noise * h + 0.1 * h * case.noise * 10
    want = {"hang": 0.0, "data_stall": 0.0}
    bound = 0.0
    data_since = {since for _, since, phase in fed.hangs if phase == "data_loading"}
    starts = [e - s for e, s in zip(fed.ends, fed.steps, strict=True)]
    stalls = [(starts[i], fed.stall_ns[i]) for i in range(len(fed.ends)) if fed.stall_ns[i]]
    if fed.tail_stall_ns:
        stalls.append((fed.ends[-1], fed.tail_stall_ns))
    for start, stall in stalls:
        tail = start == fed.ends[-1] and stall == fed.tail_stall_ns
        # (a stall in the last iteration: where in it the stall sits is not seen)
        slack = max(0.05 * stall, noise_ns + (h if tail else 0))
        cause = "data_stall" if start in data_since else "hang"
        # (the rule's floor, give or take the noise and 1% of it: a case on the floor)
        if stall >= floor * (1.01 + 3 * case.noise) + noise_ns + (h if tail else 0):
            want[cause] += stall
            bound += slack
        elif stall > floor * (0.99 - 3 * case.noise) - noise_ns - (h if tail else 0):
            want[cause] += stall / 2  # (either: half way, the bound both ways)
            bound += stall / 2 + slack
    for cause in ("hang", "data_stall"):
        errors.within(f"{cause}_s", lost[cause], want[cause] / S, bound / S + 0.002)


def _check_slowdowns(case: Case, judged: Judged, errors: Errors) -> None:
    """A rise the detector's rule can find (2.5 times its smallest shift d, lasting its
    longest sustain and a few blocks) is a fail_slow event dated within two blocks of
    its start and found within ``detect_bound_s``; after it, a fall of that size is an
    event within the same delay: ``recovered`` when the level is back within d / 2 of
    the old one, an event that closes the episode when the new level is clearly nearer
    the old level than the slow one (``recovered_partly``), ``eased`` when clearly
    nearer the slow one; and once back, no episode is left open. The ledger's lost
    time is the injected excess within 10%, less what two blocks at each edge, the
    noise band and a return above the old level (the new pace) may move."""
    fed, events = judged.fed, judged.events
    d = _shift(case)
    h = case.step_s
    block = _block_s(case)
    bound_s = detect_bound_s(case)
    kinds = [(e["event"], round(e["t_mono_ns"] / S, 1), round(e["detected_mono_ns"] / S, 1))
             for e in events]
    t = fed.first_end_ns / S
    slow: float | None = None  # the level of the episode the truth says is open
    # (the job's healthy levels so far: the baseline is theirs, and only when they agree
    # is "back at the old level" the detector's "back at the baseline")
    healthy = [case.segments[0].level]
    for prev, seg in itertools.pairwise(case.segments):
        t += prev.seconds
        before = prev.to_level or prev.level
        # (a rise dated as a creep is dated from where the job last ran at or below
        # its baseline: earlier, by the rule)
        near = [e for e in events if e["detected_mono_ns"] / S <= t + bound_s
                and (abs(e["t_mono_ns"] / S - t) <= 2 * block + 1
                     or (e.get("drift") and t - bound_s <= e["detected_mono_ns"] / S))]
        if seg.to_level is not None:
            # A creep: found by its end once 2.5 d above, when the stream goes on long
            # enough after it and the job's healthy history before it is as long as the
            # creep (the baseline is the median of the healthy blocks: a creep longer
            # than the history it joins moves it)
            held = case.segments[-1].seconds >= bound_s
            if math.log(seg.to_level / before) >= 2.5 * d and held \
                    and prev.seconds >= seg.seconds:
                errors.holds("creep_found", any(e["event"] == "fail_slow" for e in events
                                                if e["detected_mono_ns"] / S
                                                <= t + seg.seconds + bound_s), str(kinds))
                slow = seg.to_level
            continue
        change = math.log(seg.level / before)
        if seg.level < math.exp(2.5 * d):
            healthy.append(seg.level)
        # (too small or too short for the rule, or a rise before the level formed, five
        # blocks after the change before it: either way)
        if abs(change) < 2.5 * d or seg.seconds < bound_s \
                or (change > 0 and prev.seconds < 5 * block):
            continue
        if change > 0:
            rises = [e for e in near if e["event"] == "fail_slow"]
            errors.holds("rise_found", bool(rises),
                         f"+{math.expm1(change):.0%} at {t:.1f} s: {kinds}")
            if rises:
                errors.within("rise_found_after_s", rises[0]["detected_mono_ns"] / S - t, 0.0,
                              bound_s)
            slow = seg.level
            continue
        if slow is None:
            continue
        found = [e for e in near if e["event"] != "fail_slow"]
        errors.holds("fall_found", bool(found),
                     f"{math.expm1(change):.0%} at {t:.1f} s back to {seg.level:.3f}: {kinds}")
        if found:
            errors.within("fall_found_after_s", found[0]["detected_mono_ns"] / S - t, 0.0,
                          bound_s)
        above, fallen = math.log(seg.level), math.log(slow / seg.level)
        # (where the events within the delay leave it: a fall measured while under way
        # may be eased first, then recovered)
        kind = found[-1]["event"] if found else None
        clear = max(abs(math.log(x)) for x in healthy) < d / 2
        if above < d / 2 and clear:
            errors.holds("recovered", kind == "recovered", f"at {t:.1f} s: {kinds}")
        elif above < fallen - d:
            errors.holds("closed", kind in EPISODE_CLOSES, f"at {t:.1f} s: {kinds}")
        elif above > fallen + d:
            errors.holds("eased", kind == "eased", f"at {t:.1f} s: {kinds}")
        slow = None if kind in EPISODE_CLOSES else seg.level
    last = case.segments[-1]
    if case.family == "slowdowns" and abs(math.log(last.level)) < d / 2 \
            and max(abs(math.log(x)) for x in healthy) < d / 2 and last.seconds >= bound_s:
        # back at the old level at the end: no episode open (the gauge at 0)
        errors.holds("none_open", not judged.open_now, str(kinds))
    # The ledger: the injected excess over the healthy step: the old one's, or the pace
    # of a job that sped up (the baseline follows a healthy level down).
    injected = sum(b - h * S for b in fed.base_ns) / S
    faster = h
    for seg in case.segments:
        if seg.to_level is None and seg.level < 1 and seg.seconds >= bound_s:
            faster = min(faster, seg.level * h)
    after_faster = sum(max(0.0, b - faster * S) for b in fed.base_ns) / S
    lost = judged.ledger["lost_seconds"]
    measured = lost["slowdown"] + lost["unexplained"] + lost["data_stall"]
    # (each edge of an episode: two blocks of the new level's excess may fall either way;
    # outside episodes, the noise band; a return above the old level is the new pace)
    edges = [abs((s.to_level or s.level) - 1) for s in case.segments[1:]]
    edge_s = sum(2 * block * x for x in edges) + 2 * block * max(edges, default=0)
    band_s = max(MIN_SHIFT, 3 * case.noise) * sum(fed.steps) / S
    residual_s = sum(max(0.0, s.level - 1) * s.seconds for s in case.segments[1:]
                     if s.to_level is None and s.level < math.exp(2.5 * d))
    bound = 0.1 * abs(injected) + edge_s + band_s + residual_s + 3 * case.noise * h
    want = min((max(0.0, injected), after_faster), key=lambda w: abs(measured - w))
    errors.within("slowdown_s", measured, want, bound)


def _check_restart(case: Case, judged: Judged, errors: Errors) -> None:
    """The job's ledger: the first session's time after its last iteration, the gap,
    the new start-up less a healthy step, and the iterations redone, all restart."""
    r = case.restart
    assert r is not None and judged.job is not None
    job = judged.job
    total = job["productive_seconds"] + sum(job["lost_seconds"].values())
    errors.within("job_adds_up_s", total, job["wall_seconds"], 0.01)
    h = case.step_s
    # (its first iteration ends a step after its start-up: that step is productive)
    want = r["after_s"] + r["gap_s"] + r["startup_s"] + r["redone"] * h
    errors.within("restart_s", job["lost_seconds"]["restart"], want,
                  0.05 * want + 3 * case.noise * h * (1 + r["redone"] ** 0.5) + 0.01)


def run_family(family: str, examples: int, *, derandomize: bool = True,
               seed: int | None = None) -> Report:
    """``examples`` generated cases of ``family`` (hypothesis: a fixed seed when
    ``derandomize``), each judged and checked; their report."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as with_seed

    report = Report(family)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck))
    @given(cases(family))
    def run(case: Case) -> None:
        judged = judge(case)
        report.add(case, judged, check(case, judged))

    (with_seed(seed)(run) if seed is not None else run)()
    return report
