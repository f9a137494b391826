"""Every rank's step, wait and compute, and the stragglers among them.

In a synchronous job every rank shows the same step time: a slow rank makes the
others wait in the collectives. So each rank's step is split into the time it was
blocked waiting (``wait``: inside c10d ``Work::wait`` or DDP's
``Reducer::finalize_backward``, plus the CUDA synchronising calls of its ``cuda``
step snapshots) and the rest (``compute = step - wait``). A straggler is the rank
whose compute stands out.

Each rank's iterations come as step rows (perfmon.agent.reducers.steps: the same
rule of an iteration end for every rank, and the time blocked on collectives in
it), a block at a time: the step is the time from the rank's previous end, the wait
the row's plus the CUDA synchronising wait of its step snapshots up to its end, at
most the step. Each rank keeps its last HISTORY rows as arrays; evaluations and
interval means cut them at their own instant, so how rows are grouped into blocks
does not change what they find.

The straggler rule (``StragglerRule``), evaluated every ``every`` (10) iterations of
the primary rank on each rank's last ``window`` (40) iterations: with c_r the median
compute of rank r, ref the median of the other ranks' c and spread 1.4826 x their
median absolute deviation, rank r is *outlying* when

    c_r - ref > max(k * spread, min_share * median step, min_ms)

(k = 3, min_share = 10 %, min_ms = 1 ms). Outlying at ``hold`` (5) evaluations in a row
and for ``hold_s`` (5 s) makes it a straggler (an episode dated from the first of
them); not outlying at ``hold`` in a row closes the episode. The delay it imposes on the job is its
excess compute, c_r - ref, the median over the episode (its last 1000 evaluations).
The summary keeps the last 500 episodes. Ranks whose last end is
older than 10 median steps (exited, hung) are left out of the comparison. At ~100 ms
steps a straggler is named ~8 s after it starts (half the 40-iteration window for its
median to cross, then 5 s); the 10 % minimum effect and the 5 s keep a balanced job's
scheduling noise out (benchmarks/steady_false_positives.py).

A job whose layout has pipeline stages (perfmon.parsers.parallel_layout) compares each
rank with its own stage's ranks only (its data-parallel replicas): a stage's compute is
not another's, and the stages are compared as stages (perfmon.agent.reducers.pipeline).

When the wait probes are sampled (perfmon.agent.measure.wait_sampling) only rows whose
wait was probed have a compute: the window is then the probed rows among the last
``window``, or the last ``least`` (10) probed rows when fewer, and interval and run
means of wait and compute are over the probed rows (``waits_probed`` says how many).
"""

from __future__ import annotations

import functools
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from perfmon.parsers.figures import RankCoords, RankFigures, StragglerEpisode
from perfmon.parsers.step_rows import StepBlock

MAD_TO_SIGMA = 1.4826
MAX_EPISODES = 500  # the most recent kept (a week of a flapping rank stays bounded)
# The cross-host form: a spread over the hosts from this many on (fewer: none, and of
# two hosts the faster is the reference).
SPREAD_HOSTS = 3


@dataclass(frozen=True)
class StragglerRule:
    """The straggler rule, of ranks (RankTimes) and, in its cross-host form, of hosts
    (``across_hosts``: merge's slow host; docs/prometheus/rules.yml's PerfmonSlowHost
    is the same rule in PromQL, its thresholds these)."""

    k: float = 3.0
    min_share: float = 0.10
    min_ms: float = 1.0
    window: int = 40  # iterations of each rank compared
    least: int = 10  # ... their probed rows, at least (waits sampled: from further back)
    every: int = 10  # primary iterations between evaluations
    hold: int = 5  # evaluations in a row to open or close an episode
    hold_s: float = 5.0  # ... and outlying for this long to open one

    @dataclass(frozen=True)
    class Outlier:
        """The host that stands out, its median compute, the reference's, its excess,
        the bar it crossed and the spread (ms)."""

        host: str
        compute_ms: float
        reference_ms: float
        excess_ms: float
        bar_ms: float
        spread_ms: float

    def floor(self, step: float, ms: float = 1.0) -> float:
        """The least excess that counts: min_share of the step, at least min_ms (``ms``:
        a millisecond in the unit of ``step``)."""
        return max(self.min_share * step, self.min_ms * ms)

    def bar(self, spread: float, step: float, ms: float = 1.0) -> float:
        """The excess above which one is outlying: k x the spread, at least the floor."""
        return max(self.k * spread, self.floor(step, ms))

    def across_hosts(self, compute_ms: dict[str, float], step_ms: float
                     ) -> StragglerRule.Outlier | None:
        """The host whose median compute exceeds the reference host's (the median host;
        of two, the faster) by more than the bar, the spread 1.4826 x the hosts' median
        absolute excess (from SPREAD_HOSTS hosts on; else none) and the step the ranks'
        mean. None when no host does, or fewer than two are given."""
        if len(compute_ms) < 2:
            return None
        values = list(compute_ms.values())
        spread_over = len(values) >= SPREAD_HOSTS
        reference = statistics.median(values) if spread_over else min(values)
        excess = {h: v - reference for h, v in compute_ms.items()}
        spread = (MAD_TO_SIGMA * statistics.median(abs(e) for e in excess.values())
                  if spread_over else 0.0)
        bar = self.bar(spread, step_ms)
        host = max(excess, key=excess.__getitem__)
        if excess[host] <= bar:
            return None
        return self.Outlier(host, compute_ms[host], reference, excess[host], bar, spread)


HISTORY = 4096  # rows kept per rank (the minute around a fail-slow change at 15 ms steps)
CUDA_MATCH_NS = 1_000_000  # a step snapshot and the row of the same Optimizer.step


# A row's end, step, wait (0 where not probed), whether its wait was probed and its
# point-to-point part, then the running sums of step, wait, probed rows, their steps and
# the point-to-point wait.
(_END, _STEP, _WAIT, _PROBED, _P2P,
 _SUM_STEP, _SUM_WAIT, _SUM_PROBED, _SUM_PROBED_STEP, _SUM_P2P) = range(10)
_COLUMNS = 10
_SUMS = 5


def _history() -> np.ndarray:
    return np.zeros((0, _COLUMNS), dtype=np.int64)  # (grown as rows come: a log may name 100,000)


@dataclass
class _Rank:
    pid: int
    rank: int | None
    coords: RankCoords | None = None  # its place in the job's layout (stated)
    last_end: int | None = None
    cuda_sync_ns: int | None = None  # the last step snapshot's cumulative sync wait
    cuda: list[tuple[int, int]] = field(default_factory=list)  # (t, sync wait) not in a row
    # The last rows (``kept`` of them; the history's columns, _END to _SUM_PROBED_STEP),
    # after ``dropped`` trimmed from the front, whose sums ``base`` holds. (One array,
    # grown to 2 x HISTORY: a block's rows in one copy.)
    history: np.ndarray = field(default_factory=_history)
    kept: int = 0
    dropped: int = 0
    base: tuple[int, ...] = (0,) * _SUMS
    cut: tuple[int, ...] = (0,) * (1 + _SUMS)  # totals_at the last interval
    cpu: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=64))
    outlying: int = 0  # evaluations in a row (negative: not outlying)
    outlying_since: int = 0  # the first of them

    @property
    def n(self) -> int:
        return self.dropped + self.kept

    @property
    def ends(self) -> np.ndarray:
        return self.history[:self.kept, _END]

    @property
    def steps(self) -> np.ndarray:
        return self.history[:self.kept, _STEP]

    @property
    def waits(self) -> np.ndarray:
        return self.history[:self.kept, _WAIT]

    def totals_at(self, i: int) -> tuple[int, ...]:
        """(rows, step, wait, probed rows, their step, point-to-point wait) summed over
        the rows before history index ``i``."""
        if i == 0:
            return (self.dropped, *self.base)
        return (self.dropped + i, *self.history[i - 1, _SUM_STEP:].tolist())

    def at(self, t: int) -> int:
        """History index just past the rows that ended at or before ``t``."""
        k = self.kept
        if k and self.history[k - 1, _END] <= t:  # (usually: asked at the latest row)
            return k
        return int(self.ends.searchsorted(t, "right"))

    @property
    def recent(self) -> list[tuple[int, int, int]]:
        """(end, step, wait) of the rows kept whose wait was probed."""
        rows = self.history[:self.kept]
        return [tuple(row) for row in rows[rows[:, _PROBED] == 1, :_PROBED].tolist()]

    def rows_between(self, start_ns: int, end_ns: int) -> list[tuple[int, int, int | None]]:
        """(end, step, wait; None where not probed) of the rows kept that ended between
        the two instants."""
        rows = self.history[self.at(start_ns - 1):self.at(end_ns), :_P2P].tolist()
        return [(end, step, wait if probed else None) for end, step, wait, probed in rows]

    def probed_window(self, i: int, n: int, least: int) -> np.ndarray:
        """The (step, wait) of the probed rows among the last ``n`` before history index
        ``i`` (all of them when every wait is probed), or of the last ``least`` probed
        rows when fewer."""
        lo = max(0, i - n)
        probed = self.totals_at(i)[3] - self.totals_at(lo)[3]
        if probed == i - lo:
            return self.history[lo:i, _STEP:_PROBED]
        rows = np.flatnonzero(self.history[:i, _PROBED])[-max(least, probed):]
        return self.history[rows, _STEP:_PROBED]

    def add(self, rows: np.ndarray) -> None:
        """Keep rows of all the history's columns (their running sums counted on from
        this rank's: RankTimes.on_rows)."""
        k = len(rows)
        if self.kept + k > len(self.history) < 2 * HISTORY:
            grown = np.zeros((min(2 * HISTORY, max(64, 2 * (self.kept + k))), _COLUMNS),
                             np.int64)
            grown[:self.kept] = self.history[:self.kept]
            self.history = grown
        if self.kept + k > len(self.history):  # keep the last HISTORY (or this block)
            keep = max(0, min(self.kept, HISTORY, len(self.history) - k))
            drop = self.kept - keep
            if drop:
                self.base = tuple(self.history[drop - 1, _SUM_STEP:].tolist())
            if k > len(self.history):
                self.history = np.zeros((k, _COLUMNS), dtype=np.int64)
            else:
                self.history[:keep] = self.history[drop:self.kept]
            self.dropped, self.kept = self.dropped + drop, keep
        self.history[self.kept:self.kept + k] = rows
        self.kept += k


def _median(values: list[int]) -> float:
    """statistics.median of a non-empty list, without its generality (hot)."""
    values.sort()
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _middle(a: np.ndarray) -> np.ndarray:
    """The medians along the second axis (numpy's median less its overhead: hot)."""
    a = np.sort(a, axis=1)
    n = a.shape[1]
    return (a[:, (n - 1) // 2] + a[:, n // 2]) / 2


@functools.lru_cache(maxsize=64)
def _others(n: int) -> np.ndarray:
    """Row i: the indices of 0..n-1 but i (each rank's others)."""
    return np.array([[j for j in range(n) if j != i] for i in range(n)], dtype=np.intp)


class _Episode:
    """A straggler episode as it goes: its record, and the rank's excess compute (ns) at
    each evaluation (the last 1000: bounded over long episodes), whose median is the delay
    it imposes on the job."""

    def __init__(self, record: StragglerEpisode, excess_ns: float) -> None:
        self.record = record
        self.delays: deque[float] = deque([excess_ns], maxlen=1000)

    def public(self) -> StragglerEpisode:
        return replace(self.record, delay_per_step_s=statistics.median(self.delays) / 1e9)


class RankTimes:
    """Feed step rows, cuda snapshots and process samples of every rank."""

    def __init__(self, ranks: dict[int, int | None], primary_pid: int, start_t_mono_ns: int,
                 wall_time: Callable[[int], str], rule: StragglerRule | None = None, *,
                 coords: dict[int, RankCoords] | None = None, staged: bool = False) -> None:
        """``coords``: pid -> its coordinates in the job's stated layout; ``staged``: the
        layout has pipeline stages, and ranks are compared with their own stage's only
        (a stage's compute is not another's: docs/pipeline.md)."""
        self.rule = rule or StragglerRule()
        self.primary_pid = primary_pid
        self.start_t_mono_ns = start_t_mono_ns
        self.wall_time = wall_time
        self._coords = coords or {}
        self._staged = staged
        self._ranks = {pid: _Rank(pid, rank, self._coords.get(pid))
                       for pid, rank in ranks.items()}
        self._primary_iterations = 0
        self.episodes: list[_Episode] = []  # stragglers, open and closed
        self._open: dict[int, _Episode] = {}  # pid -> its open episode
        self.new_events: list[StragglerEpisode] = []  # for live lines: opened/closed since read

    def _rank(self, pid: int) -> _Rank:
        r = self._ranks.get(pid)
        if r is None:
            r = self._ranks[pid] = _Rank(pid, None, self._coords.get(pid))
        return r

    # -- feeding -------------------------------------------------------------------------

    def on_rows(self, block: StepBlock) -> None:
        """Every rank's rows of a ``steps`` block (grouped by rank, the running sums of
        all ranks in one cumulative sum: this runs for every rank-iteration of a
        replayed week)."""
        order = np.argsort(block.pid, kind="stable")
        pids = block.pid[order]
        ends, waits, p2p = block.end_ns[order], block.wait_ns[order], block.p2p_wait_ns[order]
        probed = (block.waits[order] >= 0).astype(np.int64)
        starts = np.flatnonzero(np.concatenate(([True], pids[1:] != pids[:-1])))
        previous = np.concatenate((ends[:1], ends[:-1]))
        bounds = [*starts.tolist(), len(pids)]
        ranks, firsts, sums = [], [], []
        for a, b, pid in zip(bounds, bounds[1:], pids[starts].tolist(), strict=False):
            r = self._ranks.get(pid) or self._rank(pid)
            ranks.append(r)
            if r.cuda:
                waits[a:b] += self._cuda_waits(r, ends[a:b])
            # (the partial iteration at attach: its first row, a step of 0, not kept)
            previous[a] = ends[a] if r.last_end is None else r.last_end
            firsts.append(a + 1 if r.last_end is None else a)
            if r.last_end is None:
                probed[a] = 0  # (so it adds nothing to the sums)
            sums.append(r.totals_at(r.kept)[1:])
        # (a row that came late counts as a step of 0)
        steps = np.maximum(ends - previous, 0)
        # (an unprobed row's wait is unknown: its CUDA sync wait alone is not kept either)
        rows = np.empty((len(pids), _COLUMNS), dtype=np.int64)
        rows[:, _END], rows[:, _STEP], rows[:, _PROBED] = ends, steps, probed
        rows[:, _WAIT] = np.minimum(waits, steps) * probed
        rows[:, _P2P] = np.minimum(p2p, rows[:, _WAIT])
        rows[:, _SUM_PROBED_STEP] = steps * probed
        # Each rank's running sums: one cumulative sum, less what came before the rank's
        # first row, plus the rank's own sums so far.
        summed = rows[:, _SUM_STEP:]
        np.cumsum(rows[:, [_STEP, _WAIT, _PROBED, _SUM_PROBED_STEP, _P2P]], axis=0,
                  out=summed)
        before = np.concatenate((np.zeros((1, _SUMS), np.int64), summed[starts[1:] - 1]))
        summed += np.repeat(np.array(sums, dtype=np.int64) - before, np.diff(bounds), axis=0)
        for first, b, r in zip(firsts, bounds[1:], ranks, strict=True):
            r.last_end = max(int(ends[b - 1]), r.last_end or 0)
            if first < b:
                r.add(rows[first:b])

    @staticmethod
    def _cuda_waits(r: _Rank, ends: np.ndarray) -> np.ndarray:
        """The CUDA sync wait of each row: its step snapshots' up to its end."""
        extra = np.zeros(len(ends), dtype=np.int64)
        bounds = ends + CUDA_MATCH_NS
        left = []
        for t, ns in r.cuda:
            i = int(bounds.searchsorted(t, "left"))
            if i < len(ends):
                extra[i] += ns
            else:
                left.append((t, ns))
        r.cuda = left
        return extra

    def on_cuda(self, record: dict[str, Any]) -> None:
        if not record.get("at_step"):
            return
        r = self._rank(record["pid"])
        total = record["sync_wait_ns"]
        if r.cuda_sync_ns is not None and total >= r.cuda_sync_ns:
            r.cuda.append((record["t_mono_ns"], total - r.cuda_sync_ns))
            del r.cuda[:-64]  # (a rank whose rows stopped)
        r.cuda_sync_ns = total

    def on_process(self, record: dict[str, Any]) -> None:
        if record.get("cpu_ns") is not None and record.get("run_delay_ns") is not None:
            self._rank(record["pid"]).cpu.append(
                (record["t_mono_ns"], record["cpu_ns"], record["run_delay_ns"]))

    def on_primary_iteration(self, t: int) -> None:
        """The primary rank ended an iteration at ``t`` (its rows are in)."""
        self._primary_iterations += 1
        if self._primary_iterations % self.rule.every == 0:
            self._evaluate(t)

    # -- stragglers ----------------------------------------------------------------------

    def _evaluate(self, now: int) -> None:
        rule = self.rule
        primary = self._ranks[self.primary_pid]
        i = primary.at(now)
        if i == 0:
            return
        median_step = _median(primary.steps[max(0, i - rule.window):i].tolist())
        ranks, windows = [], []
        for r in self._ranks.values():
            i = r.at(now)
            if i == 0 or r.dropped + i < rule.window // 2:
                continue
            last = r.history[i - 1].tolist()
            if last[_SUM_PROBED] < rule.least or now - last[_END] > 10 * median_step:
                continue
            ranks.append(r)
            windows.append(r.probed_window(i, rule.window, rule.least))
        current = self._medians(ranks, windows)
        excess: dict[int, float] = {}
        for peers in self._peer_groups(ranks):
            excess.update(self._excess({p: current[p] for p in peers}, median_step))
        for pid, r in self._ranks.items():
            e = excess.get(pid)
            if e is None:
                r.outlying = min(r.outlying, 0) - 1
            else:
                if r.outlying <= 0:
                    r.outlying_since = now
                r.outlying = max(r.outlying, 0) + 1
            episode = self._open.get(pid)
            if (episode is None and r.outlying >= rule.hold
                    and now - r.outlying_since >= rule.hold_s * 1e9):
                self._open_episode(r, now, current)
            elif episode is not None and e is not None:
                episode.delays.append(e)
            elif episode is not None and r.outlying <= -rule.hold:
                self._close_episode(r, now)

    @staticmethod
    def _medians(ranks: list[_Rank], windows: list[np.ndarray]
                 ) -> dict[int, tuple[float, float, float]]:
        """pid -> the median compute, wait and step (ns) of its rows in its window."""
        if not windows:
            return {}
        if len({len(w) for w in windows}) == 1:  # (usually: one call for all)
            rows = np.stack(windows)  # (rank, row, (step, wait))
            n = rows.shape[1]
            out = np.empty((len(windows), 3, n), dtype=np.int64)
            out[:, 0] = rows[:, :, 0] - rows[:, :, 1]
            out[:, 1], out[:, 2] = rows[:, :, 1], rows[:, :, 0]
            med = _middle(out.reshape(-1, n)).reshape(len(windows), 3).tolist()
        else:
            med = [_middle(np.stack((w[:, 0] - w[:, 1], w[:, 1], w[:, 0]))).tolist()
                   for w in windows]
        return {r.pid: (m[0], m[1], m[2]) for r, m in zip(ranks, med, strict=True)}

    def _peer_groups(self, ranks: list[_Rank]) -> list[list[int]]:
        """The pids compared with each other: all, or each pipeline stage's (staged)."""
        if not self._staged:
            return [[r.pid for r in ranks]]
        groups: dict[int | None, list[int]] = {}
        for r in ranks:
            groups.setdefault(r.coords.pp if r.coords is not None else None, []).append(r.pid)
        return list(groups.values())

    def stage(self, r: _Rank) -> int | None:
        """The rank's pipeline stage (None: the layout has none, or the rank no place)."""
        return r.coords.pp if self._staged and r.coords is not None else None

    def _excess(self, current: dict[int, tuple[float, float, float]],
                median_step: float) -> dict[int, float]:
        """pid -> its excess compute (ns), for the ranks outlying now."""
        if len(current) < 2:
            return {}
        pids = list(current)
        compute = np.array([current[p][0] for p in pids])
        others = compute[_others(len(pids))]
        ref = _middle(others)
        spread = MAD_TO_SIGMA * _middle(np.abs(others - ref[:, None]))
        rule = self.rule
        excess = compute - ref
        bar = np.maximum(rule.k * spread, rule.floor(median_step, ms=1e6))
        return {pids[j]: float(excess[j]) for j in np.flatnonzero(excess > bar)}

    def _open_episode(self, r: _Rank, now: int, current: dict[int, tuple[float, float, float]]
                      ) -> None:
        # Since the first evaluation of the run that opened it.
        since = r.outlying_since
        compute, wait, step = current[r.pid]
        stage = self.stage(r)
        peers = [p for p in current if self.stage(self._ranks[p]) == stage]
        others = [v for p, v in current.items() if p != r.pid and p in peers]
        others_compute = statistics.median(c for c, _, _ in others)
        episode = _Episode(StragglerEpisode(
            pid=r.pid, rank=r.rank, since_ns=since, since=self.wall_time(since),
            detected_ns=now, detected=self.wall_time(now), compute_s=compute / 1e9,
            wait_s=wait / 1e9, step_s=step / 1e9, others_compute_s=others_compute / 1e9,
            others_wait_s=statistics.median(w for _, w, _ in others) / 1e9,
            differs=self._differs(r.pid, peers), stage=stage), compute - others_compute)
        self._open[r.pid] = episode
        self.episodes.append(episode)
        if len(self.episodes) > MAX_EPISODES:
            del self.episodes[0]
        self.new_events.append(episode.public())

    def _close_episode(self, r: _Rank, now: int) -> None:
        episode = self._open.pop(r.pid)
        episode.record = replace(episode.record, until_ns=now, until=self.wall_time(now))
        self.new_events.append(episode.public())

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

    # -- reading ---------------------------------------------------------------------------

    def all(self) -> list[_Rank]:
        return list(self._ranks.values())

    def interval(self, until: int) -> tuple[RankFigures, ...]:
        """Each rank's means over its rows since the previous call, up to ``until``
        (the log interval's ``ranks``)."""
        out = []
        for r in self._ranks.values():
            totals = r.totals_at(r.at(until))
            since = tuple(a - b for a, b in zip(totals, r.cut, strict=True))
            r.cut = totals
            if since[0]:
                out.append(self._means(r, *since))
        return tuple(out)

    def _means(self, r: _Rank, *totals: int) -> RankFigures:
        """The means of totals_at's rows; wait and compute over the probed of them."""
        n, step, wait, probed, probed_step, p2p = totals
        return RankFigures(
            pid=r.pid, rank=r.rank, iterations=n, step_s=step / n / 1e9,
            wait_s=wait / probed / 1e9 if probed else None,
            p2p_wait_s=p2p / probed / 1e9 if probed else None,
            compute_s=(probed_step - wait) / probed / 1e9 if probed else None,
            wait_share=wait / probed_step if probed_step else None,
            waits_probed=probed if probed < n else None, straggler=r.pid in self._open,
            coords=r.coords)

    def summary(self) -> dict[int, RankFigures]:
        """pid -> the whole run's means of the ranks that ended an iteration."""
        return {r.pid: self._means(r, *r.totals_at(r.kept))
                for r in self._ranks.values() if r.n}

    def without_waits(self) -> int:
        """The ranks with ``rule.least`` probed rows or more, none of them with a wait."""
        return sum(1 for r in self._ranks.values()
                   if r.n and (t := r.totals_at(r.kept))[3] >= self.rule.least and t[2] == 0)

    def stragglers(self) -> list[StragglerEpisode]:
        return [e.public() for e in self.episodes]
