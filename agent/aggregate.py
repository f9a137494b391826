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
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any


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


@dataclass
class StepAggregator:
    workload: Workload
    primary_pid: int
    start_t_mono_ns: int
    start_wall_s: float
    log_interval: int = 10
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
    _memory: list[tuple[int, int]] = field(default_factory=list)  # (t, max rss over ranks)
    _peak_rss_bytes: int | None = None

    def feed(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one record; return the iteration_logs entries it completed."""
        kind = record["type"]
        if kind == "marker":
            # Markers from before the probes were all attached fall outside the window.
            if record["pid"] != self.primary_pid or record["t_mono_ns"] < self.start_t_mono_ns:
                return []
            return self._on_marker(record["kind"], record["t_mono_ns"])
        if kind == "process":
            t, rss = record["t_mono_ns"], record["rss_bytes"]
            if self._memory and self._memory[-1][0] == t:
                self._memory[-1] = (t, max(rss, self._memory[-1][1]))
            else:
                self._memory.append((t, rss))
            self._peak_rss_bytes = max(
                rss, record.get("peak_rss_bytes") or 0, self._peak_rss_bytes or 0
            )
        elif kind == "lost":
            self.lost_events += record["count"]
        elif kind == "session_end":
            self.end_t_mono_ns, self.end_reason = record["t_mono_ns"], record["reason"]
        return []

    def _on_marker(self, marker: str, t_ns: int) -> list[dict[str, Any]]:
        if marker == "backward_enter":
            self._backwards_since_end += 1
            self._backward_seen = True
            return []
        if marker != "optimizer_step":
            return []
        if self._backward_seen and self._backwards_since_end == 0:
            return []  # another optimizer of the same iteration
        micro = self._backwards_since_end if self._backward_seen else None
        self._backwards_since_end = 0
        self.iterations_ended += 1
        previous_end, self._last_end_ns = self._last_end_ns, t_ns
        if previous_end is None:
            return []  # the partial iteration that was running at attach
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
        self._interval = []
        self.iteration_logs.append(entry)
        return [entry]

    def _memory_gb(self, t_from: int, t_to: int) -> float | None:
        """Mean RSS of the largest rank over samples in the window, in GB (1e9 bytes).

        An interval shorter than the sampling period takes the latest sample
        before its end. Older samples are dropped: intervals arrive in order.
        """
        window = [rss for t, rss in self._memory if t_from <= t <= t_to]
        if not window:
            window = [rss for t, rss in self._memory if t <= t_to][-1:]
        self._memory = [m for m in self._memory if m[0] >= t_to] or self._memory[-1:]
        return _mean([rss / 1e9 for rss in window])

    def _interval_entry(self, its: list[Iteration]) -> dict[str, Any]:
        last = its[-1]
        totals = _Totals()
        for it in its:
            totals.add(it)
        samples_s, tokens_s, tflops = totals.rates(self.workload.world_size)
        return {
            "iteration": last.number,
            "timestamp": self.wall_time(last.end_t_mono_ns),
            "step_time_ms": totals.step_ns / len(its) / 1e6,
            "TFLOPS_per_GPU": tflops,
            "tokens_per_sec": tokens_s,
            "samples_per_sec": samples_s,
            "memory_GB": self._memory_gb(last.end_t_mono_ns - totals.step_ns, last.end_t_mono_ns),
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
            "peak_memory_gb": self._peak_rss_bytes / 1e9 if self._peak_rss_bytes else None,
            "avg_tokens_per_sec": tokens_s,
            "avg_samples_per_sec": samples_s,
            "p50_step_time_ms": _percentile(steps_ms, 0.50),
            "p90_step_time_ms": _percentile(steps_ms, 0.90),
            "p99_step_time_ms": _percentile(steps_ms, 0.99),
            "min_step_time_ms": steps_ms[0] if steps_ms else None,
            "max_step_time_ms": steps_ms[-1] if steps_ms else None,
            "measured_iterations": len(steps_ms),
            "microbatches_per_step": (
                int(statistics.median_low(self._microbatches)) if self._microbatches else None
            ),
            "mfu": tflops / peak if tflops is not None and peak else None,
            "avg_hardware_tflops_per_gpu": self._hardware_tflops(tflops),
            "lost_events": self.lost_events,
        }
