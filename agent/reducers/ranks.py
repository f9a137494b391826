"""Every rank's step, wait and compute, and the stragglers among them.

In a synchronous job every rank shows the same step time: a slow rank makes the
others wait in the collectives. So each rank's step is split into the time it was
blocked waiting (``wait``: inside c10d ``Work::wait`` or DDP's
``Reducer::finalize_backward``, plus the CUDA synchronising calls of its ``cuda``
step snapshots) and the rest (``compute = step - wait``). A straggler is the rank
whose compute stands out.

Iteration ends per rank follow the iteration clock's rule (an ``optimizer_step``
after a ``backward()``, every step when no backward was seen). The collective wait
of an iteration is the difference of the rank's ``waits`` totals at its two ends
(the probes add each thread's wait, nested calls once, when it returns; the thread
stepping the optimizer is in no wait, so a wait whose return was lost ends there).
A log without ``waits`` records (an older agent's) gives it from the
``wait_enter``/``wait_exit`` markers: the union over the rank's threads (a nested or
concurrent wait counts once), a wait open at an iteration end split there. Either
way the wait counted in an iteration is at most its step.

The straggler rule (``StragglerRule``), evaluated every ``every`` (10) iterations of
the primary rank on each rank's last ``window`` (50) iterations: with c_r the median
compute of rank r, ref the median of the other ranks' c and spread 1.4826 x their
median absolute deviation, rank r is *outlying* when

    c_r - ref > max(k * spread, min_share * median step, min_ms)

(k = 3, min_share = 10 %, min_ms = 1 ms). Outlying at ``hold`` (6) evaluations in a row
and for ``hold_s`` (10 s) makes it a straggler (an episode dated from the first of
them); not outlying at ``hold`` in a row closes the episode. The delay it imposes on the job is its
excess compute, c_r - ref, the median over the episode (its last 1000 evaluations).
The summary keeps the last 500 episodes. Ranks whose last end is
older than 10 median steps (exited, hung) are left out of the comparison. At ~100 ms
steps a straggler is named ~15 s after it starts (a 50-iteration window, then 10 s).
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAD_TO_SIGMA = 1.4826
MAX_EPISODES = 500  # the most recent kept (a week of a flapping rank stays bounded)


@dataclass(frozen=True)
class StragglerRule:
    k: float = 3.0
    min_share: float = 0.10
    min_ms: float = 1.0
    window: int = 50  # iterations of each rank compared
    every: int = 10  # primary iterations between evaluations
    hold: int = 6  # evaluations in a row to open or close an episode
    hold_s: float = 10.0  # ... and outlying for this long to open one


@dataclass
class _Rank:
    pid: int
    rank: int | None
    last_end: int | None = None
    backward_seen: bool = False
    backwards_since_end: int = 0
    depth: dict[int, int] = field(default_factory=dict)  # tid -> nested waits open
    open_threads: int = 0
    open_since: int = 0  # union of waits: since when some thread waits
    wait_pending_ns: int = 0  # wait in the iteration in progress
    cuda_sync_ns: int | None = None  # the last step snapshot's cumulative sync wait
    waits_ns: int | None = None  # the latest ``waits`` total (None: none seen, markers count)
    waits_at_end_ns: int | None = None  # ... at the last iteration end
    # (end, step, wait) of the last iterations; sums over all and since the last interval
    # (enough for the minute around a fail-slow change at 15 ms steps)
    recent: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=4096))
    n: int = 0
    step_ns: int = 0
    wait_ns: int = 0
    interval: list[int] = field(default_factory=lambda: [0, 0, 0])  # n, step, wait
    cpu: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=64))
    outlying: int = 0  # evaluations in a row (negative: not outlying)
    outlying_since: int = 0  # the first of them


def _median(values: list[int]) -> float:
    """statistics.median of a non-empty list, without its generality (hot: every
    evaluation takes four per rank)."""
    values.sort()
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _last(items: deque[tuple[int, int, int]], n: int) -> list[tuple[int, int, int]]:
    """The last ``n`` of a deque, without copying the rest."""
    return list(itertools.islice(reversed(items), n))


class RankTimes:
    """Feed markers, cuda snapshots and process samples of every rank."""

    def __init__(self, ranks: dict[int, int | None], primary_pid: int, start_t_mono_ns: int,
                 wall_time: Callable[[int], str], rule: StragglerRule | None = None) -> None:
        self.rule = rule or StragglerRule()
        self.primary_pid = primary_pid
        self.start_t_mono_ns = start_t_mono_ns
        self.wall_time = wall_time
        self._ranks = {pid: _Rank(pid, rank) for pid, rank in ranks.items()}
        self._primary_iterations = 0
        self.episodes: list[dict[str, Any]] = []  # stragglers, open and closed
        self._open: dict[int, dict[str, Any]] = {}  # pid -> its open episode
        self.new_events: list[dict[str, Any]] = []  # for live lines: opened/closed since read

    def _rank(self, pid: int) -> _Rank:
        r = self._ranks.get(pid)
        if r is None:
            r = self._ranks[pid] = _Rank(pid, None)
        return r

    # -- feeding -------------------------------------------------------------------------

    def on_marker(self, record: dict[str, Any]) -> None:
        t = record["t_mono_ns"]
        if t < self.start_t_mono_ns:
            return
        # (every marker of every rank comes here: no call for the usual case)
        r, kind = self._ranks.get(record["pid"]) or self._rank(record["pid"]), record["kind"]
        if kind in ("wait_enter", "wait_exit") and r.waits_ns is not None:
            return  # raw waits beside the totals (asked for): already in them
        if kind == "wait_enter":
            depth = r.depth.get(record["tid"], 0)
            r.depth[record["tid"]] = depth + 1
            if depth == 0:
                if r.open_threads == 0:
                    r.open_since = t
                r.open_threads += 1
        elif kind == "wait_exit":
            depth = r.depth.get(record["tid"], 0)
            if depth == 0:
                return  # entered before attach
            r.depth[record["tid"]] = depth - 1
            if depth == 1:
                self._thread_left_wait(r, t)
        elif kind == "backward_enter":
            r.backwards_since_end += 1
            r.backward_seen = True
        elif kind == "optimizer_step":
            # The thread stepping the optimizer is in no wait: one whose exit was lost
            # (a return probe attached just after the call began) ends here.
            if r.depth.get(record["tid"]):
                r.depth[record["tid"]] = 0
                self._thread_left_wait(r, t)
            if r.backward_seen and r.backwards_since_end == 0:
                return
            r.backwards_since_end = 0
            self._end(r, t)

    @staticmethod
    def _thread_left_wait(r: _Rank, t: int) -> None:
        r.open_threads -= 1
        if r.open_threads == 0:
            r.wait_pending_ns += t - r.open_since

    def on_waits(self, record: dict[str, Any]) -> None:
        """A rank's running wait total, logged just before its Optimizer.step marker."""
        r = self._rank(record["pid"])
        if r.waits_ns is None:  # from now on the totals count, not the markers
            r.depth.clear()
            r.open_threads = 0
        r.waits_ns = record["wait_ns"]

    def on_cuda(self, record: dict[str, Any]) -> None:
        if not record.get("at_step"):
            return
        r = self._rank(record["pid"])
        total = record["sync_wait_ns"]
        if r.cuda_sync_ns is not None and total >= r.cuda_sync_ns:
            r.wait_pending_ns += total - r.cuda_sync_ns
        r.cuda_sync_ns = total

    def on_process(self, record: dict[str, Any]) -> None:
        if record.get("cpu_ns") is not None and record.get("run_delay_ns") is not None:
            self._rank(record["pid"]).cpu.append(
                (record["t_mono_ns"], record["cpu_ns"], record["run_delay_ns"]))

    def _end(self, r: _Rank, t: int) -> None:
        if r.open_threads:  # a wait open across the end: split there
            r.wait_pending_ns += t - r.open_since
            r.open_since = t
        if r.waits_ns is not None:
            if r.waits_at_end_ns is not None and r.waits_ns >= r.waits_at_end_ns:
                r.wait_pending_ns += r.waits_ns - r.waits_at_end_ns
            r.waits_at_end_ns = r.waits_ns
        previous, r.last_end = r.last_end, t
        wait, r.wait_pending_ns = r.wait_pending_ns, 0
        if previous is None:
            return  # the partial iteration at attach
        step = t - previous
        wait = min(wait, step)
        r.recent.append((t, step, wait))
        r.n += 1
        r.step_ns += step
        r.wait_ns += wait
        r.interval[0] += 1
        r.interval[1] += step
        r.interval[2] += wait
        if r.pid == self.primary_pid:
            self._primary_iterations += 1
            if self._primary_iterations % self.rule.every == 0:
                self._evaluate(t)

    # -- stragglers ----------------------------------------------------------------------

    def _evaluate(self, now: int) -> None:
        rule = self.rule
        primary = self._ranks[self.primary_pid]
        median_step = _median([s for _, s, _ in _last(primary.recent, rule.window)])
        current: dict[int, tuple[float, float, float]] = {}  # pid -> compute, wait, step (ns)
        for r in self._ranks.values():
            if (len(r.recent) < rule.window // 2 or r.last_end is None
                    or now - r.last_end > 10 * median_step):
                continue
            last = _last(r.recent, rule.window)
            current[r.pid] = (_median([s - w for _, s, w in last]),
                              _median([w for _, _, w in last]),
                              _median([s for _, s, _ in last]))
        for pid, r in self._ranks.items():
            excess = self._excess(pid, current, median_step)
            if excess is None:
                r.outlying = min(r.outlying, 0) - 1
            else:
                if r.outlying <= 0:
                    r.outlying_since = now
                r.outlying = max(r.outlying, 0) + 1
            episode = self._open.get(pid)
            if (episode is None and r.outlying >= rule.hold
                    and now - r.outlying_since >= rule.hold_s * 1e9):
                self._open_episode(r, now, current)
            elif episode is not None and excess is not None:
                episode["_delays"].append(excess)
            elif episode is not None and r.outlying <= -rule.hold:
                self._close_episode(r, now)

    def _excess(self, pid: int, current: dict[int, tuple[float, float, float]],
                median_step: float) -> float | None:
        """The rank's excess compute (ns) when it is outlying, else None."""
        if pid not in current or len(current) < 2:
            return None
        others = [c for p, (c, _, _) in current.items() if p != pid]
        ref = statistics.median(others)
        spread = MAD_TO_SIGMA * statistics.median(abs(c - ref) for c in others)
        rule = self.rule
        excess = current[pid][0] - ref
        bar = max(rule.k * spread, rule.min_share * median_step, rule.min_ms * 1e6)
        return excess if excess > bar else None

    def _open_episode(self, r: _Rank, now: int, current: dict[int, tuple[float, float, float]]
                      ) -> None:
        # Since the first evaluation of the run that opened it.
        since = r.outlying_since
        compute, wait, step = current[r.pid]
        others = [v for p, v in current.items() if p != r.pid]
        episode: dict[str, Any] = {
            "pid": r.pid, "rank": r.rank,
            "since_mono_ns": since, "since": self.wall_time(since),
            "detected_mono_ns": now, "detected": self.wall_time(now),
            "until_mono_ns": None, "until": None,
            "compute_ms": compute / 1e6, "wait_ms": wait / 1e6, "step_ms": step / 1e6,
            "others_compute_ms": statistics.median(c for c, _, _ in others) / 1e6,
            "others_wait_ms": statistics.median(w for _, w, _ in others) / 1e6,
            "differs": self._differs(r.pid, list(current)),
            # The excess at each evaluation (the last 1000: bounded over long episodes).
            "_delays": deque([compute - statistics.median(c for c, _, _ in others)],
                             maxlen=1000),
        }
        self._open[r.pid] = episode
        self.episodes.append(episode)
        if len(self.episodes) > MAX_EPISODES:
            del self.episodes[0]
        self.new_events.append({"event": "straggler", **self._public(episode)})

    def _close_episode(self, r: _Rank, now: int) -> None:
        episode = self._open.pop(r.pid)
        episode["until_mono_ns"], episode["until"] = now, self.wall_time(now)
        self.new_events.append({"event": "straggler_ended", **self._public(episode)})

    def _differs(self, pid: int, pids: list[int]) -> dict[str, Any]:
        """What is different on the rank: its CPU use and the time its threads waited
        for a CPU (run queue), against the other ranks' median, over its samples."""
        rates = {p: self._cpu_rates(p) for p in pids}
        mine = rates.get(pid)
        others = [v for p, v in rates.items() if p != pid and v is not None]
        if mine is None or not others:
            return {}
        return {"cpu_cores": round(mine[0], 3),
                "others_cpu_cores": round(statistics.median(c for c, _ in others), 3),
                "run_queue_wait_share": round(mine[1], 3),
                "others_run_queue_wait_share": round(statistics.median(d for _, d in others), 3)}

    def _cpu_rates(self, pid: int) -> tuple[float, float] | None:
        """(CPU cores used, run-queue wait per second) over the last ~10 samples."""
        samples = list(self._ranks[pid].cpu)[-11:]
        if len(samples) < 2 or samples[-1][0] <= samples[0][0]:
            return None
        (t0, c0, d0), (t1, c1, d1) = samples[0], samples[-1]
        return (c1 - c0) / (t1 - t0), (d1 - d0) / (t1 - t0)

    @staticmethod
    def _public(episode: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in episode.items() if not k.startswith("_")}
        out["delay_ms_per_step"] = statistics.median(episode["_delays"]) / 1e6
        return out

    # -- reading ---------------------------------------------------------------------------

    def all(self) -> list[_Rank]:
        return list(self._ranks.values())

    @property
    def stragglers_now(self) -> set[int]:
        return set(self._open)

    def interval(self) -> list[dict[str, Any]]:
        """Each rank's means since the previous call (the log interval's ``ranks``)."""
        out = []
        for r in self._ranks.values():
            n, step, wait = r.interval
            r.interval = [0, 0, 0]
            if n:
                out.append(self._means(r, n, step, wait))
        return out

    def _means(self, r: _Rank, n: int, step: int, wait: int) -> dict[str, Any]:
        return {"pid": r.pid, "rank": r.rank, "iterations": n,
                "avg_step_time_ms": step / n / 1e6, "avg_wait_ms": wait / n / 1e6,
                "avg_compute_ms": (step - wait) / n / 1e6,
                "wait_share": wait / step if step else None,
                "straggler": r.pid in self._open}

    def summary(self) -> dict[int, dict[str, Any]]:
        """pid -> the whole run's means of the ranks that ended an iteration."""
        return {r.pid: self._means(r, r.n, r.step_ns, r.wait_ns)
                for r in self._ranks.values() if r.n}

    def stragglers(self) -> list[dict[str, Any]]:
        return [self._public(e) for e in self.episodes]
