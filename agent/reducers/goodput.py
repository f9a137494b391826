"""Where the job's GPU-hours went: a goodput ledger (docs/metrics.md, "Goodput").

A session's window (from ``Goodput.window_start`` to detach) times its ranks (a GPU
each; on CPU the ranks) is split into what the agent saw and what it could not:

- unobserved (``unobserved_s``, outside the wall time and the ratio): the iteration
  already running at attach, up to the first end the probes saw (the job's pace there
  is not known), the iteration still running when the window closed (unless it is a
  stall: below), and all of a session that saw no iteration;
- the wall time, the rest, split into productive time and time lost by cause:
  - productive: every iteration at the job's healthy pace (the fail-slow baseline,
    perfmon.agent.reducers.failslow), its noise around that pace included;
  - startup: from the window's start (the process start, or the attach) to its first
    iteration (less one healthy step), and the stalls of its first steps (before its
    healthy pace formed), when the job was not iterating then: its first iteration
    ended a stall's length or more after the attach, or (the node service and run)
    its process was younger at the attach than that;
  - hang: stalls, wherever they sit (in the data loader, forward, backward or optimizer
    step, between iterations, in the first or last iteration of the window): an
    iteration that took its pace plus a stall (perfmon.agent.reducers.pace: at least
    twice its pace, 0.25 s and 6 sigmas of the job's own step noise longer); the stall
    is what it took beyond the pace, whether it recovered or not; the iteration still
    running at the end, when it has run that long (or the session ended hung), likewise;
  - data_stall: a stall whose hang record found the ranks loading data, and a fail-slow
    episode whose phase that moved most was data loading;
  - straggler: in a straggler episode, its delay per step (at most the excess);
  - slowdown: in a fail-slow episode (from its change to the change that closed it),
    the rest of the steps' excess over the healthy step;
  - restart (across sessions of one job: ``job``): from the previous session's end
    (its ranks exited) to this one's first iteration, and the iterations the job redid
    (its own counter went back), at the healthy pace;
  - unexplained: excess outside every episode beyond the noise: per second, what the
    steps took over the healthy pace beyond max(MIN_SHIFT, BAND_SIGMAS x the job's
    noise) of it (a short slowdown never confirmed, a stall shorter than a stall),
    and the rounding of the bins' edges, so that the ledger adds up to the wall time.

The stall rule works on the steps themselves, not on the hang detector's records: a
stall shorter than the hang threshold, or one whose record came after the job had
resumed, is the same stall. Until the fail-slow baseline forms (its warm-up, seconds)
the steps are held (at most EARLY_MAX) and judged once it has.

Steps are kept as per-second bins (iterations, time, excess, stall; the bins widen, two
into one, past MAX_BINS), so a week-long session stays small and the episodes are laid
over the bins at the end; stalls are kept one by one (the last MAX_STALLS).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from perfmon.agent.reducers.failslow import episodes
from perfmon.agent.reducers.pace import Pace
from perfmon.parsers.figures import LOSS_CAUSES as CAUSES
from perfmon.parsers.figures import (
    FailSlowEvent,
    GoodputLedger,
    StragglerEpisode,
    finite,
)
from perfmon.parsers.figures import Goodput as GoodputFigures

MAX_BINS = 4096
MIN_SHIFT = 0.03  # outside episodes, excess within this share of the pace is noise,
BAND_SIGMAS = 3.0  # ... or within this many sigmas of a second's steps
MAX_STALLS = 4096
EARLY_MAX = 20_000  # steps held until the healthy pace is known


@dataclass
class _Bin:
    start_ns: int
    iterations: int = 0
    step_ns: int = 0
    excess_ns: int = 0  # what the steps took over the healthy step, stalls left out (signed)
    stall_ns: int = 0
    healthy_ns: float = 0.0  # the healthy steps they stand for (the band's scale)
    noise_sq: float = 0.0  # the variance of the steps' sum (ns^2)

    def add(self, other: _Bin) -> None:
        self.iterations += other.iterations
        self.step_ns += other.step_ns
        self.excess_ns += other.excess_ns
        self.stall_ns += other.stall_ns
        self.healthy_ns += other.healthy_ns
        self.noise_sq += other.noise_sq

    def band_ns(self) -> float:
        """The excess that is the job's own noise (outside episodes)."""
        return max(MIN_SHIFT * self.healthy_ns, BAND_SIGMAS * math.sqrt(self.noise_sq))


@dataclass(frozen=True)
class _Stall:
    start_ns: int
    end_ns: int  # (the session's end: still stalled)
    lost_ns: int
    early: bool = False  # before the healthy pace was known (a job's first steps)


@dataclass
class Ledger:
    """Seconds of one rank (of ``gpus``) by what they went to; productive + lost = wall.
    ``unobserved_s``: time the agent could not see (before the first iteration it
    measured, after the window closed mid-iteration, sessions that saw no iteration),
    outside the wall time (the ratio is over the time the ledger knows of)."""

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

    def figures(self) -> GoodputLedger:
        """The ledger as the stream has it (seconds to the ms, GPU-hours to 10^-6)."""
        return GoodputLedger(**self._figures())

    def _figures(self) -> dict[str, Any]:
        hours = self.gpus / 3600
        return {
            "ratio": round(self.productive_s / self.wall_s, 6) if self.wall_s > 0 else None,
            "gpus": self.gpus,
            "wall_s": round(self.wall_s, 3),
            "productive_s": round(self.productive_s, 3),
            "lost_s": {c: round(s, 3) for c, s in self.lost_s.items()},
            "gpu_hours": round(self.wall_s * hours, 6),
            "productive_gpu_hours": round(self.productive_s * hours, 6),
            "lost_gpu_hours": {c: round(s * hours, 6) for c, s in self.lost_s.items()},
            "unobserved_s": round(self.unobserved_s, 3),
            "unobserved_gpu_hours": round(self.unobserved_s * hours, 6),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Ledger:
        """The ledger a summary, a job record or a log shows (anyone's: what is not a
        number is none)."""
        lost = dict.fromkeys(CAUSES, 0.0)
        shown_lost = d.get("lost_seconds")
        for cause, s in (shown_lost.items() if isinstance(shown_lost, Mapping) else ()):
            if cause in lost and finite(s) is not None:
                lost[cause] = float(s)
        gpus = d.get("gpus")
        # (unobserved_seconds: absent before it was kept, none)
        return cls(finite(d.get("wall_seconds")) or 0.0,
                   finite(d.get("productive_seconds")) or 0.0, lost,
                   gpus if type(gpus) is int and gpus >= 1 else 1,
                   finite(d.get("unobserved_seconds")) or 0.0)

    @classmethod
    def of(cls, figures: GoodputLedger) -> Ledger:
        """The ledger to add to of one the stream had."""
        return cls(figures.wall_s, figures.productive_s,
                   {c: figures.lost_s.get(c, 0.0) for c in CAUSES}, figures.gpus,
                   figures.unobserved_s)


class _Account:
    """Judged steps: per-second bins, the stalls one by one, the pace they were judged at."""

    def __init__(self, origin_ns: int) -> None:
        self.origin_ns = origin_ns
        self.width_ns = 1_000_000_000
        self.bins: dict[int, _Bin] = {}
        self.pace = Pace()
        self.stalls: deque[_Stall] = deque(maxlen=MAX_STALLS)
        self.stalls_dropped_ns = 0  # (of stalls no longer kept one by one: hang)

    def take(self, end_ns: int, step_ns: int, healthy_ns: float, early: bool = False) -> None:
        at_pace, stall = self.pace.take(step_ns)
        b = self._bin(end_ns)
        b.iterations += 1
        b.step_ns += step_ns
        b.stall_ns += stall
        b.excess_ns += int(step_ns - stall - healthy_ns)
        b.healthy_ns += healthy_ns
        b.noise_sq += (self.pace.sigma * at_pace) ** 2
        if stall:
            if len(self.stalls) == MAX_STALLS:
                self.stalls_dropped_ns += self.stalls[0].lost_ns
            self.stalls.append(_Stall(end_ns - step_ns, end_ns, stall, early))

    def take_held(self, held: list[tuple[int, int]], healthy_ns: float) -> None:
        """Steps held before the healthy pace was known, judged against their own pace."""
        self.pace.seed([s for _, s in held])
        for end, step in held:
            self.take(end, step, healthy_ns, early=True)

    def _bin(self, t_ns: int) -> _Bin:
        key = (t_ns - self.origin_ns) // self.width_ns
        b = self.bins.get(key)
        if b is None:
            if len(self.bins) >= MAX_BINS:
                self._widen()
                return self._bin(t_ns)
            b = self.bins[key] = _Bin(self.origin_ns + key * self.width_ns)
        return b

    def _widen(self) -> None:
        """Two bins into one: the bins cover a longer time, as coarse."""
        self.width_ns *= 2
        merged: dict[int, _Bin] = {}
        for key, b in sorted(self.bins.items()):
            merged.setdefault(key // 2, _Bin(self.origin_ns + key // 2 * self.width_ns)).add(b)
        self.bins = merged


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
        self._account = _Account(attach_ns)
        self._held: list[tuple[int, int]] = []  # (end, step) before the healthy pace
        self._hangs: deque[tuple[int, str | None]] = deque(maxlen=MAX_STALLS)  # since, phase

    # -- feeding ---------------------------------------------------------------------------

    def on_first_end(self, end_ns: int) -> None:
        self.first_end_ns = self.last_end_ns = end_ns

    def on_iteration(self, end_ns: int, step_ns: int, healthy_ns: float | None) -> None:
        """One measured iteration of the primary; ``healthy_ns``: the job's healthy step
        now (None before the fail-slow baseline formed: the steps wait for it)."""
        self.last_end_ns = end_ns
        if healthy_ns is not None:
            self.healthy_ns = healthy_ns
        if self.healthy_ns is None:
            self._held.append((end_ns, step_ns))
            if len(self._held) < EARLY_MAX:
                return
            # (a pace that never settles: the held steps' own median is the healthy one)
            self.healthy_ns = _median_step(self._held)
        if self._held:
            self._account.take_held(self._held, self.healthy_ns)
            self._held = []
        self._account.take(end_ns, step_ns, self.healthy_ns)

    def on_hang(self, record: dict[str, Any]) -> None:
        """A hang since ``last_iteration_mono_ns``: the stall that holds it is a data stall
        when its ranks were loading data (the record's ``phase``), else a hang."""
        self._hangs.append((record["last_iteration_mono_ns"], record.get("phase")))

    # -- the ledger --------------------------------------------------------------------------

    def summary(self, end_ns: int, fail_slow: Sequence[FailSlowEvent],
                stragglers: Sequence[StragglerEpisode], hung: bool,
                first_job_iteration: int | None = None, *, exited: bool = False,
                last_job_iteration: int | None = None) -> GoodputFigures:
        """final_statistics.goodput at ``end_ns``: the session's ledger, and with earlier
        sessions of the job (``previous``), the job's as ``job`` (``first_job_iteration``:
        the job's own number of this session's first iteration, to count those redone;
        ``last_job_iteration``: of its last, for a next session after a restart).
        ``exited``: the session ended as its ranks exited (the time after their last
        iteration was their end, not a stall: unobserved; a next session of the job
        counts it as the restart's)."""
        ledger, window_start, healthy_ns = self._session(end_ns, fail_slow, stragglers,
                                                         hung, exited)
        job = (self._job(ledger, window_start, first_job_iteration, healthy_ns).figures()
               if self.previous is not None else None)
        return GoodputFigures(
            **ledger._figures(),
            window_from=_window_from(window_start, self.attach_ns, self.process_start_ns),
            last_job_iteration=last_job_iteration, last_end_ns=self.last_end_ns, job=job)

    def _session(self, end_ns: int, fail_slow: Sequence[FailSlowEvent],
                 stragglers: Sequence[StragglerEpisode], hung: bool,
                 exited: bool) -> tuple[Ledger, int, float]:
        """The session's ledger, where its window starts, the healthy step it used."""
        ledger = Ledger(gpus=self.gpus)
        if self.first_end_ns is None:  # (no iteration seen: starting, or unseen; not known)
            ledger.unobserved_s = max(0, end_ns - self.attach_ns) / 1e9
            return ledger, self.attach_ns, 0.0
        account, healthy = self._account, self.healthy_ns
        if self._held:  # (the healthy pace not known yet: the held steps' median, for now)
            healthy = _median_step(self._held)
            account = _Account(self.attach_ns)
            account.take_held(self._held, healthy)
        healthy = healthy or 0.0  # (one end seen, no step: the pace not known)
        pace, stalls = account.pace, list(account.stalls)
        lost = ledger.lost_s
        # The lead, to the first end: the job starting (not iterating at the attach: its
        # first end came a stall's length or more after it, or, found by the node service
        # or run, its process is younger at the attach than the lead), else the iteration
        # that was running at the attach, not seen.
        lead = self.first_end_ns - self.attach_ns
        young = (not self.attach_only and self.process_start_ns is not None
                 and self.attach_ns - self.process_start_ns < lead)
        started = young or lead - healthy >= pace.stall_ns(healthy)
        start = self.window_start() if started else self.attach_ns
        productive_ns = 0.0
        unobserved_ns = 0.0
        if started:
            productive_ns = min(healthy, self.first_end_ns - start)
            lost["startup"] = (self.first_end_ns - start - productive_ns) / 1e9
        else:
            unobserved_ns += lead
        # The tail, from the last end: a stall when it has run that long (or the session
        # ended hung), else the iteration still running (or the ranks' end), not seen.
        last = self.last_end_ns or self.first_end_ns
        tail = max(0, end_ns - last)
        at_pace = pace.ns or healthy
        if tail and (hung or (not exited and tail - at_pace >= pace.stall_ns(at_pace))):
            stalls.append(_Stall(last, end_ns, int(tail - min(tail, at_pace))))
            unobserved_ns += min(tail, at_pace)
        else:
            unobserved_ns += tail
        self._book_stalls(stalls, started, lost)
        lost["hang"] += account.stalls_dropped_ns / 1e9
        productive_ns += _lay_over(account, fail_slow, stragglers, end_ns, lost)
        ledger.wall_s = max(0, end_ns - start - unobserved_ns) / 1e9
        ledger.unobserved_s = unobserved_ns / 1e9
        ledger.productive_s = productive_ns / 1e9
        # (what the bins do not hold: the rounding of their edges, into the rest)
        rest = ledger.wall_s - ledger.productive_s - sum(lost.values())
        if rest >= 0:
            lost["unexplained"] += rest
        else:
            ledger.productive_s = max(0.0, ledger.productive_s + rest)
        return ledger, start, healthy

    def _book_stalls(self, stalls: list[_Stall], started: bool, lost: dict[str, float]) -> None:
        """Each stall under its cause: data_stall when its hang record found the ranks
        loading data; a job seen from its start: its first, slow steps, its start-up."""
        for stall in stalls:
            data = any(stall.start_ns <= since < stall.end_ns
                       for since, phase in self._hangs if phase == "data_loading")
            cause = "startup" if started and stall.early else "data_stall" if data else "hang"
            lost[cause] += stall.lost_ns / 1e9

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

    def _job(self, session: Ledger, window_start: int, first: int | None,
             healthy_ns: float) -> Ledger:
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
        # others were stopped) was the restart's too: the earlier ledger could not tell
        # (unobserved: an iteration running; a ledger of before that was kept: unexplained).
        last_end = self.previous.get("last_end_mono_ns")
        if isinstance(last_end, int) and last_end <= end_ns:
            tail_s = (end_ns - last_end) / 1e9
            unseen_s = min(tail_s, job.unobserved_s)
            job.unobserved_s -= unseen_s
            job.wall_s += unseen_s
            rest_s = min(tail_s - unseen_s, job.lost_s["unexplained"])
            job.lost_s["unexplained"] -= rest_s
            here.lost_s["restart"] += unseen_s + rest_s
        last = self.previous.get("last_job_iteration")
        if isinstance(last, int) and first is not None and first <= last and healthy_ns:
            redone_s = min(here.productive_s, (last - first + 1) * healthy_ns / 1e9)
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


def _lay_over(account: _Account, fail_slow: Sequence[FailSlowEvent],
              stragglers: Sequence[StragglerEpisode], end_ns: int, lost: dict[str, float]
              ) -> float:
    """The episodes laid over the bins: each bin's excess over the healthy step to its
    straggler (its delay per step), its fail-slow episode (slowdown, or data_stall), or
    outside them, beyond the noise band, unexplained. The bins' productive time (ns)."""
    slow = [(a, z, "data_stall" if _top_phase(e) == "data_loading" else "slowdown")
            for a, z, e in episodes(fail_slow, end_ns)]
    productive_ns = 0.0
    for b in account.bins.values():
        b_end = b.start_ns + account.width_ns
        delay = max((e.delay_per_step_s * 1e9 for e in stragglers
                     if e.since_ns < b_end
                     and (e.until_ns or end_ns) >= b.start_ns), default=0.0)
        excess = max(0.0, float(b.excess_ns))
        straggling = min(excess, delay * b.iterations)
        lost["straggler"] += straggling / 1e9
        excess -= straggling
        episode = next((c for a, z, c in slow if a < b_end and z > b.start_ns), None)
        if episode is None:  # (outside every episode: beyond the noise only)
            excess = max(0.0, excess - b.band_ns())
        lost[episode or "unexplained"] += excess / 1e9
        productive_ns += b.step_ns - b.stall_ns - straggling - excess
    return productive_ns


def _median_step(steps: list[tuple[int, int]]) -> float:
    return float(statistics.median(s for _, s in steps))


def _top_phase(event: FailSlowEvent) -> str | None:
    """The phase that moved most in a fail-slow event (None: not known)."""
    return event.phases[0].phase if event.phases else None


def _window_from(start: int, attach_ns: int, process_start_ns: int | None
                 ) -> Literal["process_start", "attach", "previous_session"]:
    """``from``: what the window starts at."""
    if start == attach_ns:
        return "attach"
    return "process_start" if start == process_start_ns else "previous_session"
