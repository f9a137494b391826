"""From event-log records to the typed figures (perfmon.parsers.figures): one small
reducer per family of numbers, and a dispatcher keyed by record type
(steps.RecordDispatch).

The Summarizer is a pure function of the record stream: the live session feeds
it each record as it logs it (its step rows as the blocks themselves), and
``perfmon-agent summarize`` feeds it the same records read back from the log, so both
give the same figures: IntervalFigures as log intervals complete, and Statistics
(``statistics()``) whenever asked. Adding a figure means one field of a figures record
and the reducer that fills it (docs/architecture.md, "Adding a figure").

- steps.StepRows: markers -> one row per rank and iteration end (older logs; the live
  session logs the rows)
- iterations.IterationClock: the primary's rows -> iterations, step times, the job's numbering
- intervals.Intervals: the log intervals (iteration_logs, and their thinning)
- phases.PhaseAccount: where each iteration's time goes
- resources.Resources: memory and GPU series, GPU events
- cuda.CudaActivity: CUDA/NCCL per iteration
- quality.DataQuality, quality.Hangs, quality.Coarsening: what sources missed; hangs;
  what of the log was made coarser
- exits.Exits: how each rank ended, and the job's cause
- ranks.RankTimes: every rank's step, wait and compute; stragglers
- failslow.FailSlow: sustained shifts of the step time, and recoveries
- goodput.Goodput: where the session's (and the job's) GPU-hours went
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from perfmon.agent.reducers.cuda import CudaActivity
from perfmon.agent.reducers.exits import Exits
from perfmon.agent.reducers.failslow import FailSlow
from perfmon.agent.reducers.goodput import Goodput
from perfmon.agent.reducers.intervals import DEFAULT_MAX_LOG_ENTRIES, Intervals
from perfmon.agent.reducers.iterations import IterationClock
from perfmon.agent.reducers.phases import PhaseAccount
from perfmon.agent.reducers.pipeline import pipeline_figures
from perfmon.agent.reducers.quality import Coarsening, DataQuality, Hangs
from perfmon.agent.reducers.ranks import RankTimes
from perfmon.agent.reducers.resources import Resources
from perfmon.agent.reducers.steps import RecordDispatch
from perfmon.parsers.events import BY_TYPE
from perfmon.parsers.figures import (
    FailSlowEvent,
    IntervalFigures,
    RankFigures,
    Statistics,
    StragglerEpisode,
)
from perfmon.parsers.figures import Goodput as GoodputFigures
from perfmon.parsers.parallel_layout import ParallelLayout
from perfmon.parsers.step_rows import StepBlock
from perfmon.parsers.workload import Workload

__all__ = ["DEFAULT_MAX_LOG_ENTRIES", "Summarizer", "rank_map"]


def rank_map(facts: dict[str, Any]) -> dict[int, int | None]:
    """pid -> rank of a session's targets (from session_info's pids and ranks)."""
    pids, ranks = facts.get("pids") or [facts.get("primary_pid")], facts.get("ranks") or []
    return {pid: ranks[i] if i < len(ranks) else None for i, pid in enumerate(pids)
            if isinstance(pid, int)}


# Sessions that ended with their ranks (they exited, or moved to other processes): the
# time after the last iteration was their end, not a stall (goodput).
ENDED_WITH_THE_RANKS = frozenset({"target_exited", "command_exited", "ranks_changed"})


class Summarizer:
    """Feed records (``feed``); read the iteration logs and the final statistics.

    Made from a session's facts (``from_facts``) by the live session and by replay
    alike: the same facts give the same reducers, so live and replayed summaries agree.
    """

    @classmethod
    def from_facts(cls, facts: dict[str, Any]) -> Summarizer:
        """A fresh summarizer for the session that ``facts`` (session_info at start,
        as the session_start record holds them) describe."""
        return cls(
            Workload.from_dict(facts["workload"]),
            facts["primary_pid"],
            facts["attach_monotonic_ns"],
            datetime.fromisoformat(facts["start_time"]).timestamp(),
            facts["log_interval"],
            stack_sampling=bool(facts.get("stack_sampling", False)),
            phases_continuous=facts.get("stack_sampling_mode") != "bursts",
            cuda_counters=bool((facts.get("cuda") or {}).get("available", False)),
            max_log_entries=facts.get("iteration_logs_max_entries"),
            ranks=rank_map(facts),
            step_rows=bool(facts.get("step_rows")),
            process_start_ns=facts.get("process_start_monotonic_ns"),
            previous=facts.get("job_before"),
            # (the goodput window starts at the attach; older logs say nothing: as before)
            attach_only=facts.get("started_by") == "attach",
            layout=ParallelLayout.from_facts(facts.get("layout")),
        )

    def __init__(self, workload: Workload, primary_pid: int, start_t_mono_ns: int,
                 start_wall_s: float, log_interval: int = 10, *, stack_sampling: bool = False,
                 phases_continuous: bool = True, cuda_counters: bool = False,
                 max_log_entries: int | None = DEFAULT_MAX_LOG_ENTRIES,
                 ranks: dict[int, int | None] | None = None,
                 step_rows: bool = False, process_start_ns: int | None = None,
                 previous: dict[str, Any] | None = None, attach_only: bool = False,
                 layout: ParallelLayout | None = None) -> None:
        self.workload = workload
        self._rank_of = ranks or {}
        self.layout = layout
        coords = {pid: c for pid, rank in self._rank_of.items()
                  if layout is not None and (c := layout.coords(rank)) is not None}
        self.start_t_mono_ns = start_t_mono_ns
        self.start_wall_s = start_wall_s
        self.end_t_mono_ns: int | None = None
        self.end_reason: str | None = None
        self.lost_events = 0
        self.phases = PhaseAccount(bursts=stack_sampling and not phases_continuous)
        self.clock = IterationClock(workload, primary_pid, start_t_mono_ns)
        self.resources = Resources(self.wall_time)
        self.cuda = CudaActivity(primary_pid) if cuda_counters else None
        self.quality = DataQuality()
        self.hangs = Hangs(self.wall_time)
        self.coarsening = Coarsening(self.wall_time, frozenset(BY_TYPE))
        self.exits = Exits(self.wall_time)
        self.ranks = RankTimes(ranks or {primary_pid: None}, primary_pid, start_t_mono_ns,
                               self.wall_time, coords=coords,
                               staged=layout is not None and layout.pp > 1)
        self.failslow = FailSlow(self.wall_time, self.ranks)
        self.goodput = Goodput(start_t_mono_ns, process_start_ns, len(ranks or [primary_pid]),
                               previous, attach_only=attach_only)
        self._latest_ns = start_t_mono_ns  # the latest record's time: "now" for the ledger
        self._told = 0  # measured iterations whose step times take_step_times_s gave
        self.intervals = Intervals(
            clock=self.clock, phases=self.phases, resources=self.resources, cuda=self.cuda,
            log_interval=log_interval, max_log_entries=max_log_entries,
            # Entries wait until the samples cover them only when sampling is
            # continuous; in bursts most intervals have none to wait for (they wait
            # for a window started before they ended: PhaseAccount.samples_due).
            wait_for_phases=stack_sampling and phases_continuous, wall_time=self.wall_time,
            ranks=self.ranks if ranks and len(ranks) > 1 else None, layout=layout)
        self._waiting = self.intervals.waiting  # entries waiting for later records
        self._primary = primary = primary_pid
        phase_feed = self.phases.feed_phase
        self._dispatch = RecordDispatch(start_t_mono_ns, step_rows, {
            "phase": lambda r: phase_feed(r) if r["pid"] == primary else None,
            "stack_window": lambda r: self.phases.on_window(r) if r["pid"] == primary else None,
            "process": self._on_process,
            "gpu": self.resources.on_gpu,
            "xid": self.resources.on_gpu_event,
            "ecc": self.resources.on_gpu_event,
            "job_iteration": self.clock.job.on_read,
            "hang": self._on_hang,
            "hang_recovered": self.hangs.on_recovered,
            "quality": self._on_quality,
            "rank_exit": self.exits.on_exit,
            "coarsened": self._on_coarsened,
            "session_end": self._on_end,
            "cuda": self._on_cuda,
        }, self._on_block)

    # -- feeding ---------------------------------------------------------------------

    def feed(self, record: dict[str, Any]) -> list[IntervalFigures]:
        """Take one record (as the log holds it); return the log intervals it completed."""
        kind, t_ns = record["type"], record["t_mono_ns"]
        self._latest_ns = max(self._latest_ns, t_ns)
        self._dispatch.feed(record)
        if not self._waiting and kind != "session_end":  # (the list itself: every record)
            return []
        return self._completed(t_ns, kind == "session_end")

    def feed_rows(self, t_mono_ns: int, block: StepBlock) -> list[IntervalFigures]:
        """Take a block of step rows (the live session's, as it logs them as a ``steps``
        record at ``t_mono_ns``); return the log intervals it completed."""
        self._latest_ns = max(self._latest_ns, t_mono_ns)
        self._on_block(block)
        return self._completed(t_mono_ns, False)

    def _completed(self, t_mono_ns: int, final: bool) -> list[IntervalFigures]:
        """The log intervals complete at ``t_mono_ns`` (``final``: the session's end)."""
        if not (self._waiting or final):  # (the list itself: this runs for every record)
            return []
        done = self.intervals.finalize(t_mono_ns, final)
        if done or final:
            self.failslow.resolve(self.intervals.entries, final)
        return self._numbered(done)

    def _numbered(self, entries: list[IntervalFigures]) -> list[IntervalFigures]:
        """Intervals as the job numbers its iterations, with the best offset known now:
        they are kept with our own count, as later reads of the job's counter may
        correct the offset."""
        offset = self.clock.job.offset
        return [replace(e, iteration=e.iteration + offset) for e in entries] if offset else (
            entries)

    def _on_block(self, block: StepBlock) -> None:
        self.ranks.on_rows(block)
        mine = block.pid == self._primary
        if not mine.any():
            return
        hows = block.hows
        for end, micro, how, backward in zip(
                block.end_ns[mine].tolist(), block.micro[mine].tolist(),
                block.how[mine].tolist(), block.backward_ns[mine].tolist(), strict=True):
            if micro >= 0:  # (backward() probed)
                self.phases.add_backward(end, backward)
            it = self.clock.on_row(end, micro if micro >= 0 else None, hows[how])
            if it is not None:
                self.ranks.on_primary_iteration(end)
                self.intervals.on_iteration(it)
                self.failslow.on_iteration(end, it.step_time_ns)
                self.goodput.on_iteration(end, it.step_time_ns, self.failslow.baseline)
            elif self.clock.iterations_ended == 1:
                self.goodput.on_first_end(end)

    def _on_coarsened(self, record: dict[str, Any]) -> None:
        self.coarsening.on_coarsened(record)
        if record["dropped"].get("phase"):
            self.phases.unsampled_until_ns = max(self.phases.unsampled_until_ns,
                                                 record["until_mono_ns"])

    def _on_process(self, record: dict[str, Any]) -> None:
        self.resources.on_process(record)
        self.ranks.on_process(record)

    def _on_cuda(self, record: dict[str, Any]) -> None:
        self.ranks.on_cuda(record)
        if self.cuda is not None:
            self.cuda.on_snapshot(record)

    def take_step_times_s(self) -> list[float]:
        """The step times (s) of the iterations measured since the last call."""
        clock, told = self.clock, self._told
        if clock.measured <= told:
            return []
        self._told = clock.measured
        return [ns / 1e9 for ns in clock.step_times_ns(told)]

    def wants_samples(self, now_ns: int) -> bool:
        """Whether a fail-slow event waits for stack samples to tell which phase moved."""
        return self.failslow.wants_samples(now_ns)

    def take_events(self) -> list[StragglerEpisode | FailSlowEvent]:
        """Straggler episodes opened or closed and fail-slow events since the last call
        (for live lines and incidents)."""
        events: list[StragglerEpisode | FailSlowEvent] = [
            *self.ranks.new_events, *self.failslow.new_events]
        self.ranks.new_events, self.failslow.new_events = [], []
        return events

    def _on_hang(self, record: dict[str, Any]) -> None:
        self.hangs.on_hang(record)
        self.goodput.on_hang(record)

    def _on_quality(self, record: dict[str, Any]) -> None:
        self.quality.on_quality(record)
        self.lost_events = sum(c.get("events_dropped", 0)
                               for c in self.quality.sources.values())

    def _on_end(self, record: dict[str, Any]) -> None:
        self.end_t_mono_ns, self.end_reason = record["t_mono_ns"], record["reason"]
        self.clock.job.resolve(None)

    # -- reading -----------------------------------------------------------------------

    @property
    def intervals_logged(self) -> list[IntervalFigures]:
        """The log intervals kept (``iteration_logs``), numbered as the job numbers them."""
        self._dispatch.take_rows()
        return self._numbered(self.intervals.entries)

    @property
    def iterations_ended(self) -> int:
        self._dispatch.take_rows()
        return self.clock.iterations_ended

    @property
    def last_end_t_mono_ns(self) -> int | None:
        self._dispatch.take_rows()
        return self.clock.last_end_t_mono_ns

    def recent_median_step_ns(self) -> float | None:
        self._dispatch.take_rows()
        return self.clock.recent_median_step_ns()

    def wall_time(self, t_mono_ns: int) -> str:
        """ISO 8601 local time with offset of a CLOCK_MONOTONIC instant."""
        wall = self.start_wall_s + (t_mono_ns - self.start_t_mono_ns) / 1e9
        return datetime.fromtimestamp(wall, timezone.utc).astimezone().isoformat()

    def session_fields(self) -> dict[str, Any]:
        """What the records add to session_info."""
        self._dispatch.take_rows()
        fields: dict[str, Any] = {
            "end_time": (self.wall_time(self.end_t_mono_ns)
                         if self.end_t_mono_ns is not None else None),
            "detach_monotonic_ns": self.end_t_mono_ns,
            "end_reason": self.end_reason,
            "total_iterations": self.clock.iterations_ended,
            "hung": self.hangs.hung,
            "iteration_logs_kept_one_in": self.intervals.log_stride,
            "exit": self.exits.summary(),
            "event_log_coarsened": self.coarsening.summary(),
        }
        if self.clock.job.offset is not None:
            fields["iteration_numbering"] = "job_counter"
            fields["iteration_counter"] = self.clock.job.variable
        return fields

    def _goodput(self) -> GoodputFigures:
        offset = self.clock.job.offset
        # (the job's own numbers of its first and last iterations: a next session, after a
        # restart, counts the iterations redone from the last)
        exited = self.end_reason in ENDED_WITH_THE_RANKS
        # (a job that stopped iterating and then exited with status 0 was ending: its
        # interpreter's exit can take many seconds on a busy node, long enough for a hang
        # record; the time after its last iteration is its end, not a stall)
        return self.goodput.summary(
            self.end_t_mono_ns or self._latest_ns, self.failslow.events,
            self.ranks.stragglers(), self.hangs.hung and not (exited and self.exits.clean),
            1 + offset if offset is not None else None,
            exited=exited,
            last_job_iteration=(self.clock.iterations_ended + offset
                                if offset is not None else None))

    def statistics(self) -> Statistics:
        """The session's figures so far."""
        self._dispatch.take_rows()
        samples_s, tokens_s, flops = self.clock.totals.rates(self.workload.world_size)
        w = self.workload
        peak = w.peak_tflops * 1e12 if w.peak_tflops else None
        hardware = (flops * w.hardware_flops_per_sample / w.flops_per_sample
                    if flops is not None and w.hardware_flops_per_sample
                    and w.flops_per_sample else None)
        derived = {"iterations": self.clock.quality()}
        if self.workload.world_size > 1:  # (a distributed job: its ranks wait on each other)
            derived["waits"] = {"ranks_without_waits": self.ranks.without_waits()}
        if self.goodput.previous is not None:  # (a restart: the iterations redone counted?)
            known = (self.clock.job.offset is not None
                     and self.goodput.previous.get("last_job_iteration") is not None)
            derived["goodput"] = {"restart_redone_unknown": 0 if known else 1}
        quality, losses = self.quality.summary(derived)
        resources = self.resources.summary()
        cuda = self.cuda.summary() if self.cuda is not None else {}
        clock = self.clock.summary()
        ranks = self._ranks()
        return Statistics(
            flops_per_gpu=flops, tokens_per_s=tokens_s, samples_per_s=samples_s,
            mfu=flops / peak if flops is not None and peak else None,
            hardware_flops_per_gpu=hardware, lost_events=self.lost_events,
            **clock, **resources, **cuda, ranks=ranks,
            pipeline=pipeline_figures(ranks, self.layout, clock["microbatches_per_step"]),
            phases=PhaseAccount.breakdown(self.phases.total_ns, self.phases.total_iterations),
            phases_source=self.phases.source,
            # (the iterations the breakdown rests on: with bursts, those sampled)
            phases_iterations=self.phases.total_iterations if self.phases.source else None,
            hangs=tuple(self.hangs.hangs), stragglers=tuple(self.ranks.stragglers()),
            fail_slow=tuple(self.failslow.events), goodput=self._goodput(),
            data_quality=quality, hung=self.hangs.hung, fail_slow_now=self.failslow.now(),
            losses=losses)

    def _ranks(self) -> tuple[RankFigures, ...]:
        """Each rank's peaks (resources) and its step, wait and compute means, by pid."""
        peaks, times = self.resources.rank_peaks(), self.ranks.summary()
        return tuple(
            replace(times[pid], **peaks.get(pid, {})) if pid in times
            else RankFigures(pid=pid, rank=self._rank_of.get(pid), **peaks[pid])
            for pid in sorted(peaks.keys() | times.keys()))
