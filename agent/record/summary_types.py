"""The summary's three parts as typed records, for the views that read them back.

Written by perfmon.parsers.schema_types from parsers/data/perf_summary.schema.json (do not
edit: ``make summary-types``). Every value may be None: a view reads summaries anyone may
have written, kept to the schema by read_summary, which turns a wrong value into None.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict


class SessionInfo(TypedDict, total=False):
    """``session_info``: what was watched, how, and why it ended."""

    start_time: str | None
    end_time: Any
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
    end_reason: Literal["target_exited", "duration", "SIGINT", "SIGTERM", "SIGHUP", "stdout_closed", "error", "log_truncated", "command_exited", "ranks_changed", "yielded"] | None
    event_log: str | None
    event_log_parts: int | None
    step_rows: bool | None
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
    process_start_monotonic_ns: int | None
    layout: dict[str, Any] | None
    wait_probes: dict[str, Any] | None
    microbatches_declared: int | None
    started_by: Literal["attach", "tracker"] | None
    job_before: dict[str, Any] | None
    job: dict[str, Any] | None
    exit: dict[str, Any] | None


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
    iteration_estimator: Literal["uprobe", "grad_read", "counted", "backward", "counter", "phase_transitions", "optimizer_frame", "function"] | None
    iteration_estimators: dict[str, Any] | None
    iteration_clock: Literal["exact", "declared", "estimated"] | None
    lost_events: int | None
    memory_kind: Literal["gpu", "rss"] | None
    avg_gpu_utilization_pct: float | None
    avg_gpu_power_w: float | None
    gpu_throttle_reasons: dict[str, Any] | None
    gpu_attribution: Literal["processes", "all_gpus", "none"] | None
    gpu_events: list[Any] | None
    phases: Any
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
    pipeline: dict[str, Any] | None
    goodput: Any
    fail_slow: list[Any] | None


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
    phases: Any
    pipeline: dict[str, Any] | None
    end_monotonic_ns: int | None
    kernels_per_iter: float | None
    cpu_sync_wait_ms: float | None
    nccl_calls_per_iter: float | None
    nccl_bytes_per_iter: float | None
    nccl_per_iter_by_collective: dict[str, Any] | None
