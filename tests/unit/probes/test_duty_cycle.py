"""perfmon.probes.duty_cycle: a probe attached for a sample, detached for the rest."""

from __future__ import annotations

from perfmon.probes import duty_cycle
from perfmon.probes.duty_cycle import DutyCycle


def test_a_probe_is_attached_after_the_rest_and_detached_once_the_sample_is_whole():
    switches: list[bool] = []
    cycle = DutyCycle(switches.append, on=False)
    assert cycle.cycle(4, sample_whole=True, rest=5) is None  # (4 of 5 rested)
    assert cycle.cycle(5, sample_whole=False, rest=5) is True
    assert cycle.on and cycle.on_since_ns is not None and cycle.begun == 1
    assert cycle.cycle(6, sample_whole=False, rest=5) is None
    assert cycle.cycle(7, sample_whole=True, rest=5) is False
    assert not cycle.on and cycle.on_since_ns is None and cycle.ended == 1
    assert cycle.cycle(11, sample_whole=True, rest=5) is None  # the rest counts from 7
    assert cycle.cycle(12, sample_whole=True, rest=5) is True
    assert switches == [True, False, True]


def test_switching_outside_the_cycle_counts_no_sample():
    switches: list[bool] = []
    cycle = DutyCycle(switches.append, on=True)
    assert cycle.on_since_ns is None  # (on from the start)
    assert cycle.cycle(3, sample_whole=True, rest=0) is False
    cycle.switch(True, 3)
    assert switches == [False, True] and (cycle.begun, cycle.ended) == (0, 1)


def test_an_attach_is_timed_after_the_probe_is_on_and_a_detach_before_it_is_off(
        monkeypatch):
    clock = iter(range(100, 200))
    monkeypatch.setattr(duty_cycle, "monotonic_ns", lambda: next(clock))
    events: list[tuple[bool, int]] = []
    cycle = DutyCycle(lambda on: events.append((on, next(clock))), on=False)
    cycle.cycle(0, sample_whole=False, rest=0)
    attached_at = cycle.switched_ns
    cycle.cycle(1, sample_whole=True, rest=0)
    detached_at = cycle.switched_ns
    assert attached_at is not None and detached_at is not None
    (on, t_on), (off, t_off) = events
    assert on and not off and t_on < attached_at < detached_at < t_off
