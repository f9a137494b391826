"""Which marker ends an update (perfmon.agent.reducers.steps.StepRows), on generated
jobs with stated truth: torch.optim's marker with or without clipping's gradient read
before it, updates found only by their first gradient read, updates no probe sees
(with and without --microbatches), any number of backward passes per update, and an
attach anywhere in the stream. And each row's collective waits, measured only where the
wait probes were on for its whole iteration.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from perfmon.agent.reducers.ranks import RankTimes
from perfmon.agent.reducers.steps import HOLD_NS, StepRows

PID = 7
MS = 1_000_000


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
        elif shape == "grad_read":  # (ended at the update's last backward return)
            out.append(_marker(t, "grad_read"))
            bounds.append(last_exit)
        else:  # no probe sees the update
            bounds.append(last_exit)
        t += 50  # the update itself
    return out, bounds


def _ends(markers: list[dict[str, Any]], start: int, declared: int | None) -> list[int]:
    rows = StepRows(start, declared)
    for m in markers:
        rows.feed(m)
    block = rows.take(final=True)
    if block is None:
        return []
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


def _rank_marker(t: int, pid: int, kind: str, tid: int | None = None) -> dict:
    return {"type": "marker", "t_mono_ns": t, "pid": pid, "tid": tid or pid, "kind": kind,
            "name": ""}


def test_rows_outside_the_probed_windows_have_their_wait_unmeasured_and_the_means_skip_them():
    # The probes on from attach, off from 150 ms, on again from 250 ms: only rows whose
    # whole iteration lies inside a window have a wait; the totals carry on across.
    rows = StepRows(0)

    def step(t_ms: int, total_ms: int) -> None:
        rows.feed({"type": "waits", "t_mono_ns": t_ms * MS, "pid": 1,
                   "wait_ns": total_ms * MS, "waits": total_ms})
        rows.feed(_rank_marker(t_ms * MS, 1, "optimizer_step"))

    step(0, 0)
    step(100, 10)
    rows.waits_probed(False, 150 * MS)
    step(200, 20)  # partly off
    rows.waits_probed(True, 250 * MS)
    step(300, 20)  # its start before the probes were back
    step(400, 30)
    block = rows.take()
    assert block is not None
    assert block.waits.tolist() == [0, 10, -1, -1, 10]
    assert block.wait_ns.tolist() == [0, 10 * MS, 0, 0, 10 * MS]
    assert rows.probed_rows == 2 and list(rows.recent) == [(100 * MS, 10), (100 * MS, 10)]

    # The ranks' means of wait and compute are over the probed rows; steps over all.
    ranks = RankTimes({1: 0}, 1, 0, str)
    ranks.on_rows(block)
    (means,) = ranks.interval(400 * MS)
    assert means.iterations == 4 and means.waits_probed == 2
    assert means.step_s == pytest.approx(0.1) and means.wait_s == pytest.approx(0.01)
    assert means.compute_s == pytest.approx(0.09) and means.wait_share == 0.1
    assert ranks.all()[0].recent == [(100 * MS, 100 * MS, 10 * MS), (400 * MS, 100 * MS, 10 * MS)]


def _micro_batches(t: int, micro: int, step_ms: int) -> tuple[list[dict[str, Any]], int]:
    """A pipeline stage's step: each micro-batch's backward, then a read of its input's
    gradient (sent back to the previous stage); ``t`` after it."""
    out, q = [], step_ms * MS // (2 * micro)
    for _ in range(micro):
        out += [_marker(t, "backward_enter"), _marker(t + q // 2, "backward_exit"),
                _marker(t + q, "grad_read")]
        t += 2 * q
    return out, t


@pytest.mark.parametrize("step_ms", [20, 400, 4000])
def test_gradient_reads_inside_a_pipelines_steps_end_no_iteration(step_ms):
    # Reads between micro-batches look like updates until the step's Optimizer.step:
    # held, then dropped; every end is a step's.
    rows, t, steps = StepRows(0), 0, []
    for _ in range(5):
        markers, t = _micro_batches(t, 8, step_ms)
        for m in [*markers, _marker(t, "optimizer_step", "Optimizer.step#SGD.step")]:
            rows.feed(m)
        steps.append(t)
        t += MS
    block = rows.take(final=True)
    assert block is not None and block.end_ns.tolist() == steps


def test_a_hand_written_updates_gradient_read_ends_stand_from_the_first():
    # No Optimizer.step within HOLD_NS: the held ends stand, the first one included,
    # once they have waited (or at the window's end).
    rows, t, ends = StepRows(0), 0, []
    while t < HOLD_NS + 2_000 * MS:
        markers, t = _micro_batches(t, 1, 100)
        for m in markers:
            rows.feed(m)
        ends.append(markers[1]["t_mono_ns"])  # (at its backward's return)
    taken = rows.take()
    assert taken is not None and taken.end_ns.tolist() == ends[:-1]  # (the last: unconfirmed)
    assert rows.take(final=True) is None
