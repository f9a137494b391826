"""What the agent costs on jobs with many collectives, and what it writes: a
tensor-parallel-style job (torchrun, gloo, 2 ranks, --tp-collectives small
all-reduces per forward), an FSDP job (the same model, fully_shard per block: an
all-gather per block forward and backward, a reduce-scatter per block) and the DDP job
the tests run.

For each job and uprobe backend it alternates rounds: the agent attached at its
defaults for --seconds, then detached for --seconds. It reports, as medians over the
rounds: the job's step time attached / detached (its own clock: the steps it stamps),
event-log bytes per rank and iteration, the agent's CPU per rank (% of a core, its
py-spy children included), events the kernel dropped, and the agent's mean step time
against the job's own clock over the agent's window (its first to last stamp there).
``--raw-markers`` adds that mode (every collective's entry and return logged) for
comparison.

    .venv/bin/python benchmarks/collective_cost.py --seconds 30 --rounds 3
    .venv/bin/python benchmarks/collective_cost.py --jobs tp --tp-collectives 400 --raw-markers
    .venv/bin/python benchmarks/collective_cost.py --jobs tp \
        --mode "all waits=--wait-probe-budget 0" --mode "no stacks=--no-stack-sampling"
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

from agent_cost import AGENT_WITHOUT_BCC, live_children_cpu_s, tree_cpu_s
from pyspy_overhead import _stamps as read_stamps

ROOT = Path(__file__).resolve().parent.parent
TRAIN_GPT = ROOT / "tests" / "targets" / "train_gpt.py"
RANKS = 2


def median_step_ms(stamps: list[int], lo: int, hi: int) -> float | None:
    inside = sorted(t for t in stamps if lo <= t <= hi)
    steps = [b - a for a, b in itertools.pairwise(inside)]
    return statistics.median(steps) / 1e6 if steps else None


def first_rank_stamps(path: Path) -> list[int]:
    """The first stamp of each iteration (both ranks append to one file)."""
    first: dict[int, int] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            first.setdefault(int(parts[0]), int(parts[1]))
    return [first[k] for k in sorted(first)]


def attached_round(launcher: subprocess.Popen, stamps: Path, backend: str, *, seconds: float,
                   out: Path, extra: list[str]) -> dict[str, float]:
    prefix = ([sys.executable, "-c", AGENT_WITHOUT_BCC] if backend == "tracefs"
              else [sys.executable, "-m", "perfmon.agent.cli"])
    agent = subprocess.Popen([*prefix, "attach", "--pid", str(launcher.pid), "--probe-backend",
                              backend, "--output-dir", str(out), *extra],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(min(10.0, seconds / 3))  # start-up
    lo, wall0 = time.monotonic_ns(), time.monotonic()
    cpu0 = tree_cpu_s(agent.pid) + live_children_cpu_s(agent.pid)
    time.sleep(seconds)
    cpu1 = tree_cpu_s(agent.pid) + live_children_cpu_s(agent.pid)
    hi, wall = time.monotonic_ns(), time.monotonic() - wall0
    agent.send_signal(signal.SIGINT)
    agent.wait(timeout=120)
    (summary_path,) = out.glob("perf_summary_*.json")
    summary = json.loads(summary_path.read_text())
    stats, info = summary["final_statistics"], summary["session_info"]
    log_bytes = sum(p.stat().st_size for p in out.glob("perf_events_*.msgpack"))
    iterations = max(1, info["total_iterations"])
    sources = (stats.get("data_quality") or {}).get("sources") or {}
    dropped = sum(int(c.get("events_dropped") or 0) for c in sources.values())
    job_stamps = first_rank_stamps(stamps)
    job_ms = median_step_ms(job_stamps, lo, hi)
    # The job's own mean step over the agent's window (its first to its last stamp in it).
    inside = [t for t in job_stamps
              if info["attach_monotonic_ns"] <= t <= info["detach_monotonic_ns"]]
    job_mean_ms = ((inside[-1] - inside[0]) / (len(inside) - 1) / 1e6 if len(inside) > 1
                   else float("nan"))
    return {"step_ms": job_ms or float("nan"),
            "agent_pct_per_rank": 100 * (cpu1 - cpu0) / wall / RANKS,
            "log_bytes_per_rank_iteration": log_bytes / iterations / RANKS,
            "dropped": dropped,
            "agent_step_ms": stats.get("avg_step_time_ms") or float("nan"),
            "job_mean_step_ms": job_mean_ms,
            "agent_wait_ms": statistics.fmean(r["avg_wait_ms"] for r in stats["ranks"])
            if stats.get("ranks") else float("nan")}


def run_job(name: str, job_args: list[str], args: argparse.Namespace, port: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        stamps = Path(tmp) / "stamps.txt"
        launcher = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
             "--master-port", str(port), str(TRAIN_GPT), "--optimizer", "sgd",
             "--timestamps", str(stamps), *job_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            while len(read_stamps(stamps)) < 20:
                time.sleep(0.2)
            modes = [("defaults", [])] + ([("raw markers", ["--raw-markers"])]
                                          if args.raw_markers else [])
            modes += [(name, extra.split()) for name, _, extra in
                      (m.partition("=") for m in args.mode)]
            for backend in args.backends.split(","):
                for mode, extra in modes:
                    rounds, off = [], []
                    for k in range(args.rounds):
                        out = Path(tmp) / f"{backend}-{mode}-{k}".replace(" ", "_")
                        out.mkdir()
                        rounds.append(attached_round(launcher, stamps, backend,
                                                     seconds=args.seconds, out=out,
                                                     extra=extra))
                        lo = time.monotonic_ns()
                        time.sleep(args.seconds)
                        off.append(median_step_ms(first_rank_stamps(stamps), lo,
                                                  time.monotonic_ns()) or float("nan"))
                    for r in rounds:
                        r["step_error_pct"] = 100 * (r["agent_step_ms"] / r["job_mean_step_ms"]
                                                     - 1)
                    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
                    ratio = med["step_ms"] / statistics.median(off)
                    # Each attached round against the detached round right after it: the
                    # job's own drift (minutes long) cancels in the pairs.
                    paired = statistics.median(r["step_ms"] / o for r, o in
                                               zip(rounds, off, strict=True))
                    print(f"{name} {backend} {mode}: step attached/detached {ratio:.4f} "
                          f"(median of the {len(off)} pairs {paired:.4f}; "
                          f"{med['step_ms']:.2f} / {statistics.median(off):.2f} ms); "
                          f"event log {med['log_bytes_per_rank_iteration']:,.0f} B per rank "
                          f"and iteration; agent CPU {med['agent_pct_per_rank']:.2f}% of a "
                          f"core per rank; dropped {med['dropped']:.0f}; agent mean step "
                          f"{med['agent_step_ms']:.2f} ms vs the job's own "
                          f"{med['job_mean_step_ms']:.2f} ms over the same window (median "
                          f"error {med['step_error_pct']:+.3f}%); "
                          f"mean wait {med['agent_wait_ms']:.2f} ms", flush=True)
        finally:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0, help="length of each round")
    p.add_argument("--rounds", type=int, default=3, help="attached/detached pairs")
    p.add_argument("--jobs", default="tp,fsdp,ddp")
    p.add_argument("--backends", default="bcc")
    p.add_argument("--tp-collectives", type=int, default=400)
    p.add_argument("--raw-markers", action="store_true", help="also measure --raw-markers")
    p.add_argument("--mode", action="append", default=[], metavar="NAME=ARGS",
                   help="also measure the agent with these arguments, e.g. "
                        "'all waits=--wait-probe-budget 0' (repeatable)")
    args = p.parse_args()
    jobs = {"tp": ["--tp-collectives", str(args.tp_collectives)], "fsdp": ["--fsdp"],
            "ddp": ["--ddp"]}
    for i, name in enumerate(args.jobs.split(",")):
        run_job(name, jobs[name], args, 29690 + i)
    return 0


if __name__ == "__main__":
    sys.exit(main())
