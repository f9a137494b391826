"""What the agent costs at its defaults: its own CPU (py-spy children included) per
monitored rank, its memory, and the job's CPU per step, for each uprobe backend.

Starts tests/targets/train_gpt.py, then for each backend alternates rounds: the
agent attached at its defaults (stack sampling within the 1% CPU budget) for
--seconds, then detached for --seconds. In each attached round it measures the
agent's CPU over the round's second half (steady state: after start-up and the
budget controller's first adjustments) from /proc/<agent>/stat (utime, stime and
its reaped children's: the py-spy windows), its peak RSS (VmHWM), and the target's
CPU per step from its threads' schedstat, compared with the detached rounds.
Targets: agent CPU <= 1% of a core per rank; target CPU per step ratio ~1.

    .venv/bin/python benchmarks/agent_cost.py --seconds 60 --rounds 3
    .venv/bin/python benchmarks/agent_cost.py --backends tracefs --seconds 40
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pyspy_overhead import _schedstat_ns as schedstat_ns
from pyspy_overhead import _stamps as read_stamps

ROOT = Path(__file__).resolve().parent.parent
TRAIN_GPT = ROOT / "tests" / "targets" / "train_gpt.py"
TICKS = os.sysconf("SC_CLK_TCK")
AGENT_WITHOUT_BCC = ("import sys; sys.modules['bcc'] = None; "
                     "from perfmon.agent.cli import main; sys.exit(main())")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its reaped children (utime+stime+cutime+cstime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / TICKS


def live_children_cpu_s(pid: int) -> float:
    """CPU seconds of the children still running (py-spy windows not yet reaped)."""
    total = 0.0
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            total += tree_cpu_s(int(child))
        except OSError:
            continue
    return total


def vm_hwm_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", text)[1]) / 1024  # type: ignore[index]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="length of each round")
    p.add_argument("--rounds", type=int, default=3, help="attached/detached pairs per backend")
    p.add_argument("--backends", default="bcc,tracefs")
    p.add_argument("--target-args", default="--hidden-size 128 --num-layers 2")
    p.add_argument("--agent-args", default="", help="extra attach arguments")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stamps = Path(tmp) / "stamps.txt"
        target = subprocess.Popen(
            [sys.executable, str(TRAIN_GPT), "--timestamps", str(stamps),
             *args.target_args.split()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while len(read_stamps(stamps)) < 20:
                time.sleep(0.1)

            def target_cpu_per_step(seconds: float) -> float:
                (cpu0, _), lo = schedstat_ns(target.pid), time.monotonic_ns()
                time.sleep(seconds)
                (cpu1, _), hi = schedstat_ns(target.pid), time.monotonic_ns()
                steps = [t for t in read_stamps(stamps) if lo <= t <= hi]
                return (cpu1 - cpu0) / 1e6 / max(1, len(steps) - 1)

            for backend in args.backends.split(","):
                agent_pct, rss, on, off = [], [], [], []
                for _ in range(args.rounds):
                    prefix = ([sys.executable, "-c", AGENT_WITHOUT_BCC] if backend == "tracefs"
                              else [sys.executable, "-m", "perfmon.agent.cli"])
                    agent = subprocess.Popen(
                        [*prefix, "attach", "--pid", str(target.pid), "--probe-backend",
                         backend, "--output-dir", tmp, *args.agent_args.split()],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(args.seconds / 2)  # start-up and the budget's first periods
                    wall0, cpu0 = time.monotonic(), tree_cpu_s(agent.pid) + live_children_cpu_s(
                        agent.pid)
                    on.append(target_cpu_per_step(args.seconds / 2))
                    cpu1 = tree_cpu_s(agent.pid) + live_children_cpu_s(agent.pid)
                    agent_pct.append(100 * (cpu1 - cpu0) / (time.monotonic() - wall0))
                    rss.append(vm_hwm_mb(agent.pid))
                    agent.send_signal(signal.SIGINT)
                    agent.wait(timeout=60)
                    time.sleep(1.0)
                    off.append(target_cpu_per_step(args.seconds / 2))
                print(f"{backend}: agent CPU {statistics.median(agent_pct):.2f}% of a core "
                      f"per rank (rounds: {', '.join(f'{x:.2f}' for x in agent_pct)}); "
                      f"peak RSS {statistics.median(rss):.0f} MB; target CPU per step "
                      f"attached/detached {statistics.median(on) / statistics.median(off):.4f}")
        finally:
            target.kill()
            target.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
