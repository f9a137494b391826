"""Event logs (or one's window: an incident bundle's) as a Chrome / Perfetto trace, in
the JSON trace-event format ("traceEvents" object form); ``perfmon-agent trace``
(perfmon.agent.views.trace) writes it for a log or a folder of them.

What goes where:

- one process per rank: pid = the rank's pid (a pid seen in an earlier log of the
  trace, another node's, is moved up by 2^22, above any Linux pid), named
  ``rank N (pid P)``; its tracks (threads, with made-up tids pid*8+k):
  ``iterations``: one ``X`` slice per iteration, from the rank's previous
  iteration end to its end (its step rows; the first end after attach only opens),
  named with the job's own number when the agent read it (``iteration 1234``), else
  the number counted from attach;
  ``phases (py-spy)``: the ``phase`` records' spans, as slices;
  ``backward() (uprobes)``: an iteration's first Engine::execute entry to its last exit
  (its step row; ``backward() xK`` for K micro-batches);
  ``hangs``: the time without iterations, and instants when it was detected and
  when iterations resumed; ``GPU events``: XID, ECC, a GPU lost (instants);
- counters (``C``) per rank: resident memory, GPU utilization / memory / power of
  the GPUs the rank uses (NVML samples), CUDA kernel launches, sync wait, NCCL
  calls and bytes per iteration (differences of the step snapshots, at the start
  of the iteration they belong to).

Iterations are found with the agent's own rule (perfmon.agent.reducers.
iterations.IterationClock, one per rank), so the primary rank's slices are the
iterations the summary counts (``total_iterations - 1``).

Timestamps are the log's CLOCK_MONOTONIC nanoseconds / 1000 (``ts`` in
microseconds, fractions kept), so the logs of several ranks of one host line up;
the clock is named in each process's labels and in ``otherData``. Logs of
different hosts each keep their own clock.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perfmon.agent.record.layout import log_parts
from perfmon.agent.record.replay import check_facts, replay
from perfmon.agent.reducers import rank_map
from perfmon.agent.reducers.cuda import CudaActivity
from perfmon.agent.reducers.iterations import Iteration, IterationClock
from perfmon.agent.reducers.steps import RecordDispatch
from perfmon.parsers.errors import InputFileError, PerfmonError
from perfmon.parsers.gpu_samples import job_gpu_indices
from perfmon.parsers.step_rows import StepBlock
from perfmon.parsers.workload import Workload

CLOCK = "CLOCK_MONOTONIC"
PID_SHIFT = 1 << 22  # above PID_MAX_LIMIT: pids of another host's log move up by this
MAX_NAMED_RANKS = 4096
GIB = 1 << 30
MIB = 1 << 20

# Tracks of a rank, as (k, name): tid = pid * 8 + k.
ITERATIONS, PHASES_TRACK, BACKWARD, HANGS, GPU_EVENTS = 1, 2, 3, 4, 5
TRACK_NAMES = {ITERATIONS: "iterations", PHASES_TRACK: "phases (py-spy samples)",
               BACKWARD: "backward() (uprobes)", HANGS: "hangs", GPU_EVENTS: "GPU events"}


def _us(t_ns: int) -> float:
    """CLOCK_MONOTONIC ns to the trace's microseconds (a float: sub-us kept)."""
    return t_ns / 1000


@dataclass
class _Rank:
    """One rank's state while its log is read."""

    pid: int  # the real pid (the log's)
    trace_pid: int
    rank: int | None
    clock: IterationClock
    cuda: CudaActivity
    numbers: array = field(default_factory=lambda: array("q"))
    starts: array = field(default_factory=lambda: array("q"))
    ends: array = field(default_factory=lambda: array("q"))
    phase_end: int = 0  # the phase track's last slice end (slices never overlap)
    phase_overlaps: int = 0

    def tid(self, track: int) -> int:
        return self.trace_pid * 8 + track


@dataclass
class _Process:
    """A rank's process in the trace, for its metadata events."""

    trace_pid: int
    name: str
    host: str
    sort_index: int
    labels: str
    tids: list[int]


class TraceBuilder:
    """Reads event logs into trace events (each kept as its JSON text, so a long log
    costs its text, not Python objects)."""

    def __init__(self, window_ns: tuple[int, int] | None = None) -> None:
        """``window_ns``: only what happened between these CLOCK_MONOTONIC instants (an
        incident's minutes), the names of processes and tracks whatever their time."""
        self.window_us = (window_ns[0] / 1000, window_ns[1] / 1000) if window_ns else None
        self.events: list[str] = []
        self.logs: list[dict[str, Any]] = []  # per log: its facts and what was made of it
        self.warnings: list[str] = []
        self.processes: list[_Process] = []
        self._used_pids: set[int] = set()

    def _emit(self, event: dict[str, Any]) -> None:
        if self.window_us is not None and event["ph"] != "M":
            start, end = event["ts"], event["ts"] + event.get("dur", 0)
            if end < self.window_us[0] or start > self.window_us[1]:
                return
        self.events.append(json.dumps(event, separators=(",", ":"), allow_nan=False))

    # -- one log -------------------------------------------------------------------

    def add_log(self, path: Path) -> None:
        """Read one event log (all its parts). Raises EventLogError / InputFileError."""
        try:
            parts = log_parts(path)
        except OSError as err:
            raise InputFileError(f"event log {path}: {err.strerror}") from err
        state: dict[str, Any] = {}

        def start(first: dict[str, Any]) -> Callable[[dict[str, Any]], object]:
            facts = first["session"]
            problem = check_facts(facts, str(parts[0]))
            if problem is not None:
                self.warnings.append(problem)
            state["log"] = _Log(self, facts, parts[0])
            return state["log"].feed

        warnings, _, last_ns = replay(parts, start)
        log: _Log = state["log"]
        log.finish(last_ns)
        self.warnings += [f"{parts[0]}: {w}" for w in warnings]
        self.logs.append(log.describe())

    def add_records(self, facts: dict[str, Any], records: list[dict[str, Any]],
                    source: str) -> None:
        """A session's records held in memory (an incident's window; ``facts``: its
        session_start's), as add_log reads a log's."""
        log = _Log(self, facts, Path(source))
        last_ns = facts["attach_monotonic_ns"]
        for record in records:
            log.feed(record)
            last_ns = max(last_ns, record.get("t_mono_ns") or 0)
        log.finish(last_ns)
        self.logs.append(log.describe())

    def _trace_pid(self, pid: int) -> int:
        trace_pid = pid
        while trace_pid in self._used_pids:
            trace_pid += PID_SHIFT
        self._used_pids.add(trace_pid)
        return trace_pid

    # -- the file ------------------------------------------------------------------

    def document(self) -> bytes:
        """The trace file's bytes: {"traceEvents": [...], "displayTimeUnit", "otherData"}."""
        other = {"clock": CLOCK, "ts_unit": "microseconds (CLOCK_MONOTONIC ns / 1000)",
                 "made_by": "perfmon-agent trace",
                 "logs": [{k: v for k, v in log.items() if k != "process_names"}
                          for log in self.logs]}
        several_hosts = len({p.host for p in self.processes}) > 1
        for p in self.processes:
            name = f"{p.name} on {p.host}" if several_hosts else p.name
            self._emit({"ph": "M", "name": "process_name", "pid": p.trace_pid,
                        "args": {"name": name}})
            self._emit({"ph": "M", "name": "process_sort_index", "pid": p.trace_pid,
                        "args": {"sort_index": p.sort_index}})
            self._emit({"ph": "M", "name": "process_labels", "pid": p.trace_pid,
                        "args": {"labels": p.labels}})
            for tid, (track, track_name) in zip(p.tids, TRACK_NAMES.items(), strict=True):
                self._emit({"ph": "M", "name": "thread_name", "pid": p.trace_pid, "tid": tid,
                            "args": {"name": track_name}})
                self._emit({"ph": "M", "name": "thread_sort_index", "pid": p.trace_pid,
                            "tid": tid, "args": {"sort_index": track}})
        self.processes = []  # emitted once
        head = '{"traceEvents":[\n'
        tail = ('\n],"displayTimeUnit":"ms","otherData":'
                + json.dumps(other, separators=(",", ":"), allow_nan=False) + "}\n")
        return (head + ",\n".join(self.events) + tail).encode()


class _Log:
    """The sink of one log's records."""

    def __init__(self, builder: TraceBuilder, facts: dict[str, Any], path: Path) -> None:
        self.builder, self.facts, self.path = builder, facts, path
        self.emit = builder._emit
        self.attach_ns: int = facts["attach_monotonic_ns"]
        self.primary_pid: int = facts["primary_pid"]
        self.host = str(facts.get("host", "?"))
        self.workload = Workload.from_dict(facts["workload"])
        self.ranks: dict[int, _Rank] = {}
        self.gpu_owner: dict[int, int] = {}  # GPU index -> pid of a rank using it
        self.lost_gpus: set[int] = set()
        self.hang_open: dict[str, Any] | None = None
        self.end_ns: int | None = None
        # The ranks the facts name, up to MAX_NAMED_RANKS (a log may name 100,000): each
        # a process of the trace even without records; others once they have records.
        self.rank_numbers = rank_map(facts)
        for pid in list(self.rank_numbers)[:MAX_NAMED_RANKS]:
            self._rank(pid)
        self.dispatch = RecordDispatch(self.attach_ns, bool(facts.get("step_rows")), {
            "phase": self._on_phase, "job_iteration": self._on_read,
            "cuda": self._on_cuda, "process": self._on_process, "gpu": self._on_gpu,
            "xid": self._on_gpu_event, "ecc": self._on_gpu_event, "hang": self._on_hang,
            "hang_recovered": self._on_recovered, "session_end": self._on_end,
        }, self._on_block)
        self.feed = self.dispatch.feed

    def _rank(self, pid: int) -> _Rank:
        found = self.ranks.get(pid)
        if found is not None:
            return found
        clock = IterationClock(self.workload, pid, self.attach_ns)
        r = _Rank(pid, self.builder._trace_pid(pid), self.rank_numbers.get(pid), clock,
                  CudaActivity(pid))
        self.ranks[pid] = r
        return r

    # -- records -------------------------------------------------------------------

    def _on_block(self, b: StepBlock) -> None:
        for pid, end, micro, how, bw_from, bw_to in zip(
                b.pid.tolist(), b.end_ns.tolist(), b.micro.tolist(), b.how.tolist(),
                b.backward_from_ns.tolist(), b.backward_to_ns.tolist(), strict=True):
            r = self._rank(pid)
            if bw_to > bw_from:
                # (the first backward() entry to the last return of the iteration)
                name = "backward()" if micro <= 1 else f"backward() x{micro}"
                self._slice(r, BACKWARD, name, bw_from, bw_to, cat="backward")
            it = r.clock.on_row(end, micro if micro >= 0 else None, b.hows[how])
            if it is not None:
                self._on_iteration(r, it)

    def _on_iteration(self, r: _Rank, it: Iteration) -> None:
        start = it.end_t_mono_ns - it.step_time_ns
        r.numbers.append(it.number)
        r.starts.append(start)
        r.ends.append(it.end_t_mono_ns)
        figures = r.cuda.window(start, it.end_t_mono_ns, 1)
        r.cuda.prune(start)
        if figures["cpu_sync_wait_s"] is None:
            return
        ts = _us(start)
        for name, key, value in (
                ("CUDA kernel launches / iteration", "launches", figures["kernels_per_iter"]),
                ("CUDA sync wait / iteration", "ms", figures["cpu_sync_wait_s"] * 1e3),
                ("NCCL calls / iteration", "calls", figures["nccl_calls_per_iter"]),
                ("NCCL bytes / iteration", "MiB", figures["nccl_bytes_per_iter"] / MIB)):
            if value is not None:
                self._counter(r, name, ts, {key: value})

    def _on_read(self, record: dict[str, Any]) -> None:
        self._rank(record["pid"]).clock.job.on_read(record)

    def _on_cuda(self, record: dict[str, Any]) -> None:
        self._rank(record["pid"]).cuda.on_snapshot(record)

    def _on_phase(self, record: dict[str, Any]) -> None:
        r = self._rank(record["pid"])
        # Stacks are sampled from before the window opens (the iteration probes attach
        # last): spans are cut to the window.
        begin = max(record["t_mono_ns"], self.attach_ns)
        start, end = max(begin, r.phase_end), record["end_mono_ns"]
        if start > begin:
            r.phase_overlaps += 1
        if end <= start:
            return
        self._slice(r, PHASES_TRACK, record["phase"], start, end, cat="phase")
        r.phase_end = end

    def _on_process(self, record: dict[str, Any]) -> None:
        r = self._rank(record["pid"])
        self._counter(r, "resident memory", _us(record["t_mono_ns"]),
                      {"GiB": record["rss_bytes"] / GIB})

    def _on_gpu(self, record: dict[str, Any]) -> None:
        t, gpus = record["t_mono_ns"], record["gpus"]
        indices, _ = job_gpu_indices(gpus)
        for g in gpus:
            index = g["index"]
            for pid in g.get("process_memory_bytes") or {}:
                if int(pid) in self.ranks:
                    self.gpu_owner.setdefault(index, int(pid))
            if g.get("lost") and index not in self.lost_gpus:
                self.lost_gpus.add(index)
                self._instant(self._owner(index), GPU_EVENTS, f"GPU {index} lost", t,
                              {"error": g.get("error")})
        ts = _us(t)
        for g in gpus:
            index = g["index"]
            if index not in indices or g.get("lost"):
                continue
            r = self._owner(index)
            if g.get("utilization_gpu_pct") is not None:
                self._counter(r, f"GPU {index} utilization", ts, {"%": g["utilization_gpu_pct"]})
            if g.get("memory_used_bytes") is not None:
                self._counter(r, f"GPU {index} memory", ts, {"GiB": g["memory_used_bytes"] / GIB})
            if g.get("power_w") is not None:
                self._counter(r, f"GPU {index} power", ts, {"W": g["power_w"]})

    def _on_gpu_event(self, record: dict[str, Any]) -> None:
        index = record["gpu_index"]
        name = (f"XID {record['xid']} on GPU {index}" if record["type"] == "xid"
                else f"ECC {record['kind']} x{record['count']} on GPU {index}")
        args = {k: v for k, v in record.items() if k not in ("type", "t_mono_ns")}
        self._instant(self._owner(index), GPU_EVENTS, name, record["t_mono_ns"], args)

    def _on_hang(self, record: dict[str, Any]) -> None:
        args = {"frame": record["frame"], "threshold_s": record["threshold_s"],
                "report": record["report"]}
        for r in self.ranks.values():
            self._instant(r, HANGS, "hang detected", record["t_mono_ns"], args)
        self.hang_open = record

    def _on_recovered(self, record: dict[str, Any]) -> None:
        for r in self.ranks.values():
            self._instant(r, HANGS, "iterations resumed", record["t_mono_ns"], {})
        self._close_hang(record["t_mono_ns"], recovered=True)

    def _on_end(self, record: dict[str, Any]) -> None:
        self.end_ns = record["t_mono_ns"]

    def _close_hang(self, t_ns: int, *, recovered: bool) -> None:
        hang = self.hang_open
        if hang is None:
            return
        self.hang_open = None
        start = min(hang["last_iteration_mono_ns"], hang["t_mono_ns"])
        for r in self.ranks.values():
            self._slice(r, HANGS, "hung: no iteration", start, max(start, t_ns), cat="hang",
                        args={"frame": hang["frame"], "recovered": recovered})

    # -- events --------------------------------------------------------------------

    def _owner(self, gpu_index: int) -> _Rank:
        pid = self.gpu_owner.get(gpu_index, self.primary_pid)
        return self._rank(pid)

    def _slice(self, r: _Rank, track: int, name: str, start_ns: int, end_ns: int, *, cat: str,
               args: dict[str, Any] | None = None) -> None:
        self.emit({"ph": "X", "name": name, "cat": cat, "pid": r.trace_pid, "tid": r.tid(track),
                   "ts": _us(start_ns), "dur": (end_ns - start_ns) / 1000,
                   **({"args": args} if args else {})})

    def _instant(self, r: _Rank, track: int, name: str, t_ns: int, args: dict[str, Any]) -> None:
        self.emit({"ph": "i", "s": "t", "name": name, "pid": r.trace_pid, "tid": r.tid(track),
                   "ts": _us(t_ns), **({"args": args} if args else {})})

    def _counter(self, r: _Rank, name: str, ts: float, values: dict[str, float]) -> None:
        self.emit({"ph": "C", "name": name, "pid": r.trace_pid, "ts": ts, "args": values})

    # -- the end -------------------------------------------------------------------

    def _name(self, r: _Rank) -> str:
        rank = r.rank
        if rank is None and len(self.ranks) == 1 and self.workload.world_size == 1:
            rank = 0  # a job that is not distributed: its only process is rank 0
        return f"rank {'?' if rank is None else rank} (pid {r.pid})"

    def finish(self, last_ns: int) -> None:
        """Close what is open and emit the iteration slices and the metadata."""
        end_ns = self.end_ns if self.end_ns is not None else last_ns
        self._close_hang(end_ns, recovered=False)
        primary = self.ranks[self.primary_pid] if self.primary_pid in self.ranks else None
        for r in self.ranks.values():
            r.clock.job.resolve(None)
        primary_offset = primary.clock.job.offset if primary is not None else None
        for r in sorted(self.ranks.values(), key=lambda r: (r.rank is None, r.rank or 0, r.pid)):
            offset, numbering = r.clock.job.offset, None
            if offset is not None:
                numbering = f"the job's own (local variable '{r.clock.job.variable}')"
            elif primary_offset is not None:
                offset, numbering = primary_offset, "the job's own, as read on the primary rank"
            else:
                offset, numbering = 0, "counted from attach"
            for number, start, end in zip(r.numbers, r.starts, r.ends, strict=True):
                self._slice(r, ITERATIONS, f"iteration {number + offset}", start, end,
                            cat="iteration",
                            args={"iteration": number + offset,
                                  "step_time_ms": (end - start) / 1e6,
                                  "start_mono_ns": start, "end_mono_ns": end})
            if r.phase_overlaps:
                self.builder.warnings.append(
                    f"{self.path}: pid {r.pid}: {r.phase_overlaps} phase spans overlapped the "
                    "one before and were cut to start at its end")
            self._metadata(r, numbering)

    def _metadata(self, r: _Rank, numbering: str) -> None:
        self.builder.processes.append(_Process(
            r.trace_pid, self._name(r), self.host, r.rank if r.rank is not None else 1 << 20,
            f"host {self.host}, clock {CLOCK} (ts = ns / 1000), iterations numbered "
            f"{numbering}", [r.tid(track) for track in TRACK_NAMES]))

    def describe(self) -> dict[str, Any]:
        return {
            "event_log": str(self.path), "host": self.host, "primary_pid": self.primary_pid,
            "attach_monotonic_ns": self.attach_ns,
            "ranks": [{"pid": r.pid, "trace_pid": r.trace_pid, "rank": r.rank,
                       "iterations": len(r.numbers)} for r in self.ranks.values()],
        }


def build_trace(paths: list[Path], window_ns: tuple[int, int] | None = None) -> TraceBuilder:
    """Read the logs into one trace (every log's ranks as processes; only ``window_ns``
    of them, when given). Among several, a log that cannot be read is skipped with a
    warning; raises when none can be."""
    builder = TraceBuilder(window_ns)
    errors: list[PerfmonError] = []
    for path in paths:
        try:
            builder.add_log(path)
        except PerfmonError as err:
            if len(paths) == 1:
                raise
            errors.append(err)
            builder.warnings.append(f"skipped: {err}")
    if not builder.logs:
        raise errors[0]
    return builder
