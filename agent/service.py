"""Jobs found, attached and finalized by themselves: the node service (``serve``) and the
launcher (``run``) share one tracker.

Every scan (perfmon.probes.discovery) gives the node's jobs (perfmon.agent.jobs);
the tracker starts one monitoring session per job, each in a thread of its own
(MonitorSession, as ``attach`` runs it), and takes the session's result when it
ends. A session ends when every one of its ranks is gone; ranks that appear
later (an elastic restart, a launcher starting them one by one) start the
job's next session, so one job may have several (``segments`` in its record).
A job is over when none of its processes is left: its record is closed, its
Prometheus series removed, and everything the tracker held about it dropped.

A job that cannot be attached (no privileges, a missing symbol with
``iteration_source: uprobe``, ...) is logged once per distinct reason and
retried with an exponential back-off. At most ``max_jobs`` are watched at once.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from perfmon.agent.budget import BudgetPool
from perfmon.agent.config import ServiceConfig
from perfmon.agent.jobs import FoundJob, find_jobs, safe_name
from perfmon.agent.metrics import JobMetrics, Metrics
from perfmon.agent.outputs import OutputDir, json_bytes
from perfmon.agent.session import (
    AttachOptions,
    MonitorSession,
    SessionContext,
    SessionObserver,
    SessionResult,
    agent_version,
)
from perfmon.parsers.errors import PerfmonError
from perfmon.probes.discovery import ProcessScan
from perfmon.probes.errors import ProbeError
from perfmon.probes.procfs import TargetProcess, inspect_process

JOB_RECORD = "job.json"
MAX_JOB_RECORD_BYTES = 1 << 20
PRUNE_INTERVAL_S = 600.0


def _now_iso() -> str:
    return datetime.now().astimezone().isoformat()


def one_line(err: BaseException) -> str:
    """An error as the log shows it: the agent's own errors as they are, others (bugs,
    bcc's bare exceptions) with their type."""
    text = str(err).splitlines()[0] if str(err) else ""
    return text if isinstance(err, PerfmonError) else f"{type(err).__name__}: {text}"


class JobRunner:
    """One monitoring session of a job, in a thread of its own."""

    def __init__(self, session: MonitorSession, targets: list[TargetProcess]) -> None:
        self.session = session
        self.pids = frozenset(t.pid for t in targets)
        self.result: SessionResult | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"perfmon-job-{targets[0].pid}")

    def _run(self) -> None:
        try:
            self.result = self.session.run()
        except Exception as err:  # reported by the tracker, which goes on
            self.error = err

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, reason: str) -> None:
        self.session.stop(reason)


@dataclass
class TrackedJob:
    found: FoundJob
    name: str  # unique among the jobs tracked: the metrics' job label
    first_seen_s: float
    folder: OutputDir | None = None  # serve: the job's own folder, once attached
    runner: JobRunner | None = None
    next_try_s: float = 0.0
    retry_s: float = 0.0
    last_error: str | None = None
    limited: bool = False  # said that max_jobs keeps it waiting
    record: dict[str, Any] = field(default_factory=dict)


class JobTracker:
    """The jobs of the node (or of one command's process tree) and their sessions.

    ``jobs_root``: one folder per job under ``jobs_root/<host>/`` (serve); else
    every session writes into ``options.output_dir`` (run). ``log``: one line per
    event (found, attached, failed, ended).
    """

    def __init__(self, *, options: AttachOptions, config: ServiceConfig, log: Callable[[str], None],
                 metrics: Metrics | None = None, scope_pid: int | None = None,
                 jobs_root: Path | None = None, progress: Callable[[str, dict[str, Any]], None]
                 | None = None) -> None:
        self.options = options
        self.config = config
        self.log = log
        self.metrics = metrics
        self.progress = progress
        self.scan = ProcessScan(scope_pid)
        self.host = socket.gethostname()
        self.pool = BudgetPool(config.cpu_budget_pct, config.cpu_budget_per_rank_pct)
        self.setup_lock = threading.Lock()
        self.jobs: dict[tuple[object, ...], TrackedJob] = {}
        self.results: list[SessionResult] = []  # every session's, in the order they ended
        self.host_folder: OutputDir | None = None
        if jobs_root is not None:
            self.host_folder = OutputDir.open(jobs_root / safe_name(self.host))
        self._next_prune_s = 0.0

    def reconfigure(self, config: ServiceConfig) -> None:
        self.config = config
        self.pool.configure(config.cpu_budget_pct, config.cpu_budget_per_rank_pct)

    @property
    def running(self) -> int:
        return sum(1 for j in self.jobs.values() if j.runner is not None)

    # -- one scan -------------------------------------------------------------------------

    def tick(self, now_s: float) -> None:
        found = {j.key: j for j in find_jobs(self.scan.scan(now_s), self.config.accepts)}
        for key, f in found.items():
            job = self.jobs.get(key)
            if job is None:
                job = self.jobs[key] = TrackedJob(f, self._unique_name(f.name), now_s)
            job.found = f
        self.reap(now_s)
        for key, job in list(self.jobs.items()):
            f = found.get(key)
            if job.runner is not None:
                # Ranks the session does not watch (more than it started with): the
                # next session takes them all.
                if f is not None and f.ready and set(f.ranks) - job.runner.pids:
                    job.runner.stop("ranks_changed")
                continue
            if f is None:
                self._finish(job, "ended")
                del self.jobs[key]
                continue
            if now_s < job.next_try_s or not f.ranks:
                continue
            if not f.ready and now_s - job.first_seen_s < self.config.rank_wait_s:
                continue  # the launcher has not started (or loaded PyTorch in) all ranks
            if self.running >= self.config.max_jobs:
                if not job.limited:
                    job.limited = True
                    self.log(f"job {job.name}: not watched: {self.config.max_jobs} jobs are "
                             "(max_jobs)")
                continue
            self._start(job, now_s)
        if self.host_folder is not None and now_s >= self._next_prune_s:
            self._next_prune_s = now_s + PRUNE_INTERVAL_S
            self.prune(time.time())

    def _unique_name(self, name: str) -> str:
        taken = {j.name for j in self.jobs.values()}
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}-{n}"
        return unique

    # -- starting and ending sessions ---------------------------------------------------

    def _start(self, job: TrackedJob, now_s: float) -> None:
        f = job.found
        targets: list[TargetProcess] = []
        problems: list[str] = []
        for pid in f.ranks:
            try:
                targets.append(inspect_process(pid))
            except ProbeError as err:
                problems.append(str(err))
        if not targets:
            self._failed(job, now_s, "; ".join(problems) or "no rank left")
            return
        try:
            if self.host_folder is not None and job.folder is None:
                job.folder = self._job_folder(job, targets)
        except OSError as err:
            self._failed(job, now_s, f"cannot create its folder: {err.strerror}")
            return
        job.limited = False
        job.record["ranks"] = [{"pid": t.pid, "rank": t.rank,
                                "local_rank": _int_or_none(t.environ.get("LOCAL_RANK"))}
                               for t in targets]
        self._write_record(job)
        output_dir = (self.host_folder.path / job.folder.path.name
                      if self.host_folder is not None and job.folder is not None
                      else self.options.output_dir)
        options = replace(self.options, pid=(f.launchers or [targets[0].pid])[0],
                          output_dir=output_dir)
        observer: SessionObserver = (JobMetrics(self.metrics, job.name)
                                     if self.metrics is not None else SessionObserver())
        context = SessionContext(
            targets=targets, observer=observer, budget_pool=self.pool,
            setup_lock=self.setup_lock, handle_signals=False,
            job={"id": f.name, "name": job.name, "id_from": f.id_from, "host": self.host,
                 "container_id": f.container_id, "pid_namespace": f.pid_namespace,
                 "folder": str(output_dir) if job.folder is not None else None})
        progress = self.progress

        def on_entry(entry: dict[str, Any]) -> None:
            if progress is not None:
                progress(job.name, entry)

        session = MonitorSession(options, on_entry,
                                 warn=lambda line: self.log(f"job {job.name}: {line}"),
                                 context=context)
        job.runner = JobRunner(session, targets)
        job.runner.start()
        if job.last_error is not None:
            return  # retrying: said once, when it first failed
        ranks = ",".join(str(t.rank) if t.rank is not None else "-" for t in targets)
        self.log(f"job {job.name}: attaching to {len(targets)} rank(s) (ranks {ranks}; pids "
                 f"{','.join(str(t.pid) for t in targets)}) -> {output_dir}")

    def _failed(self, job: TrackedJob, now_s: float, reason: str) -> None:
        """Log a failure once per distinct reason; retry with back-off."""
        cfg = self.config
        job.retry_s = (min(cfg.retry_max_s, job.retry_s * 2) if job.retry_s
                       else cfg.retry_initial_s)
        job.next_try_s = now_s + job.retry_s
        job.record["attach_failures"] = job.record.get("attach_failures", 0) + 1
        job.record["last_attach_error"] = reason
        if reason != job.last_error:
            job.last_error = reason
            self.log(f"job {job.name}: cannot attach: {reason} (retrying with back-off, "
                     "said once)")
        self._write_record(job)

    def reap(self, now_s: float) -> None:
        """Take the results of the sessions that ended."""
        for job in self.jobs.values():
            runner = job.runner
            if runner is None or runner.alive:
                continue
            job.runner = None
            if runner.error is not None:
                self._failed(job, now_s, one_line(runner.error))
                continue
            result = runner.result
            assert result is not None
            self.results.append(result)
            job.retry_s, job.last_error = 0.0, None
            info, stats = result.summary["session_info"], result.summary["final_statistics"]
            job.record.setdefault("segments", []).append({
                "summary": result.summary_path.name, "event_log": result.events_path.name,
                "pids": info.get("pids"), "ranks": info.get("ranks"),
                "start_time": info.get("start_time"), "end_time": info.get("end_time"),
                "end_reason": info.get("end_reason"),
                "iterations": info.get("total_iterations"),
                "avg_step_time_ms": stats.get("avg_step_time_ms"),
                "cause": (info.get("exit") or {}).get("cause"),
            })
            cause = job.record["segments"][-1]["cause"]
            self.log(f"job {job.name}: session ended ({info.get('end_reason')}): "
                     f"{info.get('total_iterations')} iterations"
                     + (f"; rank {cause['rank']} (pid {cause['pid']}) failed first: "
                        f"{cause['what']}" if cause else "")
                     + f"; summary {result.summary_path}")
            if result.write_error is not None:
                self.log(f"job {job.name}: {result.write_error}")
            self._write_record(job)

    def _finish(self, job: TrackedJob, status: str) -> None:
        """The job is over (or no longer watched): close its record, drop its series."""
        if job.record:
            job.record.update(status=status, ended=_now_iso())
            self._write_record(job)
            self.log(f"job {job.name}: {status}")
        if self.metrics is not None:
            self.metrics.job_finished(job.name)
        if job.folder is not None:
            job.folder.close()
            job.folder = None

    def stop(self, reason: str, timeout_s: float) -> None:
        """End every session (summaries written), wait up to ``timeout_s``, close the
        records. Sessions still detaching after that are left to the process's exit."""
        for job in self.jobs.values():
            if job.runner is not None:
                job.runner.stop(reason)
        deadline = time.monotonic() + timeout_s
        for job in self.jobs.values():
            if job.runner is not None:
                job.runner.thread.join(max(0.0, deadline - time.monotonic()))
        self.reap(time.monotonic())
        for job in self.jobs.values():
            segments = job.record.get("segments") or [{}]
            ended = job.runner is None and segments[-1].get("end_reason") == "target_exited"
            self._finish(job, "ended" if ended else "monitoring_stopped")
        self.jobs.clear()

    # -- job folders and records --------------------------------------------------------

    def _job_folder(self, job: TrackedJob, targets: list[TargetProcess]) -> OutputDir:
        assert self.host_folder is not None
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        folder = self.host_folder.make_subdir(f"{job.name}.{stamp}")
        f = job.found
        launcher = None
        if f.launchers:
            try:
                launcher = inspect_process(f.launchers[0])
            except ProbeError:
                pass
        job.record = {
            "agent": "perfmon-agent", "agent_version": agent_version(),
            "job_id": f.name, "name": job.name, "id_from": f.id_from, "host": self.host,
            "container_id": f.container_id, "pid_namespace": f.pid_namespace,
            "launcher": ({"pid": launcher.pid, "command_line": launcher.shown_cmdline}
                         if launcher is not None else None),
            "command_line": targets[0].shown_cmdline,
            "first_seen": _now_iso(), "ended": None, "status": "running",
            "segments": [],
        }
        return folder

    def _write_record(self, job: TrackedJob) -> None:
        if job.folder is None or not job.record:
            return
        try:
            job.folder.replace(JOB_RECORD, json_bytes(job.record))
        except OSError as err:
            self.log(f"job {job.name}: cannot write {JOB_RECORD}: {err.strerror}")

    def prune(self, now_wall_s: float) -> None:
        """Remove finished job folders beyond ``keep_jobs`` and older than ``keep_days``.

        Only folders holding a job record of this agent are candidates, never a
        job being watched; age is the record's last change.
        """
        assert self.host_folder is not None
        active = {j.folder.path.name for j in self.jobs.values() if j.folder is not None}
        finished = []
        for name in self.host_folder.subdirs():
            found = read_job_record(self.host_folder, name) if name not in active else None
            if found is not None:
                finished.append((found[1], name))
        finished.sort(reverse=True)
        max_age_s = self.config.keep_days * 86400
        for i, (mtime, name) in enumerate(finished):
            if i >= self.config.keep_jobs or now_wall_s - mtime > max_age_s:
                try:
                    self.host_folder.remove_subdir(name)
                except OSError as err:
                    self.log(f"cannot remove the old job folder {name}: {err.strerror}")


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() and len(value) < 10 else None


def read_job_record(folder: OutputDir, name: str) -> tuple[dict[str, Any], float] | None:
    """The job record this agent wrote in subfolder ``name``, and its mtime (None: none
    there, or not one of ours)."""
    found = folder.read_file(f"{name}/{JOB_RECORD}", MAX_JOB_RECORD_BYTES)
    if found is None:
        return None
    try:
        record = json.loads(found[0])
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("agent") != "perfmon-agent":
        return None
    return record, found[1]
