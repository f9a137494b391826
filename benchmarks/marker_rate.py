"""How far the marker path goes on one node: an 8-rank job at 50 iterations a second per
rank, and faster, through the session's own step rows, reducers and event-log writer,
with synthetic records shaped as the bcc probe delivers them (per rank and iteration: a
``waits`` record, the ``Optimizer.step`` marker, a backward's entry and return).

For each rate it feeds --seconds of records in 200 ms polls (the session's loop: the
markers made rows, the rows logged and reduced once a second), timing what the agent
spends per poll (rows + reduce + log append + flush), and reports the share of one
core that takes; the ring buffer's capacity between two polls is printed beside it
(DEFAULT_RING_PAGES of 4 KiB, 112 bytes a marker event).

    .venv/bin/python benchmarks/marker_rate.py --seconds 60
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perfmon.agent.measure.session import POLL_INTERVAL_S, ROWS_INTERVAL_NS  # noqa: E402
from perfmon.agent.record.eventlog import EventLogWriter  # noqa: E402
from perfmon.agent.record.outputs import OutputDir  # noqa: E402
from perfmon.agent.reducers import Summarizer  # noqa: E402
from perfmon.agent.reducers.steps import StepRows  # noqa: E402
from perfmon.probes.uprobes import DEFAULT_RING_PAGES  # noqa: E402

from tests.eventlogs import START_NS, session_facts  # noqa: E402

RANKS = 8
POLL_NS = int(POLL_INTERVAL_S * 1e9)
ROWS_POLLS = ROWS_INTERVAL_NS // POLL_NS  # polls between two takes of the rows
EVENT_BYTES = 112  # event_t (104) + the ring buffer's 8-byte header


def facts() -> dict:
    f = session_facts()
    pids = [1000 + r for r in range(RANKS)]
    f.update(pids=pids, ranks=list(range(RANKS)), primary_pid=pids[0], step_rows=True)
    f["workload"] = {**f["workload"], "world_size": RANKS, "data_parallel_size": RANKS}
    return f


def polls(rate_hz: float, seconds: float):
    """Each 200 ms poll's records, as the session sorts them."""
    step_ns = int(1e9 / rate_hz)
    waited = dict.fromkeys(range(RANKS), 0)
    t_end = START_NS + int(seconds * 1e9)
    poll_end, batch = START_NS + POLL_NS, []
    t = START_NS
    while t < t_end:
        for r in range(RANKS):
            pid, at = 1000 + r, t + r * 1000
            waited[r] += step_ns // 3
            batch += [
                {"type": "marker", "t_mono_ns": at + step_ns // 4, "pid": pid, "tid": pid,
                 "kind": "backward_enter", "name": ""},
                {"type": "marker", "t_mono_ns": at + step_ns // 2, "pid": pid, "tid": pid,
                 "kind": "backward_exit", "name": ""},
                {"type": "waits", "t_mono_ns": at + step_ns, "pid": pid,
                 "wait_ns": waited[r], "waits": 0},
                {"type": "marker", "t_mono_ns": at + step_ns, "pid": pid, "tid": pid,
                 "kind": "optimizer_step", "name": "Optimizer.step#AdamW.step"}]
        t += step_ns
        if t >= poll_end:
            yield batch
            batch, poll_end = [], poll_end + POLL_NS
    if batch:
        yield batch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="job time fed at each rate")
    p.add_argument("--rates", default="50,100,200,400", help="iterations/s per rank")
    args = p.parse_args()
    ring = DEFAULT_RING_PAGES * 4096 // EVENT_BYTES
    for rate in (float(r) for r in args.rates.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = OutputDir.open(Path(tmp))
            log = EventLogWriter(out, "perf_events_bench")
            summarizer = Summarizer.from_facts(facts())
            rows = StepRows(START_NS)
            spent, worst, events = 0.0, 0.0, 0
            for n, batch in enumerate(polls(rate, args.seconds)):
                began = time.perf_counter()
                logged = rows.feed_poll(batch, raw_markers=False)
                steps = rows.take() if n % ROWS_POLLS == ROWS_POLLS - 1 else None
                for record in logged + ([steps.to_record()] if steps is not None else []):
                    log.append(record)
                    summarizer.feed(record)
                log.flush_if_due()
                took = time.perf_counter() - began
                spent, worst = spent + took, max(worst, took)
                events += sum(1 for r in batch if r["type"] == "marker")
            log.close()
            size = (Path(tmp) / log.name).stat().st_size
            out.close()
        per_poll = events / (args.seconds * 1e9 / POLL_NS)
        print(f"{RANKS} ranks x {rate:.0f} it/s: agent {100 * spent / args.seconds:.1f}% of a "
              f"core (worst poll {1e3 * worst:.1f} ms of 200); {per_poll:,.0f} ring events a "
              f"poll of {ring:,} ({100 * per_poll / ring:.0f}% full); log "
              f"{size / (RANKS * rate * args.seconds):.1f} B per rank and iteration",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
