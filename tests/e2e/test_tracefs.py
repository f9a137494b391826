"""The tracefs uprobe backend against real PyTorch training processes, without bcc.

Each probe runs in a process of its own in which ``import bcc`` fails and
BCC_KERNEL_SOURCE names an empty folder, as on a host with neither. The target
writes time.monotonic_ns() just before each optimizer.step(); the probe's
Optimizer.step marker is the kernel's CLOCK_MONOTONIC time of the trap at that
step's record_function entry, so the two compare directly. (trace_pipe's lines:
tests/unit/parsers/test_trace_pipe.py.)
"""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from perfmon.parsers.errors import PerfmonError
from perfmon.probes import tracefs as tracefs_module
from perfmon.probes.errors import PrerequisiteMissing
from perfmon.probes.ftrace import GROUP_PREFIX, remove_stale_probes
from perfmon.probes.procfs import inspect_process
from perfmon.probes.tracefs import TracefsMarkerProbe, check_tracefs_prerequisites

ROOT = Path(__file__).resolve().parents[2]

# The probe process: start, poll every 100 ms for DURATION s, print JSON lines, close.
PROBE = r"""
import sys
sys.modules["bcc"] = None  # `import bcc` raises ImportError from here on
import json, time
from perfmon.probes.procfs import inspect_process
from perfmon.probes.tracefs import TracefsMarkerProbe

duration_s, pids = float(sys.argv[1]), [int(p) for p in sys.argv[2:]]
# Every marker kind, to compare with bcc's (the agent asks only for Optimizer.step).
probe = TracefsMarkerProbe([inspect_process(p) for p in pids],
                           step_kinds=("optimizer_step", "zero_grad", "dataloader_next"))
began = time.perf_counter()
probe.start()
attach_s = time.perf_counter() - began
print(json.dumps({"type": "started", "t_mono_ns": time.monotonic_ns(), "attach_s": attach_s,
                  "group": probe.group, "instance": probe.instance_name}), flush=True)
end = time.monotonic() + duration_s
max_poll_s = 0.0

def drain():
    global max_poll_s
    began = time.perf_counter()
    events = probe.poll()
    max_poll_s = max(max_poll_s, time.perf_counter() - began)
    for event in events:
        print(json.dumps(event.to_record()), flush=True)

while time.monotonic() < end:
    drain()
    time.sleep(0.1)
stopped = time.monotonic_ns()
drain()
probe.close()
probe.close()  # idempotent
print(json.dumps({"type": "closed", "t_mono_ns": stopped, "dropped": probe.dropped,
                  "warnings": probe.warnings, "max_poll_s": max_poll_s,
                  "bcc_loaded": sys.modules.get("bcc") is not None}), flush=True)
"""


def tracefs_missing() -> str | None:
    """Why tracefs uprobes cannot be used here, or None."""
    try:
        check_tracefs_prerequisites()
    except PerfmonError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def tracefs() -> str:
    """The tracefs root; a failure, not a skip, under PERFMON_REQUIRE_EBPF=1."""
    reason = tracefs_missing()
    if reason is None:
        return check_tracefs_prerequisites()
    if os.environ.get("PERFMON_REQUIRE_EBPF") == "1":
        pytest.fail(f"PERFMON_REQUIRE_EBPF=1 but tracefs uprobes cannot be used: {reason}")
    pytest.skip(f"tracefs uprobes cannot be used: {reason}")


class Probes:
    """Probe processes started by a test; all are killed and reaped at the end."""

    def __init__(self, empty_dir: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "BCC_KERNEL_SOURCE": str(empty_dir)}

    def start(self, duration_s: float, *pids: int) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, str(duration_s), *map(str, pids)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
            cwd=ROOT, start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def run(self, duration_s: float, *pids: int) -> list[dict]:
        """Run a probe to its end; its JSON records."""
        proc = self.start(duration_s, *pids)
        out, err = proc.communicate(timeout=duration_s + 30)
        assert proc.returncode == 0, err
        records = [json.loads(line) for line in out.splitlines()]
        assert records[0]["type"] == "started" and records[-1]["type"] == "closed", out
        assert records[-1]["warnings"] == [] and records[-1]["dropped"] == 0
        assert not records[-1]["bcc_loaded"]
        assert records[-1]["max_poll_s"] < 0.05  # poll() never waits for events
        return records

    @staticmethod
    def first_record(proc: subprocess.Popen, timeout_s: float = 30) -> dict:
        """The probe's "started" record, without blocking past the timeout."""
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        assert ready, "the probe did not start"
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        return json.loads(line)

    def reap(self) -> None:
        for proc in self.procs:
            try:
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
            except psutil.NoSuchProcess:
                tree = []
            for p in tree:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            proc.communicate(timeout=30)
            psutil.wait_procs(tree[1:], timeout=30)


@pytest.fixture
def probes(tracefs: str, tmp_path: Path) -> Iterator[Probes]:
    empty = tmp_path / "no_kernel_headers"
    empty.mkdir()
    p = Probes(empty)
    yield p
    p.reap()
    # Whatever a failed test left behind belongs to a dead probe: remove it.
    remove_stale_probes(tracefs)


def markers(records: list[dict], kind: str | None = None, pid: int | None = None) -> list[dict]:
    return [r for r in records if r["type"] == "marker" and (kind is None or r["kind"] == kind)
            and (pid is None or r["pid"] == pid)]


def leftovers(root: str, group: str) -> list[str]:
    """Events, instances and event folders of ``group`` still in tracefs."""
    lines = Path(root, "uprobe_events").read_text().splitlines()
    found = [li for li in lines if f"{group}/" in li]
    found += [f"instance {n}" for n in os.listdir(Path(root, "instances"))
              if n.startswith(f"{group}_")]
    if Path(root, "events", group).exists():
        found.append(f"events/{group}")
    return found


def mean_interval_ms(times: list[int]) -> float:
    return statistics.fmean((b - a) / 1e6 for a, b in itertools.pairwise(times))


def test_step_markers_match_the_targets_own_timestamps(start_target, probes, tracefs):
    target = start_target()
    other = start_target()  # same libtorch file, not probed: its traps must not show
    records = probes.run(3, target.pid)
    started, closed = records[0], records[-1]
    lo, hi = started["t_mono_ns"], closed["t_mono_ns"]
    steps = [m["t_mono_ns"] for m in markers(records, "optimizer_step")]
    truth = [t for _, t in target.timestamps() if lo <= t <= hi]
    assert len(truth) > 20
    assert abs(len([t for t in steps if lo <= t <= hi]) - len(truth)) <= 1
    assert mean_interval_ms(steps) == pytest.approx(mean_interval_ms(truth), rel=0.005)
    # Each marker follows its own step's stamp closely (the stamp is taken just before).
    stamps = sorted(t for _, t in target.timestamps())
    for t in steps:
        before = max(s for s in stamps if s <= t + 1000)  # +1 us: markers are floored to us
        assert t - before < 50_000_000
    assert {m["pid"] for m in markers(records)} == {target.pid}
    assert {m["tid"] for m in markers(records)} == {target.pid}  # its main thread
    assert all(m["name"].startswith("Optimizer.step#") for m in markers(records, "optimizer_step"))
    assert Counter(m["kind"] for m in markers(records)).keys() == {
        "optimizer_step", "zero_grad", "dataloader_next", "backward_enter", "backward_exit"}
    assert leftovers(tracefs, started["group"]) == []

    # Both targets map the same file, so they share one set of events: each
    # marker still arrives once, with its own process.
    both = probes.run(1.5, target.pid, other.pid)
    lo, hi = both[0]["t_mono_ns"], both[-1]["t_mono_ns"]
    for t in (target, other):
        seen = [m["t_mono_ns"] for m in markers(both, "optimizer_step", t.pid)]
        assert len(seen) == len(set(seen)) > 5
        assert abs(len([s for s in seen if lo <= s <= hi])
                   - len([s for _, s in t.timestamps() if lo <= s <= hi])) <= 1
    assert leftovers(tracefs, both[0]["group"]) == []


def test_grad_accumulation_gives_four_backward_passes_per_step(start_target, probes, tracefs):
    target = start_target("--grad-accum", "4")
    records = probes.run(2.5, target.pid)
    kinds = [m["kind"] for m in markers(records)]
    steps = [i for i, k in enumerate(kinds) if k == "optimizer_step"]
    assert len(steps) >= 4
    for a, b in itertools.pairwise(steps):
        between = Counter(kinds[a + 1:b])
        assert between["backward_enter"] == between["backward_exit"] == 4
        assert between["dataloader_next"] == 4 and between["zero_grad"] == 1
    assert leftovers(tracefs, records[0]["group"]) == []


def test_a_sigkilled_probe_is_cleaned_up_by_the_next_start(start_target, probes, tracefs):
    target = start_target(warm_iterations=1)
    killed = probes.start(60, target.pid)
    started = probes.first_record(killed)
    group = started["group"]
    assert any(li.startswith(f"instance {group}_") for li in leftovers(tracefs, group))
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=30)
    left = leftovers(tracefs, group)
    assert any(f"{group}/rf_enter_" in li for li in left)  # nothing removed them
    assert any(f"{group}/bw_exit_" in li for li in left)
    assert f"instance {started['instance']}" in left

    records = probes.run(0.5, target.pid)  # its start() removes what the dead one left
    assert leftovers(tracefs, group) == []
    assert leftovers(tracefs, records[0]["group"]) == []


def test_a_target_that_dies_mid_run_ends_the_probe_cleanly(start_target, probes, tracefs):
    target = start_target()
    proc = probes.start(2.5, target.pid)
    started = probes.first_record(proc)
    time.sleep(0.8)
    target.proc.kill()
    target.proc.wait(timeout=30)
    died = time.monotonic_ns()
    out, err = proc.communicate(timeout=40)
    assert proc.returncode == 0, err
    records = [started, *(json.loads(line) for line in out.splitlines())]
    assert records[-1]["type"] == "closed" and records[-1]["warnings"] == []
    steps = markers(records, "optimizer_step")
    assert steps and all(m["t_mono_ns"] < died for m in steps)
    assert leftovers(tracefs, started["group"]) == []


def test_attach_takes_well_under_a_second(steady_target, probes, tracefs):
    target = steady_target
    attach = [probes.run(0, target.pid)[0]["attach_s"] for _ in range(3)]
    median = statistics.median(attach)
    print(f"tracefs attach times: {', '.join(f'{a * 1e3:.0f} ms' for a in attach)}; "
          f"median {median * 1e3:.0f} ms")
    assert median < 1.0


def test_a_refused_definition_raises_one_line_and_leaves_nothing(
    steady_target, tracefs, monkeypatch
):
    target = steady_target
    monkeypatch.setitem(tracefs_module._NAME_FETCH, os.uname().machine,
                        "+0(+0(%no_such_register)):ustring")
    probe = TracefsMarkerProbe([inspect_process(target.pid)])
    with pytest.raises(PrerequisiteMissing, match=rf"^pid {target.pid} \(python[^)]*\): the "
                       "kernel refused uprobe event .*rf_enter_") as raised:
        probe.start()
    assert "\n" not in str(raised.value)
    assert leftovers(tracefs, probe.group) == []
    probe.close()  # harmless after a failed start
    assert probe.poll() == []


# --- without a target: parsing and stale clean-up ---------------------------------


def test_stale_clean_up_removes_only_dead_agents_probes(tmp_path):
    """On a stand-in tracefs folder: removals are appended to uprobe_events."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = os.getpid()
    events = tmp_path / "uprobe_events"
    events.write_text(
        f"p:{GROUP_PREFIX}{dead.pid}/rf_enter_0 /proc/self/fd/5:0x5c77e90 "
        "name=+0(+0(%si)):ustring\n"
        f"r:{GROUP_PREFIX}{dead.pid}/bw_exit_0 /proc/self/fd/5:0x5c3c980\n"
        f"p:{GROUP_PREFIX}{live}/rf_enter_0 /proc/self/fd/6:0x5c77e90\n"
        "p:uprobes/someone_elses /usr/lib/libc.so.6:0x1234\n"
    )
    (tmp_path / "instances" / f"{GROUP_PREFIX}{dead.pid}_00ab").mkdir(parents=True)
    (tmp_path / "instances" / f"{GROUP_PREFIX}{live}_00cd").mkdir()
    (tmp_path / "instances" / "not_ours").mkdir()
    assert remove_stale_probes(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path / "instances")) == sorted(
        [f"{GROUP_PREFIX}{live}_00cd", "not_ours"])
    appended = events.read_text().splitlines()[4:]
    assert appended == [f"-:{GROUP_PREFIX}{dead.pid}/rf_enter_0",
                        f"-:{GROUP_PREFIX}{dead.pid}/bw_exit_0"]


# -- the whole agent on the tracefs backend, without bcc or kernel headers ---------------

AGENT_WITHOUT_BCC = ("import sys; sys.modules['bcc'] = None; "
                     "from perfmon.agent.cli import main; sys.exit(main())")


def our_definitions(root: str, *agents: subprocess.Popen) -> list[str]:
    """The uprobe events of these agents (each defines its own group, perfmon_PID: the
    agents of tests running beside this one have theirs)."""
    groups = tuple(f"{GROUP_PREFIX}{agent.pid}/" for agent in agents)
    with open(os.path.join(root, "uprobe_events")) as f:
        return [line for line in f if any(g in line for g in groups)]


def start_agent_without_bcc(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", AGENT_WITHOUT_BCC, "attach", "--metrics-address", "off", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "BCC_KERNEL_SOURCE": str(tmp_path / "no-headers")},
        start_new_session=True)


def test_attach_on_tracefs_without_bcc_or_headers_matches_the_targets_clock(
    start_target, tracefs, out_dir, tmp_path
):
    from tests.conftest import load_summary

    target = start_target("--grad-accum", "4")
    proc = start_agent_without_bcc(tmp_path, "--pid", str(target.pid), "--duration", "6",
                                   "--no-stack-sampling", "--output-dir", str(out_dir))
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    # auto: bcc is missing, so tracefs, with one warning that says so.
    (warning,) = [li for li in err.splitlines() if "markers from tracefs" in li]
    assert "bcc" in warning
    summary = load_summary(out_dir)
    info, stats = summary["session_info"], summary["final_statistics"]
    assert info["probe_backend"] == "tracefs" and info["iteration_source"] == "uprobe"
    truth = [t for _, t in target.timestamps()
             if info["attach_monotonic_ns"] <= t <= info["detach_monotonic_ns"]]
    assert abs(info["total_iterations"] - len(truth)) <= 1
    true_ms = statistics.fmean((b - a) / 1e6 for a, b in itertools.pairwise(truth))
    assert stats["avg_step_time_ms"] == pytest.approx(true_ms, rel=0.005)
    assert stats["microbatches_per_step"] == 4
    assert our_definitions(tracefs, proc) == []  # nothing left after a normal exit


def test_a_sigkilled_agent_leaves_events_the_next_agent_removes(
    start_target, tracefs, tmp_path
):
    target = start_target()
    first = start_agent_without_bcc(tmp_path, "--pid", str(target.pid), "--probe-backend",
                                    "tracefs", "--no-stack-sampling",
                                    "--output-dir", str(tmp_path / "a"))
    try:
        deadline = time.monotonic() + 30
        while not our_definitions(tracefs, first) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert our_definitions(tracefs, first), "the first agent never defined its events"
        time.sleep(1)
        first.kill()
        first.wait(timeout=10)
        assert our_definitions(tracefs, first)  # a killed agent cannot clean up after itself
        second = start_agent_without_bcc(tmp_path, "--pid", str(target.pid), "--probe-backend",
                                         "tracefs", "--no-stack-sampling", "--duration", "2",
                                         "--output-dir", str(tmp_path / "b"))
        _, err = second.communicate(timeout=60)
        assert second.returncode == 0, err
        assert our_definitions(tracefs, first, second) == []
    finally:
        first.kill()


def test_an_agent_whose_target_dies_leaves_nothing(start_target, tracefs, tmp_path):
    target = start_target("--train-iters", "120")
    proc = start_agent_without_bcc(tmp_path, "--pid", str(target.pid), "--probe-backend",
                                   "tracefs", "--no-stack-sampling",
                                   "--output-dir", str(tmp_path / "out"))
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert our_definitions(tracefs, proc) == []
    instances = os.listdir(os.path.join(tracefs, "instances"))
    assert not [name for name in instances if name.startswith(f"{GROUP_PREFIX}{proc.pid}_")]
