"""Views of recorded runs on files anyone may have written: never a crash, never a hang.

`report`, `top`, `merge`, `trace` and `summarize` are given crafted summaries (NaN,
+-Infinity, 1e308, nesting 100,000 deep, values of the wrong types, 100,000 ranks,
100,000 log entries) and crafted event logs (hostile session facts and records). Each
ends within 10 s of CPU with its output (what the schema does not allow shown as unknown,
with one warning) or one line and exit 2, never a traceback. (Documents generated
from the summary schema itself, with every field at its edges or unknown, through every
view in-process: tests/unit/agent/views/test_hostile_summaries.py.)
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from perfmon.agent.record.summary import read_summary

from tests import eventlogs
from tests.conftest import ROOT
from tests.e2e.test_security import job_user, other_user, run_as  # noqa: F401

LIMIT_S = 10.0  # CPU seconds
START = "2026-12-01T00:00:00+00:00"


def _base() -> dict[str, Any]:
    return {"session_info": {"host": "h", "pid": 1, "pids": [1], "ranks": [0], "primary_pid": 1,
                             "attach_monotonic_ns": 1, "start_time": START, "log_interval": 10,
                             "job": {"id": "j", "name": "j", "id_from": "launcher",
                                     "host": "h"}},
            "final_statistics": {"avg_step_time_ms": 10.0}, "iteration_logs": []}


def _entries(n: int, **values: Any) -> list[dict[str, Any]]:
    return [{"iteration": (i + 1) * 10, "timestamp": START, "step_time_ms": 10.0,
             "end_monotonic_ns": (i + 1) * 10**8, "tokens_per_sec": 1000.0, **values}
            for i in range(n)]


def _crafted(case: str) -> str:
    """A crafted summary's text."""
    s = _base()
    if case in ("nan", "infinity", "minus_infinity", "1e308"):
        value = {"nan": math.nan, "infinity": math.inf, "minus_infinity": -math.inf,
                 "1e308": 1e308}[case]
        s["final_statistics"].update(avg_step_time_ms=value, avg_tokens_per_sec=value,
                                     ranks=[{"pid": 1, "avg_compute_ms": value}])
        s["iteration_logs"] = _entries(5, step_time_ms=value, tokens_per_sec=value,
                                       memory_GB=value)
        return json.dumps(s)  # NaN, Infinity, -Infinity as Python's json writes them
    if case == "deep":
        return ('{"session_info": {"x": ' + "[" * 100_000 + "]" * 100_000
                + '}, "final_statistics": {}, "iteration_logs": []}')
    if case == "wrong_types":
        s["session_info"].update(pids=["1"], ranks=["a"], primary_pid="x", host=5,
                                 command_line="x", job=[1], start_time=7)
        s["final_statistics"].update(ranks=["x", {"pid": "1"}], stragglers=[{"pid": "1"}, 3],
                                     phases="x", hangs={"a": 1}, data_quality=[])
        s["iteration_logs"] = [{"iteration": "10", "step_time_ms": "5", "phases": "x"}, 5, None]
        return json.dumps(s)
    if case == "ranks_100000":
        n = 100_000
        s["session_info"].update(pids=list(range(1, n + 1)), ranks=list(range(n)))
        s["final_statistics"]["ranks"] = [{"pid": i + 1, "rank": i, "avg_compute_ms": 10.0 + i % 7,
                                           "avg_wait_ms": 1.0, "peak_rss_gb": 1.0}
                                          for i in range(n)]
        return json.dumps(s)
    if case == "entries_100000":
        s["iteration_logs"] = _entries(100_000)
        return json.dumps(s)
    raise AssertionError(case)


CASES = ["nan", "infinity", "minus_infinity", "1e308", "deep", "wrong_types", "ranks_100000",
         "entries_100000"]


def _agent(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """The command's outcome and the CPU seconds it took: its own work, whatever else the
    machine runs beside it (a wall-clock limit measured the other tests' load; a command
    that blocks meets the timeout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "perfmon.agent.cli", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def _assert_output_or_one_line(done: subprocess.CompletedProcess, elapsed_s: float) -> None:
    assert elapsed_s <= LIMIT_S, elapsed_s
    assert "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    if done.returncode == 0:
        assert all(li.startswith("perfmon-agent: warning: ") for li in lines), lines
        assert len(lines) <= 2, lines
    else:
        # One line naming the problem (after the warnings of what was read before it).
        assert done.returncode == 2 and lines, done.stderr
        assert lines[-1].startswith("perfmon-agent: error: "), lines
        assert all(li.startswith("perfmon-agent: warning: ") for li in lines[:-1]), lines
        assert len(lines) <= 3, lines


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One folder per crafted summary, each holding it as perf_summary_1.json."""
    root = tmp_path_factory.mktemp("crafted")
    folders = {}
    for case in CASES:
        folder = root / case
        folder.mkdir()
        (folder / "perf_summary_20261201_000000.json").write_text(_crafted(case))
        folders[case] = folder
    return folders


@pytest.mark.parametrize("case", CASES)
def test_report_top_and_merge_end_in_time_with_output_or_one_line(
        crafted: dict[str, Path], tmp_path: Path, case: str) -> None:
    folder = crafted[case]
    summary = next(folder.iterdir())
    for args in (["report", str(summary), "-o", str(tmp_path / "r.html")],
                 ["top", "--once", str(folder)],
                 ["merge", str(folder), "-o", str(tmp_path / "job.json")]):
        done, elapsed_s = _agent(*args)
        _assert_output_or_one_line(done, elapsed_s)
        if args[0] == "report" and done.returncode == 0:
            page = (tmp_path / "r.html").read_text()
            assert "NaN" not in page and "inf ms" not in page
    if case in ("nan", "infinity", "minus_infinity", "1e308"):
        # What is not a figure is unknown, with one warning naming the field.
        _, problem = read_summary(summary)
        assert problem is not None and "final_statistics.avg_step_time_ms" in problem
    if case == "ranks_100000":
        # The 64 slowest and fastest ranks drawn, the rest as one line.
        page = (tmp_path / "r.html").read_text()
        assert "99,872 more ranks: compute min" in page
        assert page.count("<tr>") < 200


@pytest.mark.parametrize("case", CASES)
def test_trace_and_summarize_refuse_a_summary_in_one_line(
        crafted: dict[str, Path], tmp_path: Path, case: str) -> None:
    summary = next(crafted[case].iterdir())
    for args in (["trace", str(summary), "-o", str(tmp_path / "t.json")],
                 ["summarize", str(summary), "--output", str(tmp_path / "s.json")]):
        done, elapsed_s = _agent(*args)
        _assert_output_or_one_line(done, elapsed_s)
        assert done.returncode == 2


# -- crafted event logs --------------------------------------------------------------------

def _facts(mutate: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    records = list(eventlogs.records(60))
    mutate(records[0]["session"])
    return records


def _records_out_of_range() -> list[dict[str, Any]]:
    records = list(eventlogs.records(60))
    t = eventlogs.START_NS + 10**9
    gpu = eventlogs._gpu(0, t, [eventlogs.PID])
    gpu.update(power_w=1e308, power_limit_w=1e308, utilization_gpu_pct=(1 << 63) - 1,
               memory_used_bytes=(1 << 63) - 1, temperature_c=(1 << 63) - 1)
    records[30:30] = [
        {"type": "gpu", "t_mono_ns": t, "gpus": [gpu]},
        {"type": "process", "t_mono_ns": t, "pid": eventlogs.PID, "rss_bytes": (1 << 63) - 1,
         "peak_rss_bytes": (1 << 63) - 1},
        # A part said to be coarser, with counts of every wrong kind.
        {"type": "coarsened", "t_mono_ns": t, "part": -5, "from_mono_ns": -(1 << 63),
         "until_mono_ns": (1 << 63) - 1, "interval_s": 0,
         "merged": {"process": [-1, (1 << 63) - 1], "gpu": "x", "nonsense": [1, 1]},
         "dropped": {"phase": (1 << 63) - 1, "marker": -3, "x" * 10_000: 1}},
    ]
    return records


LOGS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "nan_workload": lambda: _facts(lambda f: f["workload"].update(
        flops_per_sample=math.nan, seq_length=math.inf)),
    "1e308_workload": lambda: _facts(lambda f: f["workload"].update(
        flops_per_sample=1e308, global_batch_size=1e308)),
    "huge_world": lambda: _facts(lambda f: f["workload"].update(world_size=1 << 62)),
    "wrong_types": lambda: _facts(lambda f: f.update(
        pids=["1"], ranks=["a"], host=5, command_line="x", gpu=[], cuda="x", model=7,
        job=[1])),
    "deep_facts": lambda: _facts(lambda f: f.update(model=eval("[" * 200 + "]" * 200))),
    "ranks_100000": lambda: _facts(lambda f: f.update(pids=list(range(1, 100_001)),
                                                      ranks=list(range(100_000)))),
    "records_out_of_range": _records_out_of_range,
}


@pytest.mark.parametrize("case", list(LOGS))
def test_summarize_trace_and_report_of_a_crafted_log_end_in_time(tmp_path: Path,
                                                                 case: str) -> None:
    log = tmp_path / "perf_events_20261201_000000.msgpack"
    with open(log, "wb") as f:
        for record in LOGS[case]():
            f.write(msgpack.packb(record))
    for args in (["summarize", str(log), "--output", str(tmp_path / "s.json")],
                 ["trace", str(log), "-o", str(tmp_path / "t.json")],
                 ["report", str(log), "-o", str(tmp_path / "r.html")]):
        done, elapsed_s = _agent(*args)
        _assert_output_or_one_line(done, elapsed_s)
        if args[0] == "summarize" and done.returncode == 0:
            # What summarize writes keeps to the schema, what is unknown null.
            written = json.loads((tmp_path / "s.json").read_text(), parse_constant=_no_constant)
            assert read_summary(tmp_path / "s.json")[1] is None, written["session_info"]
        if args[0] == "trace" and done.returncode == 0:
            json.loads((tmp_path / "t.json").read_text(), parse_constant=_no_constant)
    if case == "huge_world":
        assert done.returncode == 2


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} in the trace")


def test_a_part_planted_by_another_user_beside_a_log_is_not_read(
        tmp_path: Path, job_user, other_user) -> None:  # noqa: F811
    # A sticky folder both may write, as /tmp is: the job user's log, and a ".part1" the
    # other user plants beside it to add records of their own.
    shared = Path(os.environ.get("TMPDIR", "/tmp")) / f"perfmon-shared-{os.getpid()}"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    try:
        log = shared / "perf_events_20261201_000000.msgpack"
        eventlogs.write_log(log, 50)
        os.chown(log, job_user.pw_uid, job_user.pw_gid)
        planted = shared / "perf_events_20261201_000000.part1.msgpack"
        with open(planted, "wb") as f:
            f.write(msgpack.packb({"type": "log_part", "t_mono_ns": 1, "part": 1}))
            for record in list(eventlogs.records(500))[1:]:
                f.write(msgpack.packb(record))
        os.chown(planted, other_user.pw_uid, other_user.pw_gid)
        done, _ = _agent("summarize", str(log), "--output", str(tmp_path / "s.json"))
        assert done.returncode == 0, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert f"{planted}: owned by uid {other_user.pw_uid}" in line and "not read" in line
        summary = json.loads((tmp_path / "s.json").read_text())
        assert summary["session_info"]["total_iterations"] <= 50
    finally:
        for path in shared.iterdir():
            path.unlink()
        shared.rmdir()


# -- documents made from the schema: every field, at its edges or unknown -------------------
