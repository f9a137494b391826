"""The node service over many short jobs: is it bounded? Starts `perfmon-agent serve` (its
defaults, but a 1 s scan and only this run's tagged jobs), then runs --jobs short training
jobs one after another (every --torchrun-th one a 2-rank torchrun job), each for
--iterations iterations, and waits for the service to finalize each before the next.

Reports: the service's peak RSS (VmHWM), its RSS after the first job and after the
last (flat memory: the state of finished jobs is dropped), its CPU per job (its own and
its reaped children's, py-spy included), how many jobs it found and finalized, and the
time from a job's first iteration... to its folder's "ended" record.

    .venv/bin/python benchmarks/service_soak.py --jobs 50
"""

from __future__ import annotations

import argparse
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
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / TICKS


def status_mb(pid: int, key: str) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text)[1]) / 1024  # type: ignore[index]


def job_records(root: Path) -> list[dict]:
    records = []
    for path in root.glob("*/*/job.json"):
        try:
            records.append(json.loads(path.read_text()))
        except ValueError:
            continue
    return records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--torchrun", type=int, default=5, help="every Nth job is a torchrun job")
    args = p.parse_args()
    tag = f"soak-{uuid.uuid4().hex[:8]}"
    folder = Path(tempfile.mkdtemp(prefix="perfmon-soak-"))
    config = folder / "config.yaml"
    config.write_text(json.dumps({
        "jobs_root": str(folder / "jobs"), "scan_interval_s": 1.0,
        "metrics_address": "127.0.0.1:0", "include": {"commands": [re.escape(tag)]}}))
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}  # as the unit sets it
    log = (folder / "serve.log").open("wb")
    service = subprocess.Popen([sys.executable, "-m", "perfmon.agent.cli", "serve",
                                "--config", str(config)], stdout=log, stderr=subprocess.STDOUT,
                               env=env, cwd=ROOT)
    rss_after: list[float] = []
    finalize_s: list[float] = []
    try:
        time.sleep(3)
        cpu_start = cpu_s(service.pid)
        for i in range(args.jobs):
            if args.torchrun and i % args.torchrun == args.torchrun - 1:
                argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(TRAIN_GPT), "--ddp"]
            else:
                argv = [sys.executable, str(TRAIN_GPT)]
            job = subprocess.run([*argv, "--train-iters", str(args.iterations), "--tag", tag],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 check=False)
            exited = time.monotonic()
            deadline = exited + 60
            while time.monotonic() < deadline:
                records = job_records(folder / "jobs")
                if len(records) > i and all(r["status"] != "running" for r in records):
                    break
                time.sleep(0.1)
            finalize_s.append(time.monotonic() - exited)
            rss_after.append(status_mb(service.pid, "VmRSS"))
            print(f"job {i + 1:3}/{args.jobs} exit {job.returncode}: service RSS "
                  f"{rss_after[-1]:.1f} MB, finalized {finalize_s[-1]:.1f} s after exit",
                  flush=True)
        cpu_total = cpu_s(service.pid) - cpu_start
        peak = status_mb(service.pid, "VmHWM")
    finally:
        service.terminate()
        service.wait(timeout=30)
        log.close()
    records = job_records(folder / "jobs")
    attached = sum(1 for r in records if r["segments"])
    iterations = [s["iterations"] for r in records for s in r["segments"]]
    print(f"\njobs run {args.jobs}, found {len(records)}, attached {attached}, "
          f"finalized {sum(1 for r in records if r['status'] == 'ended')}")
    print(f"iterations per job: median {statistics.median(iterations)} of {args.iterations}")
    print(f"service peak RSS (VmHWM): {peak:.1f} MB")
    print(f"service RSS after job 1: {rss_after[0]:.1f} MB; after job {args.jobs}: "
          f"{rss_after[-1]:.1f} MB (ratio {rss_after[-1] / rss_after[0]:.2f}); after job "
          f"{min(10, args.jobs)}: {rss_after[min(10, args.jobs) - 1]:.1f} MB")
    print(f"service CPU: {cpu_total:.1f} s in all, {cpu_total / args.jobs:.2f} s per job")
    print(f"finalized after the job's exit: median {statistics.median(finalize_s):.1f} s, "
          f"max {max(finalize_s):.1f} s")
    print(f"(files in {folder})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
