"""`perfmon-agent trace` : a real session's event
log as a Chrome/Perfetto trace, and several logs as several ranks."""

from __future__ import annotations

import bisect
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests import eventlogs
from tests.conftest import load_summary
from tests.e2e.test_report import node_log, shifted
from tests.traces import trace_events as _load


def _trace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "perfmon.agent.cli", "trace", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def _names(events: list[dict[str, Any]], kind: str) -> dict[tuple[int, int | None], str]:
    return {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == kind}


def _track(events: list[dict[str, Any]], pid: int, name: str) -> list[dict[str, Any]]:
    """The X slices on a process's track of that name, in time order."""
    (tid,) = [t for (p, t), n in _names(events, "thread_name").items() if p == pid and n == name]
    return sorted((e for e in events if e["ph"] == "X" and e["pid"] == pid and e["tid"] == tid),
                  key=lambda e: e["ts"])


def test_trace_of_a_real_session_has_an_iteration_slice_per_measured_iteration(
    steady_target, agent, out_dir, tmp_path: Path
):
    target = steady_target
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "6", "--log-interval", "5",
                    "--cpu-budget", "0", "--output-dir", str(out_dir))
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    info = summary["session_info"]
    (log,) = out_dir.glob("perf_events_*.msgpack")
    out = tmp_path / "trace.json"
    done = _trace(str(log), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"trace: {out} (1 event log, 1 rank, ")
    events = _load(out)
    assert _names(events, "process_name") == {(target.pid, None): f"rank 0 (pid {target.pid})"}

    # One slice per measured iteration, end to end, at the step rows' own times.
    iterations = _track(events, target.pid, "iterations")
    assert len(iterations) == info["total_iterations"] - 1 > 50
    records = eventlogs.read_records(log)
    ends = [row["end_ns"] for row in eventlogs.step_rows(records) if row["pid"] == target.pid]
    assert len(ends) == info["total_iterations"]
    for slice_, (start, end) in zip(iterations, itertools.pairwise(ends), strict=True):
        assert slice_["ts"] == start / 1000
        assert slice_["dur"] == (end - start) / 1000
        assert slice_["args"]["start_mono_ns"] == start and slice_["args"]["end_mono_ns"] == end
    for a, b in itertools.pairwise(iterations):
        assert a["args"]["end_mono_ns"] == b["args"]["start_mono_ns"]  # ordered, no overlap
        assert a["args"]["iteration"] + 1 == b["args"]["iteration"]
    # Named with the job's own number when the agent read it: the number the target
    # stamped just before that optimizer.step.
    if info["iteration_numbering"] == "job_counter":
        stamps = target.timestamps()
        times = [t for _, t in stamps]
        for slice_ in (iterations[0], iterations[-1]):
            number, _ = stamps[bisect.bisect_right(times, slice_["args"]["end_mono_ns"]) - 1]
            assert slice_["name"] == f"iteration {number}"

    # Phases (py-spy spans): inside the session's window, never overlapping each other.
    phases = _track(events, target.pid, "phases (py-spy samples)")
    assert phases and {p["name"] for p in phases} <= {
        "data_loading", "forward", "backward", "optimizer", "other"}
    window = (info["attach_monotonic_ns"] / 1000, info["detach_monotonic_ns"] / 1000)
    for p in phases:
        assert window[0] <= p["ts"] and p["ts"] + p["dur"] <= window[1] + 1e-3
    for a, b in itertools.pairwise(phases):
        assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
    # backward() from the uprobes lies inside the iterations.
    backward = _track(events, target.pid, "backward() (uprobes)")
    assert len(backward) >= len(iterations)
    memory = [e for e in events if e["ph"] == "C" and e["name"] == "resident memory"]
    assert memory and all(0 < e["args"]["GiB"] < 64 for e in memory)


def test_two_logs_give_two_processes(tmp_path: Path):
    folder = tmp_path / "logs"
    folder.mkdir()
    eventlogs.write_log(folder / "perf_events_rank0.msgpack", 50)
    with open(folder / "perf_events_rank1.msgpack", "wb") as f:
        eventlogs.write(f, shifted(eventlogs.records(50), pid_shift=101, rank0=1))
    out = tmp_path / "trace.json"
    done = _trace(str(folder), "-o", str(out))
    assert done.returncode == 0, done.stderr
    events = _load(out)
    pid0, pid1 = eventlogs.PID, eventlogs.PID + 101
    assert _names(events, "process_name") == {(pid0, None): f"rank 0 (pid {pid0})",
                                              (pid1, None): f"rank 1 (pid {pid1})"}
    for pid in (pid0, pid1):
        iterations = _track(events, pid, "iterations")
        assert [s["name"] for s in iterations] == [f"iteration {n}" for n in range(2, 51)]
        assert iterations[0]["ts"] == (eventlogs.START_NS + 96_000_000) / 1000
        assert all(s["dur"] == eventlogs.STEP_NS / 1000 for s in iterations)
        assert len(_track(events, pid, "phases (py-spy samples)")) == 4 * 50


def test_a_gpu_node_gives_gpu_and_cuda_counters_per_rank(tmp_path: Path):
    log = node_log(tmp_path / "perf_events_node.msgpack", iterations=12, ranks=2)
    out = tmp_path / "trace.json"
    assert _trace(str(log), "-o", str(out)).returncode == 0
    events = _load(out)
    for rank, pid in enumerate((eventlogs.PID, eventlogs.PID + 1)):
        assert _names(events, "process_name")[(pid, None)] == f"rank {rank} (pid {pid})"
        assert len(_track(events, pid, "iterations")) == 11
        counters = {e["name"]: e["args"] for e in events if e["ph"] == "C" and e["pid"] == pid}
        # Each rank shows the GPU it uses (one GPU per rank in node_records).
        assert counters[f"GPU {rank} utilization"] == {"%": 97}
        assert counters[f"GPU {rank} power"] == {"W": 612.5}
        assert counters["CUDA sync wait / iteration"] == {"ms": 2.0}
        assert counters["NCCL calls / iteration"] == {"calls": 20.0}  # 2 a collective type


def test_logs_of_two_hosts_with_the_same_pid_stay_apart(tmp_path: Path):
    folder = tmp_path / "logs"
    (folder / "a").mkdir(parents=True)
    (folder / "b").mkdir()
    for host in ("a", "b"):
        with open(folder / host / "perf_events_x.msgpack", "wb") as f:
            eventlogs.write(f, shifted(eventlogs.records(20), host=f"host-{host}"))
    out = tmp_path / "trace.json"
    assert _trace(str(folder), "-o", str(out)).returncode == 0
    names = _names(_load(out), "process_name")
    assert names == {(eventlogs.PID, None): f"rank 0 (pid {eventlogs.PID}) on host-a",
                     (eventlogs.PID + (1 << 22), None): f"rank 0 (pid {eventlogs.PID}) on host-b"}


def test_a_summary_is_refused_with_one_line(tmp_path: Path):
    path = tmp_path / "perf_summary_x.json"
    path.write_text('{"session_info": {}}\n')
    done = _trace(str(path), "-o", str(tmp_path / "t.json"))
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("perfmon-agent: error: ") and "not an event log" in line
