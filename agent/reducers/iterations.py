"""The iteration clock: each iteration's step time and work, from the primary rank's
step rows (perfmon.agent.reducers.steps says which markers end an iteration), and the
job's own iteration numbering. The first end after attach only opens the window: the
partial iteration before it is not measured.
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

from perfmon.parsers.workload import Workload

# How an end was found, when it is exact: torch.optim's Optimizer.step marker
# ("uprobe"), or the first gradient read after backward passes ("grad_read",
# perfmon.agent.reducers.steps), or the backward passes per update those reads showed
# ("counted", checked again now and then); as exact as the user's count: every K backward
# passes ("backward", --microbatches). Every other estimator (py-spy's) is an estimate.
EXACT_ESTIMATORS = frozenset(("uprobe", "grad_read", "counted"))
DECLARED_ESTIMATORS = frozenset(("backward",))


@dataclass(frozen=True)
class Iteration:
    number: int  # 1 = the first iteration that ended after attach
    end_t_mono_ns: int
    step_time_ns: int
    microbatches: int | None
    samples: int | None
    tokens: int | None
    flops: float | None


class Totals:
    """Running sums over measured iterations; a sum turns None once a term is unknown."""

    def __init__(self) -> None:
        self.step_ns = 0
        self.samples: float | None = 0
        self.tokens: float | None = 0
        self.flops: float | None = 0

    def add(self, it: Iteration) -> None:
        self.step_ns += it.step_time_ns
        self.samples = None if self.samples is None or it.samples is None else (
            self.samples + it.samples)
        self.tokens = None if self.tokens is None or it.tokens is None else (
            self.tokens + it.tokens)
        self.flops = None if self.flops is None or it.flops is None else self.flops + it.flops

    def rates(self, world_size: int) -> tuple[float | None, float | None, float | None]:
        """(samples/s, tokens/s, model FLOP/s per GPU) over the summed time."""
        seconds = self.step_ns / 1e9
        if seconds <= 0:
            return None, None, None

        def per_s(total: float | None) -> float | None:
            return total / seconds if total is not None else None

        flops = per_s(self.flops)
        return per_s(self.samples), per_s(self.tokens), (
            flops / world_size if flops is not None else None)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class IterationClock:
    """Feeds on the primary rank's step rows and the job's counter reads.

    ``on_row`` returns the Iteration a row completed (or None). Whole-run
    state is compact (8 bytes an iteration) for week-long jobs.
    """

    def __init__(self, workload: Workload, primary_pid: int, start_t_mono_ns: int) -> None:
        self.workload = workload
        self.primary_pid = primary_pid
        self.start_t_mono_ns = start_t_mono_ns
        self.iterations_ended = 0
        self.last_end_t_mono_ns: int | None = None
        self.estimators: dict[str, int] = {}  # iteration ends by how they were found
        self.totals = Totals()
        self._step_ns = array("q")
        self._microbatches = array("q")
        self._recent_ends: deque[int] = deque(maxlen=1024)
        # Backward passes per update of the ends found by gradient reads: a count
        # that varies says a gradient was read between micro-batches (split updates).
        self._grad_read_micro: dict[int, int] = {}
        self.job = JobNumbering(self)

    def on_row(self, t_ns: int, micro: int | None, how: str) -> Iteration | None:
        """The iteration the primary rank's step row (perfmon.agent.reducers.steps) ended
        (``micro`` None: no backward() seen); None for the first, which only opens the
        window."""
        self.iterations_ended += 1
        self._recent_ends.append(t_ns)
        self.job.on_end(t_ns)
        previous_end, self.last_end_t_mono_ns = self.last_end_t_mono_ns, t_ns
        if previous_end is None:
            return None  # the partial iteration that was running at attach
        # How this end was found: uprobes (exact), or py-spy's estimators
        # (perfmon.parsers.sampled_iterations).
        self.estimators[how] = self.estimators.get(how, 0) + 1
        w = self.workload
        samples = w.samples(micro)
        tokens = samples * w.seq_length if samples and w.seq_length else None
        flops = samples * w.flops_per_sample if samples and w.flops_per_sample else None
        step_ns = t_ns - previous_end
        it = Iteration(self.iterations_ended, t_ns, step_ns, micro, samples, tokens, flops)
        self._step_ns.append(step_ns)
        if micro is not None:
            self._microbatches.append(micro)
            if how == "grad_read" and len(self._grad_read_micro) < 64:
                self._grad_read_micro[micro] = self._grad_read_micro.get(micro, 0) + 1
        self.totals.add(it)
        return it

    @property
    def kind(self) -> str | None:
        """exact (every measured end a marker or a gradient read), declared (some
        counted from --microbatches), estimated (some from stack samples), None (none
        measured)."""
        if not self.estimators:
            return None
        if any(how not in EXACT_ESTIMATORS | DECLARED_ESTIMATORS for how in self.estimators):
            return "estimated"
        return "declared" if DECLARED_ESTIMATORS & self.estimators.keys() else "exact"

    def quality(self) -> dict[str, int]:
        """The clock's own losses, as a source's counters (data_quality, source
        ``iterations``): derived from the rows, so a replay finds the same."""
        measured = self.measured
        usual = max(self._grad_read_micro, key=self._grad_read_micro.__getitem__,
                    default=None)
        return {
            "measured": measured,
            "none_measured": int(measured == 0),
            "ends_estimated": sum(n for how, n in self.estimators.items()
                                  if how not in EXACT_ESTIMATORS | DECLARED_ESTIMATORS),
            "microbatches_unknown": measured - len(self._microbatches),
            "microbatches_varied": sum(n for micro, n in self._grad_read_micro.items()
                                       if micro != usual),
            # (the Optimizer.step marker is the truth: where it alone ended iterations, a
            # counter that disagrees is no update counter (HF Trainer's micro-batch
            # `step`), not a miss)
            "counter_disagrees": (self.job.disagreement
                                  if self.estimators.keys() - {"uprobe"} else 0),
        }

    @property
    def measured(self) -> int:
        """Iterations with a step time (all but the partial one at attach)."""
        return len(self._step_ns)

    def step_times_ns(self, start: int) -> list[int]:
        """The step times of measured iterations ``start``, ``start + 1``, ... (0-based)."""
        return self._step_ns[start:].tolist()

    def count_at(self, t_ns: int) -> int:
        """Iterations ended at or before ``t_ns`` (among the last 1024 ends)."""
        return self.iterations_ended - sum(1 for t in self._recent_ends if t > t_ns)

    def last_end_before(self, t_ns: int) -> int:
        return max((t for t in self._recent_ends if t <= t_ns), default=0)

    def recent_median_step_ns(self) -> float | None:
        """Median of the last 101 step times (None before any)."""
        recent = sorted(self._step_ns[-101:])
        return float(recent[len(recent) // 2]) if recent else None

    def summary(self) -> dict[str, Any]:
        """The step times' statistics (perfmon.parsers.figures.Statistics' fields)."""
        steps_s = sorted(ns / 1e9 for ns in self._step_ns)
        return {
            "step_s": sum(steps_s) / len(steps_s) if steps_s else None,
            "p50_step_s": percentile(steps_s, 0.50),
            "p90_step_s": percentile(steps_s, 0.90),
            "p99_step_s": percentile(steps_s, 0.99),
            "min_step_s": steps_s[0] if steps_s else None,
            "max_step_s": steps_s[-1] if steps_s else None,
            "measured_iterations": len(steps_s),
            "iteration_estimator": (max(self.estimators, key=self.estimators.__getitem__)
                                    if self.estimators else None),
            "iteration_estimators": dict(self.estimators),
            "iteration_clock": self.kind,
            "microbatches_per_step": (
                int(statistics.median_low(self._microbatches)) if self._microbatches else None),
        }


class JobNumbering:
    """Turns reads of the job's counter (``job_iteration`` records) into the offset
    from our count to the job's own iteration number."""

    def __init__(self, clock: IterationClock) -> None:
        self.clock = clock
        self.variable: str | None = None
        self._reads: list[dict[str, Any]] = []
        self._offsets: list[int] = []  # exact reads late in a step
        self._early: list[int] = []  # exact reads early in a step
        self._bounds: list[tuple[int, int]] = []

    def on_read(self, record: dict[str, Any]) -> None:
        self._reads.append(record)
        self.variable = record["name"]

    def on_end(self, t_ns: int) -> None:
        if self._reads:
            self.resolve(t_ns)

    def resolve(self, until_ns: int | None) -> None:
        """Turn reads into offsets from our count.

        A read made between ``t_mono_ns`` and ``end_mono_ns`` is resolved once an
        iteration end after it has been seen (``until_ns``; None: now, at the
        end), so every end before it is counted. With no end inside the read's
        window the offset is exact; otherwise each read bounds it, and the
        bounds of all reads are intersected.
        """
        unresolved = []
        clock = self.clock
        for read in self._reads:
            if until_ns is not None and read["end_mono_ns"] >= until_ns:
                unresolved.append(read)
                continue
            before = clock.count_at(read["t_mono_ns"])
            after = clock.count_at(read["end_mono_ns"])
            if before == after:
                # Right after a step entry the job has not yet counted that step
                # (it increments after the optimizer returns): a read late in the
                # step is the one to trust.
                since = read["t_mono_ns"] - clock.last_end_before(read["t_mono_ns"])
                median = clock.recent_median_step_ns()
                late = median is None or since > median / 2
                (self._offsets if late else self._early).append(read["value"] - before)
            else:
                self._bounds.append((read["value"] - after, read["value"] - before))
        self._reads = unresolved

    @property
    def disagreement(self) -> int:
        """How far the job's own counter and our count drifted apart: how much the
        offsets of the reads (the exact ones, and the bounds of the others) fail to
        meet. 0 when they agree, as they do when every iteration end is found;
        a count that runs ahead of the job's (split updates) or behind it (missed ends)
        spreads them. A spread of one is forgiven: a read can race the job's increment.
        None measured: 0 (nothing to compare; that is a loss of its own)."""
        if self.clock.measured == 0:
            return 0
        exact = [*self._offsets, *self._early]  # (an early read is at most one off)
        lows = [*exact, *(lo for lo, _ in self._bounds)]
        highs = [*exact, *(hi for _, hi in self._bounds)]
        return max(0, max(lows) - min(highs) - 1) if lows else 0

    @property
    def offset(self) -> int | None:
        """Our iteration count plus this is the job's own number (None: not read).

        The most frequent exact offset of reads late in a step, else of reads
        early in one (which can race the job's increment), else the middle of the
        intersected bounds. iteration_logs entries take the offset known when the
        summary is written (Summarizer), so a later, better read renumbers them all.
        Never below 0: a job's count below ours since the attach is ours splitting its
        updates (counter_disagrees says so) or a counter from 0, and the job's iterations
        are numbered from 1.
        """
        found = self._best()
        return max(found, 0) if found is not None else None

    def _best(self) -> int | None:
        for offsets in (self._offsets, self._early):
            if offsets:
                return max(set(offsets), key=offsets.count)
        if self._bounds:
            lo = max(b[0] for b in self._bounds)
            hi = min(b[1] for b in self._bounds)
            return (lo + hi) // 2 if lo <= hi else self._bounds[-1][0]
        return None
