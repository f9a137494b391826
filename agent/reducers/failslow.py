"""Fail-slow: a sustained shift of the job's step time, and its recovery.

Online change-point detection by CUSUM on block medians of the primary rank's step
time, against a level that follows the job and a baseline, its healthy pace
(``FailSlowRule``; docs/stragglers.md says the same):

- Blocks: the step times are grouped into blocks of ``block_s`` (2 s) of steps (5 to
  50 of them); each block is reduced to its median m, so one slow iteration (a GC
  pause, a checkpoint) moves nothing. Stalls (perfmon.agent.reducers.pace) are left
  out: the goodput ledger's hang, no shift of the pace, and never time that sustains
  one (the time a shift lasts is its blocks' steps').
- Warm-up: the first blocks are left out until ``settle_blocks`` (3) in a row lie
  within d of their median (or after ``settle_max_blocks``, 15): a job's first
  steps (compilation, caches, the agent's probes attaching) are no baseline, and a
  job slow from its first iteration is measured at its own pace. Those 3 blocks
  form the level and the baseline: ~6 s after the first iteration seen.
- Level: the median of the last ``level_blocks`` (30, ~1 min) blocks of the current
  pace. Blocks of a shift that is building are kept apart until both sums are back
  at 0 (or there are 30 of them), so that a change never becomes its own level;
  after a confirmed change the level starts again from the blocks since the change
  (10 s or more of them), and the sums go on at once.
  Baseline: the healthy level, following it down (a job that speeds up), never up.
- Noise: sigma of a block median, from the steps inside the blocks (1.4826 x their
  median absolute deviation / (1 - 1.3 / B) x 1.2533 / sqrt(B): the MAD of a few
  steps reads low; the median over the last 30 blocks) and, once 10 pairs of
  successive healthy blocks are in, from their differences (1.4826 x the median
  |ln(m_i / m_i-1)| / sqrt(2)), whichever is larger. The smallest shift reported:
  d = max(ln(1 + threshold), z x sigma), threshold 3 %, z = 3.
- With x = ln(m / level) and k = d / 2, S+ = max(0, S+ + x - k) and
  S- = max(0, S- - x - k); a sum above 2 d raises an alarm. The change point is the
  first block of the run's last stretch of blocks nearer the new level (the median
  of the last ``confirm_blocks``, 3) than the old. The alarm is confirmed once the
  blocks from the change point to the last one still nearer the new level cover
  ``sustain_s`` (10 s) for a shift of 2 d or more, 10 s x 2 d / shift for a smaller
  one (at most ``sustain_max_s``, 25 s), and the shift (the median of those blocks,
  the first left out) is at least max(threshold, d / 2), with the last block within
  max(d, shift) of it (else the job is still moving, e.g. a small drift met a large
  step: the next blocks say where it settles); if the last blocks are back within
  d / 4, the sums restart.
- Drift: healthy, when every block of the last 10 s is d or more above the
  baseline though the sums never confirmed a step (a creep), that is a
  ``fail_slow`` event too. Any rise whose last block at or below the baseline (or,
  after a recovery, within d / 4 of the pace it came back to) lies more than 20 s
  before its change point is marked ``drift`` and dated from there.
- Return: slow, every block of the last 10 s back within d of the baseline (their
  median nearer it than the level the last event found) is a ``recovered`` event
  whatever the sums say: an episode measured over a short spike, or a fall smaller
  than d, never stays open on a job back at its pace.
- Healthy, a confirmed rise is a ``fail_slow`` event (before: the level); a
  confirmed fall is a new pace (a job that sped up), no event. Slow, every confirmed
  change is an event, found as a rise is: a further rise is another ``fail_slow``; a
  fall back within d of the baseline (or below it), or one not every block since is d
  or more above, is ``recovered``; a fall to a level still d or more above the baseline,
  every block since too (a creep's evidence), but nearer it than the episode's level
  (more than half of the rise undone, in log terms) is ``recovered_partly``: the
  episode closes and the healthy pace starts again from the new level (a host a
  little busier than before), the event saying where the job runs against the old
  baseline (``vs_baseline_pct``); a smaller fall is ``eased``: still slow, the
  episode open at the lower level. ``EPISODE_CLOSES`` names the kinds that close an
  episode; ``episodes`` lays them out (the goodput ledger and the Prometheus gauge
  read them from there).

At 100-250 ms steps a rise of 10 % or more is confirmed ~10-13 s after it starts, a
5 % one within ~15-25 s (on a quiet job), as soon as the baseline has formed. The
event names the time, the before/after means, each rank's compute and wait before
and after, the phases whose time moved and the interval fields (memory, GPU
utilization, power, throttling) that changed. Phases and fields come from the
iteration_logs entries on either side of the change (since the previous event,
until the next), filled in by ``resolve`` once 3 entries with phases exist on each
side: with stack samples in bursts few entries have phases, so ``wants_samples``
asks the session to sample continuously for up to ``boost_s`` (30 s) after a
detection.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from perfmon.agent.reducers.pace import Pace
from perfmon.agent.reducers.ranks import MAD_TO_SIGMA, RankTimes
from perfmon.parsers.figures import (
    FailSlowEvent,
    FailSlowNow,
    IntervalFigures,
    PhaseShift,
    RankShift,
    mean,
)

MAX_EVENTS = 500  # the most recent kept
EVENT_KINDS = ("fail_slow", "eased", "recovered_partly", "recovered")
EPISODE_CLOSES = frozenset({"recovered", "recovered_partly"})
# A fail-slow episode is open when the last event is one of these.
EPISODE_OPEN = frozenset(EVENT_KINDS) - EPISODE_CLOSES
# The interval figures that are the state around the step (not the step itself), as the
# summary shows them: (field, its key there, the factor from SI to its unit there).
_STATE = tuple((f.name, f.metadata["key"], f.metadata["unit"].per_si)
               for f in dataclasses.fields(IntervalFigures) if f.name in {
                   "memory_bytes", "gpu_utilization", "gpu_power_w", "gpu_throttle_reasons",
                   "kernels_per_iter", "cpu_sync_wait_s", "nccl_calls_per_iter",
                   "nccl_bytes_per_iter"})


@dataclass(frozen=True)
class FailSlowRule:
    threshold: float = 0.03
    block_s: float = 2.0
    min_block: int = 5
    max_block: int = 50
    settle_blocks: int = 3  # blocks in a row within d of their median end the warm-up
    settle_max_blocks: int = 15  # ... or this many blocks (a job too noisy to agree)
    level_blocks: int = 30
    baseline_blocks: int = 300  # healthy blocks whose median is the baseline (~10 min)
    noise_blocks: int = 30  # successive healthy blocks whose differences give the noise
    noise_min: int = 10  # ... trusted from this many on (the noise inside blocks till then)
    confirm_blocks: int = 3
    sustain_s: float = 10.0  # a shift of 2 d or more is confirmed after this long
    sustain_max_s: float = 25.0  # ... a smaller one after up to this long
    z: float = 3.0
    boost_s: float = 30.0
    phase_entries: int = 3  # iteration_logs entries with phases needed on each side
    before_blocks: int = 10  # blocks before a change whose rows give each rank's before


class FailSlow:
    """Feed the primary's step times (``on_iteration``); events in ``events``."""

    def __init__(self, wall_time: Callable[[int], str], ranks: RankTimes | None = None,
                 rule: FailSlowRule | None = None) -> None:
        self.rule = rule or FailSlowRule()
        self.wall_time = wall_time
        self.ranks = ranks
        self.events: list[FailSlowEvent] = []
        # When each event's before starts and its change settled (its phases' sides).
        self._sides: list[tuple[int, int]] = []
        self.new_events: list[FailSlowEvent] = []  # for live lines
        self.warmup_until_ns: int | None = None  # the end of the blocks left out as warm-up
        self._current: list[tuple[int, int]] = []  # (end, step) of the block being filled
        self._current_ns = 0  # ... the time of its steps
        # (start, end, median step ns, its steps' time: a stall between them left out)
        self._blocks: list[tuple[int, int, float, int]] = []
        self._stall_rule = Pace()  # (stalls are left out of the blocks: no shift of the pace)
        self.baseline: float | None = None  # ns: the healthy pace
        self.level: float | None = None  # the current level (follows the job)
        self.slow = False
        self._episode_level = 0.0  # the level the last event put the job at (slow)
        self._came_back_to = 1.0  # ... healthy: where the last recovery found it (ns)
        self._up = self._down = 0.0
        self._up_from = self._down_from = 0  # index in _blocks of the change point
        self._at_baseline = 0  # index in _blocks of the last block near the baseline
        self._healthy: deque[float] = deque(maxlen=self.rule.baseline_blocks)
        # The last blocks of the current pace (their median is the level), and the
        # differences of successive healthy blocks.
        self._pace: deque[float] = deque(maxlen=self.rule.level_blocks)
        self._noise: deque[float] = deque(maxlen=self.rule.noise_blocks)
        self._within: deque[float] = deque(maxlen=self.rule.noise_blocks)  # sigma in blocks
        self._pending: list[float] = []  # block medians while a shift builds

    @property
    def shift(self) -> float:
        """d: the smallest shift reported (log units)."""
        floor = math.log1p(self.rule.threshold)
        # The noise of a block median: from the steps inside the blocks (known from
        # the first block), and from successive blocks once a few are in (a shift of
        # the level moves one difference only), whichever is larger.
        sigma = statistics.median(self._within) if self._within else 0.0
        if len(self._noise) >= self.rule.noise_min:
            sigma = max(sigma, MAD_TO_SIGMA * statistics.median(abs(x) for x in self._noise)
                        / math.sqrt(2))
        return max(floor, self.rule.z * sigma)

    def on_iteration(self, end_ns: int, step_ns: int) -> None:
        if self._stall_rule.take(step_ns)[1]:
            return  # a stall: no shift of the pace (the goodput ledger's hang)
        # Blocks by time (block_s of steps, min_block..max_block of them), so that a
        # block spans the same time whatever the pace, warm-up or not.
        current = self._current
        current.append((end_ns, step_ns))
        self._current_ns += step_ns
        if len(current) < self.rule.max_block and (
                len(current) < self.rule.min_block
                or self._current_ns < self.rule.block_s * 1e9):
            return
        block, self._current = current, []
        active_ns, self._current_ns = self._current_ns, 0
        start = block[0][0] - block[0][1]
        logs = [math.log(max(s, 1)) for _, s in block]
        centre = statistics.median(logs)
        # The spread of a median of B steps: 1.2533 sigma / sqrt(B) (normal steps), sigma
        # from the MAD of the block's steps, corrected for how low it reads on a few
        # (about their own median: 0.74 sigma at 5 steps, 0.85 at 8, 0.95 at 20:
        # 1 - 1.3 / B; long steps make small blocks).
        sigma = (MAD_TO_SIGMA * statistics.median(abs(x - centre) for x in logs)
                 / (1 - 1.3 / len(logs)))
        self._within.append(sigma * 1.2533 / math.sqrt(len(logs)))
        self._blocks.append((start, block[-1][0], math.exp(centre), active_ns))
        # Blocks are small (one every ~2 s); keep what the change points need.
        if len(self._blocks) > 4096:
            drop = len(self._blocks) - 2048
            del self._blocks[:drop]
            self._up_from = max(0, self._up_from - drop)
            self._down_from = max(0, self._down_from - drop)
            self._at_baseline = max(0, self._at_baseline - drop)
        self._on_block()

    def _settled(self) -> bool:
        """Whether the warm-up is over: the last blocks agree (within d, each as steady
        inside as the others: a block that mixes warm-up steps with paced ones spreads
        more than five times as much), or there have been settle_max_blocks. The
        blocks before them are left out."""
        rule = self.rule
        last = [b[2] for b in self._blocks[-rule.settle_blocks:]]
        if len(last) < rule.settle_blocks:
            return False
        centre = statistics.median(last)
        spreads = list(self._within)[-rule.settle_blocks:]
        if (max(abs(math.log(m / centre)) for m in last) > self.shift
                or max(spreads) > 5 * statistics.median(spreads)) \
                and len(self._blocks) < rule.settle_max_blocks:
            return False
        self.warmup_until_ns = self._blocks[-rule.settle_blocks][0]
        self._pace.extend(last)
        self._noise.extend(math.log(b / a) for a, b in itertools.pairwise(last))
        self._healthy.extend(last)
        self.baseline = self.level = statistics.median(self._pace)
        self._at_baseline = len(self._blocks) - 1
        return True

    def _on_block(self) -> None:
        i = len(self._blocks) - 1
        m = self._blocks[i][2]
        if self.baseline is None:
            self._settled()
            return
        # The level follows the job at its current pace, healthy or slow: the median of
        # the last blocks of that pace. Healthy, the baseline is the median of the last
        # ~10 minutes of healthy blocks: a creep stands out against it, and the job's
        # wander over minutes is no creep.
        self.level = statistics.median(self._pace)
        if not self.slow:
            self.baseline = statistics.median(self._healthy)
        x = math.log(m / self.level)
        d = self.shift
        if not self.slow:
            self._noise.append(math.log(m / self._blocks[i - 1][2]))
        # At the healthy pace, give or take: near the baseline, or near the pace the job
        # came back to (a recovery a little above the baseline).
        if m <= self.baseline or (
                not self.slow and abs(math.log(m / self._came_back_to)) < d / 4):
            self._at_baseline = i
        if self._up == 0:
            self._up_from = i
        if self._down == 0:
            self._down_from = i
        self._up = max(0.0, self._up + x - d / 2)
        self._down = max(0.0, self._down - x - d / 2)
        # Blocks of a shift that is building are kept apart, so that a change never
        # becomes the level it is measured against. They join the level once both sums
        # are back at 0, or once there are as many as the level holds (a new pace the
        # sums never confirmed: the baseline still sees it, _drift).
        self._pending.append(m)
        if self._up == self._down == 0 or len(self._pending) >= self.rule.level_blocks:
            self._settle_pending()
        if self._step_change(i, d) or self._drift(i, d) or self._returned(i, d):
            self._up = self._down = 0.0
            self._settle_pending()

    def _step_change(self, i: int, d: float) -> bool:
        """A confirmed step of the level (True: the sums start again)."""
        assert self.level is not None
        rule = self.rule
        for sign, alarm, run_from in ((1, self._up > 2 * d, self._up_from),
                                      (-1, self._down > 2 * d, self._down_from)):
            if not alarm or i - run_from + 1 < rule.confirm_blocks:
                continue
            # The change point: the first block of the run's last stretch of blocks
            # nearer the new level (the median of the last few) than the old one.
            guess = statistics.median(b[2] for b in self._blocks[-rule.confirm_blocks:])
            if sign * math.log(guess / self.level) < d / 4:
                return True  # the last blocks are back: what built the sum has passed
            start = i
            while start > run_from and (abs(math.log(self._blocks[start - 1][2] / guess))
                                        < abs(math.log(self._blocks[start - 1][2]
                                                       / self.level))):
                start -= 1
            recent = [b[2] for b in self._blocks[start:]]
            # (the first block may hold steps from before the change)
            if len(recent) > rule.confirm_blocks:
                recent = recent[1:]
            after = statistics.median(recent)
            size = abs(math.log(after / self.level))
            # Sustained: a shift of 2 d or more for sustain_s, a smaller one for longer,
            # from the change point to the end of the last block still shifted.
            need_s = min(rule.sustain_max_s, rule.sustain_s * max(1.0, 2 * d / max(size, 1e-9)))
            last = i  # (still shifted: nearer the new level than the old)
            while last > start and (abs(math.log(self._blocks[last][2] / after))
                                    > abs(math.log(self._blocks[last][2] / self.level))):
                last -= 1
            if self._active_ns(start, last) < need_s * 1e9:
                return False  # not sustained (yet): the sums go on
            # (the alarm is the evidence: the shift's own size need only come near d;
            # below that the sums go on, until its blocks join the level)
            if size < max(math.log1p(rule.threshold), d / 2):
                return False
            # (the last block far from the level found, beyond both d and the shift: the
            # job is still moving, a small drift met a large step; the next blocks say
            # where it settles)
            if abs(math.log(self._blocks[i][2] / after)) > max(d, size):
                return False
            self._changed(start, after, d, recent)
            self._pending.clear()
            return True
        return False

    def _drift(self, i: int, d: float) -> bool:
        """Healthy, a level that crept away from the baseline (each step too small for
        the sums, e.g. thermal creep): a fail_slow event (``drift``) dated from the last
        block at or below the baseline, once the last sustain_s of blocks are all d or
        more above it."""
        assert self.baseline is not None
        if self.slow or self._up > d:  # (a step that builds is the sums' to confirm)
            return False
        since = self._sustained_from(i)
        recent = [b[2] for b in self._blocks[since:i + 1]]
        if since == 0 or min(math.log(m / self.baseline) for m in recent) < d:
            return False
        start = min(self._at_baseline + 1, i)
        self.level = self.baseline
        self._changed(start, statistics.median(recent), d, recent, drift=True)
        self._pending.clear()
        return True

    def _sustained_from(self, i: int) -> int:
        """The first of the blocks up to ``i`` that hold the last sustain_s of steps
        (0: not that many yet)."""
        since = i
        while since > 0 and self._active_ns(since, i) < self.rule.sustain_s * 1e9:
            since -= 1
        return since

    def _returned(self, i: int, d: float) -> bool:
        """Slow, a job back at its healthy pace whatever the sums say (an episode whose
        level was measured over a short spike, a fall too small for the sums): every
        block of the last sustain_s within d of the baseline, their median nearer it
        than the level the last event found (the level itself follows the job down by
        steps smaller than d). A ``recovered`` event dated from the first of them."""
        assert self.baseline is not None and self.level is not None
        if not self.slow:
            return False
        since = self._sustained_from(i)
        recent = [b[2] for b in self._blocks[since:i + 1]]
        if since == 0 or max(math.log(m / self.baseline) for m in recent) >= d:
            return False
        after = statistics.median(recent)
        if math.log(after / self.baseline) >= math.log(self._episode_level / after):
            return False
        self._changed(since, after, d, recent)
        self._pending.clear()
        return True

    def _active_ns(self, first: int, last: int) -> int:
        """The time of the steps of blocks ``first`` to ``last`` (stalls left out: a
        shift is sustained by the job's steps, never by a stall between them)."""
        return sum(b[3] for b in self._blocks[first:last + 1])

    def _settle_pending(self) -> None:
        """The pending blocks were no change: into the level."""
        self._pace.extend(self._pending)
        if not self.slow:
            self._healthy.extend(self._pending)
        self._pending.clear()

    def _at_pace(self, level: float, blocks: list[float]) -> None:
        """A confirmed change: the level starts again from the blocks since it (10 s of
        them or more: the sums go on at once, so a change that follows within seconds,
        the end of a short slowdown, is measured from there)."""
        self.level = level
        self._pace.clear()
        self._pace.extend(blocks)
        if not self.slow:  # (at the healthy pace again: from here a creep would start)
            self._healthy.extend(blocks)
            self._at_baseline = len(self._blocks) - 1

    def _changed(self, start: int, after: float, threshold: float, recent: list[float],
                 drift: bool = False) -> None:
        assert self.level is not None and self.baseline is not None
        before = self.level
        above = math.log(after / self.baseline)  # (where the new level is: its excess)
        if after > before:  # slower (than the healthy level, or than the slow level)
            kind = "fail_slow"
        elif not self.slow:  # faster: the healthy pace starts again from here, no event
            self.baseline = after
            self._healthy.clear()
            self._at_pace(after, recent)
            return
        elif min(math.log(m / self.baseline) for m in recent) < threshold:
            # Back within d of the baseline (their median), or faster; or some of the
            # blocks since the fall are: a job still slower than its baseline is one whose
            # every block since is d or more above it (the evidence a creep needs, _drift).
            # On a node whose load comes and goes, a baseline of its first quiet seconds
            # is no healthy pace to fall short of.
            kind = "recovered"
        elif above < math.log(before / after):
            kind = "recovered_partly"  # nearer the baseline than the episode's level
        else:
            kind = "eased"  # still nearer the slow level: the episode goes on there
        change_ns, detected_ns = self._blocks[start][0], self._blocks[-1][1]
        if kind == "fail_slow" and not self.slow:
            # When the job last ran at its healthy pace: long before the change point,
            # the rise was a creep (a drift), dated from there.
            began_ns = self._blocks[min(self._at_baseline + 1, start)][0]
            drift = drift or change_ns - began_ns > 2 * self.rule.sustain_s * 1e9
            change_ns = began_ns if drift else change_ns
        before_from = self._blocks[max(0, start - self.rule.before_blocks)][0]
        event = FailSlowEvent(
            event=kind, t_ns=change_ns, timestamp=self.wall_time(change_ns),
            detected_ns=detected_ns, detected=self.wall_time(detected_ns),
            before_step_s=before / 1e9, after_step_s=after / 1e9, change=after / before - 1,
            baseline_step_s=self.baseline / 1e9, vs_baseline=math.expm1(above),
            min_shift=math.expm1(threshold), drift=drift,
            ranks=self._ranks(before_from, change_ns, rising=after > before))
        self.events.append(event)
        self._sides.append((before_from, self._blocks[start][1]))
        if len(self.events) > MAX_EVENTS:
            del self.events[0], self._sides[0]
        self.new_events.append(event)
        self.slow = kind in ("fail_slow", "eased")
        self._episode_level = self._came_back_to = after  # (where the last event put it)
        if kind == "recovered_partly":  # (the job's pace from here is its healthy one)
            self.baseline = after
            self._healthy.clear()
        self._at_pace(after, recent)

    def _ranks(self, before_from: int, change_ns: int, rising: bool,
               ) -> tuple[RankShift, ...]:
        """Each rank's compute and wait before and after the change (its recent ends)."""
        if self.ranks is None:
            return ()
        out = []
        for r in self.ranks.all():
            recent = r.recent
            before = [(s, w) for t, s, w in recent if before_from <= t - s and t <= change_ns]
            after = [(s, w) for t, s, w in recent if t - s >= change_ns]
            if not before or not after:
                continue

            def mean_s(values: list[tuple[int, int]], compute: bool) -> float:
                return statistics.fmean((s - w) if compute else w for s, w in values) / 1e9

            out.append(RankShift(r.pid, r.rank, (mean_s(before, True), mean_s(after, True)),
                                 (mean_s(before, False), mean_s(after, False)),
                                 stage=self.ranks.stage(r)))
        return mark_moved(out, rising)

    def resolve(self, entries: list[IntervalFigures], final: bool) -> None:
        """Fill in the phases and interval fields that moved, from the logged intervals on
        either side of each event: since the previous event up to the change, and from the
        first changed block's end up to the next event. Phases wait for intervals with
        phases on both sides (until ``final``)."""
        for i, event in enumerate(self.events):
            if event.phases is not None:
                continue
            previous = self.events[i - 1].t_ns if i else 0
            nxt = self.events[i + 1].t_ns if i + 1 < len(self.events) else None
            settled = self._sides[i][1]
            before = [e for e in entries if previous <= e.end_ns <= event.t_ns]
            after = [e for e in entries if e.end_ns > settled
                     and (nxt is None or e.end_ns <= nxt)]
            state = _moved_state(before, after) if before and after else event.state
            phased = [e for e in before if e.phases], [e for e in after if e.phases]
            # A few entries a side: one entry's phases may rest on a handful of samples.
            enough = min(map(len, phased)) >= self.rule.phase_entries
            phases = None
            if enough or (final and phased[0] and phased[1]):
                phases = _moved_phases(*phased, event)
            elif final:
                phases, state = (), state if state is not None else {}
            self.events[i] = replace(event, phases=phases, state=state)

    def wants_samples(self, now_ns: int) -> bool:
        """Whether an event waits for stack samples past its change (for ``boost_s``)."""
        return any(e.phases is None and now_ns - e.detected_ns < self.rule.boost_s * 1e9
                   for e in self.events[-2:])

    def now(self) -> FailSlowNow | None:
        """The episode open now (its last event's step over the healthy baseline, and the
        phase that moved most), or None."""
        if not self.events or self.events[-1].event not in EPISODE_OPEN:
            return None
        last = self.events[-1]
        base = last.baseline_step_s or last.before_step_s
        if not base:
            return None
        return FailSlowNow(last.after_step_s / base,
                           last.phases[0].phase if last.phases else "unknown")


def episodes(events: Iterable[FailSlowEvent], end_ns: int
             ) -> list[tuple[int, int, FailSlowEvent]]:
    """The fail-slow episodes in ``events`` (in time order): (from its first change, to
    the change that closed it or ``end_ns`` when still open, its first event)."""
    out = []
    opened: FailSlowEvent | None = None
    for e in events:
        if e.event == "fail_slow" and opened is None:
            opened = e
        elif e.event in EPISODE_CLOSES and opened is not None:
            out.append((opened.t_ns, e.t_ns, opened))
            opened = None
    if opened is not None:
        out.append((opened.t_ns, end_ns, opened))
    return out


def _moved_phases(before: list[IntervalFigures], after: list[IntervalFigures],
                  event: FailSlowEvent) -> tuple[PhaseShift, ...]:
    """Phases whose mean time per iteration moved by at least a quarter of the step's
    change (largest first)."""
    step_delta = event.after_step_s - event.before_step_s
    names = {p for e in before + after for p in (e.phases or {})}
    moved = []
    for name in names:
        b = mean([e.phases[name]["ms"] for e in before if e.phases and e.phases.get(name)])
        a = mean([e.phases[name]["ms"] for e in after if e.phases and e.phases.get(name)])
        if a is None or b is None:
            continue
        a, b = a / 1e3, b / 1e3
        if abs(a - b) >= 0.25 * abs(step_delta) and (a - b) * step_delta > 0:
            moved.append(PhaseShift(name, b, a, a - b))
    return tuple(sorted(moved, key=lambda m: -abs(m.delta_s)))


def _moved_state(before: list[IntervalFigures], after: list[IntervalFigures]
                 ) -> dict[str, Any]:
    """Interval figures (memory, GPU utilization, power, throttle reasons, CUDA activity)
    that changed, as the summary shows them: numbers by 10 % or more, throttle reasons
    that appeared or went."""
    out: dict[str, Any] = {}
    for name, key, per_si in _STATE:
        values = [getattr(e, name) for e in before], [getattr(e, name) for e in after]
        if name == "gpu_throttle_reasons":
            b_set = {r for v in values[0] if v for r in v}
            a_set = {r for v in values[1] if v for r in v}
            if a_set != b_set:
                out[key] = [sorted(b_set), sorted(a_set)]
            continue
        b = mean([v for v in values[0] if v is not None])
        a = mean([v for v in values[1] if v is not None])
        if a is not None and b is not None and abs(a - b) > 0.1 * max(abs(b), 1e-9):
            out[key] = [b * per_si, a * per_si]
    return dict(sorted(out.items()))


def mark_moved(shifts: list[RankShift], rising: bool) -> tuple[RankShift, ...]:
    """``moved``: the ranks whose compute changed the way the step did (up for a slowdown,
    down for a recovery) by at least half the largest such change and 0.5 ms. A rank whose
    compute went the other way did not move the step: on a loaded node a fast rank's
    compute fell 13 ms (its cores freed) as a slowed rank's rose 9 ms, and both were named."""
    sign = 1.0 if rising else -1.0
    toward = [sign * (o.compute_s[1] - o.compute_s[0]) for o in shifts]
    most = max(toward, default=0.0)
    return tuple(replace(o, moved=d > 0 and d >= 0.5 * most and d >= 0.5e-3)
                 for o, d in zip(shifts, toward, strict=True))
