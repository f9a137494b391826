"""The iteration clock (perfmon.agent.reducers.iterations): the cross-check of the measured
count against the job's own counter (JobNumbering.disagreement), on generated jobs with
stated truth."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from perfmon.agent.reducers.iterations import IterationClock
from perfmon.parsers.workload import Workload

PID = 7


@settings(max_examples=300, deadline=None)
@given(n=st.integers(40, 200), period_us=st.integers(500, 50_000),
       fault=st.sampled_from(["none", "split", "missed"]), every=st.integers(2, 5),
       reads=st.lists(st.floats(0.05, 0.95), min_size=2, max_size=8),
       read_ms=st.floats(0.05, 10), lag=st.floats(0.001, 0.9))
def test_the_jobs_counter_disagrees_only_when_ends_were_split_or_missed(
        n, period_us, fault, every, reads, read_ms, lag):
    """The job counts its updates (its counter goes up ``lag`` of a step after each
    boundary, as a loop that counts after its logging does); our
    clock ends each one (none), also mid-way through every ``every``-th (split), or
    misses every ``every``-th (missed). Reads of the counter at any times, each taking
    ``read_ms``: disagreement 0 when the counts agree; when they drift by more than a
    couple between the first read and the last, it is seen."""
    period = period_us * 1000
    clock = IterationClock(Workload(), PID, 0)
    bounds = [(i + 1) * period for i in range(n)]
    ends = []
    for i, b in enumerate(bounds):
        if fault == "split" and i % every == 0:
            ends.append(b - period // 2)
        if not (fault == "missed" and i % every == 1):
            ends.append(b)
    at = sorted(int(f * n * period) for f in reads)
    window = int(read_ms * 1e6)
    for t in at:
        value = sum(1 for b in bounds if b + int(lag * period) <= t)
        clock.job.on_read({"t_mono_ns": t, "end_mono_ns": t + window, "value": value,
                           "name": "iteration"})
    for end in ends:
        clock.on_row(end, 1, "grad_read")
    clock.job.resolve(None)
    drift = sum(1 for e in ends if at[0] < e <= at[-1]) - sum(
        1 for b in bounds if at[0] < b <= at[-1])
    if fault == "none":
        assert clock.job.disagreement == 0
    elif abs(drift) >= 3 + 2 * window // period:
        assert clock.job.disagreement > 0


def test_a_counter_that_disagrees_with_the_optimizer_marker_is_no_loss():
    """HF Trainer's local ``step`` counts micro-batches: against iterations ended by the
    Optimizer.step marker it drifts, and that says the counter is no update counter,
    not that an update was missed; against gradient-read ends the same drift is a loss."""
    period = 10_000_000
    for how, expected in (("uprobe", False), ("grad_read", True)):
        clock = IterationClock(Workload(), PID, 0)
        for i, t in enumerate((5 * period, 40 * period)):
            clock.job.on_read({"t_mono_ns": t + period // 2, "end_mono_ns": t + period // 2 + 1000,
                               "value": 2 * (5 + 35 * i), "name": "step"})
        for k in range(1, 60):
            clock.on_row(k * period, 2, how)
        clock.job.resolve(None)
        assert (clock.quality()["counter_disagrees"] > 0) == expected


def test_a_counter_below_our_count_numbers_nothing_below_one():
    """Our count split the job's updates (gradients read between micro-batches): the
    job's counter reads fewer than we counted, an offset below 0, which would number
    our first iterations 0 or less; the numbering starts at 1 (the split is a loss)."""
    period = 10_000_000
    clock = IterationClock(Workload(), PID, 0)
    for k in range(1, 41):
        clock.on_row(k * period, 1, "grad_read")
    clock.job.on_read({"t_mono_ns": 40 * period + period * 3 // 4,
                       "end_mono_ns": 40 * period + period * 3 // 4 + 1000, "value": 20,
                       "name": "iteration"})
    clock.job.resolve(None)
    assert clock.job.offset == 0
