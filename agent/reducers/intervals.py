"""Interval windows: every ``log_interval`` iterations, one iteration_logs entry.

An entry takes its memory and GPU figures when its last iteration ends, and is
complete when the stack samples covering it are in (stack sampling continuous;
in bursts, those of every py-spy window started before it ended) and the CUDA
snapshot at its end is in, or when it waited
PHASE_WAIT_NS of record time, or at the session's end; decided by record
contents alone, so a replay of the log decides the same. Beyond
``max_log_entries`` the older entries are thinned evenly (``kept_one_in``).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from perfmon.agent.reducers.cuda import CudaActivity
from perfmon.agent.reducers.iterations import Iteration, IterationClock, Totals
from perfmon.agent.reducers.phases import PhaseAccount
from perfmon.agent.reducers.pipeline import pipeline_figures
from perfmon.agent.reducers.ranks import RankTimes
from perfmon.agent.reducers.resources import Resources
from perfmon.parsers.figures import IntervalFigures
from perfmon.parsers.parallel_layout import ParallelLayout

# How long (in record time) an interval entry waits for the samples covering it.
PHASE_WAIT_NS = 5_000_000_000
DEFAULT_MAX_LOG_ENTRIES = 2000


class Intervals:
    """Groups iterations into windows and builds their entries from the other reducers."""

    def __init__(self, *, clock: IterationClock, phases: PhaseAccount, resources: Resources,
                 cuda: CudaActivity | None, log_interval: int, wait_for_phases: bool,
                 max_log_entries: int | None, wall_time: Any,
                 ranks: RankTimes | None = None, layout: ParallelLayout | None = None
                 ) -> None:
        self.clock, self.phases, self.resources, self.cuda = clock, phases, resources, cuda
        self.log_interval = log_interval
        self.wait_for_phases = wait_for_phases
        self.max_log_entries = max_log_entries
        self.wall_time = wall_time
        self.ranks = ranks  # multi-rank sessions: each rank's means per entry
        self.layout = layout  # the job's stated layout: its pipeline's stages per entry
        self.entries: list[IntervalFigures] = []  # iteration_logs
        self.log_stride = 1
        self._seq: list[int] = []  # interval number of each entry
        self._logged = 0
        self._current: list[Iteration] = []
        # Entries waiting for samples: (entry, start, end, iterations); ``waiting`` is
        # this list (changed in place only), which the dispatcher holds and reads for
        # every record.
        self._pending: list[tuple[dict[str, Any], int, int, int]] = []  # (fields so far, ...)
        self.waiting = self._pending

    def on_iteration(self, it: Iteration) -> None:
        self._current.append(it)
        if len(self._current) < self.log_interval:
            return
        its, self._current = self._current, []
        totals = Totals()
        for i in its:
            totals.add(i)
        samples_s, tokens_s, flops = totals.rates(self.clock.workload.world_size)
        end = its[-1].end_t_mono_ns
        peak = self.clock.workload.peak_tflops
        figures: dict[str, Any] = {
            "end_ns": end,
            "iteration": its[-1].number,
            "timestamp": self.wall_time(end),
            "step_s": totals.step_ns / len(its) / 1e9,
            "flops_per_gpu": flops,
            "tokens_per_s": tokens_s,
            "samples_per_s": samples_s,
            "mfu": flops / (peak * 1e12) if flops is not None and peak else None,
        }
        # Memory and GPU figures now: their samples are logged as they are taken.
        start = end - totals.step_ns
        figures.update(self.resources.interval(start, end))
        if self.ranks is not None:
            figures["ranks"] = ranks = self.ranks.interval(end)
            micro = [i.microbatches for i in its if i.microbatches]
            figures["pipeline"] = pipeline_figures(
                ranks, self.layout, statistics.median_low(micro) if micro else None)
        self.resources.prune(end)
        self._pending.append((figures, start, end, len(its)))

    def finalize(self, now_ns: int | None, final: bool) -> list[IntervalFigures]:
        """Entries whose samples are in (or that waited long enough, or ``final``)."""
        done = []
        while self._pending:
            figures, start, end, count = self._pending[0]
            waited = now_ns is not None and now_ns >= end + PHASE_WAIT_NS
            phases_in = ((not self.wait_for_phases or self.phases.watermark_ns >= end)
                         and not self.phases.samples_due(end))
            cuda_in = self.cuda is None or self.cuda.snapshot(end) is not None
            if not ((phases_in and cuda_in) or waited or final):
                break
            self._pending.pop(0)
            if self.cuda is not None:
                figures.update(self.cuda.window(start, end, count))
                self.cuda.prune(end)
            per_phase = self.phases.window_ns(start, end)
            self.phases.record(per_phase, count)
            self.phases.prune(end)
            entry = IntervalFigures(**figures, phases=PhaseAccount.breakdown(per_phase, count))
            self._append(entry)
            done.append(entry)
        return done

    def _append(self, entry: IntervalFigures) -> None:
        """Append to iteration_logs, thinning older entries evenly beyond max_log_entries.

        The newest half stays whole; in the older part one entry in ``log_stride``
        (by interval number) is kept, the stride doubling as the run goes on, so
        the older part always samples the run evenly.
        """
        self.entries.append(entry)
        self._seq.append(self._logged)
        self._logged += 1
        limit = self.max_log_entries
        if limit is None or len(self.entries) <= limit:
            return
        recent = max(1, limit // 2)
        while len(self.entries) > limit:
            old = len(self.entries) - recent
            keep = [i for i in range(old) if self._seq[i] % self.log_stride == 0]
            if len(keep) == old:
                self.log_stride *= 2
                continue
            keep += range(old, len(self.entries))
            self.entries = [self.entries[i] for i in keep]
            self._seq = [self._seq[i] for i in keep]
        for i in range(len(self.entries) - recent):
            if self.entries[i].kept_one_in != self.log_stride:  # (most are already)
                self.entries[i] = replace(self.entries[i], kept_one_in=self.log_stride)
