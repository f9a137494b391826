"""`perfmon-agent stacks` (the real CLI) on real targets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TRAIN_GPT

# A stand-in for torchrun: no RANK itself, one child with RANK=0.
LAUNCHER = f"""
import os, subprocess, sys
env = {{**os.environ, "RANK": "0", "WORLD_SIZE": "1"}}
sys.exit(subprocess.call([sys.executable, {str(TRAIN_GPT)!r}, *sys.argv[1:]], env=env))
"""
NO_SUCH_PID = 2**22 + 1  # above the largest pid_max Linux allows


def _stacks(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "perfmon.agent.cli", "stacks", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )


def test_stacks_text_lists_each_thread_most_recent_call_last(start_target):
    target = start_target("--stall-at", "2")
    done = _stacks("--pid", str(target.pid), "--locals")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"Process {target.pid}: ")
    assert f"Thread {target.pid} (idle): MainThread, most recent call last" in lines[1]
    order = [next(i for i, line in enumerate(lines) if line.strip().startswith(name))
             for name in ("<module> (", "train (", "deliberately_stalled_collective (")]
    assert order == sorted(order)
    assert "        iteration = 2" in lines  # --locals, under train()


def test_stacks_json_gives_frames_innermost_first(start_target):
    target = start_target("--stall-at", "2")
    done = _stacks("--pid", str(target.pid), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    (process,) = doc["processes"]
    assert process["pid"] == target.pid and process["rank"] is None
    (thread,) = process["threads"]
    assert thread["tid"] == target.pid and thread["thread_name"] == "MainThread"
    frames = thread["frames"]
    assert [f["function"] for f in frames] == [
        "deliberately_stalled_collective", "train", "<module>"]
    assert frames[0]["file"] == str(TRAIN_GPT) and frames[0]["line"] > 0
    assert "locals" not in frames[0]
    assert doc["innermost_common_frame"] is None  # one rank only


def test_stacks_of_a_launcher_pid_shows_its_rank(start_target, tmp_path: Path):
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    job = start_target("--stall-at", "2", script=launcher)
    done = _stacks("--pid", str(job.pid), "--json")
    assert done.returncode == 0, done.stderr
    (rank,) = json.loads(done.stdout)["processes"]
    assert rank["pid"] != job.pid and rank["rank"] == 0
    assert rank["threads"][0]["frames"][0]["function"] == "deliberately_stalled_collective"


@pytest.mark.parametrize(("pid", "start"), [
    (NO_SUCH_PID, f"perfmon-agent: error: pid {NO_SUCH_PID}: "),
    (0, "perfmon-agent stacks: error: argument --pid: must be positive"),
    (-5, "perfmon-agent stacks: error: argument --pid: must be positive"),
])
def test_stacks_of_a_bad_pid_is_one_line_on_stderr(pid: int, start: str):
    done = _stacks("--pid", str(pid))
    assert done.returncode != 0
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(start)
