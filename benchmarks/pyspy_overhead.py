"""What py-spy stack sampling costs a training job: its step time with the sampler on and off.

Starts tests/targets/train_gpt.py (which stamps CLOCK_MONOTONIC before every
optimizer.step()), then alternates rounds of --seconds with PySpySampler running
and with nothing attached, in ABBA order (off/on, on/off, ...) so that drift in
the machine's load falls on both sides. A step counts for a round when both of
its stamps fall inside it. Prints per-round and overall median step times, the
ratio on/off (the cost; aim: < 1.02), the target's own CPU time and run-queue
wait per step (from /proc/PID/task/*/schedstat: CPU time is blind to other
load on a shared host, the wait shows contention for the CPUs) and the CPU
py-spy itself used.

examples:
  /tmp/v/bin/python benchmarks/pyspy_overhead.py --seconds 5 --rounds 4
  /tmp/v/bin/python benchmarks/pyspy_overhead.py --rate 200 --target-args "--hidden-size 512"
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from perfmon.probes.pyspy import DEFAULT_RATE_HZ, DEFAULT_WINDOW_S, PySpySampler

TRAIN_GPT = Path(__file__).resolve().parent.parent / "tests" / "targets" / "train_gpt.py"
POLL_INTERVAL_S = 0.1  # as the monitoring session polls


def _stamps(path: Path) -> list[int]:
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    return [int(row[1]) for row in rows if len(row) == 2]


def _schedstat_ns(pid: int) -> tuple[int, int]:
    """(on-CPU ns, run-queue wait ns) of all the target's threads, from their schedstat."""
    on_cpu = waiting = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:
            continue  # a thread that just exited
        on_cpu, waiting = on_cpu + int(fields[0]), waiting + int(fields[1])
    return on_cpu, waiting


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Round:
    sampling: bool
    t0_ns: int
    t1_ns: int
    pyspy_cpu_s: float
    target_cpu_ns: int  # on-CPU time of all the target's threads
    target_wait_ns: int  # time they were runnable but waiting for a CPU
    sampler: PySpySampler | None


def _round(pid: int, seconds: float, sampling: bool, args: argparse.Namespace) -> Round:
    """One round with or without the sampler."""
    cpu0, (on0, wait0), t0 = _children_cpu_s(), _schedstat_ns(pid), time.monotonic_ns()
    sampler = PySpySampler([pid], rate_hz=args.rate, window_s=args.window) if sampling else None
    if sampler:
        sampler.start()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if sampler:
                sampler.poll()
            time.sleep(POLL_INTERVAL_S)
    finally:
        if sampler:
            sampler.close()  # reaps every py-spy, so RUSAGE_CHILDREN includes them
    t1, (on1, wait1) = time.monotonic_ns(), _schedstat_ns(pid)
    return Round(sampling, t0, t1, _children_cpu_s() - cpu0, on1 - on0, wait1 - wait0, sampler)


def _steps_ms(stamps: list[int], t0: int, t1: int) -> list[float]:
    inside = [t for t in stamps if t0 <= t <= t1]
    return [(b - a) / 1e6 for a, b in pairwise(inside)]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each round")
    parser.add_argument("--rounds", type=int, default=4, help="on/off pairs")
    parser.add_argument("--rate", type=int, default=DEFAULT_RATE_HZ, help="samples a second")
    parser.add_argument("--window", type=float, default=DEFAULT_WINDOW_S, help="seconds per window")
    parser.add_argument("--target-args", default="", help="extra train_gpt.py arguments")
    parser.add_argument("--warmup-steps", type=int, default=20)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pyspy-overhead-") as tmp:
        stamps_path = Path(tmp) / "stamps.txt"
        target = subprocess.Popen(
            [sys.executable, str(TRAIN_GPT), "--timestamps", str(stamps_path),
             *shlex.split(args.target_args)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            while len(_stamps(stamps_path)) < args.warmup_steps:
                if target.poll() is not None:
                    print(f"target exited with {target.returncode}", file=sys.stderr)
                    return 1
                time.sleep(0.1)
            rounds = []
            for pair in range(args.rounds):
                for sampling in ((False, True) if pair % 2 == 0 else (True, False)):
                    rounds.append(_round(target.pid, args.seconds, sampling, args))
            stamps = _stamps(stamps_path)
        finally:
            os.killpg(target.pid, signal.SIGKILL)
            target.wait()

    print(f"target: train_gpt.py {args.target_args}".rstrip())
    print(f"sampler: {args.rate} Hz, {args.window} s windows, --nonblocking --idle; "
          f"{args.rounds} x ({args.seconds} s off + {args.seconds} s on), ABBA order")
    print(f"{'round':>5} {'sampler':>7} {'steps':>5} {'median ms':>9} {'CPU ms/step':>11} "
          f"{'wait ms/step':>12} {'py-spy CPU':>10}")
    steps_by: dict[bool, list[float]] = {True: [], False: []}
    cpu_by: dict[bool, list[float]] = {True: [], False: []}  # target CPU ms per step, by round
    pyspy_cpu_s = seconds_on = 0.0
    samples = lost = 0
    for i, r in enumerate(rounds):
        steps = _steps_ms(stamps, r.t0_ns, r.t1_ns)
        steps_by[r.sampling].extend(steps)
        n = max(1, len(steps))
        cpu_by[r.sampling].append(r.target_cpu_ns / 1e6 / n)
        if r.sampler:
            pyspy_cpu_s += r.pyspy_cpu_s
            seconds_on += (r.t1_ns - r.t0_ns) / 1e9
            samples += r.sampler.samples_total
            lost += r.sampler.lost_windows
        median = f"{statistics.median(steps):9.2f}" if steps else f"{'-':>9}"
        cpu = f"{100 * r.pyspy_cpu_s / ((r.t1_ns - r.t0_ns) / 1e9):9.1f}%" if r.sampler else ""
        print(f"{i // 2:>5} {'on' if r.sampling else 'off':>7} {len(steps):>5} {median} "
              f"{r.target_cpu_ns / 1e6 / n:11.2f} {r.target_wait_ns / 1e6 / n:12.2f} {cpu:>10}")
    on, off = steps_by[True], steps_by[False]
    if not on or not off:
        print("no complete steps in a round: use longer --seconds", file=sys.stderr)
        return 1
    median_on, median_off = statistics.median(on), statistics.median(off)
    print(f"median step time: on {median_on:.2f} ms ({len(on)} steps), "
          f"off {median_off:.2f} ms ({len(off)} steps)")
    print(f"ratio on/off: {median_on / median_off:.4f}")
    # The target's own CPU time per step is blind to other processes taking the
    # CPUs (which swamps wall time on a shared host) but not to py-spy's cost
    # to the target (cache, memory-map lock).
    cpu_on, cpu_off = statistics.median(cpu_by[True]), statistics.median(cpu_by[False])
    print(f"target CPU per step (median of rounds): on {cpu_on:.2f} ms, off {cpu_off:.2f} ms, "
          f"ratio {cpu_on / cpu_off:.4f}")
    print(f"py-spy: {100 * pyspy_cpu_s / seconds_on:.1f}% of one core while on "
          f"(start-up dump included); {samples} samples in finished windows, "
          f"{lost} lost windows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
