"""A watched process is the same process while its pid and start time (clock ticks after
boot) are: never a float that adds the kernel's boot time.

The kernel derives /proc/stat's ``btime`` from the wall clock minus the time since
boot, so it moves by a second when the clock is slewed (issue 36: a 2-rank session
ended "target_exited" 0.3 s after attaching, both ranks alive, and the ledger charged
a restart that never happened). psutil's ``create_time`` is ``btime + ticks / HZ``.

The captured files (tests/data/proc_pid_stat_python.txt, proc_stat_host.txt) are a
sleeping Python process's /proc/PID/stat and its host's /proc/stat. (A real child:
tests/e2e/test_process_identity.py.)
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from perfmon.parsers import procfs as parse
from perfmon.probes import procfs

DATA = Path(__file__).resolve().parents[2] / "data"
CAPTURED_STAT = (DATA / "proc_pid_stat_python.txt").read_text()
CAPTURED_PID = int(CAPTURED_STAT.split()[0])
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _proc_root(tmp: Path, btime: int, stat: str = CAPTURED_STAT) -> str:
    """A /proc holding the captured files, with the host's boot time set to ``btime``."""
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / str(CAPTURED_PID)).mkdir(parents=True)
    (tmp / str(CAPTURED_PID) / "stat").write_text(stat)
    host = (DATA / "proc_stat_host.txt").read_text()
    (tmp / "stat").write_text(re.sub(r"(?m)^btime \d+$", f"btime {btime}", host))
    return str(tmp)


def _target(proc: str) -> procfs.TargetProcess:
    """The process as attach saw it: its start ticks read once, from ``proc``."""
    start_ticks = parse.parse_stat(Path(proc, str(CAPTURED_PID), "stat").read_text()).start_ticks
    btime = int(re.search(r"(?m)^btime (\d+)$", Path(proc, "stat").read_text())[1])
    return procfs.TargetProcess(CAPTURED_PID, "python3", [], {}, "", btime
                                + start_ticks / CLOCK_TICKS, start_ticks=start_ticks)


@given(shift_s=st.integers(-3, 3).filter(bool))
def test_a_boot_time_that_moves_never_ends_a_live_process(tmp_path_factory, shift_s):
    root = tmp_path_factory.mktemp("proc")
    captured_btime = int(re.search(r"(?m)^btime (\d+)$",
                                   (DATA / "proc_stat_host.txt").read_text())[1])
    target = _target(_proc_root(root, captured_btime))
    moved = _proc_root(root, captured_btime + shift_s)
    # What the old rule compared: the same process's create_time now differs ...
    moved_create_time = (captured_btime + shift_s) + target.start_ticks / CLOCK_TICKS
    assert moved_create_time != target.create_time
    # ... and what identity is now: the same process, alive.
    assert procfs.process_state(target, moved) == "alive"


def test_another_start_time_on_the_pid_is_gone_and_a_zombie_is_one(tmp_path):
    target = _target(_proc_root(tmp_path / "a", 0))
    fields = CAPTURED_STAT.split(" ")
    fields[21] = str(int(fields[21]) + 1)  # starttime: the pid reused by a newer process
    assert procfs.process_state(target, _proc_root(tmp_path / "b", 0, " ".join(fields))) == "gone"
    fields = CAPTURED_STAT.split(" ")
    fields[2] = "Z"
    assert procfs.process_state(target, _proc_root(tmp_path / "c", 0, " ".join(fields))) == "zombie"
    shutil.rmtree(tmp_path / "d", ignore_errors=True)
    (tmp_path / "d").mkdir()
    assert procfs.process_state(target, str(tmp_path / "d")) == "gone"  # reaped
    torn = _proc_root(tmp_path / "e", 0, "6260 (python3")  # a read that is not a stat line
    assert procfs.process_state(target, torn) == "unknown"
