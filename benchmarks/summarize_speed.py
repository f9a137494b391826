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

--baseline DIR alternates each run with one of another version of the agent on the same
log (DIR: a folder holding a ``perfmon`` package of that version, e.g. links to an older
checkout's agent, probes and parsers; put first on PYTHONPATH) and reports the ratios.
"""

from __future__ import annotations

import argparse
import os
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


def summarize_once(log: Path, baseline: Path | None = None) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of one `summarize` in its own process (``baseline``: of
    the agent in that folder)."""
    # VmHWM: this process's own peak (ru_maxrss would include the forking parent's,
    # which Linux carries across exec).
    code = ("import re, sys; from perfmon.agent.cli import main; rc = main(sys.argv[1:]); "
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1], "
            "file=sys.stderr); sys.exit(rc)")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code, "summarize", str(log), "--output",
         str(log.with_suffix(".json"))],
        capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(baseline)} if baseline else None)
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
    p.add_argument("--baseline", type=Path, metavar="DIR",
                   help="alternate every run with the agent in DIR (a perfmon package)")
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
        measured = ({"this": _runs(log, args.runs, size, rank_iterations, None)}
                    if args.baseline is None
                    else _alternating(log, args.runs, size, rank_iterations, args.baseline))
        for name, (rates, speeds, peaks) in measured.items():
            print(f"{name}: median {statistics.median(rates) / 1e6:.2f} M rank-iterations/s "
                  f"(target >= 1), {statistics.median(speeds):.1f} MiB/s, "
                  f"peak RSS max {max(peaks):.0f} MB (target <= 200)")
        if args.baseline is not None:
            (rates, _, peaks), (base, _, base_peaks) = measured["this"], measured["baseline"]
            ratios = [a / b for a, b in zip(rates, base, strict=True)]
            print(f"this / baseline: speed x{statistics.median(ratios):.3f} (median of "
                  f"{len(ratios)} pairs), peak RSS x{max(peaks) / max(base_peaks):.3f}")
    return 0


Runs = tuple[list[float], list[float], list[float]]  # rank-iterations/s, MiB/s, MB


def _runs(log: Path, runs: int, size: int, rank_iterations: int, baseline: Path | None
          ) -> Runs:
    """``runs`` runs of one version (``baseline``: the agent in that folder)."""
    rates, speeds, peaks = [], [], []
    for run in range(runs):
        took, peak_mb = summarize_once(log, baseline)
        rates.append(rank_iterations / took)
        speeds.append(size / 2**20 / took)
        peaks.append(peak_mb)
        print(f"{'baseline' if baseline else 'this'} run {run + 1}: {took:.1f} s, "
              f"{rates[-1] / 1e6:.2f} M rank-iterations/s, {speeds[-1]:.1f} MiB/s of log, "
              f"peak RSS {peak_mb:.0f} MB")
    return rates, speeds, peaks


def _alternating(log: Path, runs: int, size: int, rank_iterations: int,
                 baseline: Path) -> dict[str, Runs]:
    """This version and the baseline, one run each in turn."""
    out: dict[str, Runs] = {"this": ([], [], []), "baseline": ([], [], [])}
    for _ in range(runs):
        for name, where in (("baseline", baseline), ("this", None)):
            rates, speeds, peaks = _runs(log, 1, size, rank_iterations, where)
            out[name][0].extend(rates)
            out[name][1].extend(speeds)
            out[name][2].extend(peaks)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
