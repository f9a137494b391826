"""The perf summary file: built from the session facts and the aggregator, written atomically.

The format is FlagScale's in-process perf monitor's (``session_info``,
``final_statistics``, ``iteration_logs``), with extra keys only added, so
existing dashboards keep reading it. docs/perf_summary.schema.json describes it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from perfmon.agent.aggregate import StepAggregator, Workload


def finite(value: Any) -> Any:
    """The value with NaN and infinities replaced by None, recursively: strict JSON only."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def build_summary(session: dict[str, Any], aggregator: StepAggregator) -> dict[str, Any]:
    """The summary document for the records the aggregator has seen so far.

    ``end_time`` is null while the session runs; ``end_reason`` says why it
    ended (target_exited, duration, SIGINT, SIGTERM, error, or log_truncated
    for a summary rebuilt from the log of an agent that was killed).
    """
    info = dict(session)
    end_ns = aggregator.end_t_mono_ns
    info["end_time"] = aggregator.wall_time(end_ns) if end_ns is not None else None
    info["detach_monotonic_ns"] = end_ns
    info["end_reason"] = aggregator.end_reason
    info["total_iterations"] = aggregator.iterations_ended
    info["hung"] = bool(aggregator.hangs) and aggregator.hangs[-1]["recovered_at"] is None
    if aggregator.job_iteration_offset is not None:
        info["iteration_numbering"] = (
            f"the job's own (local variable '{aggregator.job_iteration_variable}')")
    return finite(
        {
            "session_info": info,
            "final_statistics": aggregator.final_statistics(),
            "iteration_logs": aggregator.iteration_logs,
        }
    )


def write_json_atomic(path: Path, document: dict[str, Any]) -> None:
    """Write, fsync, rename, fsync the folder: readers see the old file or the new, never half."""
    text = json.dumps(document, indent=2, allow_nan=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def summary_from_records(records: list[dict[str, Any]], truncated: bool) -> dict[str, Any]:
    """Rebuild the summary from an event log's records (see perfmon.parsers.events).

    A log without a ``session_end`` record (the agent was killed) ends at its
    last record, with ``end_reason`` ``log_truncated``.
    """
    facts = records[0]["session"]
    aggregator = StepAggregator(
        Workload.from_dict(facts["workload"]),
        facts["primary_pid"],
        facts["attach_monotonic_ns"],
        datetime.fromisoformat(facts["start_time"]).timestamp(),
        facts["log_interval"],
        stack_sampling=facts.get("stack_sampling", False),
        cuda_counters=facts.get("cuda", {}).get("available", False),
    )
    for record in records[1:]:
        aggregator.feed(record)
    if aggregator.end_reason is None:
        last_ns = max(r.get("t_mono_ns", 0) for r in records)
        aggregator.feed({"type": "session_end", "t_mono_ns": last_ns, "reason": "log_truncated"})
    summary = build_summary(facts, aggregator)
    summary["session_info"]["rebuilt_from_event_log"] = True
    summary["session_info"]["event_log_tail_cut"] = truncated
    return summary
