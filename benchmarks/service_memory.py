"""The node service's memory with its slots full: is it bounded by max_jobs?

Starts `perfmon-agent serve` (its defaults, but a 1 s scan, this run's tagged processes
only, and max_jobs_per_user = max_jobs, since every process here is one user's), then
one of two loads, and samples the service's resident set every second:

- ``--jobs N``: N real training jobs (tests/targets/train_gpt.py, small), all watched
  (N <= max_jobs), each making iterations, for --seconds;
- ``--candidates N``: N processes that map the real libtorch and never train (what a
  user can start by the dozen): max_jobs of them watched, the rest waiting.

Reports the service's RSS once every slot is attached, its RSS at the end, its peak
(VmHWM), the sessions attached and the processes waiting, with MALLOC_ARENA_MAX=2 as
the unit sets it (--arenas to change).

    .venv/bin/python benchmarks/service_memory.py --jobs 16 --seconds 120
    .venv/bin/python benchmarks/service_memory.py --candidates 100 --seconds 120
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN_GPT = ROOT / "tests" / "targets" / "train_gpt.py"
FAKE = "import ctypes, sys, time; ctypes.CDLL(sys.argv[1]); time.sleep(3600)"


def status_mb(pid: int, key: str) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text)[1]) / 1024  # type: ignore[index]


def libtorch() -> Path:
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0]) / "lib" / "libtorch_cpu.so"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--jobs", type=int, help="real training jobs, all watched")
    load.add_argument("--candidates", type=int, help="processes that map libtorch, never train")
    p.add_argument("--max-jobs", type=int, default=16)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--arenas", default="2",
                   help="MALLOC_ARENA_MAX of the service (default 2, as the unit sets it; "
                   "'unset': glibc's default)")
    p.add_argument("--backend", default="auto", choices=["auto", "bcc", "tracefs"])
    args = p.parse_args()
    tag = f"mem-{uuid.uuid4().hex[:8]}"
    folder = Path(tempfile.mkdtemp(prefix="perfmon-mem-"))
    config = folder / "config.yaml"
    config.write_text(json.dumps({
        "jobs_root": str(folder / "jobs"), "scan_interval_s": 1.0, "rank_wait_s": 5,
        "metrics_address": "127.0.0.1:0", "max_jobs": args.max_jobs,
        "max_jobs_per_user": args.max_jobs, "include": {"commands": [re.escape(tag)]},
        "attach": {"probe_backend": args.backend}}))
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    if args.arenas != "unset":
        env["MALLOC_ARENA_MAX"] = args.arenas
    log_path = folder / "serve.log"
    log = log_path.open("wb")
    service = subprocess.Popen([sys.executable, "-m", "perfmon.agent.cli", "serve",
                                "--config", str(config)], stdout=log, stderr=subprocess.STDOUT,
                               env=env, cwd=ROOT)
    procs: list[subprocess.Popen] = []
    samples: list[float] = []
    try:
        time.sleep(3)
        base_mb = status_mb(service.pid, "VmRSS")
        count = args.jobs or args.candidates
        for _ in range(count):
            argv = ([sys.executable, str(TRAIN_GPT), "--tag", tag] if args.jobs else
                    [sys.executable, "-c", FAKE, str(libtorch()), tag])
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, cwd=folder))
        want = min(count, args.max_jobs)
        started = time.monotonic()
        full_mb = None
        while time.monotonic() - started < args.seconds:
            time.sleep(1.0)
            samples.append(status_mb(service.pid, "VmRSS"))
            # Every slot measuring: each attached session has written its first summary.
            measuring = len(list((folder / "jobs").glob("*/*/perf_summary_*.json")))
            if full_mb is None and measuring >= want:
                full_s = time.monotonic() - started
                time.sleep(5)  # their first summaries written
                full_mb = status_mb(service.pid, "VmRSS")
        text = log_path.read_text()
        attached = text.count("attaching to")
        waiting = text.count("(max_jobs)") + text.count("(max_jobs_per_user)")
        print(f"load: {args.jobs or 0} training jobs, {args.candidates or 0} candidates; "
              f"max_jobs {args.max_jobs}; MALLOC_ARENA_MAX={args.arenas}; backend "
              f"{args.backend}")
        print(f"sessions attached: {attached}; waiting said for {waiting}")
        print(f"service RSS: {base_mb:.0f} MB idle; "
              + (f"{full_mb:.0f} MB with every slot measuring ({full_s:.0f} s); "
                 if full_mb is not None else "slots never all measuring; ")
              + f"median {statistics.median(samples):.0f} MB, {samples[-1]:.0f} MB at the end; "
              f"peak (VmHWM) {status_mb(service.pid, 'VmHWM'):.0f} MB")
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
        service.terminate()
        service.wait(timeout=30)
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
