"""How fast, and in how much memory, does `summarize` rebuild a big event log?

Writes a synthetic log of the records a real session writes (tests/eventlogs.py),
then runs `perfmon-agent summarize` on it --runs times in a fresh process each,
reporting rank-iterations a second, MiB/s and the peak resident memory of that
process. Targets: >= 1 M rank-iterations/s and <= 200 MB on a week-long 8-rank
log (rows); >= 50 MiB/s on a 1 GiB log of the older per-marker format.

Mixes:
  rows  this agent's log (zstd, step rows once a second) of an 8-GPU node for
        --days days at --step-ms steps: NVML and every rank's memory and CPU at
        1 Hz, the primary's backward() spans, every rank's rows
  node  the older per-marker format (--gib): 8 ranks probed, NVML at 1 Hz, memory
        of every rank at 1 Hz, CUDA snapshots of every rank at each step, py-spy
        phases; 500 ms steps
  cpu   the older format (--gib), a CPU job with 100 ms steps: markers and phase
        spans only (the smallest records, so the most of them per MiB)

    .venv/bin/python benchmarks/summarize_speed.py --mix rows --days 7 --runs 3
    .venv/bin/python benchmarks/summarize_speed.py --gib 1 --mix node --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import eventlogs  # noqa: E402

# Bytes of one iteration in each mix (measured), to size the log.
_BYTES_PER_ITERATION = {"node": 9_560, "cpu": 548}


def write_log(path: Path, gib: float, mix: str) -> tuple[int, int]:
    """(bytes, rank-iterations) of an older-format log of about ``gib`` GiB."""
    iterations = int(gib * (1 << 30) / _BYTES_PER_ITERATION[mix])
    records = (eventlogs.node_records(iterations) if mix == "node"
               else eventlogs.records(iterations))
    with open(path, "wb", buffering=1 << 20) as f:
        return eventlogs.write(f, records), iterations * (8 if mix == "node" else 1)


def summarize_once(log: Path) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of one `summarize` in its own process."""
    # VmHWM: this process's own peak (ru_maxrss would include the forking parent's,
    # which Linux carries across exec).
    code = ("import re, sys; from perfmon.agent.cli import main; rc = main(sys.argv[1:]); "
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1], "
            "file=sys.stderr); sys.exit(rc)")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code, "summarize", str(log), "--output",
         str(log.with_suffix(".json"))],
        capture_output=True, text=True, check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"summarize failed: {done.stderr}")
    peak_kib = int(done.stderr.strip().splitlines()[-1])
    return seconds, peak_kib / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mix", choices=["rows", *sorted(_BYTES_PER_ITERATION)], default="rows")
    p.add_argument("--days", type=float, default=7.0, help="rows mix: the job's length")
    p.add_argument("--step-ms", type=int, default=100, help="rows mix")
    p.add_argument("--ranks", type=int, default=8, help="rows mix")
    p.add_argument("--gib", type=float, default=1.0, help="older mixes: the log's size")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="perfmon-bench-") as tmp:
        started = time.monotonic()
        if args.mix == "rows":
            seconds = int(args.days * 86400)
            log = eventlogs.write_rows_log(Path(tmp), seconds, ranks=args.ranks,
                                           step_ns=args.step_ms * 1_000_000)
            size = log.stat().st_size
            rank_iterations = seconds * (1000 // args.step_ms) * args.ranks
        else:
            log = Path(tmp) / "perf_events_20261130_120000.msgpack"
            size, rank_iterations = write_log(log, args.gib, args.mix)
        print(f"wrote {size / 2**20:.0f} MiB ({args.mix} mix, {rank_iterations:,} "
              f"rank-iterations, {size / rank_iterations:.1f} B each) "
              f"in {time.monotonic() - started:.1f} s")
        rates, speeds, peaks = [], [], []
        for run in range(args.runs):
            took, peak_mb = summarize_once(log)
            rates.append(rank_iterations / took)
            speeds.append(size / 2**20 / took)
            peaks.append(peak_mb)
            print(f"run {run + 1}: {took:.1f} s, {rates[-1] / 1e6:.2f} M rank-iterations/s, "
                  f"{speeds[-1]:.1f} MiB/s of log, peak RSS {peak_mb:.0f} MB")
        print(f"median {statistics.median(rates) / 1e6:.2f} M rank-iterations/s (target >= 1), "
              f"{statistics.median(speeds):.1f} MiB/s, "
              f"peak RSS max {max(peaks):.0f} MB (target <= 200)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
