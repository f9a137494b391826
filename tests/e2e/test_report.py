"""`perfmon-agent report` : the page of a real
session rendered in headless Chromium, long runs downsampled, PNGs, folders of logs,
bad inputs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import eventlogs
from tests.conftest import load_summary

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Runs a command as a child subreaper: Chromium leaves helpers behind (zygotes, the
# crash handler, which daemonizes); they are re-parented here, killed and reaped, so
# nothing outlives the test. argv: timeout_s, command...
REAPER = r"""
import ctypes, os, subprocess, sys
import psutil
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
proc = subprocess.Popen(sys.argv[2:])
try:
    rc = proc.wait(timeout=float(sys.argv[1]))
except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    rc = 124
while True:
    left = psutil.Process().children(recursive=True)
    if not left:
        break
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
sys.exit(rc)
"""


def _report(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "perfmon.agent.cli", "report", *args],
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def _chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium on a local page (no network needed), every process reaped."""
    assert CHROMIUM is not None
    argv = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
            "--enable-logging=stderr", "--v=0", f"--user-data-dir={profile}",
            "--no-first-run", "--disable-crash-reporter", *args, page.resolve().as_uri()]
    return subprocess.run([sys.executable, "-c", REAPER, "90", *argv], capture_output=True,
                          text=True, timeout=150, check=False)


def _console_errors(stderr: str) -> list[str]:
    """Chromium's console lines (``--enable-logging=stderr``) that report a script error."""
    return [line for line in stderr.splitlines()
            if ":CONSOLE" in line and ("Uncaught" in line or "Error" in line)]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _figures(page: str) -> dict[str, str]:
    """id -> inner markup of every <figure class="plot"> of a page."""
    return dict(re.findall(r'<figure class="plot" id="([^"]+)">(.*?)</figure>', page, re.S))


def _assert_self_contained(page: str) -> None:
    assert "<script" not in page.lower()
    assert not re.search(r"<link\b|\bsrc\s*=|@import|url\(\s*['\"]?(https?:|//)", page, re.I)
    # The only http URLs left are SVG namespace names, which nothing fetches.
    urls = set(re.findall(r"https?://[^\s\"')<]+", page))
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}, urls


@needs_chromium
def test_report_of_a_real_session_renders_in_headless_chromium_without_errors(
    steady_target, agent, out_dir, tmp_path: Path
):
    target = steady_target
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "6", "--log-interval", "5",
                    "--cpu-budget", "0", "--output-dir", str(out_dir))
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    (log,) = out_dir.glob("perf_events_*.msgpack")
    page_path = tmp_path / "report.html"
    done = _report(str(log), "-o", str(page_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"report: {page_path} (1 input")
    page = page_path.read_text()
    _assert_self_contained(page)
    # The numbers are summarize's (the same Summarizer replaying the same log).
    avg = summary["final_statistics"]["avg_step_time_ms"]
    assert f"<td>{avg:.2f} ms</td>" in page
    assert f"{summary['session_info']['total_iterations']:,} ended" in page

    dom = _chromium(page_path, tmp_path / "profile", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    figures = _figures(dom.stdout)
    for plot_id in ("plot-step-time", "plot-phases", "plot-memory", "plot-throughput"):
        assert plot_id in figures, sorted(figures)
        assert "<svg" in figures[plot_id] and "<path" in figures[plot_id]
    assert "plot-gpu" not in figures  # a CPU job: no GPU plot
    assert 'id="summary-table"' in dom.stdout and 'id="ranks-table"' in dom.stdout
    assert f'<td class="num">{target.pid}</td>' in dom.stdout  # the ranks table
    assert not _console_errors(dom.stderr), _console_errors(dom.stderr)

    shot = tmp_path / "report.png"
    done = _chromium(page_path, tmp_path / "profile", f"--screenshot={shot}",
                     "--window-size=1280,2400")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not _console_errors(done.stderr), _console_errors(done.stderr)
    data = shot.read_bytes()
    assert _png_size(data) == (1280, 2400)
    assert len(data) > 50_000  # text, tables and plots, not a blank page


@needs_chromium
def test_phases_sampled_in_bursts_show_the_whole_run_and_no_blank_chart(
    steady_target, agent, out_dir, tmp_path: Path
):
    # The default CPU budget samples stacks in bursts, and a short log interval leaves
    # most intervals without a sample (as `make demo`'s report does).
    run = agent.run("attach", "--pid", str(steady_target.pid), "--duration", "12",
                    "--log-interval", "3", "--output-dir", str(out_dir))
    assert run.returncode == 0, run.stderr
    stats = load_summary(out_dir)["final_statistics"]
    assert stats["phases"] is not None and stats["phases_iterations"] >= 1, stats
    (log,) = out_dir.glob("perf_events_*.msgpack")
    page_path = tmp_path / "report.html"
    done = _report(str(log), "-o", str(page_path))
    assert done.returncode == 0, done.stderr
    dom = _chromium(page_path, tmp_path / "profile", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    figure = _figures(dom.stdout)["plot-phases"]
    # The whole run's breakdown, with the iterations it rests on ...
    assert "whole run" in figure and f"{stats['phases_iterations']:,} it." in figure
    assert f"({stats['phases_iterations']:,} iterations sampled)" in figure
    # ... and every interval drawn: sampled as phases, the rest hatched "not sampled".
    caption = re.search(r"each log interval on the right, (\d+) of (\d+) sampled", figure)
    assert caption is not None, figure[-600:]
    sampled, total = int(caption[1]), int(caption[2])
    assert total == len(load_summary(out_dir)["iteration_logs"]) and total >= 5
    assert 0 < sampled < total  # (bursts: some intervals sampled, not all)
    assert "not sampled" in figure and "<pattern" in figure  # the hatch, in the legend too
    assert not _console_errors(dom.stderr), _console_errors(dom.stderr)


@needs_chromium
def test_the_console_check_sees_a_script_error(tmp_path: Path):
    # The check above is only worth something if Chromium's log shows script errors.
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>throw new Error('boom')</script></body></html>")
    done = _chromium(page, tmp_path / "profile", "--dump-dom")
    assert done.returncode == 0
    assert any("Uncaught Error: boom" in line for line in _console_errors(done.stderr))


@pytest.mark.long(reason='a run long enough to be downsampled')
def test_a_long_run_is_downsampled_and_says_so(tmp_path: Path):
    log = eventlogs.write_log(tmp_path / "perf_events_long.msgpack", 25_000)
    page_path = tmp_path / "long.html"
    done = _report(str(log), "-o", str(page_path), "--json", timeout_s=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    (down,) = result["downsampled"]
    # 24,999 measured iterations in entries of 10: 2,499 intervals, over the 2,000 points
    # a chart is drawn with.
    assert down["intervals"] == 2_499
    assert down["points"] <= 2000 and down["stride"] == 2
    assert down["points"] == -(-2_499 // 2)
    page = page_path.read_text()
    assert len(page.encode()) < 3 << 20 and result["bytes"] == len(page.encode())
    note = re.search(r'<p class="note" id="downsampling">(.*?)</p>', page, re.S)
    assert note is not None
    assert (f"Downsampled: 2,499 log intervals (24,990 iterations) are drawn as "
            f"{down['points']:,} points, each the mean of 2 consecutive intervals") in note[1]
    # The table covers every iteration: 100 ms steps, all of them.
    assert "<td>100.00 ms</td>" in page and "25,000 ended, 24,999 measured" in page


def shifted(records: Iterator[dict[str, Any]], *, pid_shift: int = 0, host: str = "node-1",
            rank0: int = 0) -> Iterator[dict[str, Any]]:
    """A synthetic session's records as another node's: pids moved up, another host name,
    ranks from ``rank0``."""
    for record in records:
        out = record
        if record["type"] == "session_start":
            facts = dict(record["session"])
            facts.update(host=host, pid=facts["pid"] + pid_shift,
                         primary_pid=facts["primary_pid"] + pid_shift,
                         pids=[p + pid_shift for p in facts["pids"]],
                         ranks=[r + rank0 for r in facts["ranks"]])
            out = {**record, "session": facts}
        elif "pid" in record:
            out = {**record, "pid": record["pid"] + pid_shift}
        elif record["type"] == "gpu":
            out = {**record, "gpus": [
                {**g, "process_memory_bytes": {p + pid_shift: b for p, b in
                                               g["process_memory_bytes"].items()}}
                for g in record["gpus"]]}
        yield out


def node_log(path: Path, *, iterations: int = 30, ranks: int = 2, **shift: Any) -> Path:
    """A GPU node's event log (tests/eventlogs.node_records), optionally shifted."""
    with open(path, "wb") as f:
        eventlogs.write(f, shifted(eventlogs.node_records(iterations, ranks=ranks), **shift))
    return path


def test_png_writes_every_plot_of_a_gpu_node(tmp_path: Path):
    log = node_log(tmp_path / "perf_events_node.msgpack")
    pngs = tmp_path / "plots"
    done = _report(str(log), "-o", str(tmp_path / "node.html"), "--png", str(pngs))
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in pngs.iterdir())
    assert names == sorted(f"plot-{n}.png" for n in
                           ("step-time", "phases", "memory", "gpu", "throughput", "goodput"))
    for name in names:
        data = (pngs / name).read_bytes()
        width, height = _png_size(data)
        assert width >= 1000 and height >= 250 and len(data) > 10_000
    assert [line for line in done.stdout.splitlines() if line.startswith("png: ")] == [
        f"png: {pngs / n}" for n in ("plot-step-time.png", "plot-phases.png",
                                     "plot-memory.png", "plot-gpu.png",
                                     "plot-throughput.png", "plot-goodput.png")]
    page = (tmp_path / "node.html").read_text()
    assert set(_figures(page)) == {"plot-step-time", "plot-phases", "plot-memory", "plot-gpu",
                                   "plot-throughput", "plot-goodput"}
    assert "97.0 %" in page  # GPU utilization of the node's samples


def test_a_folder_of_two_nodes_gives_a_section_each_and_a_combined_table(tmp_path: Path):
    folder = tmp_path / "job"
    (folder / "node-a").mkdir(parents=True)
    (folder / "node-b").mkdir()
    node_log(folder / "node-a" / "perf_events_a.msgpack", host="node-a")
    node_log(folder / "node-b" / "perf_events_b.msgpack", host="node-b", pid_shift=100,
              rank0=2)
    page_path = tmp_path / "job.html"
    done = _report(str(folder), "-o", str(page_path))
    assert done.returncode == 0, done.stderr
    assert "(2 inputs," in done.stdout
    page = page_path.read_text()
    assert 'id="combined-table"' in page
    figures = _figures(page)
    assert "plot-step-time-combined" in figures
    for n in (1, 2):
        assert f'<section class="run" id="run-{n}">' in page
        assert f"plot-step-time-{n}" in figures and f"plot-gpu-{n}" in figures
    # Sections in host order, each with its own ranks.
    assert page.index("node-a · pid 4242 · ranks 0-1") < page.index("node-b · pid 4342 · ranks 2-3")
    # No id twice on the page (each SVG's own ids are prefixed by its plot's).
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))


def test_a_summary_file_gives_the_same_tables(tmp_path: Path):
    log = eventlogs.write_log(tmp_path / "perf_events_s.msgpack", 120)
    done = subprocess.run([sys.executable, "-m", "perfmon.agent.cli", "summarize", str(log),
                           "--output", str(tmp_path / "perf_summary_s.json")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    from_log, from_summary = tmp_path / "a.html", tmp_path / "b.html"
    assert _report(str(log), "-o", str(from_log)).returncode == 0
    assert _report(str(tmp_path / "perf_summary_s.json"), "-o", str(from_summary)).returncode == 0

    def rows(path: Path) -> list[tuple[str, str]]:
        table = re.search(r'<table id="summary-table">(.*?)</table>', path.read_text(), re.S)
        assert table is not None
        return [row for row in re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td></tr>", table[1])
                if row[0] != "source"]

    assert len(rows(from_log)) > 10
    assert rows(from_log) == rows(from_summary)


@pytest.mark.parametrize("kind", ["missing", "fifo", "not_a_log", "json_not_a_summary",
                                  "empty_folder"])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, kind: str):
    path = tmp_path / "input"
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading must not block
    elif kind == "not_a_log":
        path.write_text("hello, this is not an event log\n")
    elif kind == "json_not_a_summary":
        path.write_text('{"hello": 1}\n')
    elif kind == "empty_folder":
        path.mkdir()
    done = _report(str(path), "-o", str(tmp_path / "r.html"), timeout_s=30)
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("perfmon-agent: error: ") and str(path) in line
    assert not (tmp_path / "r.html").exists()
