"""Incident bundles: one folder per hang, straggler, fail-slow event or abnormal exit,
with what an engineer needs from that moment on every rank.

``incident_<stamp>_<kind>/`` beside the summary (record/layout.py), made like every
other folder the agent writes (0750, created exclusively, never through a link):

- ``incident.json``: what, when (detected, and when it began), which ranks, the figures
  that moved (the event's own fields), the files;
- ``stacks.json``: every live rank's Python stacks when it was detected (py-spy, not
  pausing the ranks; a rank that exited has none);
- ``gpus.json``: the latest NVML sample of the job's GPUs (``available: false``
  without NVML);
- ``history.json``: each rank's iterations (end, step, wait, compute) from
  ``BEFORE_S`` before the incident to ``AFTER_S`` after it;
- ``trace.json``: the Perfetto trace of that window, made from the session's own
  records (perfmon.agent.record.trace), written once ``AFTER_S`` have passed (or the
  session ends).

Bounded: at most ``MAX_PER_SESSION`` bundles a session (then one log line), the
window's records at most ``MAX_RECORDS``, and at most ``MAX_KEPT`` bundles in the
folder (the oldest of this agent's removed first).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from perfmon.agent.console import fmt
from perfmon.agent.record.layout import (
    INCIDENT_GPUS,
    INCIDENT_HISTORY,
    INCIDENT_RECORD,
    INCIDENT_STACKS,
    INCIDENT_TRACE,
    incident_folder,
    is_incident,
)
from perfmon.agent.record.outputs import OutputDir, json_bytes
from perfmon.agent.record.trace import TraceBuilder
from perfmon.agent.reducers import Summarizer
from perfmon.parsers.figures import FailSlowEvent, StragglerEpisode, render, scaled
from perfmon.probes.background import BackgroundCalls
from perfmon.probes.errors import NoSuchProcess
from perfmon.probes.procfs import TargetProcess, is_running
from perfmon.probes.pyspy import dump_stacks

BEFORE_S, AFTER_S = 120.0, 30.0
STACKS_WAIT_S = 10.0  # at the session's end, for the dumps still running
MAX_PER_SESSION = 10
MAX_RECORDS = 50_000  # the window's records held (a few per second per rank)
MAX_KEPT = 50  # bundles kept in a folder
KINDS = ("hang", "straggler", "fail_slow", "exit")


@dataclass
class _Open:
    """A bundle whose trace is still to come (its window's end not reached)."""

    folder: OutputDir
    record: dict[str, Any]
    t_ns: int  # when it began (the window is around it)
    files: list[str] = field(default_factory=list)


class Incidents:
    """One session's incident bundles; every call from the session's thread."""

    def __init__(self, out: OutputDir, targets: list[TargetProcess], facts: dict[str, Any],
                 warn: Callable[[str], None]) -> None:
        self.out, self.targets, self.facts, self.warn = out, targets, facts, warn
        self.written = 0
        self._window: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDS)
        self._gpu: dict[str, Any] | None = None  # the latest NVML sample (every GPU)
        self._open: list[_Open] = []
        self._stacks = BackgroundCalls("perfmon-incident-stacks")
        self._said_full = False
        self._exit_seen = False

    # -- what the session sees ---------------------------------------------------------------

    def on_record(self, record: dict[str, Any]) -> None:
        """Every record the session logs: the window, GPU samples, hangs and exits."""
        self._window.append(record)
        kind = record["type"]
        if kind == "gpu":
            self._gpu = record
        elif kind == "hang":
            self.begin("hang", record["last_iteration_mono_ns"], record["t_mono_ns"],
                       f"no iteration for {record['threshold_s']:.1f} s; the ranks wait in "
                       f"{record['frame']}", pids=[t.pid for t in self.targets],
                       figures={k: record[k] for k in ("threshold_s", "frame")})
        elif kind == "rank_exit" and _failed(record) and not self._exit_seen:
            # (the first abnormal exit: the others follow from it, e.g. a launcher
            # stopping the other ranks)
            self._exit_seen = True
            self.begin("exit", record["t_mono_ns"], record["t_mono_ns"],
                       f"rank {record.get('rank')} (pid {record['pid']}) ended abnormally",
                       pids=[record["pid"]],
                       figures={k: v for k, v in record.items() if k != "type"})

    def on_event(self, event: StragglerEpisode | FailSlowEvent) -> None:
        """A reducer's event (perfmon.agent.reducers.Summarizer.take_events); the bundle
        shows its figures as the summary does."""
        if isinstance(event, StragglerEpisode) and event.until is None:
            self.begin("straggler", event.since_ns, event.detected_ns,
                       f"rank {event.rank} (pid {event.pid}) delays every step by "
                       f"{fmt(scaled(event.delay_per_step_s, 1e3), '.1f')} ms",
                       pids=[event.pid], figures=render(event))
        elif isinstance(event, FailSlowEvent) and event.event == "fail_slow":
            # (the ranks whose compute moved; none singled out: every rank is involved)
            moved = [r.pid for r in event.ranks if r.moved] or [t.pid for t in self.targets]
            self.begin("fail_slow", event.t_ns, event.detected_ns,
                       f"step time {event.before_step_s * 1e3:.1f} -> "
                       f"{event.after_step_s * 1e3:.1f} ms ({event.change:+.0%})",
                       pids=moved, figures=render(event))

    def begin(self, kind: str, t_ns: int, detected_ns: int, what: str, *, pids: list[int],
              figures: dict[str, Any]) -> None:
        """A new incident: its folder and record now, its stacks in the background."""
        if self.written >= MAX_PER_SESSION:
            if not self._said_full:
                self._said_full = True
                self.warn(f"incidents: {MAX_PER_SESSION} bundles written this session; no more")
            return
        now = datetime.now().astimezone()
        try:
            folder = self.out.make_subdir(incident_folder(now, kind))
        except OSError as err:
            self.warn(f"incident ({kind}): no bundle: {err.strerror}")
            return
        self.written += 1
        ranks = {t.pid: t.rank for t in self.targets}
        record = {"agent": "perfmon-agent", "kind": kind, "what": what, "time": now.isoformat(),
                  "t_mono_ns": t_ns, "detected_mono_ns": detected_ns,
                  "ranks": [{"pid": p, "rank": ranks.get(p)} for p in pids],
                  "session_summary": self.facts.get("event_log"), "figures": _plain(figures),
                  "files": []}
        incident = _Open(folder, record, t_ns)
        self._write(incident, INCIDENT_GPUS, self._gpu_snapshot())
        self._write(incident, INCIDENT_RECORD, record)
        self._open.append(incident)
        self._stacks.submit(folder.path.name, _dump_live, self.targets,
                            cancel=self._stacks.cancel)
        self._prune()

    # -- as time goes on -----------------------------------------------------------------------

    def poll(self, now_ns: int, summarizer: Summarizer) -> None:
        """Stacks that came in; traces and histories whose window is over."""
        self._take_stacks()
        for incident in [i for i in self._open if now_ns >= i.t_ns + AFTER_S * 1e9]:
            self._finish(incident, now_ns, summarizer)

    def close(self, end_ns: int, summarizer: Summarizer) -> None:
        """The session ends: the stacks still being dumped (a few seconds at most), then
        every open bundle's trace up to now."""
        deadline = time.monotonic() + STACKS_WAIT_S
        while self._stacks.busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._take_stacks()
        for incident in list(self._open):
            self._finish(incident, end_ns, summarizer)
        self._stacks.close()

    def _take_stacks(self) -> None:
        for name, stacks, error in self._stacks.done():
            for incident in self._open:
                if incident.folder.path.name == name:
                    self._write(incident, INCIDENT_STACKS,
                                {"error": str(error)} if error else stacks)

    def _finish(self, incident: _Open, now_ns: int, summarizer: Summarizer) -> None:
        self._open.remove(incident)
        start = int(incident.t_ns - BEFORE_S * 1e9)
        end = min(now_ns, int(incident.t_ns + AFTER_S * 1e9))
        self._write(incident, INCIDENT_HISTORY, _history(summarizer, start, end))
        builder = TraceBuilder((start, end))
        records = [r for r in self._window if start <= (r.get("t_mono_ns") or 0) <= end
                   or r["type"] == "steps"]
        builder.add_records(self.facts, records, incident.folder.path.name)
        try:
            incident.folder.replace(INCIDENT_TRACE, builder.document())
            incident.files.append(INCIDENT_TRACE)
            incident.record["files"] = list(incident.files)
        except OSError as err:
            self.warn(f"incident {incident.folder.path.name}: no trace: {err.strerror}")
        incident.record["window_mono_ns"] = [start, end]
        self._write(incident, INCIDENT_RECORD, incident.record)
        incident.folder.close()

    def _write(self, incident: _Open, name: str, data: Any) -> None:
        try:
            incident.folder.replace(name, json_bytes(data))
        except OSError as err:
            self.warn(f"incident {incident.folder.path.name}: {name} not written: {err.strerror}")
            return
        if name not in incident.files:
            incident.files.append(name)
            incident.record["files"] = list(incident.files)

    def _gpu_snapshot(self) -> dict[str, Any]:
        """The latest NVML sample of the GPUs the job's processes hold memory on (every
        GPU when NVML names none of them: it cannot see processes in some containers)."""
        if self._gpu is None:
            return {"available": False, "why": "no NVML sample of the job's GPUs"}
        pids = set(self.facts.get("pids") or [])
        gpus = self._gpu["gpus"]
        theirs = [g for g in gpus if pids & {int(p) for p in g.get("process_memory_bytes")
                                             or {}}]
        return {"available": True, "t_mono_ns": self._gpu["t_mono_ns"],
                "gpus": theirs or gpus, "job_processes_seen": bool(theirs)}

    def _prune(self) -> None:
        """Keep the newest MAX_KEPT bundles this agent made in the folder."""
        ours = []
        for name in self.out.subdirs():
            if is_incident(name) and self.out.read_file(f"{name}/{INCIDENT_RECORD}",
                                                         1 << 20) is not None:
                ours.append(name)
        for name in sorted(ours)[:-MAX_KEPT]:
            try:
                self.out.remove_subdir(name)
            except OSError as err:
                self.warn(f"incidents: cannot remove {name}: {err.strerror}")


def _failed(record: dict[str, Any]) -> bool:
    """An abnormal exit: a non-zero status, a signal, an OOM kill or a known failure."""
    return bool((record.get("exit_code") not in (None, 0)) or record.get("signal")
                or record.get("oom_killed") or record.get("log_tail_cause"))


def _dump_live(targets: list[TargetProcess], cancel: Any = None) -> dict[str, Any]:
    """Every live rank's Python stacks (not pausing them), by pid."""
    out: dict[str, Any] = {}
    for target in targets:
        if not is_running(target):
            out[str(target.pid)] = {"exited": True}
            continue
        try:
            out[str(target.pid)] = {"rank": target.rank, "threads": [
                asdict(t) for t in dump_stacks(target.pid, timeout_s=10, cancel=cancel)]}
        except NoSuchProcess:
            # (it exited as it was read: a launcher stops the other ranks when one fails)
            out[str(target.pid)] = {"exited": True}
        except Exception as err:  # (one rank's failure is its entry, not the bundle's)
            out[str(target.pid)] = {"rank": target.rank, "error": str(err).splitlines()[0]}
    return out


def _history(summarizer: Summarizer, start_ns: int, end_ns: int) -> dict[str, Any]:
    """Each rank's iterations in the window: end, step, wait (null: not probed), compute."""
    ranks = []
    for r in summarizer.ranks.all():
        rows = r.rows_between(start_ns, end_ns)
        ranks.append({"pid": r.pid, "rank": r.rank, "iterations": [
            {"end_mono_ns": end, "step_ms": step / 1e6,
             "wait_ms": None if wait is None else wait / 1e6,
             "compute_ms": None if wait is None else (step - wait) / 1e6}
            for end, step, wait in rows]})
    return {"from_mono_ns": start_ns, "until_mono_ns": end_ns, "ranks": ranks}


def _plain(value: Any) -> Any:
    """``value`` as JSON keeps it (a deque of the reducers' becomes a list)."""
    return json.loads(json.dumps(value, default=list))
