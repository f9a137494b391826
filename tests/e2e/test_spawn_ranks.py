"""Ranks are the processes that train, whatever launched them.

Real jobs of tests/targets/train_spawn.py in each shape research code starts them
(``mp.spawn`` with and without a process group, the fork and forkserver start
methods, a plain job with DataLoader workers or hand-made loader processes), scanned
as the node service scans them (perfmon.probes.discovery, perfmon.agent.daemon.jobs)
and expanded as ``attach --pid`` expands a pid; the truth is each training process's
own pid file. Then the real agent: ``serve`` finds a 2-rank ``mp.spawn`` DDP job of
an ordinary user, ``run`` one whose parent is watched alone before it spawns, and
``attach --pid`` its parent; each counts the iterations of the job's own clock. And a
process that never ends an iteration is "not training", never hung. (Shapes that need
another launcher or PyTorch, on synthetic scans: tests/unit/agent/daemon/test_jobs.py.)
"""

from __future__ import annotations

import itertools
import json
import pwd
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from perfmon.agent.daemon.jobs import FoundJob, find_jobs
from perfmon.probes.discovery import ProcessScan
from perfmon.probes.procfs import resolve_targets

from tests.conftest import ROOT, _reap, load_summary, wait_for
from tests.e2e.test_security import job_user  # noqa: F401  (the unprivileged job user)
from tests.e2e.test_service import TAG, Service, ended, summaries
from tests.e2e.test_service_users import LIBTORCH, UserJobs
from tests.prom import free_port

pytestmark = pytest.mark.usefixtures("ebpf")

TRAIN_SPAWN = ROOT / "tests" / "targets" / "train_spawn.py"
# Every collective wait probed (no sampling): a sampled wait probe re-attached just as a
# rank exits fails the session ("Failed to attach BPF to uretprobe", end reason
# "error": probes/uprobes.py's _attach_waits), which the jobs here, run to their end,
# would meet at times. That race is not what these tests are about.
ATTACH = {"log_interval": 5, "iteration_source": "uprobe", "stack_sampling": False,
          "wait_probe_budget_pct": 0}


class SpawnJob:
    """One run of train_spawn.py, started by the test: its parent and the pids its
    training processes wrote (the truth of which processes train)."""

    def __init__(self, folder: Path, *args: str, prefix: tuple[str, ...] = ()) -> None:
        self.stamps = folder / "stamps"
        self.nprocs = int(args[args.index("--nprocs") + 1])
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(TRAIN_SPAWN), "--timestamps", str(self.stamps),
             "--port", str(free_port()), "--tag", TAG, *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            cwd=folder)

    def trainers(self, timeout_s: float = 90) -> list[int]:
        """The pids of its training processes, by spawn index, once each has stepped."""
        def ready() -> list[int] | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"the job exited with {self.proc.returncode}")
            n = max(1, self.nprocs)
            if not all(self.stamp_file(i).exists() and self.timestamps(i)
                       for i in range(n)):
                return None
            return [int(Path(f"{self.stamps}.{i}.pid").read_text()) for i in range(n)]
        return wait_for(ready, timeout_s, "every training process to step")

    def stamp_file(self, index: int) -> Path:
        return Path(f"{self.stamps}.{index}")

    def timestamps(self, index: int = 0) -> list[int]:
        """CLOCK_MONOTONIC ns just before each optimizer.step() of training process
        ``index``, as it wrote them."""
        path = self.stamp_file(index)
        if not path.exists():
            return []
        return [int(line.split()[1]) for line in path.read_text().splitlines()
                if len(line.split()) == 2]


@pytest.fixture
def spawn_jobs(tmp_path: Path) -> Iterator[Any]:
    started: list[SpawnJob] = []

    def start(*args: str) -> SpawnJob:
        folder = tmp_path / f"job{len(started)}"
        folder.mkdir()
        job = SpawnJob(folder, *args)
        started.append(job)
        return job

    yield start
    for job in started:
        _reap(job.proc)


def scan_jobs(scan: ProcessScan) -> list[FoundJob]:
    return find_jobs(scan.scan(time.monotonic()), lambda _cmd, _uid: True,
                     lambda pid, err: (_ for _ in ()).throw(AssertionError((pid, err))))


def settled(scan: ProcessScan, want: Any, timeout_s: float = 60) -> FoundJob:
    """The job of the scan once ``want(job)`` holds in three scans in a row (0.5 s apart,
    as ``run`` scans): the decision, not a moment of it."""
    deadline = time.monotonic() + timeout_s
    streak, last = 0, None
    while time.monotonic() < deadline:
        time.sleep(0.5)
        found = scan_jobs(scan)
        last = found
        streak = streak + 1 if len(found) == 1 and want(found[0]) else 0
        if streak == 3:
            return found[0]
    raise AssertionError(f"the scan did not settle: {last}")


# (train_spawn.py's arguments, what the parent is: "rank" (it trains: its children are
# its workers) or "launcher" (its children train), whether the job is complete at once
# (False: its children say nothing, its parent is idle: they are attached after
# rank_wait_s), the job's identity)
SHAPES = {
    "plain job, 2 DataLoader workers (fork)": (
        ("--nprocs", "0", "--num-workers", "2"), "rank", True, "launcher"),
    "plain job, 2 DataLoader workers (spawn)": (
        ("--nprocs", "0", "--num-workers", "2", "--worker-start-method", "spawn"),
        "rank", True, "launcher"),
    "plain job, 2 hand-made loader processes with PyTorch (fork)": (
        ("--nprocs", "0", "--helpers", "2"), "rank", True, "launcher"),
    "mp.spawn nprocs=2, DDP": (
        ("--nprocs", "2", "--dist"), "launcher", True, "MASTER_ADDR:MASTER_PORT"),
    "mp.spawn nprocs=1, DDP": (
        ("--nprocs", "1", "--dist"), "launcher", True, "MASTER_ADDR:MASTER_PORT"),
    "mp.spawn nprocs=2, DDP, 2 DataLoader workers each": (
        ("--nprocs", "2", "--dist", "--num-workers", "2"), "launcher", True,
        "MASTER_ADDR:MASTER_PORT"),
    "mp.spawn nprocs=1, no process group, 2 DataLoader workers": (
        ("--nprocs", "1", "--num-workers", "2"), "launcher", True, "MASTER_ADDR:MASTER_PORT"),
    "mp.spawn nprocs=1, no process group, nothing else": (
        ("--nprocs", "1"), "launcher", False, "MASTER_ADDR:MASTER_PORT"),
    "start_processes fork, nprocs=2, DDP": (
        ("--nprocs", "2", "--dist", "--start-method", "fork"), "launcher", True, "launcher"),
    "start_processes forkserver, nprocs=2, DDP": (
        ("--nprocs", "2", "--dist", "--start-method", "forkserver"), "launcher", True,
        "MASTER_ADDR:MASTER_PORT"),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_ranks_of_each_shape_are_the_processes_that_train(spawn_jobs, shape: str) -> None:
    args, parent_is, complete, id_from = SHAPES[shape]
    job = spawn_jobs(*args)
    trainers = job.trainers()
    parent = job.proc.pid
    scan = ProcessScan(parent)
    ranks = sorted(trainers)
    found = settled(scan, lambda f: sorted(f.ranks) == ranks and f.ready == complete)
    assert found.id_from == id_from
    if parent_is == "rank":
        assert trainers == [parent] and found.launchers == []
        assert found.rank_of == {parent: None} and not found.numbered
    else:
        assert parent not in found.ranks and found.launchers == [parent]
        # No RANK in their environment: numbered by start order, which is the index
        # mp.spawn gives them.
        assert found.numbered and found.rank_of == {pid: i for i, pid in enumerate(trainers)}
        assert found.ranks == trainers
    if id_from == "launcher":
        assert found.name == f"python-{parent}"
    if not complete:  # attached once rank_wait_s has passed: the idle parent is their launcher
        assert found.expected == len(ranks) + 1
    # attach --pid expands the parent as the service groups it.
    targets = resolve_targets(parent)
    assert [t.pid for t in targets] == trainers
    assert [t.rank for t in targets] == ([None] if parent_is == "rank" else
                                         list(range(len(trainers))))
    assert all(t.launcher == (f"python-{parent}" if parent_is == "launcher" else None)
               for t in targets)


def in_window(stamps: list[int], info: dict[str, Any]) -> list[int]:
    lo, hi = info["attach_monotonic_ns"], info["detach_monotonic_ns"]
    return [t for t in stamps if lo <= t <= hi]


def assert_counts_the_jobs_clock(info: dict[str, Any], stats: dict[str, Any],
                                 stamps: list[int]) -> tuple[int, int, float, float]:
    """Iterations over the logged span equal the job's own (an iteration at either edge
    may fall on one side of the window for the job and the other for the probe), and the
    mean step time within 0.5%: (the agent's count, the job's, the two step times ms)."""
    truth = in_window(stamps, info)
    assert len(truth) > 100, len(truth)
    true_ms = statistics.fmean((b - a) / 1e6 for a, b in itertools.pairwise(truth))
    print(f"iterations {info['total_iterations']} (job's clock {len(truth)}); step "
          f"{stats['avg_step_time_ms']:.4f} ms (job's clock {true_ms:.4f} ms)")
    assert abs(info["total_iterations"] - len(truth)) <= 1
    assert stats["avg_step_time_ms"] == pytest.approx(true_ms, rel=0.005)
    return info["total_iterations"], len(truth), stats["avg_step_time_ms"], true_ms


@pytest.mark.long(reason=("the node service finds an mp.spawn job, waits for its ranks and follows "
                          "them to their end"))
@pytest.mark.parametrize("setup_s", [0, 5])
def test_serve_finds_an_ordinary_users_mp_spawn_job_and_its_two_children_are_the_ranks(
        tmp_path: Path, job_user: pwd.struct_passwd, setup_s: int) -> None:  # noqa: F811
    """``setup_s``: the parent maps PyTorch this long before it spawns (0: the second
    of its own import), and is watched alone until its children show they train."""
    service = Service(tmp_path, attach=ATTACH)
    user = UserJobs(job_user)
    try:
        service.wait_ready()
        port = free_port()
        stamps = user.home / "stamps"
        parent = user.start([sys.executable, str(TRAIN_SPAWN), "--nprocs", "2", "--dist",
                             "--train-iters", "1000", "--port", str(port), "--timestamps",
                             str(stamps), "--setup-s", str(setup_s), "--tag", TAG])
        pids = wait_for(lambda: [int(Path(f"{stamps}.{i}.pid").read_text()) for i in (0, 1)]
                        if all(Path(f"{stamps}.{i}.pid").exists() for i in (0, 1)) else None,
                        90, "both children")
        folder = service.job_folder(pids[0], timeout_s=90)
        job = wait_for(lambda: ended(folder), 240, "the job to end")
        assert parent.wait(timeout=60) == 0
        log = service.log()
        clock = [int(line.split()[1]) for line in Path(f"{stamps}.0").read_text().splitlines()]
    finally:
        user.close()
        service.close()
    # One job, the user's, named by the children's master address; the parent is its
    # launcher; its ranks are the two children, numbered in the order mp.spawn started
    # them (its index: rank 0 wrote stamps.0).
    assert job["user"] == job_user.pw_name and job["uid"] == job_user.pw_uid
    assert job["id_from"] == "MASTER_ADDR:MASTER_PORT" and job["job_id"] == f"127.0.0.1-{port}"
    assert job["launcher"]["pid"] == parent.pid
    assert job["ranks"] == [{"pid": pids[0], "rank": 0, "local_rank": None},
                            {"pid": pids[1], "rank": 1, "local_rank": None}]
    # The parent may have been watched alone for a moment (it maps PyTorch a second
    # before it spawns): that session ended when its children showed they train.
    *before, last = job["segments"]
    assert len(before) == 1 if setup_s else len(before) <= 1
    for segment in before:
        assert segment["pids"] == [parent.pid] and segment["end_reason"] == "ranks_changed"
        assert segment["iterations"] == 0
    assert last["pids"] == pids and last["ranks"] == [0, 1]
    assert last["end_reason"] == "target_exited"
    assert len([f for f in folder.parent.iterdir() if (f / "job.json").exists()]) == 1
    *_, summary = summaries(folder)
    info, stats = summary["session_info"], summary["final_statistics"]
    assert info["primary_pid"] == pids[0] and info["pids"] == pids
    assert_counts_the_jobs_clock(info, stats, clock)
    # No hang: not in the summary, no report, not in the log.
    assert not info["hung"] and summary["final_statistics"]["hangs"] == []
    assert list(folder.glob("hang_report_*.json")) == []
    assert "hang:" not in log and "not training" not in log.split(f"pids {pids[0]}")[-1]
    # And the parent, alone again once its children exited, is no job of its own.
    assert "cannot attach" not in log and log.count("attaching to") == len(job["segments"])


@pytest.mark.long(reason='a parent watched alone for seconds before it spawns its ranks')
def test_run_watches_the_children_once_a_parent_watched_alone_spawns_them(
        agent, out_dir: Path, tmp_path: Path) -> None:
    """The parent maps PyTorch and prepares for 4 s before mp.spawn: `run` watches it as
    the job's one process until its children show they train; then the same job's next
    session watches them (a second summary in the same folder)."""
    stamps = tmp_path / "stamps"
    done = agent.run("run", "--output-dir", str(out_dir), "--metrics-address", "off",
                     "--no-stack-sampling", "--wait-probe-budget", "0", "--",
                     sys.executable, str(TRAIN_SPAWN),
                     "--nprocs", "2", "--dist", "--setup-s", "4", "--train-iters", "800",
                     "--port", str(free_port()), "--timestamps", str(stamps),
                     timeout_s=240)
    assert done.returncode == 0, done.stderr
    pids = [int(Path(f"{stamps}.{i}.pid").read_text()) for i in (0, 1)]
    found = [json.loads(p.read_text()) for p in sorted(out_dir.glob("perf_summary_*.json"))]
    first, last = found[0]["session_info"], found[-1]["session_info"]
    assert len(found) == 2, [s["session_info"]["pids"] for s in found]
    assert first["pids"] != pids and first["end_reason"] == "ranks_changed"
    assert first["total_iterations"] == 0 and not first["hung"]
    assert last["pids"] == pids and last["ranks"] == [0, 1]
    assert last["job"]["id_from"] == "MASTER_ADDR:MASTER_PORT"
    assert_counts_the_jobs_clock(last, found[-1]["final_statistics"],
                                 [int(line.split()[1]) for line in
                                  Path(f"{stamps}.0").read_text().splitlines()])


def test_attach_to_the_parent_of_an_mp_spawn_job_measures_its_children(
        agent, out_dir: Path, spawn_jobs) -> None:
    job = spawn_jobs("--nprocs", "2", "--dist")
    trainers = job.trainers()
    # (until it has measured enough steps to count: a busy machine's job is slower)
    done = agent.attach_for_iterations(job.proc.pid, 110, out_dir)
    assert done.returncode == 0, done.stderr
    summary = load_summary(out_dir)
    info = summary["session_info"]
    assert info["pids"] == trainers and info["ranks"] == [0, 1]
    assert info["job"]["id_from"] == "MASTER_ADDR:MASTER_PORT"
    assert_counts_the_jobs_clock(info, summary["final_statistics"], job.timestamps(0))


def test_a_process_that_never_ends_an_iteration_is_not_training_never_hung(
        agent, out_dir: Path, tmp_path: Path) -> None:
    """A Python process with the real libtorch mapped that never trains (a launcher, a
    process that serves or waits): past the hang threshold it is said to be not
    training, once; no hang, no report, no stack dump."""
    idle = subprocess.Popen([sys.executable, "-c", "import ctypes, sys, time; "
                             "ctypes.CDLL(sys.argv[1]); time.sleep(120)", str(LIBTORCH)],
                            start_new_session=True)
    try:
        wait_for(lambda: "libtorch_cpu" in Path(f"/proc/{idle.pid}/maps").read_text(), 30,
                 "libtorch to be mapped")
        done = agent.run("attach", "--pid", str(idle.pid), "--duration", "7",
                         "--hang-timeout", "2", "--output-dir", str(out_dir))
    finally:
        _reap(idle)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("not training: no iteration in") == 1, done.stderr
    assert "hang:" not in done.stderr
    summary = load_summary(out_dir)
    assert summary["session_info"]["total_iterations"] == 0
    assert not summary["session_info"]["hung"] and summary["final_statistics"]["hangs"] == []
    assert list(out_dir.glob("hang_report_*.json")) == []


@pytest.mark.long(reason=("an mp.spawn job that trains, then stalls past the hang "
                          "threshold: its hang report"))
def test_a_stall_after_iterations_is_still_a_hang(agent, out_dir: Path, spawn_jobs,
                                                   tmp_path: Path) -> None:
    stall = tmp_path / "stall"
    job = spawn_jobs("--nprocs", "0", "--stall-when", str(stall))
    [pid] = job.trainers()
    proc = agent.start("attach", "--pid", str(pid), "--output-dir", str(out_dir),
                       "--hang-timeout", "3", "--hang-factor", "5")
    wait_for(lambda: (s := summary_of(out_dir)) and s["session_info"]["total_iterations"] > 0,
             60, "the session's first iterations")
    stall.touch()
    reports = wait_for(lambda: list(out_dir.glob("hang_report_*.json")), 60, "a hang report")
    report = json.loads(reports[0].read_text())
    assert report["innermost_common_frame"]["function"] == "deliberately_stalled"
    summary = wait_for(lambda: (s := summary_of(out_dir)) and s["session_info"]["hung"] and s,
                       20, "the summary to say hung")
    (hang,) = summary["final_statistics"]["hangs"]
    assert "deliberately_stalled" in hang["frame"]
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert len([line for line in err.splitlines() if "hang:" in line]) == 1
    assert "not training" not in err


def summary_of(out_dir: Path) -> dict[str, Any] | None:
    try:
        return load_summary(out_dir)
    except (ValueError, FileNotFoundError):
        return None


# -- shapes that need another launcher or PyTorch, on synthetic scans -------------------
