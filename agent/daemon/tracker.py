"""Jobs found, attached and finalized by themselves: the node service (``serve``) and the
launcher (``run``) share one tracker.

Every scan (perfmon.probes.discovery) gives the node's jobs (perfmon.agent.daemon.jobs);
the tracker starts one monitoring session per job, each in a thread of its own
(MonitorSession, as ``attach`` runs it), and takes the session's result when it
ends. A session ends when every one of its ranks is gone; ranks that appear
later (an elastic restart, a launcher starting them one by one) start the
job's next session, so one job may have several (``segments`` in its record).
A job is over when none of its processes is left: its record is closed, its
Prometheus series removed, and everything the tracker held about it dropped.

A job that cannot be attached (no privileges, a missing symbol with
``iteration_source: uprobe``, ...) is logged once per distinct reason and
retried with an exponential back-off.

Slots are shared between users: at most ``max_jobs`` are watched at once, at
most ``max_jobs_per_user`` of one user; a waiting job goes to the user with the
fewest watched jobs first (then the job that waited longest), and a watched job
without an iteration for ``idle_yield_s`` gives its slot to a waiting one (that
never yielded) and waits for a free slot itself, behind the jobs that never
yielded. A session restarts for ranks that joined its job only when they fit it
(a RANK none of its live ranks holds, below its world size), at most once per
``restart_interval_s``.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from perfmon.agent import agent_version
from perfmon.agent.console import PROG, printable
from perfmon.agent.daemon.config import ServiceConfig
from perfmon.agent.daemon.jobs import FoundJob, find_jobs
from perfmon.agent.daemon.records import prune_job_folders, write_job_record
from perfmon.agent.measure.budget import BudgetPool
from perfmon.agent.measure.metrics import JobMetrics, Metrics
from perfmon.agent.measure.observer import SessionObserver
from perfmon.agent.measure.session import MonitorSession, SessionContext, SessionResult
from perfmon.agent.options import AttachOptions
from perfmon.agent.record.layout import job_folder
from perfmon.agent.record.outputs import OutputDir
from perfmon.parsers.errors import PerfmonError
from perfmon.parsers.figures import Goodput, render, scaled
from perfmon.parsers.job_identity import local_rank, safe_name, scheduler_fields, world_size
from perfmon.probes.discovery import ProcessScan
from perfmon.probes.errors import ProbeError
from perfmon.probes.procfs import TargetProcess, inspect_process, user_name

PRUNE_INTERVAL_S = 600.0


def log(line: str) -> None:
    """One line of the service's log (journald adds the time)."""
    print(f"{PROG}: {printable(line)}", file=sys.stderr, flush=True)


def agent_figures(metrics: Metrics | None, jobs: int) -> None:
    """The agent's own CPU (its children's too: py-spy) and resident memory, to metrics."""
    if metrics is None:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open("/proc/self/statm") as f:
        resident_bytes = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    metrics.agent(usage.ru_utime + usage.ru_stime + children.ru_utime + children.ru_stime,
                  resident_bytes, jobs)


def _now_iso() -> str:
    return datetime.now().astimezone().isoformat()


def one_line(err: BaseException) -> str:
    """An error as the log shows it: the agent's own errors as they are, others (bugs,
    bcc's bare exceptions) with their type."""
    text = str(err).splitlines()[0] if str(err) else ""
    return text if isinstance(err, PerfmonError) else f"{type(err).__name__}: {text}"


class JobRunner:
    """One monitoring session of a job, in a thread of its own."""

    def __init__(self, session: MonitorSession, targets: list[TargetProcess],
                 now_s: float) -> None:
        self.session = session
        self.pids = frozenset(t.pid for t in targets)
        self.started = {t.pid: t.start_ticks for t in targets}
        self.ranks = {t.pid: t.rank for t in targets}
        self.world_size = max((world_size(t.environ) or 0 for t in targets), default=0) or None
        self.started_s = now_s
        self.stopping: str | None = None
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
        self.stopping = self.stopping or reason
        self.session.stop(reason)

    def idle_s(self, now_s: float) -> float:
        """Seconds since the session's last iteration (or its start, before the first)."""
        last_ns = self.session.last_iteration_ns
        if last_ns is None:
            return now_s - self.started_s
        return max(0.0, now_s - last_ns / 1e9)

    def fits(self, found: FoundJob) -> list[int]:
        """The pids of ``found`` that are new ranks of this session's job: a rank number
        none of the session's live ranks holds and below its world size (a process
        that copies a live rank's number is no new rank of this incarnation)."""
        live = {self.ranks[p] for p in found.ranks if p in self.pids}
        new = []
        for pid in found.ranks:
            rank = found.rank_of.get(pid)
            if pid in self.pids or (rank is not None and rank in live):
                continue
            if rank is not None and self.world_size is not None and rank >= self.world_size:
                continue
            new.append(pid)
        return new


@dataclass
class TrackedJob:
    found: FoundJob
    name: str  # the metrics' job label; unique among the jobs of its user
    user: str  # the owner's name (the metrics' user label)
    first_seen_s: float
    folder: OutputDir | None = None  # serve: the job's own folder, once attached
    runner: JobRunner | None = None
    next_try_s: float = 0.0
    retry_s: float = 0.0
    last_error: str | None = None
    limited: str | None = None  # the limit that keeps it waiting, once said
    yielded: int = 0  # times it gave its slot to a waiting job
    last_restart_s: float = -1e18  # when its session last restarted for new ranks
    record: dict[str, Any] = field(default_factory=dict)
    # Its sessions so far, for the next one's goodput (the job's ledger, restarts included)
    before: dict[str, Any] | None = None

    @property
    def key(self) -> str:
        """Unique among the tracked jobs: the metrics' key of the job."""
        return f"{self.user}/{self.name}"

    @property
    def shown(self) -> str:
        """The job as the log names it."""
        return f"{self.name} ({self.user})"


class JobTracker:
    """The jobs of the node (or of one command's process tree) and their sessions.

    ``jobs_root``: one folder per job under ``jobs_root/<host>/`` (serve); else
    every session writes into ``options.output_dir`` (run). ``log``: one line per
    event (found, attached, failed, ended).
    """

    def __init__(self, *, options: AttachOptions, config: ServiceConfig, log: Callable[[str], None],
                 metrics: Metrics | None = None, scope_pid: int | None = None,
                 jobs_root: Path | None = None, host: str | None = None) -> None:
        self.options = options
        self.config = config
        self.log = log
        self.metrics = metrics
        self.scan = ProcessScan(scope_pid)
        self.host = host or socket.gethostname()
        self.pool = BudgetPool(config.cpu_budget_pct, config.cpu_budget_per_rank_pct)
        self.setup_lock = threading.Lock()
        self.jobs: dict[tuple[object, ...], TrackedJob] = {}
        self.results: list[SessionResult] = []  # every session's, in the order they ended
        self.host_folder: OutputDir | None = None
        if jobs_root is not None:
            self.host_folder = OutputDir.open(jobs_root / safe_name(self.host))
        self._next_prune_s = 0.0
        self._skipped: dict[int, str] = {}  # pid -> why, as last said

    def reconfigure(self, config: ServiceConfig) -> None:
        self.config = config
        self.pool.configure(config.cpu_budget_pct, config.cpu_budget_per_rank_pct)

    @property
    def running(self) -> int:
        return sum(1 for j in self.jobs.values() if j.runner is not None)

    # -- one scan -------------------------------------------------------------------------

    def tick(self, now_s: float) -> None:
        skipped: dict[int, str] = {}
        found = {j.key: j for j in find_jobs(self.scan.scan(now_s), self.config.accepts,
                                             lambda pid, err: skipped.update({pid: one_line(err)}))}
        self._say_skipped(skipped)
        for key, f in list(found.items()):
            job = self.jobs.get(key) or self._carried_over(f, found)
            if job is None and self._launches_a_watched_job(f):
                del found[key]  # (no job of its own: it is another job's launcher)
                continue
            if job is None:
                user = safe_name(user_name(f.uid))
                job = self.jobs[key] = TrackedJob(f, self._unique_name(f.name, user), user,
                                                  now_s)
            job.found = f
        self.reap(now_s)
        waiting: list[TrackedJob] = []
        for key, job in list(self.jobs.items()):
            f = found.get(key)
            if job.runner is not None:
                if f is not None and f.ready:
                    self._isolated(job, now_s, self._restart_for_new_ranks, job, f, now_s)
                continue
            if f is None:
                self._isolated(job, now_s, self._finish, job, "ended")
                del self.jobs[key]
                continue
            if now_s < job.next_try_s or not f.ranks:
                continue
            if not f.ready and now_s - job.first_seen_s < self.config.rank_wait_s:
                continue  # the launcher has not started (or loaded PyTorch in) all ranks
            waiting.append(job)
        self._start_waiting(waiting, now_s)
        if self.host_folder is not None and now_s >= self._next_prune_s:
            self._next_prune_s = now_s + PRUNE_INTERVAL_S
            self.prune(time.time())

    def _carried_over(self, f: FoundJob, found: dict[tuple[object, ...], FoundJob]
                      ) -> TrackedJob | None:
        """A watched job whose key the scan no longer gives while its ranks are now
        ``f``'s ranks or launcher (a parent watched alone until its children showed
        they are the ones that train; their variables name the job): the same job, now
        under ``f``'s key. Its session restarts for the new ranks as any job's does."""
        for key, job in self.jobs.items():
            runner = job.runner
            if key in found or runner is None or job.found.uid != f.uid:
                continue
            # (the same processes: a pid reused since is another process)
            if not any(f.started.get(pid) == ticks for pid, ticks in runner.started.items()):
                continue
            del self.jobs[key]
            self.jobs[f.key] = job
            self.log(f"job {job.shown}: its ranks are pid(s) "
                     f"{','.join(map(str, f.ranks)) or '-'}"
                     + (f" (launcher pid {f.launchers[0]})" if f.launchers else "")
                     + f"; the job is {f.name} ({f.id_from})")
            return job
        return None

    def _launches_a_watched_job(self, f: FoundJob) -> bool:
        """Whether ``f`` is a process of a watched job's launcher alone (the same process:
        pid and start ticks): a parent that mp.spawn'ed the ranks, found as a job of its own
        by a scan that, on a busy node, read it before its children (issue 51)."""
        return bool(f.ranks) and any(
            job.found.uid == f.uid
            and all(pid in job.found.launchers and job.found.started.get(pid) == f.started[pid]
                    for pid in f.ranks)
            for job in self.jobs.values())

    def _say_skipped(self, skipped: dict[int, str]) -> None:
        """One line per process whose data could not be read into a job, once while it
        stays unreadable (it is scanned again every tick)."""
        for pid, why in skipped.items():
            if self._skipped.get(pid) != why:
                self.log(f"pid {pid}: skipped (its data cannot be read into a job): {why}")
        self._skipped = skipped

    def _isolated(self, job: TrackedJob, now_s: float, step: Callable[..., None],
                  *args: Any) -> None:
        """One job's step; a failure (a bug on data its user controls) is that job's:
        it is retried with back-off like a failed attach, and every other job goes on."""
        try:
            step(*args)
        except Exception as err:
            self._failed(job, now_s, one_line(err))

    def _restart_for_new_ranks(self, job: TrackedJob, found: FoundJob, now_s: float) -> None:
        """Ranks the session does not watch that fit the job: the next session takes them
        all, at most once per ``restart_interval_s``."""
        runner = job.runner
        assert runner is not None
        if (runner.stopping is None and runner.fits(found)
                and now_s - job.last_restart_s >= self.config.restart_interval_s):
            job.last_restart_s = now_s
            runner.stop("ranks_changed")

    def _start_waiting(self, waiting: list[TrackedJob], now_s: float) -> None:
        """Start waiting jobs while slots are free, fairly: the user with the fewest
        watched jobs first, then the job that yielded least and waited longest. Jobs
        kept waiting by ``max_jobs`` take the slots of idle ones (``idle_yield_s``)."""
        cfg = self.config
        per_user = Counter(j.user for j in self.jobs.values() if j.runner is not None)
        blocked = 0
        while waiting:
            # A job that yielded waits behind those that never did, so that the slot it
            # gave goes to the job it gave it for, not back to itself.
            job = min(waiting, key=lambda j: (j.yielded, per_user[j.user], j.first_seen_s))
            waiting.remove(job)
            if per_user[job.user] >= cfg.max_jobs_per_user:
                self._limited(job, "max_jobs_per_user", f"{job.user} has "
                              f"{cfg.max_jobs_per_user} jobs watched (max_jobs_per_user)")
                continue
            if self.running >= cfg.max_jobs:
                # Only jobs that never yielded take the slots of idle ones: idle jobs do
                # not hand one slot around among themselves.
                blocked += job.yielded == 0
                self._limited(job, "max_jobs", f"{cfg.max_jobs} jobs are (max_jobs)")
                continue
            self._isolated(job, now_s, self._start, job, now_s)
            if job.runner is not None:
                per_user[job.user] += 1
        if blocked:
            self._yield_idle(blocked, now_s)

    def _limited(self, job: TrackedJob, limit: str, why: str) -> None:
        if job.limited != limit:
            job.limited = limit
            self.log(f"job {job.shown}: not watched: {why}")

    def _yield_idle(self, wanted: int, now_s: float) -> None:
        """Stop up to ``wanted`` sessions without an iteration for ``idle_yield_s`` (the
        longest idle first); their jobs wait for a free slot like any other."""
        idle = sorted(((j.runner.idle_s(now_s), j) for j in self.jobs.values()
                       if j.runner is not None and j.runner.stopping is None),
                      key=lambda pair: pair[0], reverse=True)
        for idle_s, job in idle[:wanted]:
            if idle_s < self.config.idle_yield_s:
                break
            assert job.runner is not None
            job.yielded += 1
            job.runner.stop("yielded")
            self.log(f"job {job.shown}: no iteration for {idle_s:.0f} s: its "
                     "slot goes to a waiting job (it is watched again when one is free)")

    def _unique_name(self, name: str, user: str) -> str:
        taken = {j.name for j in self.jobs.values() if j.user == user}
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
                target = inspect_process(pid)
            except ProbeError as err:
                problems.append(str(err))
                continue
            # The pid may have been reused since the scan: only the job's owner's.
            if target.uid == f.uid:
                targets.append(replace(target, order_rank=f.rank_of.get(pid))
                               if f.numbered else target)
        if not targets:
            self._failed(job, now_s, "; ".join(problems) or "no rank left")
            return
        try:
            if self.host_folder is not None and job.folder is None:
                job.folder = self._job_folder(job, targets)
        except OSError as err:
            self._failed(job, now_s, f"cannot create its folder: {err.strerror}")
            return
        job.limited = None
        if job.record:  # (its launcher and ranks as they are now: they may have changed)
            job.record.update(self._described(job, targets))
        job.record["ranks"] = [{"pid": t.pid, "rank": t.rank,
                                "local_rank": local_rank(t.environ)}
                               for t in targets]
        self._write_record(job)
        output_dir = (self.host_folder.path / job.folder.path.name
                      if self.host_folder is not None and job.folder is not None
                      else self.options.output_dir)
        options = replace(self.options, pid=(f.launchers or [targets[0].pid])[0],
                          output_dir=output_dir)
        observer: SessionObserver = (JobMetrics(self.metrics, job.key, job.name, job.user)
                                     if self.metrics is not None else SessionObserver())
        context = SessionContext(
            targets=targets, observer=observer, budget_pool=self.pool,
            setup_lock=self.setup_lock, handle_signals=False, job_before=job.before,
            job={"id": f.name, **self._identity(job),
                 "folder": str(output_dir) if job.folder is not None else None})
        session = MonitorSession(options,
                                 warn=lambda line: self.log(f"job {job.shown}: {line}"),
                                 note=lambda line: self.log(f"job {job.shown}: note: {line}"),
                                 context=context)
        job.runner = JobRunner(session, targets, now_s)
        job.runner.start()
        if job.last_error is not None:
            return  # retrying: said once, when it first failed
        ranks = ",".join(str(t.rank) if t.rank is not None else "-" for t in targets)
        self.log(f"job {job.shown}: attaching to {len(targets)} rank(s) (ranks {ranks}; pids "
                 f"{','.join(str(t.pid) for t in targets)}) -> {output_dir}"
                 + ("; ranks numbered by start order (no RANK in their environment)"
                    if f.numbered else "")
                 + (f"; launcher pid {f.launchers[0]}" if f.launchers else ""))

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
            self.log(f"job {job.shown}: cannot attach: {reason} (retrying with back-off, "
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
            info, stats = result.summary["session_info"], result.statistics
            job.record.setdefault("segments", []).append({
                "summary": result.summary_path.name, "event_log": result.events_path.name,
                "pids": info.get("pids"), "ranks": info.get("ranks"),
                "start_time": info.get("start_time"), "end_time": info.get("end_time"),
                "end_reason": info.get("end_reason"),
                "iterations": info.get("total_iterations"),
                "avg_step_time_ms": scaled(stats.step_s, 1e3),
                "cause": (info.get("exit") or {}).get("cause"),
            })
            job.before = _job_so_far(stats.goodput, info.get("detach_monotonic_ns"))
            if job.before is not None:
                job.record["goodput"] = job.before["ledger"]
            cause = job.record["segments"][-1]["cause"]
            self.log(f"job {job.shown}: session ended ({info.get('end_reason')}): "
                     f"{info.get('total_iterations')} iterations"
                     + (f"; rank {cause['rank']} (pid {cause['pid']}) failed first: "
                        f"{cause['what']}" if cause else "")
                     + f"; summary {result.summary_path}")
            if result.write_error is not None:
                self.log(f"job {job.shown}: {result.write_error}")
            self._write_record(job)

    def _finish(self, job: TrackedJob, status: str) -> None:
        """The job is over (or no longer watched): close its record, drop its series."""
        if job.record:
            job.record.update(status=status, ended=_now_iso())
            self._write_record(job)
            self.log(f"job {job.shown}: {status}")
        if self.metrics is not None:
            self.metrics.job_finished(job.key)
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
        folder = self.host_folder.make_subdir(job_folder(job.name, job.user, datetime.now()))
        job.record = {
            "agent": "perfmon-agent", "agent_version": agent_version(),
            **self._described(job, targets),
            "first_seen": _now_iso(), "ended": None, "status": "running",
            "segments": [],
        }
        return folder

    def _described(self, job: TrackedJob, targets: list[TargetProcess]) -> dict[str, Any]:
        """The record's fields that say which job it is: its id, owner, launcher and
        command line (a job first seen as its launcher alone gets its children's)."""
        f = job.found
        launcher = None
        if f.launchers:
            try:
                launcher = inspect_process(f.launchers[0])
            except ProbeError:
                pass
        return {"job_id": f.name, **self._identity(job),
                "launcher": ({"pid": launcher.pid, "command_line": launcher.shown_cmdline}
                             if launcher is not None else None),
                "command_line": targets[0].shown_cmdline}

    def _identity(self, job: TrackedJob) -> dict[str, Any]:
        """Who the job is, as its record and its sessions' ``session_info.job`` say."""
        f = job.found
        return {"name": job.name, "id_from": f.id_from, "host": self.host, "uid": f.uid,
                "user": job.user, "container_id": f.container_id,
                "pid_namespace": f.pid_namespace, **scheduler_fields(f.env, f.pod_uid)}

    def _write_record(self, job: TrackedJob) -> None:
        if job.folder is not None and job.record:
            write_job_record(job.folder, job.record, job.shown, self.log)

    def prune(self, now_wall_s: float) -> None:
        assert self.host_folder is not None
        prune_job_folders(
            self.host_folder, {j.folder.path.name for j in self.jobs.values() if j.folder},
            keep_jobs=self.config.keep_jobs, keep_days=self.config.keep_days,
            now_wall_s=now_wall_s, log=self.log)


def _job_so_far(goodput: Goodput | None, end_ns: Any) -> dict[str, Any] | None:
    """What the next session of a job needs of the ended one's goodput (a session fact,
    logged, as the summary shows it): the job's ledger so far (the session's own, or the
    job's when it had earlier ones), when it ended and its last iteration did, the job's
    last iteration number."""
    if goodput is None or not isinstance(end_ns, int):
        return None
    return {"ledger": render(goodput.of_job), "end_mono_ns": end_ns,
            "last_end_mono_ns": goodput.last_end_ns,
            "last_job_iteration": goodput.last_job_iteration}
