"""Synthetic event logs with the records a real session writes, for summarize's tests
and benchmark: the same facts, the same record shapes, any length."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
from perfmon.agent.record.eventlog import EventLogWriter
from perfmon.agent.record.outputs import OutputDir
from perfmon.agent.reducers.ranks import RankTimes
from perfmon.agent.reducers.steps import StepRows
from perfmon.parsers.events import Steps
from perfmon.parsers.log_reader import EventLogReader
from perfmon.parsers.step_rows import STEP_COLUMNS, decode_steps

START_NS = 10**12  # CLOCK_MONOTONIC of attach
STEP_NS = 100_000_000  # 100 ms iterations
PID = 4242


def session_facts(log_interval: int = 10, max_log_entries: int | None = 2000) -> dict[str, Any]:
    """session_start facts like a real session's (a CPU job with a model)."""
    return {
        "start_time": "2026-11-30T12:00:00+00:00", "attach_monotonic_ns": START_NS,
        "host": "node-1", "agent_version": "test", "pid": PID, "pids": [PID], "ranks": [0],
        "primary_pid": PID, "command_line": ["python", "train.py"],
        "torch_library": "/usr/lib/libtorch_cpu.so", "iteration_numbering": "attach",
        "log_interval": log_interval, "model": {"source": "model_config:m.yaml"},
        "iteration_source": "uprobe", "warnings": [], "gpu": {"available": False},
        "stack_sampling": True, "cuda": {"available": False},
        "workload": {"flops_per_sample": 1e12, "seq_length": 1024, "global_batch_size": 8,
                     "world_size": 1, "data_parallel_size": 1},
        "iteration_logs_max_entries": max_log_entries,
    }


def records(iterations: int, *, log_interval: int = 10,
            max_log_entries: int | None = 2000, end: bool = True) -> Iterator[dict[str, Any]]:
    """A session's records: per iteration its markers and py-spy phase spans, a memory
    sample a second, and the session_end (unless ``end`` is False: a killed agent)."""
    yield {"type": "session_start", "t_mono_ns": START_NS,
           "session": session_facts(log_interval, max_log_entries)}
    for i in range(iterations):
        t = START_NS + i * STEP_NS
        yield {"type": "phase", "t_mono_ns": t, "end_mono_ns": t + 20_000_000, "pid": PID,
               "phase": "data_loading"}
        yield {"type": "phase", "t_mono_ns": t + 20_000_000, "end_mono_ns": t + 50_000_000,
               "pid": PID, "phase": "forward"}
        yield {"type": "marker", "t_mono_ns": t + 50_000_000, "pid": PID, "tid": PID,
               "kind": "backward_enter", "name": ""}
        yield {"type": "phase", "t_mono_ns": t + 50_000_000, "end_mono_ns": t + 95_000_000,
               "pid": PID, "phase": "backward"}
        yield {"type": "marker", "t_mono_ns": t + 95_000_000, "pid": PID, "tid": PID,
               "kind": "backward_exit", "name": ""}
        yield {"type": "marker", "t_mono_ns": t + 96_000_000, "pid": PID, "tid": PID,
               "kind": "optimizer_step", "name": "Optimizer.step#AdamW.step"}
        yield {"type": "phase", "t_mono_ns": t + 95_000_000, "end_mono_ns": t + STEP_NS,
               "pid": PID, "phase": "optimizer"}
        if i % 10 == 0:
            yield {"type": "process", "t_mono_ns": t, "pid": PID, "rss_bytes": 2 << 30,
                   "peak_rss_bytes": 3 << 30}
    if end:
        yield {"type": "session_end", "t_mono_ns": START_NS + iterations * STEP_NS,
               "reason": "duration"}


NCCL_KEYS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "send",
             "recv", "all_to_all", "gather", "scatter")


def _gpu(index: int, t: int, pids: list[int]) -> dict[str, Any]:
    """One GPU of a ``gpu`` record, with every field NVML sampling gives on an H100."""
    return {
        "index": index, "t_mono_ns": t, "late_ns": 12_000, "uuid": f"GPU-{index:08d}-aaaa",
        "name": "NVIDIA H100 80GB HBM3", "utilization_gpu_pct": 97, "utilization_memory_pct": 41,
        "memory_used_bytes": 70 << 30, "memory_total_bytes": 80 << 30, "power_w": 612.5,
        "power_limit_w": 700.0, "sm_clock_mhz": 1755, "mem_clock_mhz": 2619,
        "temperature_c": 63, "throttle_reasons": ["sw_power_cap"],
        "process_memory_bytes": {pids[index % len(pids)]: 68 << 30}, "process_count": 1,
        "gpm": {"sm_occupancy_pct": 61.2, "tensor_active_pct": 48.9, "dram_bw_util_pct": 71.0},
        "lost": False, "error": None,
    }


def node_records(iterations: int, *, ranks: int = 8, step_ns: int = 500_000_000,
                 log_interval: int = 10) -> Iterator[dict[str, Any]]:
    """A GPU node's session: ``ranks`` ranks (all probed, the first primary), NVML at
    1 Hz for one GPU per rank, memory per rank at 1 Hz, CUDA snapshots at every step
    of every rank, and py-spy phase spans of the primary."""
    pids = [PID + r for r in range(ranks)]
    facts = session_facts(log_interval)
    facts.update(pids=pids, ranks=list(range(ranks)), gpu={"available": True},
                 cuda={"available": True})
    yield {"type": "session_start", "t_mono_ns": START_NS, "session": facts}
    counters = {"kernel_launches": 0, "sync_wait_ns": 0, "graph_launches": 0}
    next_second = START_NS
    for i in range(iterations):
        t = START_NS + i * step_ns
        while next_second <= t:
            yield {"type": "gpu", "t_mono_ns": next_second,
                   "gpus": [_gpu(g, next_second, pids) for g in range(ranks)]}
            for pid in pids:
                yield {"type": "process", "t_mono_ns": next_second, "pid": pid,
                       "rss_bytes": 20 << 30, "peak_rss_bytes": 24 << 30}
            next_second += 1_000_000_000
        for span, (a, b) in zip(("data_loading", "forward", "backward", "optimizer"),
                                ((0, 5), (5, 40), (40, 90), (90, 100)), strict=True):
            yield {"type": "phase", "t_mono_ns": t + step_ns * a // 100,
                   "end_mono_ns": t + step_ns * b // 100, "pid": PID, "phase": span}
        counters["kernel_launches"] += 3000
        counters["sync_wait_ns"] += 2_000_000
        for pid in pids:
            yield {"type": "marker", "t_mono_ns": t + step_ns * 40 // 100, "pid": pid,
                   "tid": pid, "kind": "backward_enter", "name": ""}
            yield {"type": "marker", "t_mono_ns": t + step_ns * 90 // 100, "pid": pid,
                   "tid": pid, "kind": "backward_exit", "name": ""}
            yield {"type": "cuda", "t_mono_ns": t + step_ns * 91 // 100, "pid": pid,
                   "at_step": True, **counters,
                   "nccl_calls": dict.fromkeys(NCCL_KEYS, i * 2),
                   "nccl_bytes": dict.fromkeys(NCCL_KEYS, i * 2 << 20),
                   "runtime_launches": counters["kernel_launches"], "driver_launches": 0,
                   "forwarded_launches": counters["kernel_launches"], "sync_calls": i * 4,
                   "sync_untracked": 0, "nccl_unknown_dtype_calls": 0}
            yield {"type": "marker", "t_mono_ns": t + step_ns * 91 // 100, "pid": pid,
                   "tid": pid, "kind": "optimizer_step", "name": "Optimizer.step#AdamW.step"}
            yield {"type": "marker", "t_mono_ns": t + step_ns * 99 // 100, "pid": pid,
                   "tid": pid, "kind": "zero_grad", "name": "Optimizer.zero_grad#AdamW.zero_grad"}
    yield {"type": "session_end", "t_mono_ns": START_NS + iterations * step_ns,
           "reason": "duration"}


def write(stream: BinaryIO, items: Iterator[dict[str, Any]]) -> int:
    """Pack records into a stream; the bytes written."""
    packer = msgpack.Packer()
    total = 0
    for record in items:
        data = packer.pack(record)
        stream.write(data)
        total += len(data)
    return total


def write_log(path: Path, iterations: int = 50, **kw: Any) -> Path:
    with open(path, "wb") as f:
        write(f, records(iterations, **kw))
    return path


_SENTINEL = 0xF0F0_0000_0000_0000  # + k: the k-th varying integer of a template


class _Template:
    """Records packed once with their varying integers as sentinels (``_SENTINEL + k``
    for the k-th value), each encoded as a fixed-width uint64 (msgpack's 0xcf), so a
    copy is patched in place. Decoded, a patched copy equals the records packed afresh
    (msgpack accepts wide encodings of small integers); only the size differs."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        data = b"".join(msgpack.packb(r) for r in records)
        holes: list[tuple[int, int]] = []  # (offset of the 8 bytes, value index)
        while True:
            k = len({index for _, index in holes})
            tag = b"\xcf" + struct.pack(">Q", _SENTINEL + k)
            at = data.find(tag)
            if at < 0:
                break
            while at >= 0:
                holes.append((at + 1, k))
                at = data.find(tag, at + 1)
        holes.sort()
        self.order = [k for _, k in holes]
        ends = [0] + [off + 8 for off, _ in holes]
        self.segments = [data[a:off] for a, (off, _) in zip(ends, holes, strict=False)]
        self.tail = data[ends[-1]:]

    def patched(self, values: list[int]) -> bytes:
        packed = [v.to_bytes(8, "big") for v in values]
        filled = [packed[k] for k in self.order]
        pairs = zip(self.segments, filled, strict=True)
        return b"".join(itertools.chain.from_iterable(pairs)) + self.tail


def write_node_log(stream: BinaryIO, iterations: int, *, ranks: int = 8,
                   step_ns: int = 500_000_000, log_interval: int = 10) -> int:
    """The records of ``node_records`` (same values, in the same order), written ~10x
    faster, for big logs: an iteration's records, and a second's samples, are patched
    copies of one template each."""
    pids = [PID + r for r in range(ranks)]
    v = [_SENTINEL + k for k in range(12)]
    first = next(node_records(0, ranks=ranks, step_ns=step_ns, log_interval=log_interval))
    second = _Template([{"type": "gpu", "t_mono_ns": v[0],
                         "gpus": [_gpu(g, v[0], pids) for g in range(ranks)]}]
                       + [{"type": "process", "t_mono_ns": v[0], "pid": pid,
                           "rss_bytes": 20 << 30, "peak_rss_bytes": 24 << 30} for pid in pids])
    # Values 0..6: the instants at these percent of the step; 7..11: the CUDA counters.
    points = (0, 5, 40, 90, 91, 99, 100)
    at = {p: v[k] for k, p in enumerate(points)}
    step = [{"type": "phase", "t_mono_ns": at[a], "end_mono_ns": at[b], "pid": PID,
             "phase": span}
            for span, (a, b) in zip(("data_loading", "forward", "backward", "optimizer"),
                                    ((0, 5), (5, 40), (40, 90), (90, 100)), strict=True)]
    for pid in pids:
        step += [
            {"type": "marker", "t_mono_ns": at[40], "pid": pid, "tid": pid,
             "kind": "backward_enter", "name": ""},
            {"type": "marker", "t_mono_ns": at[90], "pid": pid, "tid": pid,
             "kind": "backward_exit", "name": ""},
            {"type": "cuda", "t_mono_ns": at[91], "pid": pid, "at_step": True,
             "kernel_launches": v[7], "sync_wait_ns": v[8], "graph_launches": 0,
             "nccl_calls": dict.fromkeys(NCCL_KEYS, v[9]),
             "nccl_bytes": dict.fromkeys(NCCL_KEYS, v[10]), "runtime_launches": v[7],
             "driver_launches": 0, "forwarded_launches": v[7], "sync_calls": v[11],
             "sync_untracked": 0, "nccl_unknown_dtype_calls": 0},
            {"type": "marker", "t_mono_ns": at[91], "pid": pid, "tid": pid,
             "kind": "optimizer_step", "name": "Optimizer.step#AdamW.step"},
            {"type": "marker", "t_mono_ns": at[99], "pid": pid, "tid": pid,
             "kind": "zero_grad", "name": "Optimizer.zero_grad#AdamW.zero_grad"}]
    iteration = _Template(step)
    total = stream.write(msgpack.packb(first))
    next_second = START_NS
    for i in range(iterations):
        t = START_NS + i * step_ns
        while next_second <= t:
            total += stream.write(second.patched([next_second]))
            next_second += 1_000_000_000
        total += stream.write(iteration.patched(
            [t + step_ns * p // 100 for p in points]
            + [3000 * (i + 1), 2_000_000 * (i + 1), i * 2, i * 2 << 20, i * 4]))
    end = {"type": "session_end", "t_mono_ns": START_NS + iterations * step_ns,
           "reason": "duration"}
    return total + stream.write(msgpack.packb(end))


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of one log part as the agent's reader decodes it (a zstd stream or
    plain msgpack); fails on undecodable data or records of the wrong shape."""
    out: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        reader = EventLogReader(f, str(path))
        reader.read_into(out.append)
    assert reader.corrupt is None and reader.skipped == 0, reader.corrupt or reader.first_problem
    return out


def rank_feed(ranks: RankTimes, start_ns: int = 0) -> Callable[[dict[str, Any]], None]:
    """Feed markers and ``waits`` records to a RankTimes alone, as the summarizer does:
    rows made of them (each as it ends), the primary's iterations counted."""
    rows, opened = StepRows(start_ns), set()

    def feed(record: dict[str, Any]) -> None:
        rows.feed(record)
        block = rows.take()
        if block is None:
            return
        ranks.on_rows(block)
        for pid, end in zip(block.pid.tolist(), block.end_ns.tolist(), strict=True):
            if pid == ranks.primary_pid and pid in opened:
                ranks.on_primary_iteration(end)
            opened.add(pid)

    return feed


def step_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row of a log's ``steps`` records, as a map of its columns (``how`` named)."""
    out = []
    for record in records:
        if record["type"] != "steps":
            continue
        block = decode_steps(record)
        names = STEP_COLUMNS
        for values in zip(*(getattr(block, n).tolist() for n in names), strict=True):
            row = dict(zip(names, values, strict=True))
            row["how"] = block.hows[row["how"]]
            out.append(row)
    return out


def rows_records(seconds: int, *, ranks: int = 8, step_ns: int = 100_000_000,
                 gpus: bool = True, phases: bool = False
                 ) -> Iterator[dict[str, Any] | None]:
    """The records a session logs (``step_rows``) for a job on ``ranks`` GPUs over
    ``seconds``, None after each second (where the session flushes): once a second NVML
    (one GPU per rank) and every rank's memory and CPU, the primary's stack-sample
    spans (``phases``), and one ``steps`` record with every rank's iteration ends of
    that second (2% of the wait jitters)."""
    pids = [PID + r for r in range(ranks)]
    facts = session_facts()
    facts.update(pids=pids, ranks=list(range(ranks)), step_rows=True,
                 gpu={"available": gpus})
    yield {"type": "session_start", "t_mono_ns": START_NS, "session": facts}
    per_second = 1_000_000_000 // step_ns
    for second in range(seconds):
        t0 = START_NS + second * 1_000_000_000
        if gpus:
            yield {"type": "gpu", "t_mono_ns": t0,
                   "gpus": [_gpu(g, t0, pids) for g in range(ranks)]}
        for pid in pids:
            yield {"type": "process", "t_mono_ns": t0, "pid": pid,
                   "rss_bytes": (20 << 30) + second * 4096, "peak_rss_bytes": 24 << 30,
                   "cpu_ns": second * 10**9, "run_delay_ns": second * 10**6}
        rows = []
        for k in range(per_second):
            t = t0 + k * step_ns
            for span, (a, b) in zip(("data_loading", "forward", "backward", "optimizer"),
                                    ((0, 5), (5, 40), (40, 90), (90, 100)), strict=True):
                if phases:
                    yield {"type": "phase", "t_mono_ns": t + step_ns * a // 100,
                           "end_mono_ns": t + step_ns * b // 100, "pid": PID, "phase": span}
            for j, pid in enumerate(pids):
                end = t + step_ns * 91 // 100 + j * 1000
                wait = step_ns * 3 // 10 + (k * 7919 + j * 104729) % (step_ns // 50)
                rows.append((pid, end, 1, wait, 400, 0, step_ns // 2, t + step_ns * 4 // 10,
                             t + step_ns * 9 // 10, 0))
        yield Steps.encode(rows[0][1], rows, ["uprobe"]).to_record()
        yield None
    yield {"type": "session_end", "t_mono_ns": START_NS + seconds * 1_000_000_000,
           "reason": "duration"}


def write_rows_log(out_dir: Path, seconds: int, **kw: Any) -> Path:
    """``rows_records`` as this agent's session writes them (EventLogWriter: zstd, parts)."""
    out = OutputDir.open(out_dir)
    writer = EventLogWriter(out, "perf_events_20261130_120000")
    for record in rows_records(seconds, **kw):
        if record is None:
            writer.flush()
        else:
            writer.append(record)
    writer.close()
    out.close()
    return out_dir / writer.name
