"""A busy main thread is told from an idle one by the CPU it wants, whatever the node's
load: ``Snapshot.busy`` on generated schedstat readings (its time on a CPU and its time
runnable, waiting for one), the process given any share of what it asks for."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from perfmon.probes import discovery
from perfmon.probes.discovery import BUSY_SHARE, ProcessInfo, Snapshot, _Known

PID = 5_000_000  # no process has it (pid_max is at most 4194304): nothing of /proc is read


@given(wants=st.floats(0, 1), gets=st.floats(0.01, 1), window_s=st.floats(0.2, 10))
def test_a_main_thread_is_busy_when_it_wants_the_busy_share_whatever_it_is_given(
        wants: float, gets: float, window_s: float) -> None:
    """A thread that wants ``wants`` of a core on a node that gives it ``gets`` of what it
    wants runs ``wants * gets`` and waits in the run queue ``wants * (1 - gets)`` of the
    window (the rest it sleeps). Seen as busy by the CPU time alone, a rank that trains
    on a node with a load of 8 on 2 cores (given a quarter) read as idle and its
    children as the ranks."""
    if abs(wants - BUSY_SHARE) < 1e-6:
        return  # (the boundary itself: rounding says either)
    info = ProcessInfo(PID, 1, PID, "python", 1000)
    scan = Snapshot({PID: info}, _known={info.key: _Known(python=True, torch=True)})
    clock = iter([100.0, 100.0 + window_s])
    run_ns = wait_ns = 0
    readings = []
    for _ in range(2):
        readings.append(f"{run_ns} {wait_ns} 7\n".encode())
        run_ns += int(wants * gets * window_s * 1e9)
        wait_ns += int(wants * (1 - gets) * window_s * 1e9)
    feed = iter(readings)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(discovery, "_read", lambda path, limit: next(feed))
        mp.setattr(discovery.time, "clock_gettime", lambda clock_id: next(clock))
        assert scan.busy(PID, since_s=0) is None  # (the first look: no window yet)
        assert scan.busy(PID, since_s=0) is (wants > BUSY_SHARE)
