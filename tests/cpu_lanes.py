"""The tests that judge a job's timing get the CPU they ask for, while the rest of the
suite runs beside them (pytest-xdist).

On a 2-core machine the suite's jobs and agents, four workers at a time, make a load of
8-9: a job whose pace a test judges against its own clock (fail-slow, goodput,
stragglers, sampled steps) was starved past the test's margins beside them, and run
after the rest, one at a time, those files made the suite's second half (17 of 29
minutes), mostly waiting. So each of those files runs in a *lane*:

- one file of a lane at a time, across the workers (a lock file per lane and run); the
  lanes run beside each other and beside the rest;
- while it runs, its worker is in a cgroup of its lane with a CPU weight far above the
  rest's (cgroup v1 ``cpu.shares`` or v2 ``cpu.weight``), and so is every process its
  tests start (they inherit it): the scheduler gives them the CPU they want at once,
  and the rest of the suite what they leave. A training node gives its jobs their
  cores the same way (a job's own cgroup); the other tests' load is not what these
  tests judge (those that judge the agent under load make their own).

``paced``: the long scenarios of jobs that stand for GPU jobs (their steps mostly wait,
tests.conftest.DEVICE_JOB), whose judgements are of the pace itself: the highest
weight. ``timing``: the other files that judge timing. Where no cgroup can be made
(no cpu controller), the lanes still take turns and the run says once that their
weight is not set.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path

import pytest

LANES = {
    "paced": frozenset({"test_fail_slow.py", "test_goodput_jobs.py"}),
    "timing": frozenset({
        "test_pipeline.py", "test_stragglers.py", "test_update_clocks.py",
        "test_pyspy_bounds.py", "test_service_memory.py", "test_attach_stacks.py",
        "test_pyspy_sampler.py", "test_cuda_probe.py", "test_collective_waits.py",
        "test_multihost.py", "test_attach_gpu.py"}),
}
# (cgroup v1 cpu.shares, v2 cpu.weight) of each lane; a process outside is 1024 or 100
WEIGHTS = {"paced": (262144, 10000), "timing": (65536, 2500)}
V1_CPU = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


def lane_of(item: pytest.Item) -> str | None:
    if item.path.parent.name != "e2e":
        return None
    return next((lane for lane, files in LANES.items() if item.path.name in files), None)


def _run_id(config: pytest.Config) -> str:
    """This run's id, the same in the controller and its workers (pytest-xdist's, which
    the controller sets before it starts them)."""
    if hasattr(config, "workerinput"):
        return os.environ["PYTEST_XDIST_TESTRUNUID"][:16]
    if config.pluginmanager.hasplugin("xdist"):
        if getattr(config.option, "testrunuid", None) is None:
            config.option.testrunuid = uuid.uuid4().hex
        return str(config.option.testrunuid)[:16]
    return f"solo{os.getpid()}"


class _Cgroups:
    """One cgroup per lane for this run; moves this process in and back out."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.v1 = (V1_CPU / "cpu.shares").exists()
        self.root = V1_CPU if self.v1 else V2_ROOT
        self.made: dict[str, Path] = {}
        self.home: Path | None = None
        self.why_not: str | None = None

    def _own(self) -> Path:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if (self.v1 and "cpu" in controllers.split(",")) or (
                    not self.v1 and controllers == ""):
                return self.root / path.lstrip("/")
        raise OSError("no cpu cgroup in /proc/self/cgroup")

    def _lane(self, lane: str) -> Path:
        if lane not in self.made:
            if not self.v1:
                control = V2_ROOT / "cgroup.subtree_control"
                if "cpu" not in control.read_text().split():
                    control.write_text("+cpu")
            group = self.root / f"perfmon-tests-{self.run_id}-{lane}"
            group.mkdir(exist_ok=True)
            shares, weight = WEIGHTS[lane]
            if self.v1:
                (group / "cpu.shares").write_text(str(shares))
            else:
                (group / "cpu.weight").write_text(str(weight))
            self.made[lane] = group
        return self.made[lane]

    def enter(self, lane: str) -> None:
        if self.why_not is not None:
            return
        try:
            self.home = self.home or self._own()
            (self._lane(lane) / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as err:
            self.why_not = f"{err.strerror or err} ({err.filename or self.root})"

    def leave(self) -> None:
        if self.home is not None and self.why_not is None:
            (self.home / "cgroup.procs").write_text(str(os.getpid()))

    def unusable(self) -> str | None:
        """Why no lane's weight can be set here, or None."""
        if self.v1:
            return None if os.access(V1_CPU, os.W_OK) else f"{V1_CPU} is not writable"
        try:
            controllers = (V2_ROOT / "cgroup.controllers").read_text().split()
        except OSError as err:
            return f"no cgroup v2 at {V2_ROOT}: {err.strerror}"
        return None if "cpu" in controllers else "no cpu controller in cgroup v2"

    def remove(self) -> None:
        """Each lane's cgroup (once the run is over: its processes are reaped)."""
        for lane in WEIGHTS:
            try:
                (self.root / f"perfmon-tests-{self.run_id}-{lane}").rmdir()
            except OSError:
                pass  # (never made)


class Lanes:
    def __init__(self, run_id: str, worker: bool) -> None:
        self.run_id = run_id
        self.worker = worker  # (a run without workers has no lanes: nothing runs beside)
        self.cgroups = _Cgroups(run_id)
        self.held: dict[str, int] = {}  # lane -> the descriptor holding its lock

    def _lock_path(self, lane: str) -> Path:
        return Path("/tmp") / f"perfmon-tests-{self.run_id}-{lane}.lock"

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        lane = lane_of(item) if self.worker else None
        if lane is not None and lane not in self.held:
            # (before the file's first set-up: its module-scoped jobs start in the lane)
            fd = os.open(self._lock_path(lane), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            self.held[lane] = fd
            self.cgroups.enter(lane)
        yield
        if lane is not None and (nextitem is None or nextitem.path != item.path):
            # (after the file's last tear-down: its jobs are reaped)
            self.cgroups.leave()
            fd = self.held.pop(lane)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter, config: pytest.Config) -> None:
        if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
            return  # (the controller of workers says it, for the run)
        why_not = self.cgroups.why_not or self.cgroups.unusable()
        if why_not is not None:
            terminalreporter.write_line(
                f"cpu_lanes: the timing lanes ran without their CPU weight ({why_not}): "
                "their jobs shared the CPU with the rest", yellow=True)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if hasattr(config, "workerinput"):
            return  # (the controller ends last: the other workers may still take turns)
        self.cgroups.remove()
        for lane in WEIGHTS:
            self._lock_path(lane).unlink(missing_ok=True)


def _markers(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "timing: judges a job's timing; runs in a lane of its own, with the CPU "
        "it asks for (tests/cpu_lanes.py)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in the order the workers take them (--dist loadfile: each runs whole on one
    worker, so its module-scoped jobs start once): the files with a long test first
    (pytest.mark.long; a long one started last would be the run's tail), and each lane's
    files (tests/cpu_lanes.py: they take turns) spread evenly through the rest, its
    longest first, so that a lane is never idle for long and a worker seldom waits for
    its turn. A lane's tests are marked timing."""
    lanes: dict[str, list[Path]] = {}
    by_file: dict[Path, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
        if (lane := lane_of(item)) is not None:
            item.add_marker(pytest.mark.timing)
            if item.path not in lanes.setdefault(lane, []):
                lanes[lane].append(item.path)
    long_files = {item.path for item in items if item.get_closest_marker("long")}
    in_lanes = {path for paths in lanes.values() for path in paths}
    rest = sorted((p for p in by_file if p not in in_lanes), key=lambda p: p not in long_files)
    placed = [(i, 1, p) for i, p in enumerate(rest)]
    for paths in lanes.values():
        paths.sort(key=lambda p: p not in long_files)
        placed += [(k * len(rest) / len(paths), 0, p) for k, p in enumerate(paths)]
    items[:] = [item for _, _, path in sorted(placed, key=lambda x: x[:2])
                for item in by_file[path]]


def pytest_configure(config: pytest.Config) -> None:
    _markers(config)
    config.pluginmanager.register(Lanes(_run_id(config), hasattr(config, "workerinput")),
                                  "perfmon_cpu_lanes")
