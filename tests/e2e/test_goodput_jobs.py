"""The goodput ledger and fail-slow on real jobs, side by side (they stand for GPU
jobs, tests/targets/train_gpt.py --device-ms, and barely use the CPU). Started by
`perfmon-agent run` (the ledger from the job's process start): a healthy job; one that
stalls 25 s between two iterations and one that stalls 25 s inside a backward; one
whose step is 60% longer for 40 s and then runs 4% above its old pace (its metrics
scraped as it runs). Attached with `attach` for 40 s to a healthy job already running.
A torchrun job whose rank is killed and restarted (--max-restarts) from its last
checkpoint. Each ledger adds up to the wall time, and each cause's seconds are what
the job's own clock says was lost. And `attach` to jobs already running (so the
ledger starts at the attach): one that makes no iteration while attached (unobserved),
and one stalled at attach (its start-up counted from the attach, not from its
process start)."""

from __future__ import annotations

import itertools
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import (
    DEVICE_JOB,
    TRAIN_GPT,
    Agent,
    Target,
    _reap,
    ebpf_missing,
    load_summary,
    wait_for,
)
from tests.e2e.test_fail_slow import confirmed_by_its_own_clock
from tests.prom import free_port, get
from tests.traces import trace_events

pytestmark = pytest.mark.long(reason=("jobs side by side for ~2 min: a 25 s stall, a 40 s "
                                      "slowdown, a torchrun rank killed and restarted"))

HANG_AT, HANG_S = 100, 25.0
# Seconds after training started: 60% longer for 40 s, then 4% above the old pace.
SLOW = (15, 55, 0.6, 0.04)
ATTACH_S = 40


@dataclass
class Done:
    summary: dict[str, Any]
    stamps: Target
    process_start_ns: int  # the job's process start (CLOCK_MONOTONIC), from psutil
    summary_folder: Path
    gauge: list[tuple[int, float]] = field(default_factory=list)  # (when, fail_slow_active)
    stdout: str = ""

    @property
    def goodput(self) -> dict[str, Any]:
        return self.summary["final_statistics"]["goodput"]

    def steps(self) -> list[tuple[int, int]]:
        """(end, step) of every iteration by the job's own clock."""
        ends = [t for _, t in self.stamps.timestamps()]
        return [(b, b - a) for a, b in itertools.pairwise(ends)]

    def healthy_ns(self) -> float:
        return statistics.median(s for _, s in self.steps())


def _mono_start(pid: int) -> int:
    """A process's start time on CLOCK_MONOTONIC."""
    return time.monotonic_ns() - int((time.time() - psutil.Process(pid).create_time()) * 1e9)


def _job_pid(agent_pid: int) -> int:
    def find() -> int | None:
        return next((c.pid for c in psutil.Process(agent_pid).children(recursive=True)
                     if str(TRAIN_GPT) in " ".join(_cmdline(c))), None)
    return wait_for(find, 60, "the job's process")


def incident(folder: Path, kind: str, ranks: int = 1) -> Path:
    """The one ``kind`` bundle in ``folder``, checked: its record, every rank's stacks (a
    rank that exited says so), the GPUs (none here), each rank's iterations around it,
    and a trace that opens as `perfmon-agent trace`'s do."""
    (bundle,) = folder.glob(f"incident_*_{kind}")
    record = json.loads((bundle / "incident.json").read_text())
    assert record["kind"] == kind and record["what"]
    assert set(record["files"]) == {"incident.json", "gpus.json", "stacks.json",
                                    "history.json", "trace.json"}, record
    stacks = json.loads((bundle / "stacks.json").read_text())
    assert len(stacks) == ranks
    assert all(r.get("exited") or r["threads"] for r in stacks.values()), stacks
    assert json.loads((bundle / "gpus.json").read_text())["available"] is False
    history = json.loads((bundle / "history.json").read_text())
    assert len(history["ranks"]) == ranks and any(r["iterations"] for r in history["ranks"])
    events = trace_events(bundle / "trace.json")
    start, end = record["window_mono_ns"]
    slices = [e for e in events if e["ph"] == "X"]
    assert slices and all(start / 1e3 <= e["ts"] + e["dur"] and e["ts"] <= end / 1e3
                          for e in slices)
    return bundle


def _adds_up(ledger: dict[str, Any]) -> None:
    total = ledger["productive_seconds"] + sum(ledger["lost_seconds"].values())
    assert total == pytest.approx(ledger["wall_seconds"], rel=0.01), ledger


class _Gauge(threading.Thread):
    """perfmon_fail_slow_active as Prometheus would scrape it, once a second."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url, self.samples = f"http://127.0.0.1:{port}/metrics", []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                text = get(self.url)
            except OSError:
                continue
            found = re.search(r"^perfmon_fail_slow_active\{[^}]*\} (\S+)$", text, re.M)
            if found:
                self.samples.append((time.monotonic_ns(), float(found.group(1))))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if (reason := ebpf_missing()) is not None:
        pytest.fail(f"eBPF uprobes cannot run: {reason}")
    hang = ("--train-iters", "300", "--stall-at", str(HANG_AT), "--stall-for", str(HANG_S))
    scenarios = {
        "healthy": ("--train-iters", "300"),
        "hang": hang,
        "hang_backward": (*hang, "--stall-in", "backward"),
        "slowed": ("--train-iters", "520", "--slow-ranks", "all", "--slow-wait",
                   "--slow-schedule", f"{SLOW[0]}-{SLOW[1]}:{SLOW[2]},{SLOW[1]}-9999:{SLOW[3]}"),
    }
    port = free_port()
    agent, runs, gauge = Agent(), {}, _Gauge(port)
    done: dict[str, Any] = {}
    attached: subprocess.Popen | None = None
    try:
        for name, args in scenarios.items():
            folder = tmp_path_factory.mktemp(name)
            stamps = folder / "stamps.txt"
            metrics = f"127.0.0.1:{port}" if name == "slowed" else "off"
            proc = agent.start("run", "--output-dir", str(folder), "--metrics-address", metrics,
                               "--hang-timeout", "5", "--", sys.executable, str(TRAIN_GPT),
                               *DEVICE_JOB, "--timestamps", str(stamps), *args)
            runs[name] = (proc, folder, stamps, _mono_start(_job_pid(proc.pid)))
        gauge.start()
        restart = _start_restarted_job(agent, tmp_path_factory.mktemp("restart"))
        # A healthy job already running, attached for ATTACH_S.
        folder = tmp_path_factory.mktemp("attached")
        stamps = folder / "stamps.txt"
        attached = subprocess.Popen([sys.executable, str(TRAIN_GPT), *DEVICE_JOB,
                                     "--timestamps", str(stamps)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
        job = Target(attached, stamps)
        job.wait_for_iterations(10)
        proc = agent.start("attach", "--pid", str(attached.pid), "--duration", str(ATTACH_S),
                           "--output-dir", str(folder))
        runs["attached"] = (proc, folder, stamps, _mono_start(attached.pid))
        done["restart"] = _kill_and_restart(*restart)
        for name, (proc, folder, stamps, start_ns) in runs.items():
            stdout, stderr = proc.communicate(timeout=240)
            assert proc.returncode == 0, stderr
            (path,) = folder.glob("perf_summary_*.json")
            done[name] = Done(json.loads(path.read_text()), Target(proc, stamps), start_ns,
                              folder, stdout=stdout)
        gauge.stop.set()
        done["slowed"].gauge = gauge.samples
        yield done
    finally:
        gauge.stop.set()
        for proc in [*agent.procs, *([attached] if attached else [])]:
            _reap(proc)


def test_a_healthy_jobs_ledger_is_its_start_up_and_its_iterations(jobs: dict[str, Done]) -> None:
    run = jobs["healthy"]
    ledger = run.goodput
    _adds_up(ledger)
    assert ledger["from"] == "process_start" and ledger["gpus"] == 1
    # Start-up: from the process start to its first iteration (less one healthy step).
    first_end = run.stamps.timestamps()[0][1]
    startup_s = (first_end - run.process_start_ns - run.healthy_ns()) / 1e9
    assert ledger["lost_seconds"]["startup"] == pytest.approx(startup_s, rel=0.1, abs=0.3)
    after = ledger["productive_seconds"] / (ledger["wall_seconds"]
                                           - ledger["lost_seconds"]["startup"])
    # Its iterations at its healthy pace, as much as its own clock says they were: at least
    # 98% of the time, less what the machine took from it (other tests' load stretches a
    # job's steps for seconds at a time; the job's own median step against all of them).
    steps = [s for _, s in run.steps()]
    own = len(steps) * statistics.median(steps) / sum(steps)
    assert after >= min(0.98, own - 0.02), (ledger, own)
    lost = {c: s for c, s in ledger["lost_seconds"].items() if c not in ("startup",
                                                                          "unexplained")}
    # (a slowdown only where a fail-slow episode was, and the job's own clock shows it)
    episodes = run.summary["final_statistics"]["fail_slow"]
    assert all(confirmed_by_its_own_clock(run.stamps, e) for e in episodes), episodes
    if not episodes:
        assert lost["slowdown"] == 0, ledger
    assert all(s == 0 for c, s in lost.items() if c != "slowdown"), ledger


def test_a_healthy_job_attached_for_40s_loses_nothing_and_says_what_it_did_not_see(
        jobs: dict[str, Done]) -> None:
    # (issue 38: ratio 0.919, 3.2 s unexplained: its noise and the window's edges)
    run = jobs["attached"]
    ledger, info = run.goodput, run.summary["session_info"]
    _adds_up(ledger)
    assert ledger["from"] == "attach" and ledger["ratio"] >= 0.98, ledger
    # Not seen: the iteration running at the attach, up to the first end; and the one
    # running when the window closed (by the job's own clock, less than a step each).
    attach, detach = info["attach_monotonic_ns"], info["detach_monotonic_ns"]
    ends = [t for _, t in run.stamps.timestamps()]
    first = min(t for t in ends if t > attach)
    last = max(t for t in ends if t <= detach)
    assert ledger["unobserved_seconds"] == pytest.approx(
        (first - attach + detach - last) / 1e9, abs=0.05), ledger
    assert ledger["wall_seconds"] == pytest.approx((last - first) / 1e9, abs=0.05)
    assert 0 < ledger["unobserved_seconds"] < 2 * run.healthy_ns() / 1e9
    # (and the end table says both)
    row = next(line for line in run.stdout.splitlines() if "goodput" in line)
    assert f"{ledger['ratio']:.1%}" in row and "not seen" in row, run.stdout


@pytest.mark.parametrize("where", ["hang", "hang_backward"])
def test_a_25s_stall_between_iterations_or_inside_a_backward_is_25s_of_hang(
        jobs: dict[str, Done], where: str) -> None:
    run = jobs[where]
    ledger = run.goodput
    _adds_up(ledger)
    # The job's own clock: its stalled iteration's step beyond a healthy one, within 5%.
    stalled = max(s for _, s in run.steps())
    assert ledger["lost_seconds"]["hang"] == pytest.approx((stalled - run.healthy_ns()) / 1e9,
                                                           rel=0.05), ledger
    assert ledger["lost_seconds"]["hang"] == pytest.approx(HANG_S, rel=0.05)
    hangs = run.summary["final_statistics"]["hangs"]
    assert hangs, "the hang was reported"
    # Where the ranks waited, from their stacks: inside backward(), or outside any phase.
    assert hangs[0]["phase"] == ("backward" if where == "hang_backward" else "other"), hangs
    bundle = incident(run.summary_folder, "hang")
    # Every rank involved, with its pid and rank (none: a job of one process).
    record = json.loads((bundle / "incident.json").read_text())
    assert record["ranks"] == [{"pid": run.summary["session_info"]["primary_pid"],
                                "rank": None}], record
    # `perfmon-agent incidents` lists it.
    listed = subprocess.run([sys.executable, "-m", "perfmon.agent.cli", "incidents",
                             str(run.summary_folder), "--json"], capture_output=True,
                            text=True, timeout=60, check=True)
    # (the hang's, once; a CPU job's own pace on this shared VM can also move enough, a
    # few % for 10 s, for a fail_slow incident beside it: CI saw +4% after the hang)
    (found,) = [i for i in json.loads(listed.stdout)["incidents"] if i["kind"] == "hang"]
    assert found["folder"] == str(bundle)


def test_a_60pct_slowdown_back_4pct_above_closes_its_episode_and_is_its_excess(
        jobs: dict[str, Done]) -> None:
    run = jobs["slowed"]
    ledger = run.goodput
    _adds_up(ledger)
    steps = run.steps()
    healthy = statistics.median(s for _, s in steps[:100])
    slow_ends = [t for t, s in steps if s > 1.3 * healthy]
    began_ns, fell_ns = slow_ends[0], slow_ends[-1]  # (by the job's own clock)
    events = run.summary["final_statistics"]["fail_slow"]
    rise = [e for e in events if e["event"] == "fail_slow"
            and abs(e["t_mono_ns"] - began_ns) < 5e9]
    assert rise, events
    # The fall is news within 15 s, and the episode closes: recovered, or recovered
    # partly (4% above the old pace), saying where the job runs against its baseline.
    closing = [e for e in events if e["event"] in ("recovered", "recovered_partly")
               and abs(e["t_mono_ns"] - fell_ns) < 5e9]
    assert closing, events
    assert (closing[0]["detected_mono_ns"] - fell_ns) / 1e9 <= 15, closing[0]
    assert events[-1]["event"] in ("recovered", "recovered_partly"), events
    # The Prometheus gauge: 1 in the episode, 0 again once the fall was found (an event
    # writes the summary, and the figures follow it, at once; scraped once a second).
    found_ns, rise_ns = closing[0]["detected_mono_ns"], rise[0]["detected_mono_ns"]
    seen = [(round((t - rise_ns) / 1e9, 1), v) for t, v in run.gauge]
    during = [v for t, v in run.gauge if rise_ns + 4e9 < t < fell_ns]
    after = [v for t, v in run.gauge if t > found_ns + 4e9]
    assert during and set(during) == {1.0}, (seen, (fell_ns - rise_ns) / 1e9)
    assert after and set(after) == {0.0}, (seen, (found_ns - rise_ns) / 1e9)
    # The ledger: each slow step's excess over the healthy step, as a slowdown.
    excess = [s - healthy for t, s in steps if began_ns <= t <= fell_ns]
    injected_s = sum(excess) / 1e9
    assert 12 <= injected_s <= 18  # (~40 s at 1.6 times the step: 15 s of it)
    assert ledger["lost_seconds"]["slowdown"] == pytest.approx(injected_s, rel=0.1), ledger
    incident(run.summary_folder, "fail_slow")


@dataclass
class Restarted:
    """The torchrun job whose rank was killed: its two sessions' summaries, its own clock,
    when the rank was killed and the job's last iteration before."""

    summaries: list[Path]
    job: Target
    killed_at: int
    last_before: int
    folder: Path


def _start_restarted_job(agent: Agent, folder: Path) -> tuple[subprocess.Popen, Target, Path]:
    stamps, checkpoint = folder / "stamps.txt", folder / "checkpoint"
    proc = agent.start(
        "run", "--output-dir", str(folder), "--metrics-address", "off", "--",
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        "2", "--max-restarts", "1", str(TRAIN_GPT), "--ddp", *DEVICE_JOB,
        "--train-iters", "260", "--checkpoint", str(checkpoint), "--checkpoint-every", "50",
        "--timestamps", str(stamps),
        # (torch shares the rendezvous store with the workers, and a restarted
        # worker can read its peer's address from the attempt before, then wait
        # for it forever: pytorch/pytorch#135712, seen here with gloo)
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    return proc, Target(proc, stamps), folder


def _cmdline(process: psutil.Process) -> list[str]:
    """Its command line; none for a child that has exited meanwhile (a zombie's is
    unreadable: a short-lived helper of torchrun or the agent, seen in a CI run)."""
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _kill_and_restart(proc: subprocess.Popen, job: Target, folder: Path) -> Restarted:
    """Rank 1 killed after 130 iterations; torchrun restarts it (--max-restarts) from the
    last checkpoint, and the job finishes."""
    job.wait_for_iterations(2 * 130, timeout_s=120)  # (both ranks stamp each iteration)
    ranks = [c for c in psutil.Process(proc.pid).children(recursive=True)
             if str(TRAIN_GPT) in " ".join(_cmdline(c))]
    victim = next(r for r in ranks if r.environ().get("RANK") == "1")
    killed_at = max(t for _, t in job.timestamps())
    last_before = max(i for i, _ in job.timestamps())
    victim.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr  # (torchrun restarted it, and it finished)
    return Restarted(sorted(folder.glob("perf_summary_*.json")), job, killed_at, last_before,
                     folder)


def test_a_killed_rank_restarted_by_torchrun_is_a_restart_in_the_jobs_ledger(
        jobs: dict[str, Any]) -> None:
    run: Restarted = jobs["restart"]
    assert len(run.summaries) == 2, run.summaries  # one session per incarnation
    second = json.loads(run.summaries[-1].read_text())
    ledger = second["final_statistics"]["goodput"]
    job_ledger = ledger["job"]
    _adds_up(job_ledger)
    # The job's own clock (the first rank to stamp each iteration): from the last
    # iteration before the kill to the first after the restart (less that one's healthy
    # step), and the iterations redone since the checkpoint it resumed from.
    before: dict[int, int] = {}
    after: dict[int, int] = {}
    for i, t in run.job.timestamps():
        side = before if t <= run.killed_at else after
        side[i] = min(t, side.get(i, t))
    ends = [before[i] for i in sorted(before)]
    healthy = statistics.median(b - a for a, b in itertools.pairwise(ends))
    resumed_from = min(after) - 1
    redone = run.last_before - resumed_from
    truth_s = (min(after.values()) - run.killed_at - healthy + redone * healthy) / 1e9
    assert 0 < redone <= 50
    print(f"restart: {job_ledger['lost_seconds']['restart']:.2f} s lost by the ledger, "
          f"{truth_s:.2f} s by the job's own clock ({redone} iterations redone)")
    assert job_ledger["lost_seconds"]["restart"] == pytest.approx(truth_s, rel=0.1), (
        job_ledger, truth_s, redone)
    assert second["session_info"]["job_before"]["last_job_iteration"] is not None
    incident(run.folder, "exit", ranks=2)


@pytest.mark.usefixtures("ebpf")
def test_attached_to_a_job_that_makes_no_iteration_its_time_is_unobserved(
        start_target: Any, agent: Agent, out_dir: Path) -> None:
    # (issue 37: a job whose iterations the agent could not see read as goodput 0 and all
    # of its time since its process start as startup; here the job made 3 and sleeps)
    job = start_target(*DEVICE_JOB, "--train-iters", "3", "--after-train", "sleep",
                       warm_iterations=3)
    run = agent.run("attach", "--pid", str(job.pid), "--duration", "5", "--output-dir",
                    str(out_dir))
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    info, ledger = summary["session_info"], summary["final_statistics"]["goodput"]
    assert info["started_by"] == "attach" and info["total_iterations"] == 0
    assert info["process_start_monotonic_ns"] < info["attach_monotonic_ns"]
    _adds_up(ledger)
    assert ledger["ratio"] is None and ledger["from"] == "attach"
    assert ledger["unobserved_seconds"] == pytest.approx(
        (info["detach_monotonic_ns"] - info["attach_monotonic_ns"]) / 1e9, abs=0.002)
    assert ledger["wall_seconds"] == 0 and not any(ledger["lost_seconds"].values()), ledger


@pytest.mark.usefixtures("ebpf")
def test_attached_to_a_stalled_job_its_lost_time_starts_at_the_attach(
        start_target: Any, agent: Agent, out_dir: Path) -> None:
    # Stalled for 10 s after its 3rd iteration (a long evaluation, a checkpoint), attached
    # at once: its first iteration seen ends well after the attach. Its start-up is from
    # the attach to it, never from its process start.
    job = start_target(*DEVICE_JOB, "--stall-at", "3", "--stall-for", "10",
                       warm_iterations=3)
    run = agent.run("attach", "--pid", str(job.pid), "--duration", "20", "--output-dir",
                    str(out_dir))
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    info, ledger = summary["session_info"], summary["final_statistics"]["goodput"]
    attach, detach = info["attach_monotonic_ns"], info["detach_monotonic_ns"]
    first_end = min(t for _, t in job.timestamps() if t > attach)
    assert first_end - attach > 2e9, "the stall was over before the attach"
    assert info["started_by"] == "attach"
    # (an older process: a start-up from its start would be off by more than the 0.3 s
    # allowed below)
    assert info["process_start_monotonic_ns"] < attach - 1e9
    _adds_up(ledger)
    assert ledger["from"] == "attach"
    # The job's own clock: seen from the attach to its last iteration's end (the one
    # running at detach not seen); start-up from the attach to its first iteration's
    # end, less a healthy step.
    ends = [t for _, t in job.timestamps() if attach < t <= detach]
    assert ledger["wall_seconds"] == pytest.approx((ends[-1] - attach) / 1e9, abs=0.01)
    assert ledger["unobserved_seconds"] == pytest.approx((detach - ends[-1]) / 1e9, abs=0.01)
    healthy = statistics.median(b - a for a, b in itertools.pairwise(ends))
    assert ledger["lost_seconds"]["startup"] == pytest.approx(
        (first_end - attach - healthy) / 1e9, abs=0.3), ledger
    assert ledger["ratio"] is not None
