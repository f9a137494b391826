"""Does attaching the agent slow the training job? Alternate with/without in one run.

Starts tests/targets/train_gpt.py (which writes its own step timestamps), then
alternates rounds: agent attached for --seconds, agent detached for --seconds.
Reports the median step time in each state and the ratio attached/detached.
Target: a ratio under 1.01 for uprobes alone (the default), under 1.02 with
stack sampling (--agent-args '').

    .venv/bin/python benchmarks/uprobe_overhead.py --seconds 5 --rounds 6
    .venv/bin/python benchmarks/uprobe_overhead.py --seconds 5 --rounds 6 --agent-args ''

A job without torch.optim's marker (its updates found by gradient reads, which the
agent probes for as long as the job shows no Optimizer.step):

    .venv/bin/python benchmarks/uprobe_overhead.py --target tests/targets/train_variants.py \
        --target-args '--update manual'

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

# Shared with the stack-sampling benchmark beside this file.
from pyspy_overhead import _schedstat_ns as schedstat_ns
from pyspy_overhead import _stamps as read_stamps

ROOT = Path(__file__).resolve().parent.parent
TRAIN_GPT = ROOT / "tests" / "targets" / "train_gpt.py"


def step_times_ms(stamps: list[int], lo: int, hi: int) -> list[float]:
    inside = [t for t in stamps if lo <= t <= hi]
    return [(b - a) / 1e6 for a, b in itertools.pairwise(inside)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0, help="length of each round")
    p.add_argument("--rounds", type=int, default=4, help="pairs of attached/detached rounds")
    p.add_argument("--target", type=Path, default=TRAIN_GPT,
                   help="the training script (it takes --timestamps FILE)")
    p.add_argument("--target-args", default="--hidden-size 128 --num-layers 2",
                   help="arguments for the training script")
    p.add_argument("--agent-args", default="--no-stack-sampling",
                   help="extra attach arguments (default: uprobes alone, no py-spy; "
                   "pass '' for the default session with stack sampling)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stamps = Path(tmp) / "stamps.txt"
        target = subprocess.Popen(
            [sys.executable, str(args.target), "--timestamps", str(stamps),
             *args.target_args.split()],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not stamps.exists() or len(read_stamps(stamps)) < 20:
                time.sleep(0.1)
            on: list[float] = []
            off: list[float] = []
            cpu: dict[bool, list[float]] = {True: [], False: []}  # target CPU ms per step

            def measure(attached: bool) -> None:
                (cpu0, _), lo = schedstat_ns(target.pid), time.monotonic_ns()
                time.sleep(args.seconds)
                (cpu1, _), hi = schedstat_ns(target.pid), time.monotonic_ns()
                steps = step_times_ms(read_stamps(stamps), lo, hi)
                (on if attached else off).extend(steps)
                cpu[attached].append((cpu1 - cpu0) / 1e6 / max(1, len(steps)))

            for _ in range(args.rounds):
                agent = subprocess.Popen(
                    [sys.executable, "-m", "perfmon.agent.cli", "attach", "--pid",
                     str(target.pid), "--output-dir", tmp, *args.agent_args.split()],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(3.0)  # agent start-up: imports, BPF compile, attach
                measure(attached=True)
                agent.send_signal(signal.SIGINT)
                agent.wait(timeout=30)
                time.sleep(1.0)  # detach settles
                measure(attached=False)
        finally:
            target.kill()
            target.wait()
    med_on, med_off = statistics.median(on), statistics.median(off)
    print(f"attached:  median step {med_on:.3f} ms over {len(on)} steps")
    print(f"detached:  median step {med_off:.3f} ms over {len(off)} steps")
    print(f"ratio attached/detached: {med_on / med_off:.4f}")
    cpu_on, cpu_off = statistics.median(cpu[True]), statistics.median(cpu[False])
    print(f"target CPU per step (median of rounds): attached {cpu_on:.3f} ms, "
          f"detached {cpu_off:.3f} ms, ratio {cpu_on / cpu_off:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
