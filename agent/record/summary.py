"""The perf summary: built from the session facts and the aggregator, written atomically,
and rebuilt from an event log.

The format is FlagScale's in-process perf monitor's (``session_info``,
``final_statistics``, ``iteration_logs``), with extra keys only added, so
existing dashboards keep reading it. parsers/data/perf_summary.schema.json describes it.
"""

from __future__ import annotations

import functools
import json
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal, TypedDict

from perfmon.agent.record.eventlog import EventLogWriter
from perfmon.agent.record.layout import session_names
from perfmon.agent.record.outputs import (
    OutputDir,
    OutputDirError,
    json_bytes,
    json_document,
    refused,
)
from perfmon.agent.reducers import Summarizer
from perfmon.parsers.errors import InputFileError
from perfmon.parsers.figures import Statistics, render
from perfmon.parsers.schema_filter import SchemaFilter
from perfmon.probes.files import read_user_file

MAX_SUMMARY_BYTES = 256 << 20  # a summary keeps at most --max-log-entries entries

# The summary's three parts as typed records, for the views that read them back. Every
# value may be None: a view reads summaries anyone may have written, kept to the schema
# by read_summary, which turns a wrong value into None. tests/unit/test_architecture.py checks
# that their keys are the schema's.

class SessionInfo(TypedDict, total=False):
    """``session_info``: what was watched, how, and why it ended."""

    start_time: str | None
    end_time: str | None
    total_iterations: int | None
    pid: int | None
    pids: list[Any] | None
    ranks: list[Any] | None
    primary_pid: int | None
    command_line: list[Any] | None
    host: str | None
    agent_version: str | None
    iteration_source: Literal["uprobe", "pyspy"] | None
    hung: bool | None
    stack_sampling: bool | None
    cuda: dict[str, Any] | None
    iteration_numbering: Literal["attach", "job_counter"] | None
    iteration_counter: str | None
    schema_version: int | None
    torch_library: str | None
    probe_backend: Literal["bcc", "tracefs"] | None
    stack_sampling_mode: Literal["bursts", "continuous"] | None
    cpu_budget_pct_per_rank: float | None
    rebuilt_from_event_log: bool | None
    event_log_tail_cut: bool | None
    attach_monotonic_ns: int | None
    detach_monotonic_ns: int | None
    end_reason: Literal[
        "target_exited", "duration", "SIGINT", "SIGTERM", "SIGHUP", "stdout_closed", "error",
        "log_truncated", "command_exited", "ranks_changed", "yielded"] | None
    event_log: str | None
    event_log_parts: int | None
    step_rows: bool | None  # iteration ends logged as rows (steps records), not markers
    event_log_coarsened: dict[str, Any] | None
    iteration_logs_max_entries: int | None
    iteration_logs_kept_one_in: int | None
    log_interval: int | None
    warnings: list[Any] | None
    notes: list[Any] | None
    model: dict[str, Any] | None
    workload: dict[str, Any] | None
    gpu: dict[str, Any] | None
    health: dict[str, Any] | None
    job: dict[str, Any] | None
    exit: dict[str, Any] | None
    process_start_monotonic_ns: int | None
    started_by: Literal["attach", "tracker"] | None
    microbatches_declared: int | None
    job_before: dict[str, Any] | None


class FinalStatistics(TypedDict, total=False):
    """``final_statistics``: the session's figures."""

    avg_tflops_per_gpu: float | None
    avg_step_time_ms: float | None
    peak_memory_gb: float | None
    avg_tokens_per_sec: float | None
    avg_samples_per_sec: float | None
    p50_step_time_ms: float | None
    p90_step_time_ms: float | None
    p99_step_time_ms: float | None
    min_step_time_ms: float | None
    max_step_time_ms: float | None
    microbatches_per_step: int | None
    mfu: float | None
    avg_hardware_tflops_per_gpu: float | None
    measured_iterations: int | None
    iteration_estimator: Literal[
        "uprobe", "grad_read", "counted", "backward", "counter", "phase_transitions",
        "optimizer_frame", "function"] | None
    iteration_estimators: dict[str, Any] | None
    iteration_clock: Literal["exact", "declared", "estimated"] | None
    lost_events: int | None
    memory_kind: Literal["gpu", "rss"] | None
    avg_gpu_utilization_pct: float | None
    avg_gpu_power_w: float | None
    gpu_throttle_reasons: dict[str, Any] | None
    gpu_attribution: Literal["processes", "all_gpus", "none"] | None
    gpu_events: list[Any] | None
    phases: dict[str, Any] | None
    phases_source: Literal["uprobe", "pyspy", "uprobe+pyspy"] | None
    phases_iterations: int | None
    hangs: list[Any] | None
    kernels_per_iter: float | None
    cpu_sync_wait_ms: float | None
    nccl_calls_per_iter: float | None
    nccl_bytes_per_iter: float | None
    nccl_per_iter_by_collective: dict[str, Any] | None
    ranks: list[Any] | None
    stragglers: list[Any] | None
    data_quality: dict[str, Any] | None
    kernel_launches_sampled_iterations: int | None
    fail_slow: list[Any] | None
    goodput: dict[str, Any] | None


class IterationEntry(TypedDict, total=False):
    """One ``iteration_logs`` entry: a logged iteration's figures."""

    iteration: int | None
    timestamp: str | None
    step_time_ms: float | None
    TFLOPS_per_GPU: float | None
    tokens_per_sec: float | None
    samples_per_sec: float | None
    memory_GB: float | None
    kept_one_in: int | None
    ranks: list[Any] | None
    gpu_utilization_pct: float | None
    gpu_power_w: float | None
    gpu_throttle_reasons: list[Any] | None
    phases: dict[str, Any] | None
    end_monotonic_ns: int | None
    kernels_per_iter: float | None
    cpu_sync_wait_ms: float | None
    nccl_calls_per_iter: float | None
    nccl_bytes_per_iter: float | None
    nccl_per_iter_by_collective: dict[str, Any] | None



def build_summary(session: dict[str, Any], summarizer: Summarizer,
                  stats: Statistics | None = None) -> dict[str, Any]:
    """The summary document for the records the summarizer has seen so far, its figures
    rendered in the summary's keys and units (``stats``: its statistics, when the caller
    has them already). Written with json_bytes, which turns a NaN or an infinity into null.

    ``end_time`` is null while the session runs; ``end_reason`` says why it
    ended (target_exited, duration, SIGINT, SIGTERM, SIGHUP, stdout_closed, error,
    command_exited, ranks_changed, yielded, or log_truncated for a summary rebuilt from the
    log of an agent that was killed: docs/metrics.md).
    """
    return {
        "session_info": {**session, **summarizer.session_fields()},
        "final_statistics": render(stats if stats is not None else summarizer.statistics()),
        "iteration_logs": [render(e) for e in summarizer.intervals_logged],
    }


class SummaryFile:
    """The session's ``perf_summary_<ts>.json``, rewritten atomically in ``out``.

    A write the disk refuses is data (``error``), not a failure: the previous
    summary stays in place and the next write tries again.
    """

    def __init__(self, out: OutputDir, name: str) -> None:
        self.out = out
        self.name = name
        self.error: OSError | None = None

    @property
    def path(self) -> Path:
        return self.out.path / self.name

    def write(self, document: dict[str, Any], *, compact: bool = False) -> bool:
        """Replace the file (``compact`` JSON for the frequent rewrites); False when the
        disk refused (``error``)."""
        try:
            self.out.replace(self.name, json_bytes(document, compact=compact))
        except OSError as err:
            self.error = refused(err)
            return False
        self.error = None
        return True


@functools.cache
def _summary_schema() -> dict[str, Any]:
    return json.loads(files("perfmon.parsers").joinpath("data", "perf_summary.schema.json")
                      .read_text())  # type: ignore[no-any-return]


@functools.cache
def _summary_filter() -> SchemaFilter:
    return SchemaFilter(_summary_schema())


@functools.cache
def facts_filter() -> SchemaFilter:
    return SchemaFilter(_summary_schema(), ("properties", "session_info"))


@functools.cache
def entry_filter() -> SchemaFilter:
    """The filter of one iteration_logs entry (SchemaFilter.apply)."""
    return SchemaFilter(_summary_schema(), ("properties", "iteration_logs", "items"))



def read_summary(path: Path) -> tuple[dict[str, Any], str | None]:
    """A perf summary file the user named (report, top, merge), kept to what its schema
    allows, and one line saying what was not (None when everything was).

    Values of the wrong type, out of range or not finite (NaN, Infinity, 1e308)
    become unknown (None): a summary anyone may have written never crashes a view
    nor passes a bad value for a figure. Raises InputFileError (one line) for a file
    that is not JSON, nests deeper than Python's parser goes, or lacks
    session_info, final_statistics or iteration_logs.
    """
    return parse_summary(read_user_file(str(path), "summary", MAX_SUMMARY_BYTES), path)


def parse_summary(data: bytes, path: Path) -> tuple[dict[str, Any], str | None]:
    """The summary in ``data`` (read from ``path``), as read_summary keeps it."""
    summary = json_document(data, f"summary {path}")
    if not (isinstance(summary, dict) and isinstance(summary.get("session_info"), dict)
            and isinstance(summary.get("final_statistics"), dict)
            and isinstance(summary.get("iteration_logs"), list)):
        raise InputFileError(f"summary {path}: not a perf summary (session_info, "
                             "final_statistics and iteration_logs expected)")
    return check_summary(summary, f"summary {path}")


def check_summary(summary: dict[str, Any], source: str) -> tuple[dict[str, Any], str | None]:
    """``summary`` kept to what its schema allows, and one line naming ``source`` and what
    became unknown (None when nothing did)."""
    summary, filtered = _summary_filter().apply(summary)
    if not filtered.changed:
        return summary, None
    return summary, (f"{source}: {filtered.changed} value(s) not as its schema allows "
                     f"shown as unknown ({'; '.join(filtered.examples)})")


def claim_session_files(out: OutputDir, session_stamp: str, first_summary: bytes,
                        part_bytes: int, max_bytes: int) -> tuple[SummaryFile, EventLogWriter]:
    """A session's pair under a fresh stem (perfmon.agent.record.layout.session_names).

    The summary is published (complete, ``first_summary``) under a name no file has, and
    the event log created exclusively beside it; when either name is taken (two agents
    in one second, or anything planted there), the next suffix is tried.
    """
    for names in session_names(session_stamp):
        try:
            out.publish_new(names.summary, first_summary)
        except FileExistsError:
            continue
        try:
            log = EventLogWriter(out, names.log_stem, part_bytes=part_bytes, max_bytes=max_bytes)
        except FileExistsError:
            out.unlink(names.summary)
            continue
        return SummaryFile(out, names.summary), log
    raise OutputDirError(f"output dir {out.path}: no free file name for {session_stamp}")
