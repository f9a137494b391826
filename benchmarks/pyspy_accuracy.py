"""py-spy mode's step time against the job's own clock, on each Python the job may run.

For every interpreter given (each must import torch), and --runs times each: starts
tests/targets/train_gpt.py under it (it stamps CLOCK_MONOTONIC before every
optimizer.step()), attaches `perfmon-agent attach --iteration-source pyspy` for
--seconds, and compares what the agent found with the job's stamps over the same
span: the iterations between the agent's first and last boundary (missed or doubled
ones show as a difference) and the mean step time (the summary's avg_step_time_ms
against the job's own mean between the stamps those boundaries belong to). Prints a
row per run and a table per interpreter: median and worst step-time error (the goal:
<= 1%), and the iterations missed or doubled.

examples:
  .venv/bin/python benchmarks/pyspy_accuracy.py --python .venv/bin/python
  .venv/bin/python benchmarks/pyspy_accuracy.py --python /opt/py312/bin/python \\
      --python /opt/py313/bin/python --runs 5 --seconds 30
"""

from __future__ import annotations

import argparse
import bisect
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import eventlogs  # (the agent's own log reader, as the tests use it)

TRAIN_GPT = Path(__file__).resolve().parent.parent / "tests" / "targets" / "train_gpt.py"
# Boundaries are found from stack samples a little after the stamp: up to one sampling
# window late (the tests' tolerance).
LATE_NS = 20_000_000


@dataclass
class Run:
    python: str
    version: str
    agent_iterations: int
    job_iterations: int
    agent_ms: float
    job_ms: float

    @property
    def error_pct(self) -> float:
        return (self.agent_ms / self.job_ms - 1) * 100


def _stamps(path: Path) -> list[int]:
    rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return [int(row[1]) for row in rows if len(row) == 2]


def one_run(python: str, seconds: float, target_args: list[str], folder: Path) -> Run:
    stamps, out = folder / "stamps.txt", folder / "out"
    out.mkdir(parents=True)
    job = subprocess.Popen([python, str(TRAIN_GPT), "--timestamps", str(stamps), *target_args],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_stamps(stamps)) < 3:
            if job.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{python}: the job did not start (does it import torch?)")
            time.sleep(0.1)
        done = subprocess.run([sys.executable, "-m", "perfmon.agent.cli", "attach", "--pid",
                               str(job.pid), "--iteration-source", "pyspy", "--duration",
                               str(seconds), "--output-dir", str(out)],
                              check=False, capture_output=True, text=True,
                              timeout=seconds + 120)
        (folder / "agent.stderr").write_text(done.stderr)
        if done.returncode != 0:
            raise SystemExit(f"{python}: attach failed: {done.stderr[-2000:]}")
        version = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    (summary_path,) = out.glob("perf_summary_*.json")
    stats = json.loads(summary_path.read_text())["final_statistics"]
    (log,) = out.glob("perf_events_*.msgpack")
    ends = [row["end_ns"] for row in eventlogs.step_rows(eventlogs.read_records(log))]
    job_ends = _stamps(stamps)
    first, last = (bisect.bisect_right(job_ends, t + LATE_NS) - 1 for t in (ends[0], ends[-1]))
    return Run(python, version, agent_iterations=len(ends) - 1, job_iterations=last - first,
               agent_ms=stats["avg_step_time_ms"],
               job_ms=(job_ends[last] - job_ends[first]) / (last - first) / 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--python", action="append", required=True,
                        help="an interpreter that imports torch (repeat for several)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--target-args", default="--hidden-size 64 --seq-length 256 "
                        "--micro-batch-size 16 --optimizer sgd",
                        help="train_gpt.py's arguments (default: a short SGD step, ~1.5 ms "
                             "of ~150 ms, the hardest to sample)")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep each run's stamps and agent output here (to replay or "
                             "inspect a run that was off), not in a temporary folder")
    args = parser.parse_args()
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep {args.keep}: not empty (runs would mix with earlier ones)")
    results: dict[str, list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="pyspy-accuracy-") as scratch:
        tmp = args.keep or Path(scratch)
        for n in range(args.runs):  # (interleaved, so drift in the machine's load is shared)
            for python in args.python:
                run = one_run(python, args.seconds, args.target_args.split(),
                              Path(tmp) / f"{len(results.get(python, []))}-{abs(hash(python))}")
                results.setdefault(python, []).append(run)
                print(f"run {n + 1}: Python {run.version}: agent {run.agent_iterations} "
                      f"iterations, {run.agent_ms:.2f} ms; job {run.job_iterations}, "
                      f"{run.job_ms:.2f} ms: error {run.error_pct:+.2f}%", flush=True)
    print("\n| Python | runs | median error | worst error | iterations missed or doubled |")
    print("|---|---|---|---|---|")
    for runs in results.values():
        errors = [abs(r.error_pct) for r in runs]
        off = sum(abs(r.agent_iterations - r.job_iterations) for r in runs)
        total = sum(r.job_iterations for r in runs)
        print(f"| {runs[0].version} | {len(runs)} | {statistics.median(errors):.2f}% | "
              f"{max(errors):.2f}% | {off} of {total} |")


if __name__ == "__main__":
    main()
