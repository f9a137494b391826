"""Fixtures: real training targets (always reaped), the real agent as a subprocess,
eBPF prerequisites (a failure, not a skip, under PERFMON_REQUIRE_EBPF=1), and a
schema check of every summary a test leaves behind."""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import psutil
import pytest

from tests.fakes.build import FakeNvml, build_fake_nvml
from tests.fakes.build_cuda import FakeCudaLibraries, build_fake_cuda

pytest_plugins = ["tests.time_guard"]

ROOT = Path(__file__).resolve().parent.parent
TRAIN_GPT = ROOT / "tests" / "targets" / "train_gpt.py"
# A GPU job's stand-in for the tests whose truth is the job's pace (fail-slow, goodput):
# each micro-batch's forward waits 120 ms as a GPU job's CPU waits for its kernels, around
# a CPU part as small as a GPU job's (~3.5 ms: one sequence, plain SGD). A larger one of
# four sequences and AdamW (~9 ms) wandered by up to 4% of the step under the suite's
# load: it swallowed or inflated a 5% shift, and made a fail-slow of its own.
DEVICE_JOB = ("--num-layers", "1", "--hidden-size", "64", "--seq-length", "16",
              "--micro-batch-size", "1", "--optimizer", "sgd", "--device-ms", "120")
SUMMARY_SCHEMA = json.loads((ROOT / "parsers" / "data" / "perf_summary.schema.json").read_text())


# The files of tests/e2e whose tests judge a job's timing (its pace, waits, stalls, stragglers,
# sampled steps) against its own clock with margins made for a machine of moderate load:
# `make test` runs them apart (pytest.mark.timing), two at a time, after the rest (four
# at a time): beside three other workers on 2 cores (a load of 8-9) their jobs and
# agents were starved of CPU past those margins (an attach 17 s late, ring buffers
# overflowing, py-spy windows late), in 5 of every 850 tests a run.
# Each with its seconds, one at a time on an idle machine (2026-12-07): the longest start
# first, so the two workers end together.
TIMING_FILES = {
    "test_fail_slow.py": 184, "test_goodput_jobs.py": 134, "test_pipeline.py": 127,
    "test_attach_stacks.py": 127, "test_update_clocks.py": 115, "test_attach_gpu.py": 63,
    "test_collective_waits.py": 59, "test_pyspy_sampler.py": 51, "test_multihost.py": 40,
    "test_stragglers.py": 39, "test_service_memory.py": 34, "test_pyspy_bounds.py": 33,
    "test_cuda_probe.py": 26}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "timing: judges a job's timing; `make test` runs these apart, fewer at a "
        "time (tests/conftest.py TIMING_FILES)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The timing files longest first, then the files with a long test (pytest.mark.long):
    each runs whole on one worker (--dist loadfile), and a long one started last would be
    the run's tail. A file's tests stay together, so its module-scoped jobs start once.
    The timing files' tests are marked timing."""
    timing_s = {}
    for item in items:
        if item.path.name in TIMING_FILES and item.path.parent.name == "e2e":
            item.add_marker(pytest.mark.timing)
            timing_s[item.path] = TIMING_FILES[item.path.name]
    long_files = {item.path for item in items if item.get_closest_marker("long")}
    items.sort(key=lambda item: (-timing_s.get(item.path, 0), item.path not in long_files))


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> FakeNvml:
    """The fake libnvidia-ml.so.1 (real C ABI), built once for the whole run."""
    return FakeNvml(build_fake_nvml(tmp_path_factory.mktemp("fake_nvml")))


@pytest.fixture(scope="session")
def fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> FakeCudaLibraries:
    """Fake libcudart.so.12, libcuda.so.1 and libnccl.so.2 (real C ABI), built once."""
    return build_fake_cuda(tmp_path_factory.mktemp("fake_cuda"))


def ebpf_missing() -> str | None:
    """Why eBPF uprobes cannot run here, or None."""
    from perfmon.parsers.errors import PerfmonError
    from perfmon.probes.uprobes import check_ebpf_prerequisites

    try:
        check_ebpf_prerequisites()
    except PerfmonError as err:
        return str(err)
    return None


@pytest.fixture(scope="session")
def ebpf() -> None:
    reason = ebpf_missing()
    if reason is None:
        return
    if os.environ.get("PERFMON_REQUIRE_EBPF") == "1":
        pytest.fail(f"PERFMON_REQUIRE_EBPF=1 but eBPF uprobes cannot run: {reason}")
    pytest.skip(f"eBPF uprobes cannot run: {reason}")


def _reap(proc: subprocess.Popen) -> None:
    """Kill a process we started with all its descendants, and wait for them.

    Process groups are not enough: torchrun starts its workers in sessions of
    their own, so the tree is walked before anything is killed.
    """
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(tree[1:], timeout=30)


class Target:
    """A real training process started by a test, with its own iteration timestamps."""

    def __init__(self, proc: subprocess.Popen, stamps: Path) -> None:
        self.proc, self.stamps = proc, stamps

    @property
    def pid(self) -> int:
        return self.proc.pid

    def timestamps(self) -> list[tuple[int, int]]:
        """(iteration, CLOCK_MONOTONIC ns just before optimizer.step()) as the target wrote them."""
        if not self.stamps.exists():
            return []
        rows = []
        for line in self.stamps.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                rows.append((int(parts[0]), int(parts[1])))
        return rows

    def step_s(self, warm: int = 2) -> float:
        """The median of its steps so far after the first ``warm`` (its own clock), once
        it has made four more: how long a given number of iterations takes here."""
        self.wait_for_iterations(warm + 5)
        times = [t for _, t in self.timestamps()][warm:]
        return statistics.median(b - a for a, b in itertools.pairwise(times)) / 1e9

    def wait_for_iterations(self, n: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.timestamps()) < n:
            if self.proc.poll() is not None:
                raise AssertionError(f"target exited early with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise AssertionError(f"target did not reach {n} iterations in {timeout_s} s")
            time.sleep(0.05)


@pytest.fixture
def start_target(tmp_path: Path) -> Iterator:
    started: list[subprocess.Popen] = []

    def start(*args: str, script: Path = TRAIN_GPT, warm_iterations: int = 2,
              cwd: Path | None = None) -> Target:
        stamps = tmp_path / f"stamps_{len(started)}.txt"
        proc = subprocess.Popen(
            [sys.executable, str(script), "--timestamps", str(stamps), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd=cwd,
        )
        started.append(proc)
        target = Target(proc, stamps)
        if warm_iterations:
            target.wait_for_iterations(warm_iterations)
        return target

    yield start
    for proc in started:
        _reap(proc)


@pytest.fixture(scope="session")
def _shared_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """One plain training job for the tests that only watch a running job: a job takes
    ~4 s to start on this machine. It is stopped (SIGSTOP) between those tests, so it
    takes no CPU from the others."""
    stamps = tmp_path_factory.mktemp("shared_job") / "stamps.txt"
    proc = subprocess.Popen([sys.executable, str(TRAIN_GPT), "--timestamps", str(stamps)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        target = Target(proc, stamps)
        target.wait_for_iterations(2)
        os.kill(proc.pid, signal.SIGSTOP)
        yield target
    finally:
        _reap(proc)


@pytest.fixture
def steady_target(_shared_job: Target) -> Iterator[Target]:
    """A running plain training job (train_gpt.py with its defaults), shared by the
    tests that neither end it nor need its first iterations. It resumes for the test
    and has made two more steps by then, so the step that spanned its pause is over."""
    target = _shared_job
    if target.proc.poll() is not None:
        raise AssertionError(f"the shared job exited with {target.proc.returncode}")
    os.kill(target.pid, signal.SIGCONT)
    try:
        target.wait_for_iterations(len(target.timestamps()) + 2)
        yield target
    finally:
        if target.proc.poll() is None:
            os.kill(target.pid, signal.SIGSTOP)


@pytest.fixture
def out_dir(tmp_path: Path) -> Iterator[Path]:
    """An output folder; every perf summary left in it must validate against the schema."""
    path = tmp_path / "out"
    path.mkdir()
    yield path
    for summary in path.glob("perf_summary_*.json"):
        jsonschema.validate(json.loads(summary.read_text()), SUMMARY_SCHEMA)


class Agent:
    """The real agent, run as `python -m perfmon.agent.cli` in its own process."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, env: dict[str, str] | None = None,
              prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        if args[:1] in (("attach",), ("run",)) and "--metrics-address" not in args:
            # (the default port is one per host: the agents of tests running beside this
            # one would take it, and its "in use" warning is not this test's)
            args = (args[0], "--metrics-address", "off", *args[1:])
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "perfmon.agent.cli", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout_s: float = 120, **kw) -> subprocess.CompletedProcess:
        proc = self.start(*args, **kw)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        finally:
            _reap(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def attach_for_iterations(self, pid: int, iterations: int, out_dir: Path, *args: str,
                              timeout_s: float = 300) -> subprocess.CompletedProcess:
        """`attach` until its summary (rewritten every 5-15 s) has measured ``iterations``,
        then SIGTERM, as a user stops it: a test that needs so many steps gets them however
        slow the machine is today, and waits no longer than that."""
        proc = self.start("attach", "--pid", str(pid), "--output-dir", str(out_dir), *args)

        def measured() -> bool:
            summary = summary_so_far(out_dir)
            return proc.poll() is not None or (summary is not None and (
                summary["final_statistics"].get("measured_iterations") or 0) >= iterations)

        try:
            wait_for(measured, timeout_s, f"{iterations} iterations measured", interval_s=0.5)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            _reap(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def agent() -> Iterator[Agent]:
    a = Agent()
    yield a
    for proc in a.procs:
        _reap(proc)


def load_summary(out: Path) -> dict:
    (path,) = sorted(out.glob("perf_summary_*.json"))
    return json.loads(path.read_text())


def summary_so_far(out: Path) -> dict | None:
    """The live summary a running agent rewrites (every 5-15 s), or None: not written yet,
    or caught between its writes."""
    try:
        return load_summary(out)
    except (ValueError, FileNotFoundError):
        return None


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
