"""PySpySampler (perfmon.probes.pyspy) on samples given to it, no py-spy run (on real py-spy
and real jobs: tests/e2e/test_pyspy_sampler.py)."""

from __future__ import annotations

from perfmon.parsers.pyspy import Frame, StackSample
from perfmon.probes.pyspy import PySpySampler
from perfmon.probes.pyspy_windows import Lane


def test_at_a_window_join_the_stack_seen_later_reaches_over_the_stop():
    # As recorded in CI (times in ms): the old window saw backward, then Adam from 100 on,
    # and was stopped at 110; the new window had sampled once at 20 (backward) and next at
    # 160, so its backward "stood" over the stop, inside the optimizer step.
    def stack(t_ms: float, dur_ms: float, function: str, tid: int = 7) -> StackSample:
        return StackSample(int(t_ms * 1e6), 7, tid, (Frame(function, "train.py", 1),),
                           int(dur_ms * 1e6))

    sampler, lane = PySpySampler([7]), Lane(7, {})
    old = [stack(0, 100, "backward"), stack(100, 30, "Adam.step"), stack(0, 130, "worker", 8)]
    kept = sampler._join(lane, old, stop_ns=110_000_000)
    assert [(s.t_mono_ns, s.duration_ns) for s in kept] == [
        (0, 100_000_000), (100_000_000, 10_000_000), (0, 110_000_000)]
    new = [stack(20, 140, "backward"), stack(160, 50, "forward"), stack(10, 200, "worker", 8),
           stack(105, 100, "Adam.step", 9)]
    joined = {(s.tid, s.t_mono_ns / 1e6, s.duration_ns / 1e6, s.frames[0].function)
              for s in sampler._join(lane, new, stop_ns=None)}
    assert joined == {
        (7, 110, 50, "Adam.step"),  # the old window saw it after the new one saw backward
        (7, 160, 50, "forward"),
        (8, 110, 100, "worker"),  # the same stack either way
        (9, 110, 95, "Adam.step"),  # a thread the old window never saw
    }
    assert sampler.gaps == 0
