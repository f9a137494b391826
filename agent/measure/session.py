"""One monitoring session: attach, poll the sources, log and reduce, write the summary, detach.

The session owns the clock: every record carries CLOCK_MONOTONIC nanoseconds,
and the wall-clock start is taken once, so the summary's timestamps follow
from the monotonic ones. Every source has one shape (perfmon.probes.sampler.
Source) and is started inside one ExitStack, so whatever started is closed,
whatever happens; records of one poll are sorted by (time, type) in one place
(``_ingest``) before they are logged and fed to the reducers.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from perfmon.agent import agent_version
from perfmon.agent.console import describe_event
from perfmon.agent.measure.budget import BudgetPool, CpuBudget
from perfmon.agent.measure.hangs import HangWatch
from perfmon.agent.measure.health import run_health_check
from perfmon.agent.measure.heap import release_freed_memory
from perfmon.agent.measure.incidents import Incidents
from perfmon.agent.measure.model import (
    build_workload,
    explicit_model_fields,
    job_layout,
    resolve_model,
)
from perfmon.agent.measure.observer import SessionObserver
from perfmon.agent.measure.sources import (
    MarkerSource,
    host_can_probe,
    open_cuda_source,
    open_exit_source,
    open_iteration_source,
    open_stack_source,
    started,
)
from perfmon.agent.measure.update_sampling import UpdateSampling
from perfmon.agent.measure.wait_sampling import WaitSampling
from perfmon.agent.options import AttachOptions
from perfmon.agent.record.eventlog import EventLogWriter
from perfmon.agent.record.layout import stamp
from perfmon.agent.record.outputs import OutputDir, OutputNotWritable, json_bytes
from perfmon.agent.record.summary import SummaryFile, build_summary, claim_session_files
from perfmon.agent.reducers import Summarizer
from perfmon.agent.reducers.steps import StepRows
from perfmon.parsers.events import (
    SCHEMA_VERSION,
    Quality,
    SessionEnd,
    SessionStart,
    Steps,
    cut_to_window,
    sort_key,
)
from perfmon.parsers.figures import IntervalFigures, Statistics
from perfmon.parsers.wait_symbols import by_backend
from perfmon.parsers.workload import Workload
from perfmon.probes.background import BackgroundCalls
from perfmon.probes.gpu import GpuSource
from perfmon.probes.nvml import NvmlUnavailable
from perfmon.probes.procfs import (
    MemorySource,
    TargetProcess,
    is_running,
    resolve_targets,
    target_job,
)
from perfmon.probes.sampler import Source, monotonic_ns
from perfmon.probes.stacks import StackSource
from perfmon.probes.uprobes import MarkerProbe

# Step rows go to the log and the reducers once a second: what replay reduces in bulk.
ROWS_INTERVAL_NS = 1_000_000_000
POLL_INTERVAL_S = 0.2  # the ring buffer holds ~9,200 markers: 46,000 a second
LIVENESS_INTERVAL_NS = 500_000_000
# The summary is rewritten when a log interval completes, but not more often
# than every 5 s, and at least every 15 s so a long interval (or a stalled job)
# does not leave the file stale. Both stretch to 200 x the last write's
# duration: iteration_logs grows all run long, and rewriting (and fsyncing) it
# must stay within the agent's CPU budget (half a percent of a core for this).
SUMMARY_MIN_INTERVAL_NS = 5_000_000_000
SUMMARY_REFRESH_NS = 15_000_000_000
SUMMARY_WRITE_BUDGET = 200
HEALTH_WINDOW_S = 5.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class SessionContext:
    """What the process running a session provides; ``attach`` needs none of it, the node
    service (many sessions, one per job, each in its own thread) all of it."""

    targets: list[TargetProcess] | None = None  # resolved already (else from options.pid)
    observer: SessionObserver = field(default_factory=SessionObserver)
    budget_pool: BudgetPool | None = None  # one CPU budget shared by the sessions
    # bcc's compiler is not known to be thread-safe: one session starts its sources at a time.
    setup_lock: threading.Lock | None = None
    handle_signals: bool = True  # SIGINT/SIGTERM/SIGHUP end the session (main thread only)
    job: dict[str, Any] | None = None  # the job record, kept as session_info.job
    job_before: dict[str, Any] | None = None  # the job's earlier sessions (goodput)


@dataclass
class SessionResult:
    summary_path: Path
    events_path: Path
    summary: dict[str, Any]  # as written
    statistics: Statistics  # its figures, for the end table
    warnings: list[str] = field(default_factory=list)
    # Set when the final summary (or the event log) could not be written: exit 7.
    write_error: OutputNotWritable | None = None


@dataclass
class _Live:
    """A running session: its sources, its files and its reducers."""

    targets: list[TargetProcess]
    sources: list[Source]
    stacks: StackSource | None
    out: OutputDir
    log: EventLogWriter
    summary_file: SummaryFile
    summarizer: Summarizer
    facts: dict[str, Any]
    hangs: HangWatch
    budget: CpuBudget
    rows: StepRows  # markers and wait totals -> step rows, logged once a second
    rows_taken_ns: int
    closer_look: bool = False  # a hang suspected, or a fail-slow being looked at
    news: bool = False  # a straggler or fail-slow event since the last summary written
    over_cap_told: bool = False
    markers: MarkerSource | None = None  # the uprobe source (None: py-spy mode)
    wait_sampling: WaitSampling | None = None  # (None: no collective waits probed)
    update_sampling: UpdateSampling | None = None  # (None: no gradient reads probed)
    quality: dict[str, dict[str, Any]] = field(default_factory=dict)  # last logged, per source
    incidents: Incidents | None = None  # a bundle per hang, straggler, fail-slow, bad exit


class MonitorSession:
    """Attach to a job, monitor until it exits, a signal, or the duration; write the summary.

    ``warn`` gets one-line warnings (a fallback to py-spy, a hang); what the session
    measures goes to ``context.observer`` as it comes.
    """

    def __init__(self, options: AttachOptions, warn: Callable[[str], None] = lambda _line: None,
                 context: SessionContext | None = None,
                 note: Callable[[str], None] = lambda _line: None) -> None:
        self.options = options
        self.warn = warn
        self.note = note  # (called with --verbose only)
        self.context = context or SessionContext()
        # The latest iteration's end (CLOCK_MONOTONIC ns), read by the node service
        # from its own thread (an idle job yields its slot).
        self.last_iteration_ns: int | None = None
        self._stop_reason: str | None = None
        self._failing: dict[str, bool] = {}  # file -> its last write failed
        self.warnings: list[str] = []
        self.notes: list[str] = []  # what the job does not use: nothing to act on

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stop_reason = signal.Signals(signum).name

    def _warning(self, text: str) -> None:
        self.warnings.append(text)
        self.warn(text)

    def _note(self, text: str) -> None:
        self.notes.append(text)
        if self.options.verbose:
            self.note(text)

    def stop(self, reason: str) -> None:
        """End the session at the next poll (e.g. the output stream was closed)."""
        self._stop_reason = self._stop_reason or reason

    # -- setting up ------------------------------------------------------------------

    def run(self) -> SessionResult:
        opts, context = self.options, self.context
        explicit = explicit_model_fields(opts.model_config, opts.model_preset)
        with ExitStack() as stack:
            live = self._setup(stack, explicit)
            result = self._monitor(live)
        context.observer.finished(result)
        return result

    def _setup(self, stack: ExitStack, explicit: dict[str, Any]) -> _Live:
        """Check, resolve and start every source inside ``stack``; the session's _Live."""
        opts, context = self.options, self.context
        with context.setup_lock or nullcontext():
            # The output dir is checked (owner, mode, writable) before any process is read.
            out = OutputDir.open(opts.output_dir, allow_shared=opts.allow_shared_output_dir)
            stack.callback(out.close)
            # And the host's lacks (privileges, bcc, headers) too.
            can_probe = host_can_probe(opts, self._warning)
            targets = context.targets or resolve_targets(opts.pid)
            primary = targets[0]
            model = resolve_model(primary, explicit)
            for text in model.warnings:
                self._warning(text)
            if "problem" in model.description:
                self._warning(f"model dimensions unknown, no FLOPs: "
                              f"{model.description['problem']} (give --model-config)")
            pids = [t.pid for t in targets]
            health = self._health_check(pids) if opts.health_check else None
            gpu = started(stack, GpuSource(pids, opts.gpu_interval_s), self._warning)
            assert isinstance(gpu, GpuSource)
            first_gpu_records = gpu.poll()
            peak = opts.peak_tflops
            if peak is None and gpu.available:
                peak, gpu.info["device"] = gpu.peak_tflops(first_gpu_records, opts.dtype)
            gpu.info.update(dtype=opts.dtype, peak_tflops=peak, peak_tflops_from=(
                "--peak-tflops" if opts.peak_tflops else "device table"))
            workload, model_info = build_workload(model, primary, peak)
            layout, problem = job_layout(primary, model.fields)
            if problem:
                self._warning(problem)

            # Raises before any file is written when the host cannot probe.
            probe, backend = open_iteration_source(opts, targets, stack, self._warning,
                                                   can_probe)
            stacks = open_stack_source(opts, primary, probe is None, stack, self._warning)
            cuda, cuda_info = (open_cuda_source(targets, opts.cuda_launches, stack,
                                                self._warning, self._note) if probe
                               else (None, {"available": False,
                                            "reason": "no uprobes (py-spy mode)"}))
            memory = started(stack, MemorySource(pids, opts.memory_interval_s), self._warning)
            exits = open_exit_source(targets, stack, self._warning, self._note)
            sources = [s for s in (probe, stacks, cuda, memory, gpu, exits) if s is not None]
            # Within the CPU budget, stacks are sampled in bursts; iterations from
            # samples (py-spy mode) need them continuously.
            bursts = stacks is not None and probe is not None and opts.cpu_budget_pct > 0
            facts_extra = {
                "iteration_source": "pyspy" if probe is None else "uprobe",
                "probe_backend": backend if probe is not None else None,
                "gpu": gpu.info, "cuda": cuda_info,
                "stack_sampling": stacks is not None, "health": health,
                "stack_sampling_mode": "bursts" if bursts else "continuous",
                "cpu_budget_pct_per_rank": opts.cpu_budget_pct or None,
                "model": {**model.description, **model_info},
                "layout": layout,
                "wait_probes": (by_backend(probe.wait_points.get(primary.pid, []))
                                if probe is not None else None),
            }
            dumps = BackgroundCalls("perfmon-hang-dump")
            stack.callback(dumps.close)
            live = self._begin(out, targets, sources, stacks=stacks, workload=workload,
                               facts_extra=facts_extra, dumps=dumps)
            live.markers = probe
            if probe is not None and probe.waits_probed_pids:
                live.wait_sampling = WaitSampling(
                    live.rows, probe.set_waits_on, sorted(probe.waits_probed_pids),
                    targets[0].pid, opts.wait_probe_budget_pct / 100)
            if isinstance(probe, MarkerProbe) and probe.grad_read_pids:
                live.update_sampling = UpdateSampling(live.rows, probe)
            for record in first_gpu_records:
                self._log(live, record.to_record())
            # bcc's compiler has freed what it used: back to the system, or a service
            # with many sessions keeps it all (perfmon.agent.measure.heap).
            release_freed_memory()
            return live

    def _begin(self, out: OutputDir, targets: list[TargetProcess], sources: list[Source], *,
               stacks: StackSource | None, workload: Workload, facts_extra: dict[str, Any],
               dumps: BackgroundCalls) -> _Live:
        """Start the window: the facts, the summarizer, the files and the session_start.

        It opens once every source has started, so that every iteration in it is seen;
        stack samples and GPU samples may begin a little before it."""
        opts = self.options
        primary = targets[0]
        start_ns, start_wall = monotonic_ns(), datetime.now().astimezone()
        facts = {
            "start_time": start_wall.isoformat(),
            "attach_monotonic_ns": start_ns,
            # (the node's name as the service was told it, else the system's)
            "host": (self.context.job or {}).get("host") or socket.gethostname(),
            "agent_version": agent_version(),
            "schema_version": SCHEMA_VERSION,
            "pid": opts.pid,
            "pids": [t.pid for t in targets],
            "ranks": [t.rank for t in targets],
            "primary_pid": primary.pid,
            "process_start_monotonic_ns": primary.start_monotonic_ns,
            # (the node service and run hand their sessions the processes they found)
            "started_by": "attach" if self.context.targets is None else "tracker",
            "job_before": self.context.job_before,
            "command_line": primary.shown_cmdline,
            "torch_library": primary.torch_library,
            "iteration_numbering": "attach",
            "log_interval": opts.log_interval,
            **{k: v for k, v in facts_extra.items() if v is not None},
            "warnings": self.warnings,
            "notes": self.notes,
            "workload": workload.__dict__,
            "iteration_logs_max_entries": opts.max_log_entries,
            "step_rows": True,  # iteration ends logged as rows (steps records)
            "microbatches_declared": opts.microbatches,
        }
        # The job this session belongs to: as the node service named it, else from the
        # primary rank's job variables, as the service would (perfmon.agent.daemon.jobs).
        facts["job"] = self.context.job or target_job(primary, facts["host"])
        # The reducers made as replay makes them, from the facts the log starts with.
        summarizer = Summarizer.from_facts(facts)
        summary_file, log = claim_session_files(
            out, stamp(start_wall), json_bytes(build_summary(facts, summarizer)),
            self.options.event_log_part_bytes, self.options.event_log_max_bytes)
        facts["event_log"] = log.name
        budget = CpuBudget(opts.cpu_budget_pct, len(targets),
                           stacks if facts["stack_sampling_mode"] == "bursts" else None,
                           self.context.budget_pool)
        hangs = HangWatch(opts.hang_factor, opts.hang_timeout_s, targets=targets, out=out,
                          dumps=dumps, warn=self.warn)
        live = _Live(targets, sources, stacks, out, log, summary_file, summarizer, facts, hangs,
                     budget, StepRows(start_ns, opts.microbatches), start_ns,
                     incidents=Incidents(out, targets, facts, self.warn))
        log.append(SessionStart(start_ns, facts).to_record())
        self.context.observer.started(facts)
        return live

    # -- the loop --------------------------------------------------------------------

    def _monitor(self, live: _Live) -> SessionResult:
        opts = self.options
        summarizer, log = live.summarizer, live.log
        start_ns = summarizer.start_t_mono_ns
        self._write(live)
        previous = ({s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
                    if self.context.handle_signals else {})
        deadline = start_ns + int(opts.duration_s * 1e9) if opts.duration_s else None
        next_liveness = next_write = next_refresh = start_ns
        try:
            while self._stop_reason is None:
                time.sleep(POLL_INTERVAL_S)
                completed = self._ingest(live)
                now = monotonic_ns()
                recovered = live.hangs.check(summarizer, now)
                if recovered is not None:
                    self._log(live, recovered.to_record())
                    completed = True
                # Continuous stack samples (and every collective wait logged) while a
                # hang is suspected, and after a fail-slow event until samples show
                # which phase moved.
                closer_look = live.closer_look = (live.hangs.suspected(summarizer, now)
                                                  or summarizer.wants_samples(now))
                live.budget.update(now, closer_look)
                if live.markers is not None:
                    live.markers.set_raw_waits(opts.raw_markers or closer_look)
                if live.wait_sampling is not None:
                    live.wait_sampling.schedule(keep_on=opts.raw_markers or closer_look)
                if live.update_sampling is not None:
                    live.update_sampling.schedule(now)
                if (completed and now >= next_write) or now >= next_refresh or live.news:
                    live.news = False
                    self._write(live)
                    spent = SUMMARY_WRITE_BUDGET * (monotonic_ns() - now)
                    next_write = now + max(SUMMARY_MIN_INTERVAL_NS, spent)
                    next_refresh = now + max(SUMMARY_REFRESH_NS, spent)
                log.flush_if_due()
                self._take_coarsened(live)
                if live.incidents is not None:
                    live.incidents.poll(now, summarizer)
                if deadline is not None and now >= deadline:
                    self._stop_reason = "duration"
                elif now >= next_liveness:
                    next_liveness = now + LIVENESS_INTERVAL_NS
                    self._check_ranks(live)
        finally:
            # The window ends now: take what the kernel delivered up to this instant,
            # then detach (the caller's ExitStack; it takes a while, and its events
            # are not counted).
            end_ns = monotonic_ns()
            if live.stacks is not None:
                live.stacks.settle()
            self._ingest(live, until_ns=end_ns)
            unfinished = live.hangs.unfinished()  # stopped while the ranks were being dumped
            if unfinished is not None:
                self._log(live, unfinished.to_record())
            self._log_quality(live)
            if live.incidents is not None:
                live.incidents.close(end_ns, summarizer)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            live.budget.close()
            self._log(live, SessionEnd(end_ns, self._stop_reason or "error").to_record())
            log_ok = log.close()
            self._take_coarsened(live)
            stats = summarizer.statistics()
            summary = build_summary(live.facts, summarizer, stats)
            summary_ok = live.summary_file.write(summary)
            self.context.observer.statistics(stats)
        result = SessionResult(live.summary_file.path, live.out.path / log.name, summary,
                               stats, self.warnings)
        failed = live.summary_file if not summary_ok else (log if not log_ok else None)
        if failed is not None:
            path = live.summary_file.path if failed is live.summary_file else (
                live.out.path / log.name)
            result.write_error = OutputNotWritable(
                f"output not writable: {path}: {failed.error.strerror if failed.error else '?'}")
        return result

    def _check_ranks(self, live: _Live) -> None:
        """Every rank gone ends the session: ranks may end one by one, and the job's end
        (and each rank's) is only known once the last one has."""
        if not any(is_running(t) for t in live.targets):
            self._stop_reason = "target_exited"

    def _ingest(self, live: _Live, until_ns: int | None = None) -> bool:
        """Log and reduce what the sources gathered, in (time, type) order; True when an
        interval completed. ``until_ns``: the window's end (what came after it is cut)."""
        records = [r.to_record() for source in live.sources for r in source.poll()]
        if until_ns is not None:
            records = cut_to_window(records, until_ns)
        records += [r.to_record() for r in live.hangs.reports()]
        records.sort(key=sort_key)
        completed = False
        for record in live.rows.feed_poll(records, self.options.raw_markers):
            completed |= self._log(live, record)
        # The rows once a second (and at the end), so a replayed log's blocks are large;
        # every poll during a closer look (a suspected hang: its last iteration exact).
        now = monotonic_ns()
        if (until_ns is not None or live.closer_look
                or now - live.rows_taken_ns >= ROWS_INTERVAL_NS):
            live.rows_taken_ns = now
            block = live.rows.take(final=until_ns is not None)
            if block is not None:
                # Logged as a steps record; the reducers take the block itself.
                steps = Steps.of_block(block)
                self._append(live, steps.to_record())
                completed |= self._observe(live.summarizer.feed_rows(steps.t_mono_ns, block))
        for event in live.summarizer.take_events():
            live.news = True  # (the summary, and the figures that follow it, at once)
            self.warn(describe_event(event))
            if live.incidents is not None:
                live.incidents.on_event(event)
        step_times_s = live.summarizer.take_step_times_s()
        if step_times_s:
            self.context.observer.iterations(step_times_s)
            self.last_iteration_ns = live.summarizer.last_end_t_mono_ns
        return completed

    def _log(self, live: _Live, record: dict[str, Any]) -> bool:
        """Log one record and feed it; True when it completed an interval."""
        self._append(live, record)
        return self._reduce(live, record)

    @staticmethod
    def _append(live: _Live, record: dict[str, Any]) -> None:
        live.log.append(record)
        if live.incidents is not None:
            live.incidents.on_record(record)

    def _reduce(self, live: _Live, record: dict[str, Any]) -> bool:
        """Feed one record; True when it completed an interval (its figures observed)."""
        return self._observe(live.summarizer.feed(record))

    def _observe(self, intervals: list[IntervalFigures]) -> bool:
        """Tell the intervals just completed; True when there was one."""
        for figures in intervals:
            self.context.observer.interval(figures)
        return bool(intervals)

    def _take_coarsened(self, live: _Live) -> None:
        """Parts of the log just made coarser: their ``coarsened`` records (in those
        parts, not logged again) go to the reducers, so the summary says so at once."""
        for record in live.log.take_coarsened():
            self._reduce(live, record)
        log = live.log
        if log.coarsen_error is not None:
            self._warning(f"event log: a part could not be made coarser: {log.coarsen_error}")
            log.coarsen_error = None
        if log.over_cap and not live.over_cap_told:
            live.over_cap_told = True
            self._warning(f"event log: {log.total_bytes >> 20} MiB, over its cap of "
                          f"{log.max_bytes >> 20} MiB with every closed part coarser already: "
                          "it grows on (every iteration is kept)")

    def _log_quality(self, live: _Live) -> None:
        """A ``quality`` record for every source whose counters moved since the last one
        (and for the agent itself: its CPU per rank against the budget)."""
        now = monotonic_ns()
        counted = [(s.name, s.quality()) for s in live.sources]
        if live.wait_sampling is not None:
            counted.append(("wait_probes", live.wait_sampling.quality()))
        if live.update_sampling is not None:
            counted.append(("update_probes", live.update_sampling.quality()))
        for name, counters in [*counted, ("agent", live.budget.state())]:
            if counters and counters != live.quality.get(name):
                live.quality[name] = counters
                self._log(live, Quality(now, name, counters).to_record())

    # -- files -----------------------------------------------------------------------

    def _write(self, live: _Live) -> None:
        """Log first (so the log always holds all the summary counts), then the summary.

        A failed write is said once, when it starts failing; the session goes on.
        """
        self._log_quality(live)
        log, summary_file = live.log, live.summary_file
        stats = live.summarizer.statistics()
        summary = build_summary(live.facts, live.summarizer, stats)
        for what, ok, error in (
            ("event log", log.flush(), log.error),
            ("summary", summary_file.write(summary, compact=True), summary_file.error),
        ):
            failing = self._failing.get(what, False)
            if not ok and not failing:
                path = summary_file.path if what == "summary" else live.out.path / log.name
                self.warn(f"cannot write the {what} {path}: "
                          f"{error.strerror if error else '?'}; measuring goes on, retrying")
            elif ok and failing:
                self.warn(f"the {what} is written again")
            self._failing[what] = not ok
        self.context.observer.statistics(stats)

    # -- hangs -----------------------------------------------------------------------

    @staticmethod
    def _health_check(pids: list[int]) -> dict[str, Any]:
        """The GPU health report before monitoring starts (``attach --health-check``)."""
        try:
            return run_health_check(None, HEALTH_WINDOW_S, set(pids)).to_dict()
        except NvmlUnavailable as err:
            return {"available": False, "reason": str(err)}
