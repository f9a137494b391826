"""Are jobs of every update shape measured exactly? The table of issue 37, repeated.

Starts each shape of tests/targets/train_variants.py (a compiled optimizer step, a
compiled train step, hand-written SGD with 1 and 3 backward passes an update,
torch.optim with foreach and fused kernels, updates no probe sees with and without
--microbatches), attaches the agent for --seconds, and compares the logged iteration
ends with the job's own stamps over the logged span: updates the job made there
against iterations the agent logged, and the mean step time. Each shape --runs times,
attached at a different moment; prints one row a run.

    .venv/bin/python benchmarks/update_clocks.py --runs 3 --seconds 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ROOT / "tests" / "targets" / "train_variants.py"

SHAPES = {
    "compiled optimizer step": ["--update", "compiled_opt"],
    "compiled train step, 3 bw": ["--update", "compiled_step", "--backwards", "3"],
    "hand-written SGD, 1 bw": ["--update", "manual"],
    "hand-written SGD, 3 bw": ["--update", "manual", "--backwards", "3"],
    "hand-written on .data": ["--update", "manual_data"],
    "optim foreach, 2 bw": ["--update", "optim", "--foreach", "--backwards", "2"],
    "optim fused": ["--update", "optim", "--fused"],
    "autograd.grad, 2 bw": ["--update", "autograd_grad", "--backwards", "2"],
    "autograd.grad, 2 bw, --microbatches 2": ["--update", "autograd_grad", "--backwards", "2"],
}
AGENT_ARGS = {"autograd.grad, 2 bw, --microbatches 2": ["--microbatches", "2"]}


def stamps_of(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [int(line.split()[1]) for line in path.read_text().splitlines()
            if len(line.split()) == 2]


def one_run(name: str, seconds: float, wait_s: float, tmp: Path) -> dict:
    stamps = tmp / "stamps.txt"
    out = tmp / "out"
    out.mkdir()
    job = subprocess.Popen([sys.executable, str(VARIANTS), "--timestamps", str(stamps),
                            *SHAPES[name]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while len(stamps_of(stamps)) < 20:
            if time.monotonic() > deadline or job.poll() is not None:
                raise RuntimeError(f"{name}: the job did not start stepping")
            time.sleep(0.2)
        time.sleep(wait_s)
        run = subprocess.run([sys.executable, "-m", "perfmon.agent.cli", "attach", "--pid",
                              str(job.pid), "--duration", str(seconds), "--output-dir", str(out),
                              *AGENT_ARGS.get(name, [])],
                             check=False, capture_output=True, text=True,
                             timeout=seconds + 120)
    finally:
        job.kill()
        job.wait()
    summary = json.loads(next(out.glob("perf_summary_*.json")).read_text())
    stats = summary["final_statistics"]
    ends = [e["end_monotonic_ns"] for e in summary["iteration_logs"]]
    times = stamps_of(stamps)
    row = {"shape": name, "iterations": len(ends) * 10 - 10 if ends else 0,
           "job_updates": None, "step_error_pct": None,
           "micro": stats["microbatches_per_step"], "estimators": stats["iteration_estimators"],
           "clock": stats["iteration_clock"],
           # (each loss as "source: counter", the hint left out)
           "losses": [line.split(" (", 1)[0] for line in stats["data_quality"]["losses"]],
           "nothing_missed": "nothing missed" in run.stdout, "hangs": len(stats["hangs"])}
    if len(ends) >= 2:
        first = max(i for i, t in enumerate(times) if t <= ends[0])
        last = max(i for i, t in enumerate(times) if t <= ends[-1])
        row["job_updates"] = last - first
        truth = (times[last] - times[first]) / (last - first)
        ours = (ends[-1] - ends[0]) / row["iterations"]
        row["step_error_pct"] = round(100 * (ours / truth - 1), 3)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    print("| shape | run | iterations (agent) | updates (job) | step time error % | "
          "micro-batches | estimator | clock | losses | nothing missed | hangs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        for i in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                r = one_run(name, args.seconds, 0.5 + 1.7 * i, Path(tmp))
            print(f"| {name} | {i + 1} | {r['iterations']} | {r['job_updates']} | "
                  f"{r['step_error_pct']} | {r['micro']} | "
                  f"{','.join(r['estimators']) or '-'} | {r['clock']} | "
                  f"{'; '.join(r['losses']) or '-'} | "
                  f"{r['nothing_missed']} | {r['hangs']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
