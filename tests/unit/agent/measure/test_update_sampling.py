"""UpdateSampling (perfmon.agent.measure.update_sampling): it learns how many backward passes
an update takes, counts them with the gradient-read probe detached, and checks again;
on generated jobs with stated truth."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from perfmon.agent.reducers.steps import LEARN_UPDATES, StepRows

PID = 7


def _marker(t: int, kind: str, name: str = "") -> dict[str, Any]:
    return {"type": "marker", "t_mono_ns": t, "pid": PID, "tid": PID, "kind": kind,
            "name": name}


class _FakeGradProbe:
    """The marker probe's gradient-read switch, as UpdateSampling drives it: reads are
    delivered only while the probe is on."""

    def __init__(self) -> None:
        self.grad_read_pids = {PID}
        self.grad_reads_on = {PID}
        self.switches = 0

    def set_grad_reads(self, pid: int, on: bool) -> None:
        if on != (pid in self.grad_reads_on):
            self.switches += 1
            (self.grad_reads_on.add if on else self.grad_reads_on.discard)(pid)


@settings(max_examples=150, deadline=None)
@given(k1=st.integers(1, 4), k2=st.integers(1, 4), n=st.integers(60, 400),
       change_at=st.integers(0, 399), step_ms=st.integers(5, 400),
       polls=st.lists(st.integers(0, 2), min_size=8, max_size=8))
def test_counted_updates_stay_one_end_each_and_a_changed_count_is_found(
        k1, k2, n, change_at, step_ms, polls):
    """A job of ``n`` updates of ``k1`` backward passes, ``k2`` from update
    ``change_at`` on; the session's UpdateSampling learns K, counts, detaches the probe
    and checks K again every RECHECK_S. Every update ends once, in the gap between its
    last backward pass and the next update's first, except those between a change of K
    and the check that finds it."""
    from perfmon.agent.measure.update_sampling import CONFIRM, RECHECK_S, UpdateSampling

    rows = StepRows(0)
    probe = _FakeGradProbe()
    sampling = UpdateSampling(rows, probe)
    step = step_ms * 1_000_000
    gaps = []  # (from the last backward return, to the next update's first entry)
    t = 0
    for i in range(n):
        k = k2 if i >= change_at else k1
        q = step // (2 * k + 2)  # forward, backward, ..., then the update
        for b in range(k):
            enter = t + (2 * b + 1) * q
            if gaps and gaps[-1][1] is None:
                gaps[-1] = (gaps[-1][0], enter)
            rows.feed(_marker(enter, "backward_enter"))
            rows.feed(_marker(enter + q, "backward_exit"))
        gaps.append((enter + q, None))
        # The session looks at the rows after the update's backward passes, after its
        # read, or after both (the read, sent while the probe was on, is then in flight).
        read = PID in probe.grad_reads_on
        when = polls[i % len(polls)]
        if when == 0:
            sampling.schedule(t + step - 1)
        if read:
            rows.feed(_marker(enter + q + q // 2, "grad_read"))
        t += step
        if when != 0:
            sampling.schedule(t)
    ends = []
    steps = rows.take(final=True)  # (the stream's end: rows held stand)
    if steps is not None:
        ends = steps.end_ns.tolist()
    closed = [(a, b) for a, b in gaps if b is not None]
    per_update = [sum(1 for e in ends if a <= e <= b) for a, b in closed]
    # Wrong only from the change until a check finds it (and K is learnt again).
    recheck_updates = int(RECHECK_S * 1e9 // step) + 2
    late = change_at + recheck_updates + LEARN_UPDATES + 2 if k1 != k2 else n
    wrong = [i for i, c in enumerate(per_update) if c != 1 and not change_at <= i < late]
    assert wrong in ([], [0]), (wrong[:5], per_update[:20])
    # Every end lies in some update's gap: never mid-update, unless K changed unseen.
    if k1 == k2:
        assert all(c == 1 for c in per_update[1:])
        assert sampling.counted == 1 and sampling.changes == 0
        # (a check attaches the probe for CONFIRM reads, and one that only syncs)
        period = RECHECK_S * 1e9 + (CONFIRM + 2) * step
        assert (n - LEARN_UPDATES - 2) * step / period - 1 <= sampling.rechecks <= (
            n * step / (RECHECK_S * 1e9))
    elif LEARN_UPDATES + 2 < change_at and late < n:  # (K1 learnt first) found, learnt again
        assert sampling.changes == 1 and sampling.counted == 2
