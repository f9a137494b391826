"""One monitoring session: attach, poll the probes, log and aggregate, write the summary, detach.

The session owns the clock: every record carries CLOCK_MONOTONIC nanoseconds,
and the wall-clock start is taken once, so the summary's timestamps follow
from the monotonic ones.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from perfmon.agent.aggregate import StepAggregator
from perfmon.agent.eventlog import EventLogWriter
from perfmon.agent.gpu import GpuMonitor
from perfmon.agent.health import run_health_check
from perfmon.agent.model import build_workload, explicit_model_fields, resolve_model
from perfmon.agent.summary import build_summary, write_json_atomic
from perfmon.parsers.errors import PerfmonError
from perfmon.probes.nvml import NvmlUnavailable
from perfmon.probes.procfs import MemorySampler, TargetProcess, is_running, resolve_targets
from perfmon.probes.sampler import monotonic_ns
from perfmon.probes.uprobes import MarkerProbe, check_ebpf_prerequisites

POLL_INTERVAL_S = 0.1
LIVENESS_INTERVAL_NS = 500_000_000
# Between log intervals the summary is still refreshed this often, so a long
# interval (or a stalled job) does not leave the file stale.
SUMMARY_REWRITE_NS = 5_000_000_000
HEALTH_WINDOW_S = 5.0


class OutputDirError(PerfmonError):
    exit_code = 2


@dataclass(frozen=True)
class AttachOptions:
    pid: int
    model_config: str | None = None
    model_preset: str | None = None
    output_dir: Path = Path("outputs/logs/perf_monitor")
    log_interval: int = 10
    duration_s: float | None = None
    peak_tflops: float | None = None
    dtype: str = "bf16"
    memory_interval_s: float = 1.0
    gpu_interval_s: float = 1.0
    health_check: bool = False


@dataclass
class SessionResult:
    summary_path: Path
    events_path: Path
    summary: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def agent_version() -> str:
    try:
        return version("perfmon-agent")
    except PackageNotFoundError:
        return "unknown"


def _prepare_output_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputDirError(f"output dir {path}: cannot create: {err.strerror}") from err
    if not path.is_dir():
        raise OutputDirError(f"output dir {path}: not a directory")
    return path


def _session_facts(
    targets: list[TargetProcess], model: dict[str, Any], start_wall: datetime, start_ns: int,
    options: AttachOptions,
) -> dict[str, Any]:
    primary = targets[0]
    return {
        "start_time": start_wall.isoformat(),
        "attach_monotonic_ns": start_ns,
        "host": socket.gethostname(),
        "agent_version": agent_version(),
        "pid": options.pid,
        "pids": [t.pid for t in targets],
        "ranks": [t.rank for t in targets],
        "primary_pid": primary.pid,
        "command_line": primary.cmdline,
        "torch_library": primary.torch_library,
        "iteration_source": "uprobe",
        "iteration_numbering": "counted from attach",
        "log_interval": options.log_interval,
        "model": model,
    }


@dataclass
class _Live:
    """What a running session polls and feeds."""

    probe: MarkerProbe
    memory: MemorySampler
    gpu: GpuMonitor
    log: EventLogWriter
    aggregator: StepAggregator


class MonitorSession:
    """Attach to a job, monitor until it exits, a signal, or the duration; write the summary."""

    def __init__(self, options: AttachOptions, progress: Callable[[dict[str, Any]], None]) -> None:
        self.options = options
        self.progress = progress
        self._stop_reason: str | None = None
        self._dropped_logged = 0

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stop_reason = signal.Signals(signum).name

    def run(self) -> SessionResult:
        opts = self.options
        explicit = explicit_model_fields(opts.model_config, opts.model_preset)
        # Fail on the host's lacks before looking at any process (the probe checks again).
        check_ebpf_prerequisites()
        targets = resolve_targets(opts.pid)
        primary = targets[0]
        cfg, model_source = resolve_model(primary, explicit)
        pids = [t.pid for t in targets]
        health = self._health_check(pids) if opts.health_check else None
        gpu = GpuMonitor(pids, opts.gpu_interval_s)
        first_gpu_records = gpu.poll() if gpu.start() else []
        peak = opts.peak_tflops
        if peak is None and gpu.info["available"]:
            peak, gpu.info["device"] = gpu.peak_tflops(first_gpu_records, opts.dtype)
        gpu.info.update(dtype=opts.dtype, peak_tflops=peak,
                        peak_tflops_from="--peak-tflops" if opts.peak_tflops else "device table")
        workload, model_info = build_workload(cfg, primary, peak)
        out_dir = _prepare_output_dir(opts.output_dir)

        probe = MarkerProbe(targets)
        probe.start()  # raises before any file is written when the host cannot probe
        memory = MemorySampler([t.pid for t in targets], opts.memory_interval_s)
        memory.start()
        start_ns, start_wall = monotonic_ns(), datetime.now().astimezone()
        stamp = start_wall.strftime("%Y%m%d_%H%M%S")
        summary_path = out_dir / f"perf_summary_{stamp}.json"
        events_path = out_dir / f"perf_events_{stamp}.msgpack"
        facts = _session_facts(targets, {**model_source, **model_info}, start_wall, start_ns, opts)
        facts["warnings"] = list(probe.warnings)
        facts["gpu"] = gpu.info
        if health is not None:
            facts["health"] = health
        facts["workload"] = workload.__dict__
        aggregator = StepAggregator(
            workload, primary.pid, start_ns, start_wall.timestamp(), opts.log_interval
        )
        log = EventLogWriter(events_path)
        log.append({"type": "session_start", "t_mono_ns": start_ns, "session": facts})
        for record in first_gpu_records:
            log.append(record)
            aggregator.feed(record)
        log.flush()
        write_json_atomic(summary_path, build_summary(facts, aggregator))

        live = _Live(probe, memory, gpu, log, aggregator)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        deadline = start_ns + int(opts.duration_s * 1e9) if opts.duration_s else None
        next_liveness = next_rewrite = start_ns
        self._dropped_logged = 0
        try:
            while self._stop_reason is None:
                time.sleep(POLL_INTERVAL_S)
                completed = self._ingest(live)
                now = monotonic_ns()
                if completed or now >= next_rewrite:
                    # Log first, so the log always holds all that the summary counts.
                    log.flush()
                    write_json_atomic(summary_path, build_summary(facts, aggregator))
                    next_rewrite = now + SUMMARY_REWRITE_NS
                log.flush_if_due()
                if deadline is not None and now >= deadline:
                    self._stop_reason = "duration"
                elif now >= next_liveness:
                    next_liveness = now + LIVENESS_INTERVAL_NS
                    if not is_running(primary):
                        self._stop_reason = "target_exited"
        finally:
            # The window ends now: take what the kernel delivered up to this instant,
            # then detach (which takes a while, and whose events we do not count).
            end_ns = monotonic_ns()
            self._ingest(live, until_ns=end_ns)
            probe.close()
            memory.close()
            gpu.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            end = {"type": "session_end", "t_mono_ns": end_ns,
                   "reason": self._stop_reason or "error"}
            aggregator.feed(end)
            log.append(end)
            log.close()
            summary = build_summary(facts, aggregator)
            write_json_atomic(summary_path, summary)
        return SessionResult(summary_path, events_path, summary, facts["warnings"])

    @staticmethod
    def _health_check(pids: list[int]) -> dict[str, Any]:
        """The GPU health report before monitoring starts (``attach --health-check``)."""
        try:
            return run_health_check(None, HEALTH_WINDOW_S, set(pids)).to_dict()
        except NvmlUnavailable as err:
            return {"available": False, "reason": str(err)}

    def _ingest(self, live: _Live, until_ns: int | None = None) -> bool:
        """Log and aggregate what the probes gathered; True when an interval completed."""
        records: list[dict[str, Any]] = [
            {"type": "marker", **e.__dict__} for e in live.probe.poll()
            if until_ns is None or e.t_mono_ns <= until_ns
        ]
        records += [{"type": "process", **s.__dict__} for s in live.memory.poll()]
        records += live.gpu.poll()
        if live.probe.dropped > self._dropped_logged:
            records.append({"type": "lost", "t_mono_ns": monotonic_ns(),
                            "count": live.probe.dropped - self._dropped_logged})
            self._dropped_logged = live.probe.dropped
        completed = False
        for record in records:
            live.log.append(record)
            for entry in live.aggregator.feed(record):
                self.progress(entry)
                completed = True
        return completed
