"""Where the job's GPU-hours went: a goodput ledger (docs/metrics.md, "Goodput").

A session's wall time (its window: see ``Goodput.window_start``), to detach, times its
ranks (a GPU each; on CPU the ranks), split into productive time and time lost by
cause, each measured:

- productive: every iteration at the job's healthy pace (the fail-slow baseline,
  perfmon.agent.reducers.failslow): min(step, healthy) of each, and the job's first
  iteration after its start-up;
- startup: from the window's start (the process start, or the attach) to its first
  iteration (less one healthy step), when the job was not iterating at attach;
- hang: the time of the iterations that spanned a hang beyond a healthy step, and
  after the last iteration when the session ended hung;
- straggler: in a straggler episode, its delay per step (at most the excess);
- slowdown: in a fail-slow episode (from its change to its recovery), the rest of
  each step's excess over the healthy step; data_stall when the phase that moved most
  was data loading;
- restart (across sessions of one job: ``job``): from the previous session's end (its
  ranks exited) to this one's first iteration, and the iterations the job redid (its
  own counter went back), at the healthy pace;
- unexplained: the rest (noise above the healthy pace, the tail after the last
  iteration), so the ledger always adds up to the wall time.

With no iteration seen at all, nothing of the session is known (the job was starting,
or iterating where the agent could not see it): its time, from attach to detach, is
``unobserved``, outside the wall time, and goodput (``ratio``) is unknown (None).

Steps are kept as per-second bins (iterations, time, excess; the bins widen, two into
one, past MAX_BINS), so a week-long session stays small and the episodes are laid
over the bins at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

CAUSES = ("startup", "hang", "restart", "straggler", "slowdown", "data_stall", "unexplained")
MAX_BINS = 4096
FROM_START_STEPS = 2  # the first iteration ended this many healthy steps after attach


@dataclass
class _Bin:
    start_ns: int
    iterations: int = 0
    step_ns: int = 0
    excess_ns: int = 0  # over the healthy step, outside hangs
    hang_ns: int = 0  # of the iterations that spanned a hang


@dataclass
class Ledger:
    """Seconds of one rank (of ``gpus``) by what they went to; productive + lost = wall.
    ``unobserved_s``: time of sessions that saw no iteration, outside the wall time (the
    ratio is over the time the ledger knows of)."""

    wall_s: float = 0.0
    productive_s: float = 0.0
    lost_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    gpus: int = 1
    unobserved_s: float = 0.0

    def add(self, other: Ledger) -> None:
        self.wall_s += other.wall_s
        self.productive_s += other.productive_s
        self.unobserved_s += other.unobserved_s
        for cause, s in other.lost_s.items():
            self.lost_s[cause] += s

    def to_dict(self) -> dict[str, Any]:
        hours = self.gpus / 3600
        return {
            "ratio": round(self.productive_s / self.wall_s, 6) if self.wall_s > 0 else None,
            "gpus": self.gpus,
            "wall_seconds": round(self.wall_s, 3),
            "productive_seconds": round(self.productive_s, 3),
            "lost_seconds": {c: round(s, 3) for c, s in self.lost_s.items()},
            "gpu_hours": round(self.wall_s * hours, 6),
            "productive_gpu_hours": round(self.productive_s * hours, 6),
            "lost_gpu_hours": {c: round(s * hours, 6) for c, s in self.lost_s.items()},
            "unobserved_seconds": round(self.unobserved_s, 3),
            "unobserved_gpu_hours": round(self.unobserved_s * hours, 6),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ledger:
        lost = dict.fromkeys(CAUSES, 0.0)
        for cause, s in (d.get("lost_seconds") or {}).items():
            if cause in lost and isinstance(s, int | float):
                lost[cause] = float(s)
        unobserved = d.get("unobserved_seconds")  # (absent before it was kept: none)
        return cls(float(d.get("wall_seconds") or 0.0), float(d.get("productive_seconds") or 0.0),
                   lost, int(d.get("gpus") or 1),
                   float(unobserved) if isinstance(unobserved, int | float) else 0.0)


class Goodput:
    """Feed the primary's iterations (``on_iteration``), its first end (``on_first_end``)
    and hangs; ``summary`` lays the episodes over them.

    ``attach_only``: the session was started on a process already running (``attach``,
    session_info.started_by), so nothing before the attach is the agent's to count;
    False (the node service and ``run``, on processes they just found, and logs from
    before the fact was kept) lets the window start at the process start."""

    def __init__(self, attach_ns: int, process_start_ns: int | None, gpus: int,
                 previous: dict[str, Any] | None = None, *, attach_only: bool = False) -> None:
        self.attach_ns = attach_ns
        self.process_start_ns = process_start_ns
        self.gpus = max(1, gpus)
        self.previous = previous  # the job's earlier sessions (serve, run): their ledger
        self.attach_only = attach_only
        self.first_end_ns: int | None = None
        self.last_end_ns: int | None = None
        self.healthy_ns: float | None = None  # the latest healthy step seen
        self._width_ns = 1_000_000_000
        self._bins: dict[int, _Bin] = {}
        self._hang_from_ns: int | None = None  # an open hang's last iteration
        self._last = (0, 0, 0)  # the latest iteration: start, end, excess (ns)

    # -- feeding ---------------------------------------------------------------------------

    def on_first_end(self, end_ns: int) -> None:
        self.first_end_ns = self.last_end_ns = end_ns

    def on_iteration(self, end_ns: int, step_ns: int, healthy_ns: float | None) -> None:
        """One measured iteration of the primary; ``healthy_ns``: the job's healthy step
        now (None before the fail-slow baseline formed: all of it is productive)."""
        if healthy_ns is not None:
            self.healthy_ns = healthy_ns
        b = self._bin(end_ns)
        b.iterations += 1
        b.step_ns += step_ns
        excess = max(0, int(step_ns - healthy_ns)) if healthy_ns is not None else 0
        if self._hang_from_ns is not None and end_ns - step_ns <= self._hang_from_ns:
            b.hang_ns += excess  # (the iteration that was hung: its excess is the hang's)
        else:
            b.excess_ns += excess
        self._hang_from_ns = None
        self._last = (end_ns - step_ns, end_ns, excess)
        self.last_end_ns = end_ns

    def on_hang(self, record: dict[str, Any]) -> None:
        """A hang since ``last_iteration_mono_ns``: the iteration that ends it is the hang's
        (the record comes once the ranks' stacks are in: the job may have resumed by then)."""
        since = record["last_iteration_mono_ns"]
        start, end, excess = self._last
        if start <= since < end:  # (resumed already: its excess was taken for noise)
            b = self._bin(end)
            b.excess_ns -= excess
            b.hang_ns += excess
        else:
            self._hang_from_ns = since

    def _bin(self, t_ns: int) -> _Bin:
        key = (t_ns - self.attach_ns) // self._width_ns
        b = self._bins.get(key)
        if b is None:
            if len(self._bins) >= MAX_BINS:
                self._widen()
                return self._bin(t_ns)
            b = self._bins[key] = _Bin(self.attach_ns + key * self._width_ns)
        return b

    def _widen(self) -> None:
        """Two bins into one: the bins cover a longer time, as coarse."""
        self._width_ns *= 2
        merged: dict[int, _Bin] = {}
        for key, b in sorted(self._bins.items()):
            into = merged.setdefault(key // 2, _Bin(self.attach_ns + key // 2 * self._width_ns))
            into.iterations += b.iterations
            into.step_ns += b.step_ns
            into.excess_ns += b.excess_ns
            into.hang_ns += b.hang_ns
        self._bins = merged

    # -- the ledger --------------------------------------------------------------------------

    def summary(self, end_ns: int, fail_slow: list[dict[str, Any]],
                stragglers: Iterable[dict[str, Any]], hung: bool,
                first_job_iteration: int | None = None) -> dict[str, Any]:
        """final_statistics.goodput at ``end_ns``: the session's ledger, and with earlier
        sessions of the job (``previous``), the job's as ``job`` (``first_job_iteration``:
        the job's own number of this session's first iteration, to count those redone)."""
        ledger, window_start = self._session(end_ns, fail_slow, list(stragglers), hung)
        out = {**ledger.to_dict(), "from": _window_from(window_start, self.attach_ns,
                                                        self.process_start_ns),
               "last_end_mono_ns": self.last_end_ns}
        if self.previous is not None:
            out["job"] = self._job(ledger, window_start, first_job_iteration).to_dict()
        return out

    def _session(self, end_ns: int, fail_slow: list[dict[str, Any]],
                 stragglers: list[dict[str, Any]], hung: bool) -> tuple[Ledger, int]:
        healthy = self.healthy_ns or 0.0
        ledger = Ledger(gpus=self.gpus)
        if self.first_end_ns is None:  # (no iteration seen: starting, or unseen; not known)
            ledger.unobserved_s = max(0, end_ns - self.attach_ns) / 1e9
            return ledger, self.attach_ns
        # Not iterating at attach: its first iteration ended a couple of healthy steps
        # after it (else that iteration was running at attach).
        started = self.first_end_ns - self.attach_ns > FROM_START_STEPS * healthy > 0
        start = self.window_start() if started else self.attach_ns
        ledger.wall_s = max(0, end_ns - start) / 1e9
        lost = ledger.lost_s
        productive_ns: float
        if started:
            productive_ns = min(healthy, self.first_end_ns - start)
            lost["startup"] = (self.first_end_ns - start - productive_ns) / 1e9
        else:
            productive_ns = self.first_end_ns - start  # (the iteration running at attach)
        slow = _episodes(fail_slow, end_ns)
        for b in self._bins.values():
            lost["hang"] += b.hang_ns / 1e9
            productive_ns += b.step_ns - b.excess_ns - b.hang_ns
            excess = float(b.excess_ns)
            b_end = b.start_ns + self._width_ns
            delay = max((e["delay_ms_per_step"] * 1e6 for e in stragglers
                         if e["since_mono_ns"] < b_end
                         and (e["until_mono_ns"] or end_ns) >= b.start_ns), default=0.0)
            straggling = min(excess, delay * b.iterations)
            lost["straggler"] += straggling / 1e9
            excess -= straggling
            for a, z, cause in slow:
                if a < b_end and z > b.start_ns:
                    lost[cause] += excess / 1e9
                    excess = 0.0
                    break
            lost["unexplained"] += excess / 1e9
        tail = max(0, end_ns - (self.last_end_ns or end_ns)) / 1e9
        lost["hang" if hung else "unexplained"] += tail
        ledger.productive_s = productive_ns / 1e9
        # (what the bins do not hold: the rounding of their edges, into the rest)
        lost["unexplained"] += ledger.wall_s - ledger.productive_s - sum(lost.values())
        lost["unexplained"] = max(0.0, lost["unexplained"])
        return ledger, start

    def window_start(self) -> int:
        """Where the window of a job not iterating at attach starts: the primary's process
        start when the session may have seen it (not ``attach_only``), and never before
        the job's previous session ended (that one counted the time up to its end); the
        attach otherwise (``attach`` to a running process, a process start not known or
        after the attach). Never after the attach."""
        start = self.process_start_ns
        if self.attach_only or start is None or start >= self.attach_ns:
            return self.attach_ns
        if self.previous is not None:
            start = max(start, int(self.previous["end_mono_ns"]))
        return min(start, self.attach_ns)

    def _job(self, session: Ledger, window_start: int, first: int | None) -> Ledger:
        """The job's ledger: its earlier sessions', then the restart (from the previous
        session's end to this one's first iteration, and the iterations redone), then
        this session's."""
        assert self.previous is not None
        job = Ledger.from_dict(self.previous["ledger"])
        job.gpus = max(job.gpus, session.gpus)
        here = Ledger(session.wall_s, session.productive_s, dict(session.lost_s), session.gpus,
                      session.unobserved_s)
        end_ns = int(self.previous["end_mono_ns"])
        gap_s = max(0, window_start - end_ns) / 1e9
        here.wall_s += gap_s
        here.lost_s["restart"] += gap_s + here.lost_s["startup"]
        here.lost_s["startup"] = 0.0
        # The previous session's time after its last iteration (a rank failed, the
        # others were stopped) was the restart's too: the earlier ledger said unexplained.
        last_end = self.previous.get("last_end_mono_ns")
        if isinstance(last_end, int) and last_end <= end_ns:
            tail_s = min((end_ns - last_end) / 1e9, job.lost_s["unexplained"])
            job.lost_s["unexplained"] -= tail_s
            here.lost_s["restart"] += tail_s
        last = self.previous.get("last_job_iteration")
        if isinstance(last, int) and first is not None and first <= last and self.healthy_ns:
            redone_s = min(here.productive_s, (last - first + 1) * self.healthy_ns / 1e9)
            here.productive_s -= redone_s
            here.lost_s["restart"] += redone_s
        job.add(here)
        return job


def recorded_ledger(goodputs: list[dict[str, Any]]) -> Ledger | None:
    """One host's ledger of a job from its sessions' ``goodput`` (in time order): the
    latest job ledger (it holds the sessions before it, restarts included), plus the
    sessions after it; sessions that knew of no earlier one (``attach``) add up."""
    total: Ledger | None = None
    for g in goodputs:
        if not isinstance(g, dict) or not isinstance(g.get("wall_seconds"), int | float):
            continue
        if isinstance(g.get("job"), dict):
            total = Ledger.from_dict(g["job"])
            continue
        session = Ledger.from_dict(g)
        if total is None:
            total = session
        else:
            total.add(session)
    return total


def combined(ledgers: list[Ledger]) -> Ledger | None:
    """The job's ledger over its hosts: their GPU-seconds added, as seconds per GPU."""
    gpus = sum(x.gpus for x in ledgers)
    if not ledgers or gpus == 0:
        return None
    out = Ledger(gpus=gpus)
    out.wall_s = sum(x.wall_s * x.gpus for x in ledgers) / gpus
    out.productive_s = sum(x.productive_s * x.gpus for x in ledgers) / gpus
    out.unobserved_s = sum(x.unobserved_s * x.gpus for x in ledgers) / gpus
    for cause in CAUSES:
        out.lost_s[cause] = sum(x.lost_s[cause] * x.gpus for x in ledgers) / gpus
    return out


def _window_from(start: int, attach_ns: int, process_start_ns: int | None) -> str:
    """``from``: what the window starts at."""
    if start == attach_ns:
        return "attach"
    return "process_start" if start == process_start_ns else "previous_session"


def _episodes(events: list[dict[str, Any]], end_ns: int) -> list[tuple[int, int, str]]:
    """The fail-slow episodes: (from its change, to its recovery's change or ``end_ns``,
    its cause: data_stall when data loading moved most, else slowdown)."""
    out = []
    open_at: tuple[int, str] | None = None
    for e in events:
        if e["event"] == "fail_slow" and open_at is None:
            phases = e.get("phases") or []
            top = phases[0]["phase"] if phases else None
            open_at = (e["t_mono_ns"], "data_stall" if top == "data_loading" else "slowdown")
        elif e["event"] == "recovered" and open_at is not None:
            out.append((open_at[0], e["t_mono_ns"], open_at[1]))
            open_at = None
    if open_at is not None:
        out.append((open_at[0], end_ns, open_at[1]))
    return out
