"""PySpySampler and dump_stacks on real tests/targets/train_gpt.py processes,
checked against the timestamps the target writes itself (CLOCK_MONOTONIC, just
before optimizer.step()). (Joining windows' samples: tests/unit/probes/test_pyspy.py.)"""

from __future__ import annotations

import bisect
import os
import shutil
import statistics
import subprocess
import time
from itertools import pairwise
from pathlib import Path

import psutil
import pytest
from perfmon.parsers.pyspy import StackSample
from perfmon.parsers.stack_analysis import (
    IterationDetector,
    innermost_common_frame,
    iteration_from_locals,
    main_thread,
    mean_step_time_ns,
    phase_durations_ns,
)
from perfmon.probes.errors import PrerequisiteMissing, PrivilegeError, UnsuitableTarget
from perfmon.probes.pyspy import PySpySampler, dump_stacks, find_pyspy

from tests.conftest import wait_for

# Sampling sees an iteration only if both the optimizer step and the rest of
# the iteration span several sampling periods (P(miss) = exp(-rate * seconds)):
# ~120 ms of AdamW and ~150 ms of forward and backward here on an idle core.
LONG_STEP_ARGS = ("--hidden-size", "768", "--num-layers", "4", "--micro-batch-size", "1")


def _sample_for(sampler: PySpySampler, seconds: float) -> list[StackSample]:
    samples: list[StackSample] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        samples += sampler.poll()
        time.sleep(0.1)  # the session's poll interval
    return samples


def _pyspy_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.name() == "py-spy"]


@pytest.mark.long(reason="~60 steps of a job of long steps, sampled: longer on a busy machine")
def test_mean_step_time_from_samples_matches_the_targets_own_timestamps(start_target):
    target = start_target(*LONG_STEP_ARGS)
    # ~60 steps (16 s on a quiet machine; longer at a busier one's pace), so one step
    # missed or split by sampling keeps the mean within 2%.
    with PySpySampler([target.pid]) as sampler:
        samples = _sample_for(sampler, max(16.0, 60 * target.step_s()))
    boundaries = IterationDetector().feed(samples)
    assert sampler.lost_windows == 0 and sampler.gaps == 0, sampler.last_error
    assert {s.tid for s in samples} == {target.pid}  # py-spy's thread id mapped to the kernel's
    stamps = [t for _, t in target.timestamps()]
    # Each boundary belongs to the latest step stamped before it (allowing for
    # the ms-scale error of the window's clock origin).
    matched = [bisect.bisect_right(stamps, b.t_mono_ns + 20_000_000) - 1 for b in boundaries]
    lag_ms = [(b.t_mono_ns - stamps[k]) / 1e6 for b, k in zip(boundaries, matched, strict=True)]
    assert -20 < statistics.median(lag_ms) < 40, lag_ms
    assert len(boundaries) >= 6
    # The truth over the same span: every step the target stamped between the
    # first and the last boundary, so a missed or doubled boundary shows.
    truth_ns = (stamps[matched[-1]] - stamps[matched[0]]) / (matched[-1] - matched[0])
    measured_ns = mean_step_time_ns(boundaries)
    assert measured_ns is not None
    assert abs(measured_ns - truth_ns) / truth_ns < 0.02, (measured_ns, truth_ns)


def test_slow_data_loader_is_the_largest_phase_only_in_the_job_that_has_it(start_target):
    slow = start_target("--data-delay-ms", "30")
    fast = start_target()
    with PySpySampler([slow.pid, fast.pid]) as sampler:
        samples = _sample_for(sampler, 3.5)
    shares = {}
    for target in (slow, fast):
        durations = phase_durations_ns(s for s in samples if s.tid == target.pid)
        total = sum(durations.values())
        shares[target.pid] = {phase: d / total for phase, d in durations.items()}
        assert abs(sum(shares[target.pid].values()) - 1) < 0.01
    assert max(shares[slow.pid], key=lambda p: shares[slow.pid][p]) == "data_loading", shares
    assert shares[fast.pid]["data_loading"] < 0.2, shares
    # Each thread's samples tile the time they cover: no window overlap survives.
    for pid in (slow.pid, fast.pid):
        mine = [s for s in samples if (s.pid, s.tid) == (pid, pid)]
        assert all(a.t_mono_ns + a.duration_ns <= b.t_mono_ns for a, b in pairwise(mine))


def test_iteration_number_from_locals_matches_the_targets_own(start_target):
    target = start_target("--hidden-size", "256", "--num-layers", "4")
    before = target.timestamps()[-1][0]
    threads = dump_stacks(target.pid, locals_=True)
    after = target.timestamps()[-1][0]
    iteration = iteration_from_locals(threads)
    # The target stamps iteration i + 1 before optimizer.step() and increments
    # its local `iteration` after it.
    assert iteration is not None and before - 1 <= iteration <= after
    assert abs(iteration - after) <= 1


def test_stalled_ranks_share_the_stalled_function_as_innermost_frame(start_target):
    ranks = [start_target("--stall-at", "2", warm_iterations=0) for _ in range(2)]
    for rank in ranks:
        rank.wait_for_iterations(2)

    def stalled_mains():
        mains = [main_thread(dump_stacks(r.pid)) for r in ranks]
        stalled = all(m and m.frames[0].function == "deliberately_stalled_collective"
                      for m in mains)
        return [m.frames for m in mains if m] if stalled else None

    stacks = wait_for(stalled_mains, timeout_s=15, what="both ranks to stall")
    common = innermost_common_frame(stacks)
    assert common is not None and common.function == "deliberately_stalled_collective"
    assert common.file.endswith("tests/targets/train_gpt.py")


def test_exit_of_the_target_ends_sampling_without_failure(start_target):
    target = start_target("--train-iters", "60")
    sampler = PySpySampler([target.pid])
    sampler.start()
    samples = []
    try:
        deadline = time.monotonic() + 20
        while not sampler.ended_pids and time.monotonic() < deadline:
            samples += sampler.poll()
            time.sleep(0.1)
        assert sampler.ended_pids == [target.pid]
        assert sampler.lost_windows == 0, sampler.last_error
        assert samples and sampler.samples_total > 0
    finally:
        sampler.close()


def test_close_kills_and_reaps_pyspy_and_is_idempotent(steady_target):
    target = steady_target
    sampler = PySpySampler([target.pid], window_s=0.5)
    sampler.start()
    _sample_for(sampler, 1.2)
    assert _pyspy_children()  # a window is running
    sampler.close()
    sampler.close()
    assert _pyspy_children() == []
    assert sampler.poll() == []


def test_the_burst_in_flight_when_sampling_settles_is_read_and_none_follows(steady_target):
    target = steady_target
    sampler = PySpySampler([target.pid])
    sampler.set_duty(0.1)  # one 1 s burst every 10 s
    sampler.start()
    try:
        samples: list[StackSample] = []
        wait_for(lambda: samples.extend(sampler.poll()) or sampler.sampling_pids,
                 timeout_s=20, what="py-spy to sample")
        samples += _sample_for(sampler, 0.4)
        assert samples == []  # (a window's samples come when it ends)
        settled_at = time.monotonic_ns()
        sampler.settle()
        samples = sampler.poll()
        assert samples and sampler.lost_windows == 0, sampler.last_error
        assert max(s.t_mono_ns + s.duration_ns for s in samples) > settled_at - 200_000_000
        windows = sampler.take_windows()  # the one window: started, then its samples in
        start = windows[0][1]
        assert windows == [(target.pid, start, False), (target.pid, start, True)]
        assert start <= min(s.t_mono_ns for s in samples)
        assert _sample_for(sampler, 0.5) == [] and _pyspy_children() == []
    finally:
        sampler.close()


def test_quiet_is_false_near_every_window_launch_and_true_between(steady_target):
    target = steady_target
    polls: list[tuple[int, bool]] = []
    launches: list[int] = []
    with PySpySampler([target.pid]) as sampler:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            sampler.poll()
            launches += [start for _, start, samples_in in sampler.take_windows()
                         if not samples_in]
            now = time.monotonic_ns()
            polls.append((now, sampler.quiet(now)))
            time.sleep(0.05)
    margin = sampler.window_ns // 4
    assert len(launches) >= 4
    near = [(t, q) for t, q in polls if any(-margin <= t - s < margin for s in launches)]
    assert near and not any(q for _, q in near), near
    # every 1 s window leaves a quiet stretch once it samples
    quiet_windows = {bisect.bisect(launches, t) for t, q in polls if q}
    assert len(quiet_windows) >= len(launches) - 2, (launches, polls)


def test_missing_pyspy_binary_says_how_to_install_it():
    sampler = PySpySampler([os.getpid()], executable="/nonexistent/py-spy")
    with pytest.raises(PrerequisiteMissing, match="pip install py-spy"):
        sampler.start()
    sampler.close()


def test_a_process_without_python_is_unsuitable(tmp_path: Path):
    proc = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(UnsuitableTarget, match=f"pid {proc.pid}"):
            dump_stacks(proc.pid)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to run py-spy as another user")
def test_no_ptrace_permission_names_cap_sys_ptrace(tmp_path: Path):
    # The real py-spy, run as nobody against this (root-owned) Python process.
    wrapper = tmp_path / "py-spy-as-nobody"
    wrapper.write_text(
        "#!/bin/sh\nexec setpriv --reuid=65534 --regid=65534 --clear-groups "
        f'{find_pyspy()} "$@"\n'
    )
    wrapper.chmod(0o755)
    with pytest.raises(PrivilegeError, match=r"CAP_SYS_PTRACE.*ptrace_scope"):
        dump_stacks(os.getpid(), executable=str(wrapper))
