"""PhaseAccount (perfmon.agent.reducers.phases): where a window's time goes, from stack
samples and the exact backward time."""

from __future__ import annotations

MS = 1_000_000


def test_a_burst_that_saw_only_backward_gives_its_window_no_phases():
    from perfmon.agent.reducers.phases import PhaseAccount

    for bursts in (True, False):
        phases = PhaseAccount(bursts=bursts)
        phases.add_backward(100 * MS, 50 * MS)  # the iteration's backward(): 40..90 ms
        phases.add_span(50 * MS, 60 * MS, "backward")  # the burst: inside backward only
        window = phases.window_ns(0, 100 * MS)
        if bursts:  # the other 50 ms are not known to be "other"
            assert window is None
        else:  # continuous sampling saw no other phase: the rest is "other"
            assert window == {"data_loading": 0, "forward": 0, "backward": 50 * MS,
                              "optimizer": 0, "other": 50 * MS}
        phases.add_span(0, 30 * MS, "data_loading")  # a sample outside backward: shared out
        assert phases.window_ns(0, 100 * MS) == {"data_loading": 50 * MS, "forward": 0,
                                                 "backward": 50 * MS, "optimizer": 0,
                                                 "other": 0}
