"""From event-log records to iterations, interval logs and final statistics.

The aggregator is a pure function of the record stream: the live session feeds
it each record as it logs it, and ``perfmon-agent summarize`` feeds it the
same records read back from the log, so both give the same numbers.

An iteration ends at an ``Optimizer.step`` of the primary rank that follows at
least one ``backward()`` since the previous end. Steps with no backward between
them (several optimizers stepping in one iteration, e.g. Megatron's chained
optimizer for MoE) therefore count once. When no backward has been seen at all
(no Engine::execute probe), every step ends an iteration. The first end after
attach only opens the window: the partial iteration before it is not measured.
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from perfmon.agent.gpu import job_gpu_indices
from perfmon.agent.phases import PhaseAccount

# How long (in record time) an interval entry waits for stack samples covering it.
PHASE_WAIT_NS = 5_000_000_000
DEFAULT_MAX_LOG_ENTRIES = 2000
GIB = 1 << 30  # memory is reported in GiB under the seed's "GB" key names, as FlagScale's does


@dataclass(frozen=True)
class Workload:
    """What one iteration computes; None where unknown."""

    flops_per_sample: float | None = None
    hardware_flops_per_sample: float | None = None  # with recomputation; None without
    seq_length: int | None = None
    global_batch_size: int | None = None  # as given; else derived per iteration
    micro_batch_size: int | None = None
    data_parallel_size: int = 1
    world_size: int = 1
    peak_tflops: float | None = None

    def samples(self, microbatches: int | None) -> int | None:
        """Samples in one iteration: given, or micro batch x micro-batches x DP."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        if self.micro_batch_size is not None and microbatches:
            return self.micro_batch_size * microbatches * self.data_parallel_size
        return None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})  # type: ignore[arg-type]


@dataclass(frozen=True)
class Iteration:
    number: int  # 1 = the first iteration that ended after attach
    end_t_mono_ns: int
    step_time_ns: int
    microbatches: int | None
    samples: int | None
    tokens: int | None
    flops: float | None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


CUDA_MATCH_NS = 1_000_000
_CUDA_SCALARS = ("kernel_launches", "sync_wait_ns", "graph_launches")


def _counter_delta(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    delta: dict[str, Any] = {k: last[k] - first[k] for k in _CUDA_SCALARS}
    for table in ("nccl_calls", "nccl_bytes"):
        delta[table] = {k: v - first[table].get(k, 0) for k, v in last[table].items()}
    return delta


def _counter_sum(total: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    if not total:
        return delta
    out: dict[str, Any] = {k: total[k] + delta[k] for k in _CUDA_SCALARS}
    for table in ("nccl_calls", "nccl_bytes"):
        out[table] = {k: total[table].get(k, 0) + v for k, v in delta[table].items()}
    return out


def _cuda_fields(delta: dict[str, Any] | None, iterations: int) -> dict[str, Any]:
    """Per-iteration CUDA/NCCL figures of a counter delta over ``iterations``."""
    if delta is None or iterations <= 0:
        return dict.fromkeys(("kernels_per_iter", "cpu_sync_wait_ms", "nccl_calls_per_iter",
                              "nccl_bytes_per_iter", "nccl_per_iter_by_collective"))
    return {
        "kernels_per_iter": delta["kernel_launches"] / iterations,
        "cpu_sync_wait_ms": delta["sync_wait_ns"] / iterations / 1e6,
        "nccl_calls_per_iter": sum(delta["nccl_calls"].values()) / iterations,
        "nccl_bytes_per_iter": sum(delta["nccl_bytes"].values()) / iterations,
        "nccl_per_iter_by_collective": {
            name: {"calls": calls / iterations,
                   "bytes": delta["nccl_bytes"].get(name, 0) / iterations}
            for name, calls in delta["nccl_calls"].items() if calls
        },
    }


def _scaled(value: float | None, factor: float) -> float | None:
    return value * factor if value is not None else None


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class _Totals:
    """Running sums over measured iterations; a sum turns None once a term is unknown."""

    def __init__(self) -> None:
        self.step_ns = 0
        self.samples: float | None = 0
        self.tokens: float | None = 0
        self.flops: float | None = 0

    def add(self, it: Iteration) -> None:
        def plus(total: float | None, term: float | None) -> float | None:
            return None if total is None or term is None else total + term

        self.step_ns += it.step_time_ns
        self.samples = plus(self.samples, it.samples)
        self.tokens = plus(self.tokens, it.tokens)
        self.flops = plus(self.flops, it.flops)

    def rates(self, world_size: int) -> tuple[float | None, float | None, float | None]:
        """(samples/s, tokens/s, TFLOPS per GPU) over the summed time."""
        seconds = self.step_ns / 1e9
        if seconds <= 0:
            return None, None, None

        def per_s(total: float | None) -> float | None:
            return total / seconds if total is not None else None

        flops = per_s(self.flops)
        return per_s(self.samples), per_s(self.tokens), (
            flops / world_size / 1e12 if flops is not None else None
        )


class _Series:
    """Samples of one quantity over time: window means for intervals, a whole-run mean and max.

    Only samples from the current interval on are kept (intervals arrive in
    order), so a week-long session holds a few seconds of samples.
    """

    def __init__(self) -> None:
        self._recent: list[tuple[int, float]] = []
        self.total = 0.0
        self.count = 0
        self.peak: float | None = None

    def add(self, t_ns: int, value: float, peak: float | None = None) -> None:
        if self._recent and self._recent[-1][0] == t_ns:  # several ranks at one instant
            value = max(value, self._recent[-1][1])
            self.total -= self._recent[-1][1]
            self.count -= 1
            self._recent[-1] = (t_ns, value)
        else:
            self._recent.append((t_ns, value))
        self.total += value
        self.count += 1
        self.peak = max(value, peak or value, self.peak if self.peak is not None else value)

    def window_mean(self, t_from: int, t_to: int) -> float | None:
        """Mean of the samples in [t_from, t_to]; the latest before t_to when there are none."""
        window = [v for t, v in self._recent if t_from <= t <= t_to]
        if not window:
            window = [v for t, v in self._recent if t <= t_to][-1:]
        self._recent = [m for m in self._recent if m[0] >= t_to] or self._recent[-1:]
        return _mean(window)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class StepAggregator:
    workload: Workload
    primary_pid: int
    start_t_mono_ns: int
    start_wall_s: float
    log_interval: int = 10
    # True when stack samples are expected: interval entries then wait (at most
    # PHASE_WAIT_NS of record time) for the samples that cover them.
    stack_sampling: bool = False
    # True when CUDA counters are snapshotted at each Optimizer.step (probes/cuda.py):
    # interval entries then wait for the snapshots at their ends too.
    cuda_counters: bool = False
    iteration_logs: list[dict[str, Any]] = field(default_factory=list)
    iterations_ended: int = 0
    lost_events: int = 0
    end_t_mono_ns: int | None = None
    end_reason: str | None = None
    # Whole-run state kept compact (8 bytes an iteration) for week-long jobs.
    _step_ns: array = field(default_factory=lambda: array("q"))
    _microbatches: array = field(default_factory=lambda: array("q"))
    _totals: _Totals = field(default_factory=_Totals)
    _interval: list[Iteration] = field(default_factory=list)
    _last_end_ns: int | None = None
    _backwards_since_end: int = 0
    _backward_seen: bool = False
    # Job figures over time: the largest rank's RSS and GPU memory (bytes), and the
    # mean utilization (%) and power (W) of the job's GPUs.
    _series: dict[str, _Series] = field(
        default_factory=lambda: {k: _Series() for k in ("rss", "gpu_memory", "gpu_util",
                                                         "gpu_power")})
    _job_gpus: set[int] = field(default_factory=set)
    _throttle: dict[str, int] = field(default_factory=dict)  # reason -> samples, whole run
    _interval_throttle: set[str] = field(default_factory=set)
    _rank_peaks: dict[int, dict[str, int]] = field(default_factory=dict)  # pid -> name -> bytes
    _rank_gpus: dict[int, list[int]] = field(default_factory=dict)
    _lost_gpus: set[int] = field(default_factory=set)
    phases: PhaseAccount = field(default_factory=PhaseAccount)
    _pending: list[tuple[dict[str, Any], int, int, int]] = field(default_factory=list)
    _recent_ends: deque = field(default_factory=lambda: deque(maxlen=1024))
    _job_reads: list[dict[str, Any]] = field(default_factory=list)
    _job_offsets: list[int] = field(default_factory=list)  # exact reads late in a step
    _job_early: list[int] = field(default_factory=list)  # exact reads early in a step
    _job_bounds: list[tuple[int, int]] = field(default_factory=list)
    job_iteration_variable: str | None = None
    hangs: list[dict[str, Any]] = field(default_factory=list)
    _cuda_at_step: dict[int, dict[str, Any]] = field(default_factory=dict)  # t -> counters
    _cuda_sum: dict[str, Any] = field(default_factory=dict)  # deltas over finalized intervals
    _cuda_iterations: int = 0
    gpu_events: list[dict[str, Any]] = field(default_factory=list)  # xid, ecc, lost
    gpu_attribution: str | None = None  # how the job's GPUs were found (job_gpu_indices)
    estimators: dict[str, int] = field(default_factory=dict)  # iteration ends by estimator
    # iteration_logs holds at most this many entries: older ones are thinned
    # evenly (one in log_stride kept, marked kept_one_in); None: no bound.
    max_log_entries: int | None = DEFAULT_MAX_LOG_ENTRIES
    log_stride: int = 1
    _log_seq: list[int] = field(default_factory=list)  # interval number of each entry
    _intervals_logged: int = 0

    def feed(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one record; return the iteration_logs entries it completed."""
        done = self._take(record)
        if self._pending:
            done += self._finalize_pending(record)
        return done

    def _take(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        kind, t_ns = record["type"], record.get("t_mono_ns", 0)
        if kind == "marker":
            # Markers from before the probes were all attached fall outside the window.
            if record["pid"] != self.primary_pid or t_ns < self.start_t_mono_ns:
                return []
            return self._on_marker(record["kind"], t_ns, record["name"])
        if kind == "phase" and record["pid"] == self.primary_pid:
            self.phases.add_span(t_ns, record["end_mono_ns"], record["phase"])
        elif kind == "process":
            rss, peak = record["rss_bytes"], record.get("peak_rss_bytes")
            self._series["rss"].add(t_ns, rss, peak)
            self._rank_peak(record["pid"], "rss_bytes", max(rss, peak or 0))
        elif kind == "gpu":
            self._on_gpu(t_ns, record["gpus"])
        elif kind in ("xid", "ecc"):
            self.gpu_events.append({**record, "timestamp": self.wall_time(t_ns)})
        elif kind == "cuda" and record["at_step"] and record["pid"] == self.primary_pid:
            self._cuda_at_step[t_ns] = record
        elif kind == "job_iteration":
            self._job_reads.append(record)
            self.job_iteration_variable = record.get("name")
        elif kind == "hang":
            fields = {k: v for k, v in record.items() if k != "type"}
            self.hangs.append({**fields, "timestamp": self.wall_time(t_ns), "recovered_at": None})
        elif kind == "hang_recovered" and self.hangs:
            self.hangs[-1]["recovered_at"] = self.wall_time(t_ns)
        elif kind == "lost":
            self.lost_events += record["count"]
        elif kind == "session_end":
            self.end_t_mono_ns, self.end_reason = t_ns, record["reason"]
        return []

    def _on_marker(self, marker: str, t_ns: int, name: str) -> list[dict[str, Any]]:
        if marker == "backward_enter":
            self._backwards_since_end += 1
            self._backward_seen = True
            self.phases.backward_enter(t_ns)
            return []
        if marker == "backward_exit":
            self.phases.backward_exit(t_ns)
            return []
        if marker != "optimizer_step":
            return []
        if self._backward_seen and self._backwards_since_end == 0:
            return []  # another optimizer of the same iteration
        micro = self._backwards_since_end if self._backward_seen else None
        self._backwards_since_end = 0
        self.iterations_ended += 1
        self._recent_ends.append(t_ns)
        if self._job_reads:
            self._resolve_job_reads(t_ns)
        previous_end, self._last_end_ns = self._last_end_ns, t_ns
        if previous_end is None:
            return []  # the partial iteration that was running at attach
        # How this end was found: uprobes (exact), or py-spy's estimators
        # (perfmon.parsers.sampled_iterations), named by the marker.
        how = ((name.partition(":")[2] or "optimizer_frame") if name.startswith("pyspy")
               else "uprobe")
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
        self._totals.add(it)
        self._interval.append(it)
        if len(self._interval) < self.log_interval:
            return []
        entry = self._interval_entry(self._interval)
        start, end = entry.pop("_start_ns"), entry["end_monotonic_ns"]
        self._pending.append((entry, start, end, len(self._interval)))
        self._interval = []
        return self._finalize_pending(None)

    def _finalize_pending(self, record: dict[str, Any] | None) -> list[dict[str, Any]]:
        """Complete the interval entries whose phase samples are in, or waited for long enough.

        Decided by record contents alone, so a replay of the log decides the same.
        """
        now = record.get("t_mono_ns") if record else None
        final = record is not None and record["type"] == "session_end"
        if final and self._job_reads:
            self._resolve_job_reads(None)
        done = []
        while self._pending:
            entry, start, end, count = self._pending[0]
            waited = now is not None and now >= end + PHASE_WAIT_NS
            phases_in = not self.stack_sampling or self.phases.watermark_ns >= end
            cuda_in = not self.cuda_counters or self._cuda_snapshot(end) is not None
            if not ((phases_in and cuda_in) or waited or final):
                break
            self._pending.pop(0)
            entry.update(self._cuda_per_iteration(start, end, count))
            per_phase = self.phases.window_ns(start, end)
            self.phases.record(per_phase, count)
            entry["phases"] = PhaseAccount.breakdown(per_phase, count)
            entry["iteration"] += self.job_iteration_offset or 0
            self._log_entry(entry)
            done.append(entry)
        return done

    def _log_entry(self, entry: dict[str, Any]) -> None:
        """Append to iteration_logs, thinning older entries evenly beyond max_log_entries.

        The newest half stays whole; in the older part one entry in ``log_stride``
        (by interval number) is kept, the stride doubling as the run goes on, so
        the older part always samples the run evenly.
        """
        self.iteration_logs.append(entry)
        self._log_seq.append(self._intervals_logged)
        self._intervals_logged += 1
        limit = self.max_log_entries
        if limit is None or len(self.iteration_logs) <= limit:
            return
        recent = max(1, limit // 2)
        while len(self.iteration_logs) > limit:
            old = len(self.iteration_logs) - recent
            keep = [i for i in range(old) if self._log_seq[i] % self.log_stride == 0]
            if len(keep) == old:
                self.log_stride *= 2
                continue
            keep += range(old, len(self.iteration_logs))
            self.iteration_logs = [self.iteration_logs[i] for i in keep]
            self._log_seq = [self._log_seq[i] for i in keep]
        for i in range(len(self.iteration_logs) - recent):
            self.iteration_logs[i]["kept_one_in"] = self.log_stride

    def _cuda_snapshot(self, t_ns: int) -> dict[str, Any] | None:
        """The counters snapshotted in the kernel at the step entry at ``t_ns``.

        The marker and the snapshot come from two uprobe programs on the same
        call, microseconds apart.
        """
        near = [t for t in self._cuda_at_step if abs(t - t_ns) < CUDA_MATCH_NS]
        return self._cuda_at_step[min(near, key=lambda t: abs(t - t_ns))] if near else None

    def _cuda_per_iteration(self, start: int, end: int, count: int) -> dict[str, Any]:
        """CUDA/NCCL figures per iteration between the step entries at ``start`` and ``end``."""
        if not self.cuda_counters:
            return {}
        first, last = self._cuda_snapshot(start), self._cuda_snapshot(end)
        self._cuda_at_step = {
            t: c for t, c in self._cuda_at_step.items() if t >= end - CUDA_MATCH_NS}
        if first is None or last is None:
            return _cuda_fields(None, 0)
        delta = _counter_delta(first, last)
        self._cuda_sum = _counter_sum(self._cuda_sum, delta)
        self._cuda_iterations += count
        return _cuda_fields(delta, count)

    def _resolve_job_reads(self, until_ns: int | None) -> None:
        """Turn reads of the job's counter into offsets from our count.

        A read made between ``t_mono_ns`` and ``end_mono_ns`` is resolved once an
        iteration end after it has been seen (``until_ns``; None: now, at the
        end), so every end before it is counted. With no end inside the read's
        window the offset is exact; otherwise each read bounds it, and the
        bounds of all reads are intersected.
        """
        unresolved = []
        for read in self._job_reads:
            if until_ns is not None and read["end_mono_ns"] >= until_ns:
                unresolved.append(read)
                continue
            before = self._count_at(read["t_mono_ns"])
            after = self._count_at(read["end_mono_ns"])
            if before == after:
                # Right after a step entry the job has not yet counted that step
                # (it increments after the optimizer returns): a read late in the
                # step is the one to trust.
                since = read["t_mono_ns"] - max(
                    (t for t in self._recent_ends if t <= read["t_mono_ns"]), default=0)
                median = self.recent_median_step_ns()
                late = median is None or since > median / 2
                (self._job_offsets if late else self._job_early).append(read["value"] - before)
            else:
                self._job_bounds.append((read["value"] - after, read["value"] - before))
        self._job_reads = unresolved

    def _count_at(self, t_ns: int) -> int:
        """Iterations ended at or before ``t_ns`` (among the last 1024 ends)."""
        return self.iterations_ended - sum(1 for t in self._recent_ends if t > t_ns)

    @property
    def last_end_t_mono_ns(self) -> int | None:
        """When the latest iteration ended (None before the first)."""
        return self._last_end_ns

    def recent_median_step_ns(self) -> float | None:
        """Median of the last 101 step times (None before any)."""
        recent = sorted(self._step_ns[-101:])
        return float(recent[len(recent) // 2]) if recent else None

    @property
    def job_iteration_offset(self) -> int | None:
        """Our iteration count plus this is the job's own number (None: not read).

        The most frequent exact offset of reads late in a step, else of reads
        early in one (which can race the job's increment), else the middle of the
        intersected bounds.
        """
        for offsets in (self._job_offsets, self._job_early):
            if offsets:
                return max(set(offsets), key=offsets.count)
        if self._job_bounds:
            lo = max(b[0] for b in self._job_bounds)
            hi = min(b[1] for b in self._job_bounds)
            return (lo + hi) // 2 if lo <= hi else self._job_bounds[-1][0]
        return None

    def _on_gpu(self, t_ns: int, gpus: list[dict[str, Any]]) -> None:
        """One NVML sample of every GPU: GPU memory per rank, utilization, power, throttling.

        The job's GPUs are those where NVML showed one of its processes; see
        perfmon.agent.gpu.job_gpu_indices for when every GPU, or none, counts.
        """
        per_rank: dict[int, int] = {}
        for g in gpus:
            if g["lost"] and g["index"] not in self._lost_gpus:
                self._lost_gpus.add(g["index"])
                self.gpu_events.append({"type": "gpu_lost", "gpu_index": g["index"],
                                        "t_mono_ns": t_ns, "timestamp": self.wall_time(t_ns),
                                        "error": g["error"]})
            for pid, used in (g.get("process_memory_bytes") or {}).items():
                if used is not None:
                    per_rank[int(pid)] = per_rank.get(int(pid), 0) + used
                    self._job_gpus.add(g["index"])
                    gpus_of_rank = self._rank_gpus.setdefault(int(pid), [])
                    if g["index"] not in gpus_of_rank:
                        gpus_of_rank.append(g["index"])
        for pid, used in per_rank.items():
            self._rank_peak(pid, "gpu_memory_bytes", used)
        if per_rank:
            self._series["gpu_memory"].add(t_ns, max(per_rank.values()))
        indices, how = job_gpu_indices(gpus)
        if self.gpu_attribution != "processes":
            self.gpu_attribution = how
        if self._job_gpus:
            indices = self._job_gpus
        mine = [g for g in gpus if not g["lost"] and g["index"] in indices]
        util = [g["utilization_gpu_pct"] for g in mine if g["utilization_gpu_pct"] is not None]
        power = [g["power_w"] for g in mine if g["power_w"] is not None]
        if util:
            self._series["gpu_util"].add(t_ns, sum(util) / len(util))
        if power:
            self._series["gpu_power"].add(t_ns, sum(power) / len(power))
        for g in mine:
            for reason in g["throttle_reasons"] or []:
                self._throttle[reason] = self._throttle.get(reason, 0) + 1
                self._interval_throttle.add(reason)

    def _rank_peak(self, pid: int, name: str, value: int) -> None:
        peaks = self._rank_peaks.setdefault(pid, {})
        peaks[name] = max(value, peaks.get(name, 0))

    def _ranks(self) -> list[dict[str, Any]]:
        """Per-rank peaks in GiB, and the GPUs NVML saw each rank on."""
        return [
            {"pid": pid,
             "peak_rss_gb": _scaled(peaks.get("rss_bytes"), 1 / GIB),
             "peak_gpu_memory_gb": _scaled(peaks.get("gpu_memory_bytes"), 1 / GIB),
             "gpu_indices": self._rank_gpus.get(pid, [])}
            for pid, peaks in sorted(self._rank_peaks.items())
        ]

    def _memory_bytes_series(self) -> _Series:
        """GPU memory for GPU jobs, resident memory otherwise."""
        gpu = self._series["gpu_memory"]
        return gpu if gpu.count else self._series["rss"]

    def _interval_entry(self, its: list[Iteration]) -> dict[str, Any]:
        last = its[-1]
        totals = _Totals()
        for it in its:
            totals.add(it)
        samples_s, tokens_s, tflops = totals.rates(self.workload.world_size)
        start, end = last.end_t_mono_ns - totals.step_ns, last.end_t_mono_ns
        memory = self._memory_bytes_series()
        for name in ("rss", "gpu_memory"):
            if self._series[name] is not memory:
                self._series[name].window_mean(start, end)  # keep its samples pruned too
        return {
            "_start_ns": start,
            "end_monotonic_ns": end,
            "iteration": last.number,
            "timestamp": self.wall_time(last.end_t_mono_ns),
            "step_time_ms": totals.step_ns / len(its) / 1e6,
            "TFLOPS_per_GPU": tflops,
            "tokens_per_sec": tokens_s,
            "samples_per_sec": samples_s,
            "memory_GB": _scaled(memory.window_mean(start, end), 1 / GIB),
            **self._interval_gpu(start, end),
        }

    def _interval_gpu(self, start: int, end: int) -> dict[str, Any]:
        """GPU fields of an interval entry (only for GPU jobs)."""
        if not self._series["gpu_util"].count and not self._series["gpu_power"].count:
            return {}
        throttle, self._interval_throttle = sorted(self._interval_throttle), set()
        return {
            "gpu_utilization_pct": self._series["gpu_util"].window_mean(start, end),
            "gpu_power_w": self._series["gpu_power"].window_mean(start, end),
            "gpu_throttle_reasons": throttle,
        }

    def wall_time(self, t_mono_ns: int) -> str:
        """ISO 8601 local time with offset of a CLOCK_MONOTONIC instant."""
        wall = self.start_wall_s + (t_mono_ns - self.start_t_mono_ns) / 1e9
        return datetime.fromtimestamp(wall, timezone.utc).astimezone().isoformat()

    def _hardware_tflops(self, model_tflops: float | None) -> float | None:
        """Model TFLOPS scaled by what recomputation adds; None without recomputation."""
        w = self.workload
        if model_tflops is None or not w.hardware_flops_per_sample or not w.flops_per_sample:
            return None
        return model_tflops * w.hardware_flops_per_sample / w.flops_per_sample

    def final_statistics(self) -> dict[str, Any]:
        steps_ms = sorted(ns / 1e6 for ns in self._step_ns)
        samples_s, tokens_s, tflops = self._totals.rates(self.workload.world_size)
        peak = self.workload.peak_tflops
        return {
            "avg_tflops_per_gpu": tflops,
            "avg_step_time_ms": _mean(steps_ms),
            "peak_memory_gb": _scaled(self._memory_bytes_series().peak, 1 / GIB),
            "memory_kind": "gpu" if self._series["gpu_memory"].count else "rss",
            "avg_tokens_per_sec": tokens_s,
            "avg_samples_per_sec": samples_s,
            "p50_step_time_ms": _percentile(steps_ms, 0.50),
            "p90_step_time_ms": _percentile(steps_ms, 0.90),
            "p99_step_time_ms": _percentile(steps_ms, 0.99),
            "min_step_time_ms": steps_ms[0] if steps_ms else None,
            "max_step_time_ms": steps_ms[-1] if steps_ms else None,
            "measured_iterations": len(steps_ms),
            "iteration_estimator": (max(self.estimators, key=self.estimators.__getitem__)
                                    if self.estimators else None),
            "iteration_estimators": dict(self.estimators),
            "microbatches_per_step": (
                int(statistics.median_low(self._microbatches)) if self._microbatches else None
            ),
            "mfu": tflops / peak if tflops is not None and peak else None,
            "avg_hardware_tflops_per_gpu": self._hardware_tflops(tflops),
            "lost_events": self.lost_events,
            "avg_gpu_utilization_pct": self._series["gpu_util"].mean,
            "avg_gpu_power_w": self._series["gpu_power"].mean,
            "gpu_throttle_reasons": dict(self._throttle),
            "gpu_events": self.gpu_events,
            "gpu_attribution": self.gpu_attribution,
            "ranks": self._ranks(),
            "phases": PhaseAccount.breakdown(self.phases.total_ns,
                                             self.phases.total_iterations),
            "phases_source": self.phases.source,
            **(_cuda_fields(self._cuda_sum or None, self._cuda_iterations)
               if self.cuda_counters else {}),
            "hangs": self.hangs,
        }
