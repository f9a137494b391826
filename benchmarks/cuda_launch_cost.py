"""What counting CUDA kernel launches costs a launch-bound job, and what sampling saves.

Starts tests/targets/train_fake_cuda.py against the fake libcudart/libcuda/libnccl
(the real C ABI, built by tests/fakes/build_cuda.py) making --launches
cudaLaunchKernel calls a step (~7 ms steps by default), then alternates rounds:
the agent attached with --cuda-launches MODE, then detached. Reports the median
step time ratio attached/detached per mode, the launches per iteration the agent
counted (exact on the iterations it probed), and the per-launch cost of a probed
launch ((probed step - plain step) / launch traps).
Target: sampled (the default) <= 1.01 while the launches per probed iteration stay exact.

    .venv/bin/python benchmarks/cuda_launch_cost.py --modes sampled,always --seconds 20
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fakes.build_cuda import build_fake_cuda  # noqa: E402

TARGET = ROOT / "tests" / "targets" / "train_fake_cuda.py"


def stamps(path: Path) -> list[int]:
    rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return [int(r[1]) for r in rows if len(r) == 2]


def steps_ms(path: Path, lo: int, hi: int) -> list[float]:
    inside = [t for t in stamps(path) if lo <= t <= hi]
    return [(b - a) / 1e6 for a, b in itertools.pairwise(inside)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launches", type=int, default=3000, help="cudaLaunchKernel calls a step")
    p.add_argument("--idle-ms", type=float, default=4.0, help="the step's other work")
    p.add_argument("--modes", default="sampled,always")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each round")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = build_fake_cuda(Path(tmp) / "libs")
        stamp_file = Path(tmp) / "stamps.txt"
        target = subprocess.Popen(
            [sys.executable, str(TARGET), "--cuda-lib-dir", str(libs.lib_dir), "--timestamps",
             str(stamp_file), "--idle-ms", str(args.idle_ms), "--runtime-launches",
             str(args.launches)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while len(stamps(stamp_file)) < 50:
                time.sleep(0.1)
            for mode in args.modes.split(","):
                on: list[float] = []
                off: list[float] = []
                counted: list[float | None] = []
                for r in range(args.rounds):
                    out = Path(tmp) / f"{mode}{r}"
                    agent = subprocess.Popen(
                        [sys.executable, "-m", "perfmon.agent.cli", "attach", "--pid",
                         str(target.pid), "--cuda-launches", mode, "--no-stack-sampling",
                         "--output-dir", str(out)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
                    time.sleep(3.0)  # start-up: BPF compile, attach
                    lo = time.monotonic_ns()
                    time.sleep(args.seconds)
                    on += steps_ms(stamp_file, lo, time.monotonic_ns())
                    agent.send_signal(signal.SIGINT)
                    agent.wait(timeout=60)
                    (summary,) = out.glob("perf_summary_*.json")
                    counted.append(json.loads(summary.read_text())["final_statistics"].get(
                        "kernels_per_iter"))
                    time.sleep(1.0)
                    lo = time.monotonic_ns()
                    time.sleep(args.seconds)
                    off += steps_ms(stamp_file, lo, time.monotonic_ns())
                ratio = statistics.median(on) / statistics.median(off)
                mean_ratio = statistics.fmean(on) / statistics.fmean(off)
                print(f"{mode}: median step {statistics.median(on):.3f} ms attached, "
                      f"{statistics.median(off):.3f} ms detached: ratio {ratio:.4f} "
                      f"(means: {mean_ratio:.4f}); launches per probed iteration counted: "
                      f"{counted} (the job makes {args.launches})")
                if mode == "always":
                    # Each cudaLaunchKernel traps twice: the runtime entry and the driver's.
                    per_trap_us = ((statistics.median(on) - statistics.median(off)) * 1000
                                   / (2 * args.launches))
                    print(f"  cost of a probed launch entry point: {per_trap_us:.1f} us a trap")
        finally:
            target.kill()
            target.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
