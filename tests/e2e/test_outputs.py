"""Nothing is lost: a full or read-only disk, signals, a closed stdout, a live thinned
summary, and event logs that are malformed or big given to `summarize`. (Week-long runs'
event logs, cut and corrupt logs on their own: tests/unit/agent/record/test_eventlog.py,
test_replay.py and tests/unit/agent/reducers/test_intervals.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zstandard
from perfmon.agent.record.replay import rebuild_from_event_log

from tests import eventlogs
from tests.conftest import load_summary, summary_so_far, wait_for

pytestmark = pytest.mark.usefixtures("ebpf")


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 3 MiB tmpfs of our own, to fill up or make read-only."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0750", "tmpfs", str(mount)],
                   check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> Path:
    """Fill the filesystem of ``folder`` up to the last byte."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 16, 1 << 12, 1):  # down to the last byte
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler



@pytest.mark.long(reason='a disk full for a while and free again, with a job measured throughout')
def test_full_disk_keeps_measuring_says_so_once_and_writes_everything_once_space_returns(
    steady_target, agent, small_fs
):
    target = steady_target
    out = small_fs / "out"
    proc = agent.start("attach", "--pid", str(target.pid), "--output-dir", str(out),
                       "--log-interval", "5")
    wait_for(lambda: (s := summary_so_far(out)) and s["session_info"]["total_iterations"] > 5,
             30, "the first summary")
    # The log's last tmpfs page has room for what a slow day's job logs in a few
    # seconds (one run wrote nothing past it in 8 s): keep the disk full until the
    # log has had more than a page to write, at the rate it grows now.
    (log,) = out.glob("perf_events_*")
    size, started = log.stat().st_size, time.monotonic()
    time.sleep(3)
    rate = (log.stat().st_size - size) / (time.monotonic() - started)
    filler = fill(small_fs)
    time.sleep(min(60.0, max(8.0, 3 * 4096 / max(rate, 1.0))))  # (and a summary try)
    during = summary_so_far(out)  # the last good summary stays in place, whole
    assert during is not None and during["session_info"]["end_time"] is None
    filler.unlink()
    # (the summary is rewritten every 5-15 s, more seldom when its writes are slow: a busy
    # machine's took longer than the 7 s this waited)
    wait_for(lambda: (s := summary_so_far(out)) and s["session_info"]["total_iterations"]
             > during["session_info"]["total_iterations"], 60, "the summary written again")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    full = [li for li in err.splitlines() if "No space left on device" in li]
    assert len([li for li in full if "cannot write the summary" in li]) == 1, err
    assert len([li for li in full if "cannot write the event log" in li]) == 1, err
    assert "the summary is written again" in err
    summary = load_summary(out)
    info = summary["session_info"]
    truth = [t for _, t in target.timestamps()
             if info["attach_monotonic_ns"] <= t <= info["detach_monotonic_ns"]]
    assert abs(info["total_iterations"] - len(truth)) <= 1  # no iteration missed
    # The records that waited in memory reached the log: it rebuilds the same summary.
    rebuilt = rebuild_from_event_log(out / info["event_log"]).summary
    assert rebuilt["final_statistics"] == summary["final_statistics"]
    assert rebuilt["iteration_logs"] == summary["iteration_logs"]


def test_output_that_stays_unwritable_ends_with_exit_7_naming_the_file(
    steady_target, agent, small_fs
):
    target = steady_target
    out = small_fs / "out"
    proc = agent.start("attach", "--pid", str(target.pid), "--output-dir", str(out),
                       "--duration", "6")
    wait_for(lambda: summary_so_far(out), 30, "the first summary")
    # (A filesystem cannot be remounted read-only under a file open for writing, so
    # a full one stands for every refusing disk; EROFS, EIO and EDQUOT take the same path.)
    fill(small_fs)
    reason = "No space left on device"
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("perfmon-agent: error: output not writable: ")
    assert "perf_summary_" in last and reason in last
    assert summary_so_far(out) is not None  # the last good summary is still there


def test_unwritable_output_dir_is_refused_before_anything_attaches(
    steady_target, agent, small_fs
):
    target = steady_target
    (small_fs / "out").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    started = time.monotonic()
    run = agent.run("attach", "--pid", str(target.pid), "--output-dir", str(small_fs / "out"))
    assert time.monotonic() - started < 10
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert "output dir" in line and "not writable: Read-only file system" in line


def test_closed_stdout_ends_the_session_quietly_and_keeps_the_summary(
    steady_target, agent, out_dir
):
    target = steady_target
    proc = agent.start("attach", "--pid", str(target.pid), "--output-dir", str(out_dir),
                       "--log-interval", "5")
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("Attaching to pid")
    proc.stdout.close()  # like `| head -1`
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert load_summary(out_dir)["session_info"]["end_reason"] == "stdout_closed"


def test_json_into_a_closed_pipe_is_quiet(steady_target, out_dir):
    target = steady_target
    agent_cmd = [sys.executable, "-m", "perfmon.agent.cli", "attach", "--pid", str(target.pid),
                 "--duration", "2", "--json", "--output-dir", str(out_dir)]
    done = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | head -c 10 >/dev/null',
                           "bash", *agent_cmd], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
    assert load_summary(out_dir)["session_info"]["end_reason"] == "duration"


# -- week-long runs: bounded files --------------------------------------------------------


def test_live_thinned_summary_equals_the_one_rebuilt_from_its_log(steady_target, agent, out_dir):
    target = steady_target
    run = agent.run("attach", "--pid", str(target.pid), "--output-dir", str(out_dir),
                    "--duration", "5", "--log-interval", "2", "--max-log-entries", "8")
    assert run.returncode == 0, run.stderr
    live = load_summary(out_dir)
    assert len(live["iteration_logs"]) <= 8
    assert any("kept_one_in" in e for e in live["iteration_logs"])
    rebuilt = rebuild_from_event_log(out_dir / live["session_info"]["event_log"]).summary
    assert rebuilt["iteration_logs"] == live["iteration_logs"]
    assert rebuilt["final_statistics"] == live["final_statistics"]


@pytest.mark.parametrize("signum", [signal.SIGHUP])
def test_sighup_ends_the_session_like_sigterm(steady_target, agent, out_dir, signum):
    target = steady_target
    proc = agent.start("attach", "--pid", str(target.pid), "--output-dir", str(out_dir))
    wait_for(lambda: (s := summary_so_far(out_dir)) and s["session_info"]["total_iterations"] > 10,
             30, "iterations in the live summary")
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    info = load_summary(out_dir)["session_info"]
    assert info["end_reason"] == "SIGHUP" and info["end_time"] is not None
    assert target.proc.poll() is None


# -- event logs that are cut, malformed or big -------------------------------------------

def _summarize(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "perfmon.agent.cli", "summarize", *args],
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def test_records_of_the_wrong_shape_are_counted_and_skipped_with_one_warning(tmp_path: Path):
    clean = list(eventlogs.records(200))
    bad = [{"type": "marker", "t_mono_ns": "soon", "pid": 1, "tid": 1, "kind": "optimizer_step",
            "name": ""},
           {"type": "phase", "t_mono_ns": 5},  # fields missing
           [1, 2, 3], "a string", {"no": "type"},
           {"type": "process", "t_mono_ns": 1, "pid": 1, "rss_bytes": None,
            "peak_rss_bytes": None},
           {"type": "gpu", "t_mono_ns": 1, "gpus": "none"}]
    mixed = [*clean[:100], *bad, *clean[100:]]
    log = tmp_path / "perf_events_bad.msgpack"
    with open(log, "wb") as f:
        eventlogs.write(f, iter(mixed))
    done = _summarize(str(log), "--output", str(tmp_path / "s.json"))
    assert done.returncode == 0, done.stderr
    (warning,) = done.stderr.splitlines()
    assert warning.startswith(f"perfmon-agent: warning: {log}: 7 records of the wrong shape "
                              "skipped")
    expected = rebuild_from_event_log(eventlogs.write_log(tmp_path / "perf_events_ok.msgpack",
                                                          200)).summary
    assert json.loads((tmp_path / "s.json").read_text())["final_statistics"] == \
        expected["final_statistics"]


@pytest.mark.parametrize(("content", "needle"), [
    (msgpack.packb({"type": "session_start", "t_mono_ns": 1, "session": {"log_interval": "x"}}),
     "session facts"),
    (msgpack.packb({"type": "session_start", "t_mono_ns": 1, "session": {
        **eventlogs.session_facts(), "workload": {"flops_per_sample": "lots"}}}),
     "workload 'flops_per_sample' is not a number"),
    (b"\xdb\xff\xff\xff\xff" + b"x" * 100, "not a perfmon event log"),  # a 4 GiB string header
    (b"\x91" * 100_000, "not a perfmon event log"),  # arrays nested 100,000 deep
    (b"", "not a perfmon event log"),
    # A zstd stream asking for a 128 MiB window: refused, not given the memory.
    (zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
        3, window_log=27, write_content_size=False)).compressobj().compress(msgpack.packb(
            {"type": "session_start", "t_mono_ns": 1, "session": {}}) * 100_000),
     "too much memory"),
])
def test_logs_that_are_not_event_logs_are_one_line(tmp_path: Path, content: bytes, needle: str):
    log = tmp_path / "perf_events_bogus.msgpack"
    log.write_bytes(content)
    done = _summarize(str(log), timeout_s=30)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("perfmon-agent: error: ") and needle in line
