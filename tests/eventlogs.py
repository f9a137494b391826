"""Synthetic event logs with the records a real session writes, for summarize's tests
and benchmark: the same facts, the same record shapes, any length."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

START_NS = 10**12  # CLOCK_MONOTONIC of attach
STEP_NS = 100_000_000  # 100 ms iterations
PID = 4242


def session_facts(log_interval: int = 10, max_log_entries: int | None = 2000) -> dict[str, Any]:
    """session_start facts like a real session's (a CPU job with a model)."""
    return {
        "start_time": "2026-11-30T12:00:00+00:00", "attach_monotonic_ns": START_NS,
        "host": "node-1", "agent_version": "test", "pid": PID, "pids": [PID], "ranks": [0],
        "primary_pid": PID, "command_line": ["python", "train.py"],
        "torch_library": "/usr/lib/libtorch_cpu.so", "iteration_numbering": "counted from attach",
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
