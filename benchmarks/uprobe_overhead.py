"""Does attaching the agent slow the training job? Alternate with/without in one run.

Starts tests/targets/train_gpt.py (which writes its own step timestamps), then
alternates rounds: agent attached for --seconds, agent detached for --seconds.
Reports the median step time in each state and the ratio attached/detached.
Target: a ratio under 1.01.

    .venv/bin/python benchmarks/uprobe_overhead.py --seconds 5 --rounds 4
"""

from __future__ import annotations

import argparse
import itertools
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN_GPT = ROOT / "tests" / "targets" / "train_gpt.py"


def read_stamps(path: Path) -> list[int]:
    return [int(line.split()[1]) for line in path.read_text().splitlines() if line.count(" ") == 1]


def step_times_ms(stamps: list[int], lo: int, hi: int) -> list[float]:
    inside = [t for t in stamps if lo <= t <= hi]
    return [(b - a) / 1e6 for a, b in itertools.pairwise(inside)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0, help="length of each round")
    p.add_argument("--rounds", type=int, default=4, help="pairs of attached/detached rounds")
    p.add_argument("--target-args", default="--hidden-size 128 --num-layers 2",
                   help="arguments for train_gpt.py")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stamps = Path(tmp) / "stamps.txt"
        target = subprocess.Popen(
            [sys.executable, str(TRAIN_GPT), "--timestamps", str(stamps),
             *args.target_args.split()],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not stamps.exists() or len(read_stamps(stamps)) < 20:
                time.sleep(0.1)
            on: list[float] = []
            off: list[float] = []
            for _ in range(args.rounds):
                agent = subprocess.Popen(
                    [sys.executable, "-m", "perfmon.agent.cli", "attach", "--pid",
                     str(target.pid), "--output-dir", tmp],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(3.0)  # agent start-up: imports, BPF compile, attach
                lo = time.monotonic_ns()
                time.sleep(args.seconds)
                hi = time.monotonic_ns()
                agent.send_signal(signal.SIGINT)
                agent.wait(timeout=30)
                on += step_times_ms(read_stamps(stamps), lo, hi)
                time.sleep(1.0)  # detach settles
                lo = time.monotonic_ns()
                time.sleep(args.seconds)
                hi = time.monotonic_ns()
                off += step_times_ms(read_stamps(stamps), lo, hi)
        finally:
            target.kill()
            target.wait()
    med_on, med_off = statistics.median(on), statistics.median(off)
    print(f"attached:  median step {med_on:.3f} ms over {len(on)} steps")
    print(f"detached:  median step {med_off:.3f} ms over {len(off)} steps")
    print(f"ratio attached/detached: {med_on / med_off:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
