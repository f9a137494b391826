"""A watched process is the same process while its pid and start time are: a real child
is running until it exits, and then gone. (On captured /proc files, with the boot time
moved: tests/unit/probes/test_procfs.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from perfmon.parsers import procfs as parse
from perfmon.probes import procfs


def test_a_real_child_is_running_until_it_exits_and_then_gone():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        stat = parse.parse_stat(Path(f"/proc/{child.pid}/stat").read_text())
        target = procfs.TargetProcess(child.pid, "python", [], {}, "", 0.0,
                                      start_ticks=stat.start_ticks)
        assert procfs.is_running(target)
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
        assert not procfs.is_running(target)
        assert procfs.process_state(target) == "gone"
    finally:
        child.kill()
        child.wait()
