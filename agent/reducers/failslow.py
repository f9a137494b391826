"""Fail-slow: a sustained shift of the job's step time, and its recovery.

Online change-point detection by CUSUM on block medians of the primary rank's step
time against a level that follows the healthy job (``FailSlowRule``):

- Settling: iterations in the first ``settle_s`` (30 s) after the agent attached are
  not looked at (the agent's own start, probes attaching and its CPU budget
  settling, moves the step time of a busy node).
- Blocks: the step times are grouped into blocks of B iterations, B = ``block_s``
  (2 s) of steps at the median of the first 10, clamped to 5..50; each block is
  reduced to its median m, so one slow iteration (a GC pause, a checkpoint) moves
  nothing.
- Level: healthy, the median of the last ``level_blocks`` (30, ~1 min) healthy
  blocks (at least ``baseline_blocks``, 5): a slow wander of the job is followed,
  not reported. Blocks of a shift that is building (a sum above d) are kept apart
  until it is confirmed or dropped, so that a change never becomes its own level.
- Noise: sigma = 1.4826 x the median of |ln(m_i / m_i-1)| over the last 30 pairs of
  successive healthy blocks, / sqrt(2) (a shift of the level moves one difference
  only). The smallest shift reported is d = max(ln(1 + threshold), z x sigma),
  threshold 5 %, z = 3: 5 % on a quiet node, more on a noisy one. No alarm before
  ``noise_blocks`` (10) differences are in.
- With x = ln(m / level) and k = d / 2, S+ = max(0, S+ + x - k) and
  S- = max(0, S- - x - k); a sum above 2 d raises an alarm. The change point is the
  first block of the run's last stretch of blocks nearer the new level (the median
  of the last ``confirm_blocks``, 3) than the old. The alarm is confirmed once the
  blocks since the change point cover ``confirm_s`` (15 s: sustained) and their
  median is at least d from the level; if the last blocks are back within d / 2,
  the sums restart.
- Healthy, a confirmed rise is a ``fail_slow`` event (the level before it is kept as
  the baseline); a confirmed fall is a new level (a job that sped up), no event.
  Slow, a fall back within d of the baseline (or below it) is a ``recovered`` event; a further
  rise is another ``fail_slow`` event; any other confirmed change moves the slow
  level.

At ~100 ms steps (20-iteration blocks), a 30 % rise is confirmed ~15-20 s after it
starts (once the first 30 s and ~15 blocks are past). The event names the time,
the before/after means, each rank's compute and wait before and after, the phases
whose time moved and the interval fields (memory, GPU utilization, power,
throttling) that changed. Phases and fields come from the iteration_logs entries
on either side of the change (since the previous event, until the next), filled in
by ``resolve`` once 3 entries with phases exist on each side: with stack samples in
bursts few entries have phases, so ``wants_samples`` asks the session to sample
continuously for up to ``boost_s`` (30 s) after a detection.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from perfmon.agent.reducers.ranks import MAD_TO_SIGMA, RankTimes

MAX_EVENTS = 500  # the most recent kept
# Interval entry fields that are the step itself, not the state around it.
_NOT_STATE = {"end_monotonic_ns", "iteration", "timestamp", "step_time_ms", "TFLOPS_per_GPU",
              "tokens_per_sec", "samples_per_sec", "kept_one_in", "phases", "ranks"}


@dataclass(frozen=True)
class FailSlowRule:
    threshold: float = 0.05
    block_s: float = 2.0
    min_block: int = 5
    max_block: int = 50
    baseline_blocks: int = 5
    level_blocks: int = 30
    noise_blocks: int = 10
    confirm_blocks: int = 3
    confirm_s: float = 15.0
    z: float = 3.0
    boost_s: float = 30.0
    settle_s: float = 30.0
    phase_entries: int = 3  # iteration_logs entries with phases needed on each side


class FailSlow:
    """Feed the primary's step times (``on_iteration``); events in ``events``."""

    def __init__(self, wall_time: Callable[[int], str], ranks: RankTimes | None = None,
                 rule: FailSlowRule | None = None, start_t_mono_ns: int = 0) -> None:
        self.rule = rule or FailSlowRule()
        # Iterations before this are not looked at: the agent's own start (probes
        # attaching, the CPU budget settling) moves the step time of a busy node.
        self.settled_ns = start_t_mono_ns + int(self.rule.settle_s * 1e9)
        self.wall_time = wall_time
        self.ranks = ranks
        self.events: list[dict[str, Any]] = []
        self.new_events: list[dict[str, Any]] = []  # for live lines
        self.block: int | None = None  # iterations per block, once known
        self._current: list[tuple[int, int]] = []  # (end, step) of the block being filled
        self._blocks: list[tuple[int, int, float]] = []  # (start, end, median step ns)
        self.baseline: float | None = None  # ns
        self.level: float | None = None  # the current level (baseline unless slow)
        self.slow = False
        self._up = self._down = 0.0
        self._up_from = self._down_from = 0  # index in _blocks of the change point
        # The last healthy blocks (their median is the level) and their x: the noise.
        self._healthy: deque[float] = deque(maxlen=self.rule.level_blocks)
        self._noise: deque[float] = deque(maxlen=self.rule.level_blocks)
        self._pending: list[float] = []  # block medians while a shift builds

    @property
    def shift(self) -> float:
        """d: the smallest shift reported (log units)."""
        floor = math.log1p(self.rule.threshold)
        if not self._noise:
            return floor
        # From successive blocks: a shift of the level moves one difference only.
        sigma = MAD_TO_SIGMA * statistics.median(abs(x) for x in self._noise) / math.sqrt(2)
        return max(floor, self.rule.z * sigma)

    def on_iteration(self, end_ns: int, step_ns: int) -> None:
        if end_ns - step_ns < self.settled_ns:
            return
        if self.block is None:  # sized on the median of the first 10 steps
            self._current.append((end_ns, step_ns))
            if len(self._current) < 10:
                return
            median = statistics.median(s for _, s in self._current)
            self.block = min(self.rule.max_block, max(
                self.rule.min_block, round(self.rule.block_s * 1e9 / max(median, 1))))
            pending, self._current = self._current, []
            for end, step in pending:
                self._add(end, step)
            return
        self._add(end_ns, step_ns)

    def _add(self, end_ns: int, step_ns: int) -> None:
        assert self.block is not None
        self._current.append((end_ns, step_ns))
        if len(self._current) < self.block:
            return
        block, self._current = self._current, []
        start = block[0][0] - block[0][1]
        self._blocks.append((start, block[-1][0], statistics.median(s for _, s in block)))
        # Blocks are small (one every ~2 s); keep what the change points need.
        if len(self._blocks) > 4096:
            drop = len(self._blocks) - 2048
            del self._blocks[:drop]
            self._up_from = max(0, self._up_from - drop)
            self._down_from = max(0, self._down_from - drop)
        self._on_block()

    def _on_block(self) -> None:
        rule = self.rule
        i = len(self._blocks) - 1
        m = self._blocks[i][2]
        if not self.slow:
            if len(self._healthy) < rule.baseline_blocks:
                self._healthy.append(m)
                return
            # Healthy, the level follows the job: the median of the last healthy blocks.
            self.baseline = self.level = statistics.median(self._healthy)
        assert self.level is not None and self.baseline is not None
        x = math.log(m / self.level)
        d = self.shift
        if i and not self.slow:
            self._noise.append(math.log(m / self._blocks[i - 1][2]))
        if len(self._noise) < rule.noise_blocks:  # the noise is not known yet: no alarm
            self._healthy.append(m)
            return
        if self._up == 0:
            self._up_from = i
        if self._down == 0:
            self._down_from = i
        self._up = max(0.0, self._up + x - d / 2)
        self._down = max(0.0, self._down - x - d / 2)
        if not self.slow:
            # Blocks of a shift that is building are kept apart, so that a change
            # never becomes the level it is measured against.
            self._pending.append(m)
            if max(self._up, self._down) <= d:
                self._settle_pending()
        for sign, alarm, run_from in ((1, self._up > 2 * d, self._up_from),
                                      (-1, self._down > 2 * d, self._down_from)):
            if not alarm or i - run_from + 1 < rule.confirm_blocks:
                continue
            # The change point: the first block of the run's last stretch of blocks
            # nearer the new level (the median of the last few) than the old one.
            guess = statistics.median(b[2] for b in self._blocks[-rule.confirm_blocks:])
            if sign * math.log(guess / self.level) < d / 2:
                break  # the last blocks are back: what built the sum has passed
            start = i
            while start > run_from and (abs(math.log(self._blocks[start - 1][2] / guess))
                                        < abs(math.log(self._blocks[start - 1][2]
                                                       / self.level))):
                start -= 1
            if self._blocks[i][1] - self._blocks[start][0] < rule.confirm_s * 1e9:
                continue  # not sustained (yet): the sums go on
            recent = [b[2] for b in self._blocks[start:]]
            after = statistics.median(recent)
            if sign * math.log(after / self.level) >= d:
                self._changed(start, after, d, recent)
                self._pending.clear()
            break
        else:
            return
        self._up = self._down = 0.0
        self._settle_pending()

    def _settle_pending(self) -> None:
        """The pending blocks were no change: into the level."""
        if not self.slow:
            self._healthy.extend(self._pending)
        self._pending.clear()

    def _changed(self, start: int, after: float, threshold: float, recent: list[float]
                 ) -> None:
        assert self.level is not None and self.baseline is not None
        before = self.level
        if after > before:  # slower (than the healthy level, or than the slow level)
            kind = "fail_slow"
        elif self.slow and math.log(after / self.baseline) < threshold:
            kind = "recovered"  # back within d of the baseline, or faster
        else:
            if not self.slow:  # faster: the healthy level starts again from here
                self._healthy.clear()
                self._healthy.extend(recent)
            self.level = after  # (slow: partly back, still slow at a new level)
            return
        change_ns, detected_ns = self._blocks[start][0], self._blocks[-1][1]
        before_from = self._blocks[max(0, start - 2 * self.rule.baseline_blocks)][0]
        event: dict[str, Any] = {
            "event": kind, "t_mono_ns": change_ns, "timestamp": self.wall_time(change_ns),
            "detected_mono_ns": detected_ns, "detected": self.wall_time(detected_ns),
            "before_step_time_ms": before / 1e6, "after_step_time_ms": after / 1e6,
            "change_pct": 100 * (after / before - 1),
            "baseline_step_time_ms": self.baseline / 1e6,
            "min_shift_pct": 100 * math.expm1(threshold),
            "_before_from_ns": before_from, "_settled_ns": self._blocks[start][1],
            "ranks": self._ranks(before_from, change_ns),
            "phases": None, "state": None,
        }
        self.events.append(event)
        if len(self.events) > MAX_EVENTS:
            del self.events[0]
        self.new_events.append(event)
        self.slow = kind == "fail_slow"
        self.level = after
        if not self.slow:  # recovered: healthy again, from the blocks just seen
            self._healthy.clear()
            self._healthy.extend(recent)

    def _ranks(self, before_from: int, change_ns: int) -> list[dict[str, Any]]:
        """Each rank's compute and wait before and after the change (its recent ends)."""
        if self.ranks is None:
            return []
        out = []
        for r in self.ranks.all():
            recent = r.recent
            before = [(s, w) for t, s, w in recent if before_from <= t - s and t <= change_ns]
            after = [(s, w) for t, s, w in recent if t - s >= change_ns]
            if not before or not after:
                continue

            def mean_ms(values: list[tuple[int, int]], compute: bool) -> float:
                return statistics.fmean((s - w) if compute else w for s, w in values) / 1e6

            out.append({"pid": r.pid, "rank": r.rank,
                        "compute_ms": [mean_ms(before, True), mean_ms(after, True)],
                        "wait_ms": [mean_ms(before, False), mean_ms(after, False)]})
        if out:
            rise = max(a[1] - a[0] for a in (o["compute_ms"] for o in out))
            for o in out:
                delta = o["compute_ms"][1] - o["compute_ms"][0]
                o["moved"] = abs(delta) >= 0.5 * abs(rise) and abs(delta) >= 0.5
        return out

    def resolve(self, entries: list[dict[str, Any]], final: bool) -> None:
        """Fill in the phases and interval fields that moved, from the iteration_logs
        entries on either side of each event: since the previous event up to the change,
        and from the first changed block's end up to the next event. Phases wait for
        entries with phases on both sides (until ``final``)."""
        for i, event in enumerate(self.events):
            if event["phases"] is not None:
                continue
            previous = self.events[i - 1]["t_mono_ns"] if i else 0
            nxt = self.events[i + 1]["t_mono_ns"] if i + 1 < len(self.events) else None
            before = [e for e in entries if previous <= e["end_monotonic_ns"] <= event["t_mono_ns"]]
            after = [e for e in entries if e["end_monotonic_ns"] > event["_settled_ns"]
                     and (nxt is None or e["end_monotonic_ns"] <= nxt)]
            if before and after:
                event["state"] = _moved_state(before, after)
            phased = [e for e in before if e.get("phases")], [e for e in after if e.get("phases")]
            # A few entries a side: one entry's phases may rest on a handful of samples.
            enough = min(map(len, phased)) >= self.rule.phase_entries
            if enough or (final and phased[0] and phased[1]):
                event["phases"] = _moved_phases(*phased, event)
            elif final:
                event["phases"] = []
                event["state"] = event["state"] if event["state"] is not None else {}

    def wants_samples(self, now_ns: int) -> bool:
        """Whether an event waits for stack samples past its change (for ``boost_s``)."""
        return any(e["phases"] is None and now_ns - e["detected_mono_ns"] < self.rule.boost_s * 1e9
                   for e in self.events[-2:])

    def summary(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in e.items() if not k.startswith("_")} for e in self.events]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _moved_phases(before: list[dict[str, Any]], after: list[dict[str, Any]],
                  event: dict[str, Any]) -> list[dict[str, Any]]:
    """Phases whose mean time per iteration moved by at least a quarter of the step's
    change (largest first)."""
    step_delta = event["after_step_time_ms"] - event["before_step_time_ms"]
    names = {p for e in before + after for p in (e.get("phases") or {})}
    moved = []
    for name in names:
        b = _mean([e["phases"][name]["ms"] for e in before if (e.get("phases") or {}).get(name)])
        a = _mean([e["phases"][name]["ms"] for e in after if (e.get("phases") or {}).get(name)])
        if a is None or b is None:
            continue
        if abs(a - b) >= 0.25 * abs(step_delta) and (a - b) * step_delta > 0:
            moved.append({"phase": name, "before_ms": b, "after_ms": a, "delta_ms": a - b})
    return sorted(moved, key=lambda m: -abs(m["delta_ms"]))


def _moved_state(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """Interval fields (memory, GPU utilization, power, throttle reasons) that changed:
    numbers by 10 % or more, throttle reasons that appeared or went."""
    out: dict[str, Any] = {}
    keys = {k for e in before + after for k in e if k not in _NOT_STATE}
    for key in sorted(keys):
        values = [e.get(key) for e in before], [e.get(key) for e in after]
        if all(isinstance(v, (int, float)) for v in values[0] + values[1] if v is not None):
            b = _mean([v for v in values[0] if v is not None])
            a = _mean([v for v in values[1] if v is not None])
            if a is not None and b is not None and abs(a - b) > 0.1 * max(abs(b), 1e-9):
                out[key] = [b, a]
        elif key == "gpu_throttle_reasons":
            b_set = {r for v in values[0] if v for r in v}
            a_set = {r for v in values[1] if v for r in v}
            if a_set != b_set:
                out[key] = [sorted(b_set), sorted(a_set)]
    return out
