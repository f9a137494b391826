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
from dataclasses import asdict, dataclass, field
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from perfmon.agent.aggregate import DEFAULT_MAX_LOG_ENTRIES, StepAggregator
from perfmon.agent.eventlog import DEFAULT_PART_BYTES, EventLogWriter
from perfmon.agent.gpu import GpuMonitor
from perfmon.agent.health import run_health_check
from perfmon.agent.model import build_workload, explicit_model_fields, resolve_model
from perfmon.agent.outputs import OutputDir, OutputDirError, OutputNotWritable, json_bytes
from perfmon.agent.stack_monitor import StackMonitor, dump_ranks, main_python_stacks
from perfmon.agent.summary import SummaryFile, build_summary
from perfmon.parsers.errors import PerfmonError
from perfmon.parsers.stack_analysis import innermost_common_frame
from perfmon.probes.cuda import CudaActivityProbe
from perfmon.probes.errors import PrerequisiteMissing, PrivilegeError, SymbolNotFound
from perfmon.probes.nvml import NvmlUnavailable
from perfmon.probes.procfs import MemorySampler, TargetProcess, is_running, resolve_targets
from perfmon.probes.pyspy import DEFAULT_RATE_HZ
from perfmon.probes.sampler import monotonic_ns
from perfmon.probes.uprobes import MarkerProbe, check_ebpf_prerequisites

# What makes `--iteration-source auto` fall back from uprobes to py-spy.
UPROBE_UNAVAILABLE = (PrerequisiteMissing, PrivilegeError, SymbolNotFound)

POLL_INTERVAL_S = 0.1
LIVENESS_INTERVAL_NS = 500_000_000
# The summary is rewritten when a log interval completes, but not more often
# than once a second, and at least every 5 s so a long interval (or a stalled
# job) does not leave the file stale. Both stretch to 50 x the last write's
# duration: iteration_logs grows all run long, and rewriting (and fsyncing) it
# must stay a small share of the agent's time on a core the job may need.
SUMMARY_MIN_INTERVAL_NS = 1_000_000_000
SUMMARY_REFRESH_NS = 5_000_000_000
SUMMARY_WRITE_BUDGET = 50
HEALTH_WINDOW_S = 5.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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
    iteration_source: str = "auto"  # auto | uprobe | pyspy
    iteration_function: str | None = None  # regex over function names (pyspy)
    iteration_variable: str | None = None  # the job's own counter, a local variable
    stack_sampling: bool = True  # py-spy for phases (and iterations in pyspy mode)
    stack_rate_hz: int = DEFAULT_RATE_HZ
    hang_factor: float = 10.0
    hang_timeout_s: float = 120.0
    allow_shared_output_dir: bool = False
    max_log_entries: int = DEFAULT_MAX_LOG_ENTRIES
    event_log_part_bytes: int = DEFAULT_PART_BYTES


@dataclass
class SessionResult:
    summary_path: Path
    events_path: Path
    summary: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    # Set when the final summary (or the event log) could not be written: exit 7.
    write_error: OutputNotWritable | None = None


def agent_version() -> str:
    try:
        return version("perfmon-agent")
    except PackageNotFoundError:
        return "unknown"


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
        "command_line": primary.shown_cmdline,
        "torch_library": primary.torch_library,
        "iteration_numbering": "counted from attach",
        "log_interval": options.log_interval,
        "model": model,
    }


@dataclass
class _Live:
    """What a running session polls and feeds, and the files it writes."""

    probe: MarkerProbe | None  # None in pyspy mode
    stacks: StackMonitor | None  # None without stack sampling
    cuda: CudaActivityProbe | None  # None without uprobes or without CUDA libraries
    memory: MemorySampler
    gpu: GpuMonitor
    out: OutputDir
    log: EventLogWriter
    summary: SummaryFile
    aggregator: StepAggregator

    def close_sources(self, warn: Callable[[str], None]) -> None:
        """Detach and stop every source; a failure is a warning, never a traceback."""
        for part in (self.probe, self.stacks, self.cuda, self.memory, self.gpu):
            if part is None:
                continue
            try:
                part.close()
            except Exception as err:  # bcc raises bare Exception while detaching
                warn(f"closing {type(part).__name__} failed: {err}")


class MonitorSession:
    """Attach to a job, monitor until it exits, a signal, or the duration; write the summary.

    ``progress`` gets each completed iteration_logs entry; ``warn`` one-line
    warnings (a fallback to py-spy, a hang).
    """

    def __init__(self, options: AttachOptions, progress: Callable[[dict[str, Any]], None],
                 warn: Callable[[str], None] = lambda _line: None) -> None:
        self.options = options
        self.progress = progress
        self.warn = warn
        self._stop_reason: str | None = None
        self._dropped_logged = 0
        self._hang_since: int | None = None  # iterations_ended when the hang was declared
        self._failing: dict[str, bool] = {}  # file -> its last write failed
        self.warnings: list[str] = []

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stop_reason = signal.Signals(signum).name

    def _warning(self, text: str) -> None:
        self.warnings.append(text)
        self.warn(text)

    def _uprobe_host_ready(self) -> str:
        """The iteration source to try first; fails on the host's lacks before any process."""
        source = self.options.iteration_source
        if source == "pyspy":
            return source
        try:
            check_ebpf_prerequisites()
        except UPROBE_UNAVAILABLE as err:
            if source == "uprobe":
                raise
            self._warning(f"uprobes unavailable, iterations from py-spy stack samples: {err}")
            return "pyspy"
        return "uprobe"

    def _start_sources(
        self, source: str, targets: list[TargetProcess]
    ) -> tuple[str, MarkerProbe | None, StackMonitor | None]:
        """Start the iteration source (falling back under auto) and the stack sampler."""
        opts = self.options
        probe = None
        if source == "uprobe":
            probe = MarkerProbe(targets)
            try:
                probe.start()
            except UPROBE_UNAVAILABLE as err:
                if opts.iteration_source == "uprobe":
                    raise
                self._warning(f"uprobes unavailable, iterations from py-spy stack samples: {err}")
                probe, source = None, "pyspy"
        stacks = None
        if source == "pyspy" or opts.stack_sampling:
            stacks = StackMonitor(
                targets[0], detect_iterations=source == "pyspy",
                iteration_function=opts.iteration_function,
                iteration_variable=opts.iteration_variable, rate_hz=opts.stack_rate_hz)
            try:
                stacks.start()
            except PerfmonError as err:
                if source == "pyspy":
                    if probe is not None:
                        probe.close()
                    raise
                self._warning(f"stack sampling unavailable, phases from uprobes only: {err}")
                stacks = None
        if probe is not None:
            for text in probe.warnings:
                self._warning(text)
        return source, probe, stacks

    def stop(self, reason: str) -> None:
        """End the session at the next poll (e.g. the output stream was closed)."""
        self._stop_reason = self._stop_reason or reason

    def run(self) -> SessionResult:
        opts = self.options
        explicit = explicit_model_fields(opts.model_config, opts.model_preset)
        # The output dir is checked (owner, mode, writable) before any process is read.
        out = OutputDir.open(opts.output_dir, allow_shared=opts.allow_shared_output_dir)
        try:
            return self._prepare(out, explicit)
        finally:
            out.close()

    def _prepare(self, out: OutputDir, explicit: list[tuple[str, dict[str, Any]]]
                 ) -> SessionResult:
        opts = self.options
        source = self._uprobe_host_ready()
        targets = resolve_targets(opts.pid)
        primary = targets[0]
        model = resolve_model(primary, explicit)
        for text in model.warnings:
            self._warning(text)
        if "problem" in model.description:
            self._warning(f"model dimensions unknown, no FLOPs: "
                          f"{model.description['problem']} (give --model-config)")
        pids = [t.pid for t in targets]
        health = self._health_check(pids) if opts.health_check else None
        gpu = GpuMonitor(pids, opts.gpu_interval_s)
        first_gpu_records = gpu.poll() if gpu.start() else []
        peak = opts.peak_tflops
        if peak is None and gpu.info["available"]:
            peak, gpu.info["device"] = gpu.peak_tflops(first_gpu_records, opts.dtype)
        gpu.info.update(dtype=opts.dtype, peak_tflops=peak,
                        peak_tflops_from="--peak-tflops" if opts.peak_tflops else "device table")
        workload, model_info = build_workload(model, primary, peak)
        try:
            return self._monitor(source=source, targets=targets, out=out, gpu=gpu,
                                 first_gpu_records=first_gpu_records, health=health,
                                 workload=workload, model={**model.description, **model_info})
        finally:
            gpu.close()

    def _monitor(self, *, source: str, targets: list[TargetProcess], out: OutputDir,
                 gpu: GpuMonitor, first_gpu_records: list[dict[str, Any]],
                 health: dict[str, Any] | None, workload: Any, model: dict[str, Any]
                 ) -> SessionResult:
        opts = self.options
        primary = targets[0]
        pids = [t.pid for t in targets]
        # Raises before any file is written when the host cannot probe.
        source, probe, stacks = self._start_sources(source, targets)
        cuda, cuda_info = (self._start_cuda(targets) if probe is not None
                           else (None, {"available": False, "reason": "no uprobes (py-spy mode)"}))
        memory = MemorySampler(pids, opts.memory_interval_s)
        memory.start()
        start_ns, start_wall = monotonic_ns(), datetime.now().astimezone()
        facts = _session_facts(targets, model, start_wall, start_ns, opts)
        facts.update(iteration_source=source, warnings=self.warnings, gpu=gpu.info,
                     stack_sampling=stacks is not None, workload=workload.__dict__,
                     cuda=cuda_info, iteration_logs_max_entries=opts.max_log_entries)
        if health is not None:
            facts["health"] = health
        aggregator = StepAggregator(
            workload, primary.pid, start_ns, start_wall.timestamp(), opts.log_interval,
            stack_sampling=stacks is not None, cuda_counters=cuda is not None,
            max_log_entries=opts.max_log_entries,
        )
        try:
            summary_file, log = self._claim_files(
                out, start_wall.strftime("%Y%m%d_%H%M%S"), facts, aggregator)
        except BaseException:
            for part in (probe, stacks, cuda, memory):
                if part is not None:
                    part.close()
            raise
        facts["event_log"] = log.name
        log.append({"type": "session_start", "t_mono_ns": start_ns, "session": facts})
        for record in first_gpu_records:
            log.append(record)
            aggregator.feed(record)
        self._write(log, summary_file, facts, aggregator)

        live = _Live(probe, stacks, cuda, memory, gpu, out, log, summary_file, aggregator)
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        deadline = start_ns + int(opts.duration_s * 1e9) if opts.duration_s else None
        next_liveness = next_write = next_refresh = start_ns
        try:
            while self._stop_reason is None:
                time.sleep(POLL_INTERVAL_S)
                completed = self._ingest(live)
                now = monotonic_ns()
                if self._check_hang(live, targets, now):
                    completed = True
                if (completed and now >= next_write) or now >= next_refresh:
                    self._write(log, summary_file, facts, aggregator)
                    spent = SUMMARY_WRITE_BUDGET * (monotonic_ns() - now)
                    next_write = now + max(SUMMARY_MIN_INTERVAL_NS, spent)
                    next_refresh = now + max(SUMMARY_REFRESH_NS, spent)
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
            live.close_sources(self._warning)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            end = {"type": "session_end", "t_mono_ns": end_ns,
                   "reason": self._stop_reason or "error"}
            for entry in aggregator.feed(end):
                self.progress(entry)
            log.append(end)
            log_ok = log.close()
            summary = build_summary(facts, aggregator)
            summary_ok = summary_file.write(summary)
        result = SessionResult(summary_file.path, out.path / log.name, summary, self.warnings)
        failed = summary_file if not summary_ok else (log if not log_ok else None)
        if failed is not None:
            path = summary_file.path if failed is summary_file else out.path / log.name
            result.write_error = OutputNotWritable(
                f"output not writable: {path}: {failed.error.strerror if failed.error else '?'}")
        return result

    def _claim_files(self, out: OutputDir, stamp: str, facts: dict[str, Any],
                     aggregator: StepAggregator) -> tuple[SummaryFile, EventLogWriter]:
        """Claim a fresh pair of names: perf_summary_<ts>[_N].json and perf_events_<ts>[_N].

        The summary is published (complete) under a name no file has, and the
        event log created exclusively beside it; when either name is taken (two
        agents in one second, or anything planted there), the next suffix is tried.
        """
        first = json_bytes(build_summary(facts, aggregator))
        for n in range(1000):
            suffix = f"_{n}" if n else ""
            name = f"perf_summary_{stamp}{suffix}.json"
            try:
                out.publish_new(name, first)
            except FileExistsError:
                continue
            try:
                log = EventLogWriter(out, f"perf_events_{stamp}{suffix}",
                                     part_bytes=self.options.event_log_part_bytes)
            except FileExistsError:
                out.unlink(name)
                continue
            return SummaryFile(out, name), log
        raise OutputDirError(f"output dir {out.path}: no free file name for {stamp}")

    def _write(self, log: EventLogWriter, summary_file: SummaryFile, facts: dict[str, Any],
               aggregator: StepAggregator) -> None:
        """Log first (so the log always holds all the summary counts), then the summary.

        A failed write is said once, when it starts failing; the session goes on.
        """
        for what, ok, error in (
            ("event log", log.flush(), log.error),
            ("summary", summary_file.write(build_summary(facts, aggregator)), summary_file.error),
        ):
            failing = self._failing.get(what, False)
            if not ok and not failing:
                path = (summary_file.path if what == "summary"
                        else summary_file.out.path / log.name)
                self.warn(f"cannot write the {what} {path}: "
                          f"{error.strerror if error else '?'}; measuring goes on, retrying")
            elif ok and failing:
                self.warn(f"the {what} is written again")
            self._failing[what] = not ok

    def _start_cuda(
        self, targets: list[TargetProcess]
    ) -> tuple[CudaActivityProbe | None, dict[str, Any]]:
        """CUDA/NCCL counters for jobs that loaded libcudart, libcuda or libnccl."""
        cuda = CudaActivityProbe(targets)
        try:
            cuda.start()
        except PerfmonError as err:
            self._warning(f"CUDA/NCCL counters unavailable: {err}")
            return None, {"available": False, "reason": str(err)}
        for text in cuda.warnings:
            self._warning(text)
        if not cuda.available:
            return None, {"available": False, "reason": cuda.reason}
        return cuda, {"available": True, "attached": cuda.attached}

    @staticmethod
    def _health_check(pids: list[int]) -> dict[str, Any]:
        """The GPU health report before monitoring starts (``attach --health-check``)."""
        try:
            return run_health_check(None, HEALTH_WINDOW_S, set(pids)).to_dict()
        except NvmlUnavailable as err:
            return {"available": False, "reason": str(err)}

    def _ingest(self, live: _Live, until_ns: int | None = None) -> bool:
        """Log and aggregate what the probes gathered; True when an interval completed."""
        records: list[dict[str, Any]] = []
        if live.stacks is not None:
            # Stack records first: they carry the phase samples that interval
            # entries completed by this round's markers wait for.
            records += live.stacks.poll(final=until_ns is not None)
        if live.cuda is not None:
            # Step snapshots only (the periodic ones add nothing per iteration),
            # before the markers they belong to.
            records += [{"type": "cuda", **asdict(c)} for c in live.cuda.poll() if c.at_step]
        if live.probe is not None:
            records += [{"type": "marker", **e.__dict__} for e in live.probe.poll()]
            if live.probe.dropped > self._dropped_logged:
                records.append({"type": "lost", "t_mono_ns": monotonic_ns(),
                                "count": live.probe.dropped - self._dropped_logged})
                self._dropped_logged = live.probe.dropped
        if until_ns is not None:
            records = [r for r in records if r["type"] != "marker" or r["t_mono_ns"] <= until_ns]
        records += [{"type": "process", **s.__dict__} for s in live.memory.poll()]
        records += live.gpu.poll()
        completed = False
        for record in records:
            live.log.append(record)
            for entry in live.aggregator.feed(record):
                self.progress(entry)
                completed = True
        return completed

    def _check_hang(self, live: _Live, targets: list[TargetProcess], now_ns: int) -> bool:
        """Declare a hang (stacks of every rank into a report) or its end; True on either.

        Hung: no iteration for max(hang_factor x median step time, hang_timeout).
        """
        agg = live.aggregator
        if self._hang_since is not None:
            if agg.iterations_ended > self._hang_since:
                self._hang_since = None
                self._log(live, {"type": "hang_recovered", "t_mono_ns": now_ns})
                self.warn("iterations resumed after the hang")
                return True
            return False
        last = agg.last_end_t_mono_ns or agg.start_t_mono_ns
        median = agg.recent_median_step_ns()
        threshold_ns = max(self.options.hang_factor * (median or 0),
                           self.options.hang_timeout_s * 1e9)
        if now_ns - last < threshold_ns:
            return False
        self._hang_since = agg.iterations_ended
        stacks = dump_ranks(targets)
        frame = innermost_common_frame(main_python_stacks(stacks))
        where = f"{frame.function} ({frame.file}:{frame.line})" if frame else "no common frame"
        report = {
            "detected_at": datetime.now().astimezone().isoformat(),
            "no_iteration_for_s": (now_ns - last) / 1e9,
            "threshold_s": threshold_ns / 1e9,
            "median_step_time_ms": median / 1e6 if median else None,
            "innermost_common_frame": asdict(frame) if frame else None,
            "ranks": {str(pid): [asdict(t) for t in threads] for pid, threads in stacks.items()},
        }
        try:
            name = live.out.publish_unique(
                f"hang_report_{datetime.now().strftime('%Y%m%d_%H%M%S')}", ".json",
                json_bytes(report))
            path = str(live.out.path / name)
        except OSError as err:
            path = f"not written ({err.strerror})"
        self._log(live, {"type": "hang", "t_mono_ns": now_ns, "last_iteration_mono_ns": last,
                         "threshold_s": threshold_ns / 1e9, "frame": where,
                         "report": path})
        self.warn(f"hang: no iteration for {(now_ns - last) / 1e9:.1f} s "
                  f"(threshold {threshold_ns / 1e9:.1f} s); ranks wait in {where}; "
                  f"stacks in {path}")
        return True

    def _log(self, live: _Live, record: dict[str, Any]) -> None:
        live.log.append(record)
        for entry in live.aggregator.feed(record):
            self.progress(entry)
