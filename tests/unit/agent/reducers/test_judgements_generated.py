"""The judgements on generated shapes of job (issue 38): 500 cases of each family of
tests/step_streams.py (hypothesis, a fixed seed: the same cases on every run), each
against its stated truth; the report names each figure's worst case. The same code
live and replayed: a sample fed through the Summarizer as a session's records judges
as the reducers fed directly do. benchmarks/judgements_generated.py runs 10,000 a
family."""

from __future__ import annotations

import pytest
from perfmon.agent.reducers import Summarizer
from perfmon.parsers.events import Steps
from perfmon.parsers.figures import render

from tests.eventlogs import PID, START_NS, session_facts
from tests.step_streams import FAMILIES, Case, judge, run_family, stream

EXAMPLES = 500
# The detector is statistical: on a stream with no shift, a shift of its smallest size
# is found by chance now and then (long, noisy steps: a 2 s block holds five of them).
# Seen here: 0.8% of healthy and stall cases, all at steps of 1 s or more with 5-8% noise.
FALSE_ALARM_RATE = 0.02
KNOWN_CORNERS = 0.01  # slowdown cases outside their bounds: see the test


@pytest.mark.slow  # ~25 s for the five families: left out of `make test-fast`
@pytest.mark.parametrize("family", FAMILIES)
def test_every_generated_case_of_the_family_holds_its_truth(family: str) -> None:
    report = run_family(family, EXAMPLES)
    print("\n".join(report.lines()))  # (the worst case of each figure: shown with -s)
    assert report.cases >= EXAMPLES
    # Slowdowns: the corners issue 38 left open (a rise and a return to a faster level
    # than before, back to back: 0.37% of 10,000 cases in benchmarks/judgements_generated.py)
    # are a rate, as which cases a fixed seed draws moves with the code hypothesis sees (it
    # draws constants from the loaded modules); every other family's truth is hard.
    allowed = KNOWN_CORNERS * report.cases if family == "slowdowns" else 0
    assert len(report.failures) <= allowed, "\n".join(report.lines())
    assert report.false_alarms <= FALSE_ALARM_RATE * report.cases, "\n".join(report.lines())


def _summarized(case: Case) -> tuple[dict, list[dict]]:
    """``case`` as a session's records (a steps record per second, the hang records,
    the session's end) through the Summarizer: its goodput and fail-slow events."""
    fed = stream(case, START_NS)
    summarizer = Summarizer.from_facts({**session_facts(), "started_by": "attach",
                                        "step_rows": True})
    rows = [(PID, fed.first_end_ns, -1, 0, 0, 0, 0, 0, 0, 0)]
    rows += [(PID, end, -1, 0, 0, 0, 0, 0, 0, 0) for end in fed.ends]
    hangs = sorted(fed.hangs)
    second = START_NS
    while rows:
        second += 1_000_000_000
        block = [r for r in rows if r[1] < second]
        rows = rows[len(block):]
        if block:
            summarizer.feed(Steps.encode(block[0][1], block, ["uprobe"]).to_record())
        while hangs and hangs[0][0] <= second and hangs[0][0] <= fed.end_ns:
            at, since, phase = hangs.pop(0)
            summarizer.feed({"type": "hang", "t_mono_ns": at, "last_iteration_mono_ns": since,
                             "threshold_s": 8.0, "frame": "f", "report": "r", "phase": phase})
    summarizer.feed({"type": "session_end", "t_mono_ns": fed.end_ns, "reason": "duration"})
    stats = render(summarizer.statistics())
    return stats["goodput"], stats["fail_slow"]


@pytest.mark.parametrize("family", ["stalls", "slowdowns"])
def test_the_summarizer_judges_a_session_as_the_reducers_do(family: str) -> None:
    from hypothesis import HealthCheck, given, settings

    from tests.step_streams import cases

    @settings(max_examples=15, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases(family))
    def same(case: Case) -> None:
        # (hang records after the window's end never reach a session)
        goodput, events = _summarized(case)
        direct = judge_at(case)
        assert goodput == direct[0]
        assert [(e["event"], e["t_mono_ns"], e["detected_mono_ns"]) for e in events] == [
            (e["event"], e["t_mono_ns"], e["detected_mono_ns"]) for e in direct[1]]

    same()


def judge_at(case: Case) -> tuple[dict, list[dict]]:
    """The reducers fed directly, the stream from the Summarizer's attach."""
    from tests.step_streams import _feed

    fed = stream(case, START_NS)
    ledger, events, _ = _feed(fed, START_NS, None, None, attach_only=True)
    return ledger, events


def test_the_issues_shapes() -> None:
    # Issue 38, a job at 72.5 ms slowed to 117.6 ms for 40 s, back at 75.5 ms: the fall is
    # news within the rise's delay, and the episode closes.
    from tests.step_streams import Segment, check

    case = Case("slowdowns", 0.0725, 0.03, 7, 0.5,
                [Segment(40, 1.0), Segment(40, 117.6 / 72.5), Segment(30, 75.5 / 72.5)])
    judged = judge(case)
    kinds = [e["event"] for e in judged.events]
    assert kinds == ["fail_slow", "recovered_partly"], judged.events
    fall_s = (judged.fed.first_end_ns / 1e9) + 80
    assert judged.events[1]["detected_mono_ns"] / 1e9 - fall_s <= 15
    assert judged.events[1]["vs_baseline_pct"] == pytest.approx(4.1, abs=1.5)
    assert not check(case, judged).failures
