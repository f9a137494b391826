"""`perfmon-agent top`  in a real pseudo-terminal,
next to a real attach session; and `--once` on static summaries."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from perfmon.agent.record.replay import rebuild_from_event_log

from tests import eventlogs
from tests.conftest import wait_for

ANSI = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>78]")
ROWS, COLS = 40, 160
# A new session whose controlling terminal is stdin, then the program itself (exec).
# As a user's shell starts it: a session with the pty as its controlling terminal, and
# SIGINT at its default (a test run started in the background inherits it ignored).
CONTROLLING_TTY = ("import fcntl, os, signal, sys, termios; os.setsid(); "
                   "fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                   "signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.argv[1], sys.argv[1:])")


class Terminal:
    """A program on a pseudo-terminal of ROWS x COLS that is its controlling terminal
    (so Ctrl-C typed there is SIGINT); everything it writes is collected."""

    def __init__(self, argv: list[str]) -> None:
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
        self.attrs_before = termios.tcgetattr(self.slave)
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        env.update(TERM="xterm-256color", LANG="C.UTF-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CONTROLLING_TTY, *argv], stdin=self.slave, stdout=self.slave,
            stderr=self.slave, env=env)
        self.output = bytearray()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every slave end is closed
                return
            if not data:
                return
            with self._lock:
                self.output += data

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def screen(self) -> str:
        """The text of the latest frame (from its last header on), escapes removed."""
        with self._lock:
            text = ANSI.sub(b"", bytes(self.output)).decode("utf-8", "replace")
        return text[text.rfind("perfmon-agent top"):]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        os.close(self.slave)
        self._reader.join(timeout=10)
        os.close(self.master)


@pytest.fixture
def terminal() -> Iterator:
    started: list[Terminal] = []

    def start(*args: str) -> Terminal:
        t = Terminal([sys.executable, "-m", "perfmon.agent.cli", "top", *args])
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()


def _step_on_screen(screen: str, pid: int) -> str | None:
    for line in screen.splitlines():
        if f":{pid}" in line and (m := re.search(r"(\d+\.\d\d) ms", line)):
            return m[1]
    return None


def _live_avg(out_dir: Path) -> str | None:
    try:
        (path,) = out_dir.glob("perf_summary_*.json")
        avg = json.loads(path.read_text())["final_statistics"]["avg_step_time_ms"]
    except (ValueError, KeyError, FileNotFoundError):
        return None
    return None if avg is None else f"{avg:.2f}"


def test_top_shows_a_live_sessions_step_time_and_quits_on_q(
    steady_target, agent, out_dir, terminal
):
    target = steady_target
    session = agent.start("attach", "--pid", str(target.pid), "--log-interval", "5",
                          "--output-dir", str(out_dir))
    wait_for(lambda: _live_avg(out_dir), timeout_s=30, what="the first summary with a step time")
    top = terminal(str(out_dir), "--interval", "0.5")

    def agreed() -> bool:
        # The summary is rewritten every few seconds and top redraws twice a second:
        # wait for a frame drawn from the summary now on disk.
        shown = _step_on_screen(top.screen(), target.pid)
        return shown is not None and shown == _live_avg(out_dir)

    wait_for(agreed, timeout_s=30, what="top to show the live summary's avg step time")
    screen = top.screen()
    assert "running" in screen and "q quits" in screen
    top.type(b"q")
    assert top.proc.wait(timeout=10) == 0
    assert termios.tcgetattr(top.slave) == top.attrs_before  # cooked mode, echo back
    tail = bytes(top.output)[-400:]
    assert b"\x1b[?1049l" in tail and b"\x1b[?25h" in tail  # main screen and cursor back

    session.send_signal(signal.SIGTERM)
    session.communicate(timeout=60)
    assert session.returncode == 0


def _write_summary(folder: Path, name: str, summary: dict) -> Path:
    path = folder / name
    path.write_text(json.dumps(summary))
    return path


def _node_summary(tmp_path: Path) -> dict:
    log = tmp_path / "node.msgpack"
    with open(log, "wb") as f:
        eventlogs.write(f, eventlogs.node_records(40, ranks=4))
    summary = rebuild_from_event_log(log).summary
    summary["session_info"].update(end_time=None, end_reason=None, hung=True)
    # One open straggler episode (rank 2) and one that ended (rank 1: not flagged).
    summary["final_statistics"]["stragglers"] = [
        {"pid": eventlogs.PID + 1, "rank": 1, "delay_ms_per_step": 9.0,
         "since": "2026-12-01T00:00:00+00:00", "until": "2026-12-01T00:01:00+00:00"},
        {"pid": eventlogs.PID + 2, "rank": 2, "delay_ms_per_step": 12.5,
         "since": "2026-12-01T00:02:00+00:00", "until": None}]
    return summary


def test_once_prints_every_job_with_flags_and_ranks(tmp_path: Path):
    folder = tmp_path / "jobs"
    (folder / "node-1").mkdir(parents=True)
    _write_summary(folder / "node-1", "perf_summary_node.json", _node_summary(tmp_path))
    log = eventlogs.write_log(tmp_path / "cpu.msgpack", 60)
    cpu = rebuild_from_event_log(log).summary
    cpu["session_info"].update(host="cpu-box")
    # An older session of the same job (an agent restarted on it): not shown.
    older = json.loads(json.dumps(cpu))
    older["session_info"]["start_time"] = "2026-11-30T11:00:00+00:00"
    older["final_statistics"]["avg_step_time_ms"] = 999.0
    _write_summary(folder, "perf_summary_new.json", cpu)
    _write_summary(folder, "perf_summary_old.json", older)
    done = subprocess.run([sys.executable, "-m", "perfmon.agent.cli", "top", str(folder), "--once"],
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"perfmon-agent top  2 jobs in {folder}")
    (node,) = [li for li in lines if li.startswith(f"node-1:{eventlogs.PID} (4 ranks)")]
    assert "running" in node and "500.00 ms" in node and "HUNG" in node
    assert "STRAGGLERS 1" in node and "97" in node  # GPU utilization
    ranks = [li for li in lines if li.lstrip().startswith("rank ")]
    assert len(ranks) == 4
    (straggler,) = [li for li in ranks if "STRAGGLER" in li]
    assert f"rank 2 pid {eventlogs.PID + 2}" in straggler
    (job,) = [li for li in lines if li.startswith("cpu-box:")]
    assert "ended: duration" in job and "100.00 ms" in job and "999" not in done.stdout
    assert re.search(r"D+F+B+O+", job)  # the phase bar: 20/30/45/5 % of each step


def test_ctrl_c_quits_and_restores_the_terminal(tmp_path: Path, terminal):
    folder = tmp_path / "jobs"
    folder.mkdir()
    _write_summary(folder, "perf_summary_x.json",
                   rebuild_from_event_log(eventlogs.write_log(tmp_path / "x.msgpack", 30)).summary)
    top = terminal(str(folder), "--interval", "0.2")
    wait_for(lambda: "100.00 ms" in top.screen(), timeout_s=30, what="the first frame")
    top.type(b"\x03")  # Ctrl-C on the controlling terminal: SIGINT
    assert top.proc.wait(timeout=10) == 0
    assert termios.tcgetattr(top.slave) == top.attrs_before
    assert b"\x1b[?1049l" in bytes(top.output)[-400:]


def test_without_a_terminal_it_prints_frames_until_sigterm(tmp_path: Path):
    folder = tmp_path / "jobs"
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "perfmon.agent.cli", "top", str(folder),
                             "--interval", "0.2"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    stdout = proc.stdout
    assert stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        wait_for(lambda: sum("perfmon-agent top  0 jobs" in li for li in lines) >= 2,
                 timeout_s=30, what="two frames")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
    assert proc.returncode == 0, err
    out = "".join(lines)
    assert "no perf_summary_*.json here yet" in out and "Ctrl-C quits" in out


def test_a_missing_folder_is_one_line_and_exit_2(tmp_path: Path):
    done = subprocess.run([sys.executable, "-m", "perfmon.agent.cli", "top", str(tmp_path / "none"),
                           "--once"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"perfmon-agent: error: folder {tmp_path / 'none'}: no such folder\n"
