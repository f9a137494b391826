"""py-spy mode's iteration count on recorded samples: record once, replay any estimator.

`record` starts tests/targets/train_gpt.py (its own CLOCK_MONOTONIC stamp before every
optimizer.step() is the truth), samples its main thread with PySpySampler for
--seconds as a monitoring session does (polled at 10 Hz), optionally beside --hogs
busy processes (an oversubscribed host), and writes one gzipped JSON file per run:
the samples as py-spy gave them, the stamps and the sampling rate.

`replay` feeds each recording through SampledIterationClock without the job's
counter (phase transitions alone, as for a job with no iteration variable) and
compares its ends with the stamps, as benchmarks/pyspy_accuracy.py does for the
live agent: per file the iterations found and the job's, the mean step time error,
and where an interval of the job's own held no end or two. Replays take a second,
so a change to the estimator is checked on many recorded runs at once, on the same
samples before and after.

examples:
  .venv/bin/python benchmarks/pyspy_replay.py record --out /tmp/rec --runs 3 --rate 200 \\
      --hogs 3 -- --hidden-size 64 --seq-length 256 --micro-batch-size 16 --optimizer sgd
  .venv/bin/python benchmarks/pyspy_replay.py replay /tmp/rec/*.json.gz
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perfmon.parsers.pyspy import Frame, StackSample
from perfmon.parsers.sampled_iterations import CONFIRM_NS, SampledIterationClock
from perfmon.parsers.stack_analysis import classify_phase
from perfmon.probes.pyspy import PySpySampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pyspy_accuracy import LATE_NS, TRAIN_GPT, _stamps  # (the sibling benchmark)

POLL_S = 0.1  # as the monitoring session polls


def record(python: str, seconds: float, *, rate_hz: int, hogs: int, target_args: list[str],
           out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="pyspy-replay-") as tmp:
        stamps = Path(tmp) / "stamps.txt"
        job = subprocess.Popen([python, str(TRAIN_GPT), "--timestamps", str(stamps),
                                *target_args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        busy = []
        sampler = PySpySampler([job.pid], rate_hz=rate_hz)
        batches: list[list[StackSample]] = []
        try:
            while len(_stamps(stamps)) < 3:
                if job.poll() is not None:
                    raise SystemExit(f"{python}: the job did not start (does it import torch?)")
                time.sleep(0.1)
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(hogs)]
            sampler.start()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                batches.append([s for s in sampler.poll() if s.tid == job.pid])
                time.sleep(POLL_S)
            time.sleep(3 * sampler.window_ns / 1e9)  # the last windows end and are read
            batches.append([s for s in sampler.poll() if s.tid == job.pid])
        finally:
            sampler.close()
            for proc in [*busy, job]:
                proc.kill()
                proc.wait()
        version = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        data = {"python": version, "rate_hz": rate_hz, "hogs": hogs, "args": target_args,
                "stamps": _stamps(stamps),
                "batches": [[[s.t_mono_ns, s.duration_ns,
                              [[f.function, f.file, f.line] for f in s.frames]] for s in batch]
                            for batch in batches]}
    with gzip.open(out, "wt") as f:
        json.dump(data, f)
    print(f"{out}: Python {version}, {rate_hz} Hz, {hogs} hogs, {len(data['stamps'])} steps")


def replay(path: Path) -> str:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    clock = SampledIterationClock(expect_counter=False, period_ns=10**9 // data["rate_hz"])
    ends: list[int] = []
    for batch in data["batches"]:
        clock.feed([StackSample(t, 0, 0, tuple(Frame(*frame) for frame in frames), duration)
                    for t, duration, frames in batch])
        ends += [t for t, _ in clock.take()]
    ends += [t for t, _ in clock.take(final=True)]
    stamps = data["stamps"]
    # Backward runs (of CONFIRM_NS or more) that hold two of the job's stamps or more: the
    # samples missed the whole forward between two of them.
    runs: list[list[int]] = []
    for t, duration, frames in (s for batch in data["batches"] for s in batch):
        backward = classify_phase(tuple(Frame(*frame) for frame in frames)) == "backward"
        if backward and runs and runs[-1][1] == t:
            runs[-1][1] = t + duration
        elif backward:
            runs.append([t, t + duration])
    long_runs = [(a, b) for a, b in runs if b - a >= CONFIRM_NS]
    merged = sum(1 for a, b in long_runs
                 if bisect.bisect_right(stamps, b) - bisect.bisect_right(stamps, a) >= 2)
    # Each end belongs to the job's step whose stamp it follows (found up to LATE_NS late).
    steps = [bisect.bisect_right(stamps, t + LATE_NS) - 1 for t in ends]
    first, last = steps[0], steps[-1]
    found = {i: steps.count(i) for i in range(first, last + 1)}
    off = [f"{i}:{n}" for i, n in found.items() if n != 1]
    job_ms = (stamps[last] - stamps[first]) / (last - first) / 1e6
    agent_ms = (ends[-1] - ends[0]) / (len(ends) - 1) / 1e6
    return (f"{path.name}: Python {data['python']}, {data['rate_hz']} Hz, {data['hogs']} hogs: "
            f"{len(ends) - 1} iterations for {last - first} at {job_ms:.1f} ms, error "
            f"{(agent_ms / job_ms - 1) * 100:+.2f}%; steps with no end or two: "
            f"{' '.join(off) or 'none'}; backward runs holding two steps: {merged} of "
            f"{len(long_runs)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="record runs")
    rec.add_argument("--python", default=sys.executable, help="an interpreter with torch")
    rec.add_argument("--out", type=Path, required=True, help="a folder for the recordings")
    rec.add_argument("--runs", type=int, default=1)
    rec.add_argument("--seconds", type=float, default=25.0)
    rec.add_argument("--rate", type=int, default=200, help="py-spy samples a second")
    rec.add_argument("--hogs", type=int, default=0, help="busy processes beside the job")
    rec.add_argument("target_args", nargs="*", help="train_gpt.py's arguments (after --)")
    rep = commands.add_parser("replay", help="replay recordings")
    rep.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "record":
        args.out.mkdir(parents=True, exist_ok=True)
        for n in range(args.runs):
            name = f"{time.strftime('%Y%m%d_%H%M%S')}_{args.rate}hz_{args.hogs}hogs_{n}.json.gz"
            record(args.python, args.seconds, rate_hz=args.rate, hogs=args.hogs,
                   target_args=["--anonymous-loop", *args.target_args], out=args.out / name)
    else:
        for path in args.files:
            print(replay(path))


if __name__ == "__main__":
    main()
