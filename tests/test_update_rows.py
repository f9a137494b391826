"""Which marker ends an update (perfmon.agent.reducers.steps.StepRows), on generated
jobs with stated truth: torch.optim's marker with or without clipping's gradient read
before it, updates found only by their first gradient read, updates no probe sees
(with and without --microbatches), any number of backward passes per update, and an
attach anywhere in the stream. And the cross-check of the measured count against the
job's own counter (perfmon.agent.reducers.iterations.JobNumbering.disagreement).
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from perfmon.agent.reducers.iterations import IterationClock
from perfmon.agent.reducers.steps import StepRows
from perfmon.parsers.step_rows import decode_steps
from perfmon.parsers.workload import Workload

PID = 7


def _marker(t: int, kind: str, name: str = "") -> dict[str, Any]:
    return {"type": "marker", "t_mono_ns": t, "pid": PID, "tid": PID, "kind": kind,
            "name": name}


def _job(updates: list[int], shape: str, clip: bool) -> tuple[list[dict[str, Any]], list[int]]:
    """The markers of a job making ``len(updates)`` updates of ``updates[i]`` backward
    passes each, and each update's boundary as the probes would see it (the marker, the
    first gradient read, or the last backward pass's return)."""
    t, out, bounds = 1_000, [], []
    for k in updates:
        for _ in range(k):
            t += 100  # forward
            out.append(_marker(t, "backward_enter"))
            t += 200
            out.append(_marker(t, "backward_exit"))
        last_exit = t
        t += 10
        if shape == "optim":
            if clip:  # clip_grad_norm_ reads the gradients before the step
                out.append(_marker(t, "grad_read"))
                t += 5
            out.append(_marker(t, "optimizer_step", "Optimizer.step#SGD.step"))
            bounds.append(t)
        elif shape == "grad_read":
            out.append(_marker(t, "grad_read"))
            bounds.append(t)
        else:  # no probe sees the update
            bounds.append(last_exit)
        t += 50  # the update itself
    return out, bounds


def _ends(markers: list[dict[str, Any]], start: int, declared: int | None) -> list[int]:
    rows = StepRows(start, declared)
    for m in markers:
        rows.feed(m)
    steps = rows.take()
    if steps is None:
        return []
    block = decode_steps(steps.to_record())
    return block.end_ns.tolist()


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 4), n=st.integers(3, 30), shape=st.sampled_from(["optim", "grad_read"]),
       clip=st.booleans(), cut=st.integers(0, 400))
def test_one_end_per_update_at_its_boundary(k, n, shape, clip, cut):
    markers, bounds = _job([k] * n, shape, clip)
    start = markers[0]["t_mono_ns"] + cut * 7  # attach anywhere in the first updates
    ends = _ends(markers, start, None)
    # Every boundary after the attach is an end, but the last update found by a gradient
    # read: its end waits for the next backward pass (none comes).
    expected = [b for b in bounds if b >= start]
    if shape == "grad_read":
        expected = expected[:-1]
    # A boundary whose update began before the attach may be missed (its backward passes
    # were not seen), never doubled.
    assert ends == expected or ends == expected[1:]


@settings(max_examples=200, deadline=None)
@given(ks=st.lists(st.integers(1, 4), min_size=3, max_size=20), clip=st.booleans())
def test_backward_passes_per_update_may_vary(ks, clip):
    for shape in ("optim", "grad_read"):
        markers, bounds = _job(ks, shape, clip)
        ends = _ends(markers, 0, None)
        assert ends == (bounds if shape == "optim" else bounds[:-1])


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 4), n=st.integers(3, 20), declared=st.one_of(st.none(),
                                                                       st.integers(1, 4)))
def test_updates_no_probe_sees_end_only_at_the_declared_count(k, n, declared):
    markers, bounds = _job([k] * n, "none", False)
    ends = _ends(markers, 0, declared)
    if declared is None:
        assert ends == []
    elif declared == k:
        assert ends == bounds  # the last backward pass's return of each update
    else:  # a wrong declaration counts wrong: ends every `declared` backward passes
        assert len(ends) == (n * k) // declared


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 4), n=st.integers(3, 20), declared=st.integers(1, 4),
       shape=st.sampled_from(["optim", "grad_read"]), clip=st.booleans())
def test_a_seen_update_keeps_its_own_clock_whatever_was_declared(k, n, declared, shape, clip):
    markers, bounds = _job([k] * n, shape, clip)
    ends = _ends(markers, 0, declared)
    seen = bounds if shape == "optim" else bounds[:-1]
    if declared > k:  # the first update's own end comes first: the declaration never acts
        assert ends == seen
    else:  # declared ends in the first update only (the window's opening), then its own
        assert [e for e in ends if e > seen[0]] == seen[1:]
        assert 1 <= len([e for e in ends if e <= seen[0]]) <= k // declared + 1


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
