"""The figures the Summarizer (perfmon.agent.reducers) emits: typed records in SI units
(seconds, bytes, ratios, FLOP/s), the one data model every output is a sink of.

The summary file, the Prometheus exposition, the console's lines and end table, the
incident bundles and ``top`` each render these records their own way; none reads
another's output. A field the summary shows names its key there and the unit it is
shown in (``shown``): the summary renders every record through ``render``, and reads one
back through ``parse``, so adding a figure is one field here and the reducer that fills
it (docs/architecture.md). A field with no key is for the other sinks only (the active
fail-slow episode, the loss counters, ...). tests/unit/parsers/test_figures_schema.py
checks every shown field against the summary's schema: its name, its JSON type and its
unit.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import statistics
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

__all__ = [
    "AS_IS",
    "GIB",
    "LOSS_CAUSES",
    "MS",
    "PCT",
    "SECONDS",
    "TFLOPS",
    "CudaFigures",
    "FailSlowEvent",
    "FailSlowNow",
    "Goodput",
    "GoodputLedger",
    "HangEpisode",
    "IntervalFigures",
    "PhaseShift",
    "PipelineFigures",
    "RankCoords",
    "RankFigures",
    "RankShift",
    "StageFigures",
    "Statistics",
    "StragglerEpisode",
    "Unit",
    "finite",
    "mean",
    "parse",
    "render",
    "scaled",
    "shown",
]


@dataclass(frozen=True)
class Unit:
    """How a summary shows an SI figure: ``shown = value * per_si``, the key ending in one
    of ``key_suffixes`` and the field's name in one of ``field_suffixes`` (checked by the
    test)."""

    name: str
    per_si: float
    key_suffixes: tuple[str, ...]
    field_suffixes: tuple[str, ...]


MS = Unit("ms", 1e3, ("_ms",), ("_s",))
GIB = Unit("GiB", 1 / (1 << 30), ("_gb", "_GB"), ("_bytes",))
PCT = Unit("%", 100.0, ("_pct",), ("utilization",))
TFLOPS = Unit("TFLOPS", 1e-12, ("tflops_per_gpu", "TFLOPS_per_GPU"), ("flops_per_gpu",))
SECONDS = Unit("s", 1.0, ("_seconds",), ("_s",))
AS_IS = Unit("", 1.0, (), ())  # counts, names, ratios, watts, ns stamps: shown as they are


def shown(key: str, unit: Unit = AS_IS, *, omitted_when_none: bool = False,
          only_with: str | None = None, default: Any = None,
          empty: type | None = None) -> Any:
    """A field the summary shows under ``key`` in ``unit``. ``omitted_when_none``: the key
    is left out rather than null while the figure is unknown; ``only_with``: the key is
    there (null or not) only when the record's field of that name is true (a source that
    was on); ``empty``: a fresh one of that type by default (a mapping)."""
    metadata = {"key": key, "unit": unit, "omit": only_with or omitted_when_none}
    if empty is not None:
        return field(default_factory=empty, metadata=metadata)
    return field(default=default, metadata=metadata)


def mean(values: Sequence[float]) -> float | None:
    """The mean of ``values``; None for none."""
    return statistics.fmean(values) if values else None


def scaled(value: float | None, factor: float) -> float | None:
    """``value`` in another unit (None stays unknown)."""
    return value * factor if value is not None else None


def _scaled(value: Any, factor: float) -> Any:
    return value if factor == 1.0 or isinstance(value, bool) else scaled(value, factor)


def render(record: Any) -> dict[str, Any]:
    """The summary's dict of a figures record: each shown field under its key, in its unit
    (records inside it rendered too)."""
    out: dict[str, Any] = {}
    for f, key, unit, omit, _inner in _shown_fields(type(record)):
        value = getattr(record, f)
        if omit and (not getattr(record, omit) if isinstance(omit, str) else value is None):
            continue
        if dataclasses.is_dataclass(value):
            value = render(value)
        elif isinstance(value, tuple):
            value = [render(v) if dataclasses.is_dataclass(v) else _scaled(v, unit.per_si)
                     for v in value]
        else:
            value = _scaled(value, unit.per_si)
        out[key] = value
    return out


R = TypeVar("R")


def parse(cls: type[R], shown_dict: Mapping[str, Any]) -> R:
    """The record of ``cls`` a summary's dict shows (``render``'s inverse; a key missing
    is an unknown figure). The dict is one kept to the schema (record.summary)."""
    values: dict[str, Any] = {}
    for f, key, unit, omit, inner in _shown_fields(cls):
        if key not in shown_dict:
            continue
        if isinstance(omit, str):  # (the key is there: the source it needs was on)
            values[omit] = True
        value = shown_dict[key]
        if inner is not None and isinstance(value, Mapping):
            value = parse(inner, value)
        elif inner is not None and isinstance(value, list):
            value = tuple(parse(inner, v) for v in value if isinstance(v, Mapping))
        elif isinstance(value, list):
            value = tuple(_scaled(v, 1 / unit.per_si) for v in value)
        else:
            value = _scaled(value, 1 / unit.per_si)
        values[f] = value
    return cls(**values)


def _record_type(hint: Any) -> type | None:
    """The figures record a field holds (itself, or a tuple of them), if any."""
    for arg in (hint, *typing.get_args(hint)):
        for inner in (arg, *typing.get_args(arg)):
            if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                return inner
    return None


_Shown = tuple[str, str, Unit, bool | str, type | None]
_FIELDS: dict[type, list[_Shown]] = {}


def _shown_fields(cls: type) -> list[_Shown]:
    """(field, key, unit, when it is omitted: True when None, or the name of the field
    that must be true for it to be there, the figures record it holds if any) of the
    fields ``cls`` shows, cached."""
    found = _FIELDS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        # (a record's own figures before those it shares with others, CudaFigures': the
        # summary reads iteration, timestamp, step time first, as FlagScale's does)
        own = inspect.get_annotations(cls)
        fields = sorted(dataclasses.fields(cls), key=lambda f: f.name not in own)
        found = _FIELDS[cls] = [
            (f.name, f.metadata["key"], f.metadata["unit"], f.metadata["omit"],
             _record_type(hints[f.name]))
            for f in fields if "key" in f.metadata]
    return found


def finite(value: Any) -> float | None:
    """A finite number as float; None for None, booleans, text, NaN and infinities (the
    one check of a figure read from anywhere)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


# -- the records -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankCoords:
    """A rank's place in its job's parallel layout (perfmon.parsers.parallel_layout):
    its data-parallel replica, pipeline stage, tensor-, context- and expert-parallel
    ranks."""

    dp: int = shown("dp", default=0)
    pp: int = shown("pp", default=0)
    tp: int = shown("tp", default=0)
    cp: int = shown("cp", default=0)
    ep: int = shown("ep", default=0)


# (the two records made for every log interval are not frozen: a frozen dataclass sets each
# field through object.__setattr__, which a week-long replay feels)
@dataclass(slots=True)
class RankFigures:
    """One rank's means (over a log interval, or the whole session), and its peaks."""

    pid: int = shown("pid")
    rank: int | None = shown("rank")
    iterations: int | None = shown("iterations", omitted_when_none=True)
    step_s: float | None = shown("avg_step_time_ms", MS, omitted_when_none=True)
    wait_s: float | None = shown("avg_wait_ms", MS)
    # ... of it on point-to-point sends and receives (a pipeline's activations and
    # gradients), the rest on collectives
    p2p_wait_s: float | None = shown("avg_p2p_wait_ms", MS)
    compute_s: float | None = shown("avg_compute_ms", MS)
    wait_share: float | None = shown("wait_share")
    # Iterations whose wait was measured, where fewer than all (the probes sampled).
    waits_probed: int | None = shown("waits_probed", omitted_when_none=True)
    straggler: bool | None = shown("straggler", omitted_when_none=True)
    peak_rss_bytes: int | None = shown("peak_rss_gb", GIB, omitted_when_none=True)
    peak_gpu_memory_bytes: int | None = shown("peak_gpu_memory_gb", GIB,
                                              omitted_when_none=True)
    gpu_indices: tuple[int, ...] | None = shown("gpu_indices", omitted_when_none=True)
    coords: RankCoords | None = shown("coords", omitted_when_none=True)  # the layout's


@dataclass(slots=True)
class CudaFigures:
    """CUDA and NCCL activity per iteration, where the CUDA counters ran (``cuda``: the
    figures are shown, known or not); a log interval's and the session's."""

    kernels_per_iter: float | None = shown("kernels_per_iter", only_with="cuda")
    cpu_sync_wait_s: float | None = shown("cpu_sync_wait_ms", MS, only_with="cuda")
    nccl_calls_per_iter: float | None = shown("nccl_calls_per_iter", only_with="cuda")
    nccl_bytes_per_iter: float | None = shown("nccl_bytes_per_iter", only_with="cuda")
    nccl_per_iter_by_collective: Mapping[str, Any] | None = shown(
        "nccl_per_iter_by_collective", only_with="cuda")
    cuda: bool = False  # the CUDA counters were on (their figures shown, known or not)


@dataclass(slots=True)
class IntervalFigures(CudaFigures):
    """One log interval (``iteration_logs``): the means over its iterations."""

    iteration: int = shown("iteration")  # the job's number of its last iteration
    timestamp: str = shown("timestamp")
    step_s: float = shown("step_time_ms", MS)
    flops_per_gpu: float | None = shown("TFLOPS_per_GPU", TFLOPS)  # model FLOP/s per GPU
    tokens_per_s: float | None = shown("tokens_per_sec")
    samples_per_s: float | None = shown("samples_per_sec")
    memory_bytes: float | None = shown("memory_GB", GIB)  # the largest rank's, mean
    end_ns: int = shown("end_monotonic_ns", default=0)
    kept_one_in: int | None = shown("kept_one_in", omitted_when_none=True)
    ranks: tuple[RankFigures, ...] | None = shown("ranks", omitted_when_none=True)
    gpu_utilization: float | None = shown("gpu_utilization_pct", PCT, omitted_when_none=True)
    gpu_power_w: float | None = shown("gpu_power_w", omitted_when_none=True)
    gpu_throttle_reasons: tuple[str, ...] | None = shown("gpu_throttle_reasons",
                                                          omitted_when_none=True)
    phases: Mapping[str, Any] | None = shown("phases")
    pipeline: PipelineFigures | None = shown("pipeline", omitted_when_none=True)
    mfu: float | None = None  # model FLOP/s over the device's peak


@dataclass(frozen=True, slots=True)
class PhaseShift:
    """A phase whose time per iteration moved with a fail-slow event."""

    phase: str = shown("phase")
    before_s: float = shown("before_ms", MS)
    after_s: float = shown("after_ms", MS)
    delta_s: float = shown("delta_ms", MS)


@dataclass(frozen=True, slots=True)
class RankShift:
    """A rank's compute and wait (before, after) a fail-slow event's change."""

    pid: int = shown("pid")
    rank: int | None = shown("rank")
    compute_s: tuple[float, float] = shown("compute_ms", MS)
    wait_s: tuple[float, float] = shown("wait_ms", MS)
    moved: bool = shown("moved", default=False)  # its compute moved with the step
    stage: int | None = shown("stage", omitted_when_none=True)  # its pipeline stage


@dataclass(frozen=True, slots=True)
class FailSlowEvent:
    """A sustained shift of the job's step time (docs/stragglers.md)."""

    event: Literal["fail_slow", "eased", "recovered_partly", "recovered"] = shown("event")
    t_ns: int = shown("t_mono_ns")  # the change
    timestamp: str = shown("timestamp")
    detected_ns: int = shown("detected_mono_ns")
    detected: str = shown("detected")
    before_step_s: float = shown("before_step_time_ms", MS)
    after_step_s: float = shown("after_step_time_ms", MS)
    change: float = shown("change_pct", PCT)  # after / before - 1
    baseline_step_s: float | None = shown("baseline_step_time_ms", MS)
    vs_baseline: float = shown("vs_baseline_pct", PCT)  # the new level / the baseline - 1
    min_shift: float = shown("min_shift_pct", PCT)
    drift: bool = shown("drift", default=False)
    ranks: tuple[RankShift, ...] = shown("ranks", default=())
    phases: tuple[PhaseShift, ...] | None = shown("phases")  # None: not known yet
    # The interval figures that moved, as the summary shows them (key -> [before, after]).
    state: Mapping[str, Any] | None = shown("state")


@dataclass(frozen=True, slots=True)
class StragglerEpisode:
    """A rank the others wait for (docs/stragglers.md): open while ``until`` is None."""

    pid: int = shown("pid")
    rank: int | None = shown("rank")
    since_ns: int = shown("since_mono_ns")
    since: str = shown("since")
    detected_ns: int = shown("detected_mono_ns")
    detected: str = shown("detected")
    until_ns: int | None = shown("until_mono_ns")
    until: str | None = shown("until")
    compute_s: float = shown("compute_ms", MS)
    wait_s: float = shown("wait_ms", MS)
    step_s: float = shown("step_ms", MS)
    others_compute_s: float = shown("others_compute_ms", MS)
    others_wait_s: float = shown("others_wait_ms", MS)
    differs: Mapping[str, Any] = shown("differs", empty=dict)  # its CPU against the others'
    delay_per_step_s: float = shown("delay_ms_per_step", MS)  # the job's delay, median
    # Its pipeline stage, whose ranks alone it was compared with (layout stated).
    stage: int | None = shown("stage", omitted_when_none=True)


@dataclass(frozen=True, slots=True)
class HangEpisode:
    """No iteration for ``threshold_s`` (perfmon.agent.measure.hangs): found at ``t_ns``,
    the job's last iteration before it, where the ranks wait (``frame``, the stack
    report's path ``report``), the phase most ranks' main threads were in, and when the
    iterations resumed (``recovered_at``; None while it lasts)."""

    t_ns: int = shown("t_mono_ns")
    timestamp: str = shown("timestamp")
    last_iteration_ns: int = shown("last_iteration_mono_ns")
    threshold_s: float = shown("threshold_s")
    frame: str = shown("frame")
    report: str = shown("report")
    phase: str | None = shown("phase")
    recovered_at: str | None = shown("recovered_at")


@dataclass(frozen=True, slots=True)
class StageFigures:
    """One pipeline stage's means per iteration (its ranks': data-parallel replicas,
    tensor- and context-parallel peers): its compute, its wait on its neighbours'
    activations and gradients (``bubble_s``: point-to-point sends and receives) and on
    collectives (the rest of its wait)."""

    stage: int = shown("stage")
    ranks: tuple[int, ...] = shown("ranks", default=())
    step_s: float | None = shown("avg_step_time_ms", MS)
    compute_s: float | None = shown("avg_compute_ms", MS)
    bubble_s: float | None = shown("avg_bubble_ms", MS)
    collective_wait_s: float | None = shown("avg_collective_wait_ms", MS)
    bubble_share: float | None = shown("bubble_share")  # bubble over step


@dataclass(frozen=True, slots=True)
class PipelineFigures:
    """A pipeline-parallel job's stages (docs/pipeline.md): the measured bubble (the mean
    of the stages' bubble shares) beside the schedule's ideal, (p - 1) / (v m + p - 1)
    for p stages, m micro-batches and v virtual stages a rank, and the stage that bounds
    the pipeline: the most compute, its excess over the median of the others' (in every
    data-parallel replica: the least of the replicas'), ``slow`` beyond the rule's bar."""

    stages: int = shown("stages")
    virtual_stages: int = shown("virtual_stages", default=1)
    microbatches: int | None = shown("microbatches")
    bubble: float | None = shown("bubble_fraction")
    ideal_bubble: float | None = shown("ideal_bubble_fraction")
    per_stage: tuple[StageFigures, ...] = shown("per_stage", default=())
    bounding_stage: int | None = shown("bounding_stage")
    excess_s: float | None = shown("bounding_excess_ms", MS)  # per step
    excess_per_microbatch_s: float | None = shown("bounding_excess_per_microbatch_ms", MS)
    excess_share: float | None = shown("bounding_excess_share")  # over the others' compute
    slow: bool = shown("slow_stage", default=False)


@dataclass(frozen=True, slots=True)
class FailSlowNow:
    """The fail-slow episode open now: its step time over the healthy baseline, and the
    phase whose time moved most (``unknown`` until the samples tell)."""

    ratio: float
    phase: str


# What a goodput ledger's lost time went to (docs/metrics.md, "Goodput").
LOSS_CAUSES = ("startup", "hang", "restart", "straggler", "slowdown", "data_stall",
               "unexplained")


@dataclass(frozen=True, slots=True)
class GoodputLedger:
    """Seconds of one rank (of ``gpus``) by what they went to: productive + lost = wall;
    ``unobserved_s``, time the agent could not see, is outside the wall time and the ratio.
    The GPU-hours are the seconds x ``gpus`` (perfmon.agent.reducers.goodput.Ledger)."""

    ratio: float | None = shown("ratio")  # productive over wall (None: no time, or none seen)
    gpus: int = shown("gpus", default=1)
    wall_s: float = shown("wall_seconds", SECONDS, default=0.0)
    productive_s: float = shown("productive_seconds", SECONDS, default=0.0)
    lost_s: Mapping[str, float] = shown("lost_seconds", SECONDS, empty=dict)  # by cause
    gpu_hours: float = shown("gpu_hours", default=0.0)
    productive_gpu_hours: float = shown("productive_gpu_hours", default=0.0)
    lost_gpu_hours: Mapping[str, float] = shown("lost_gpu_hours", empty=dict)
    unobserved_s: float = shown("unobserved_seconds", SECONDS, default=0.0)
    unobserved_gpu_hours: float = shown("unobserved_gpu_hours", default=0.0)


@dataclass(frozen=True, slots=True)
class Goodput(GoodputLedger):
    """A session's ledger (``final_statistics.goodput``) and, where the job had earlier
    sessions (a restart), the job's (``job``)."""

    window_from: Literal["process_start", "attach", "previous_session"] = shown(
        "from", default="attach")  # where the ledger's time starts
    last_job_iteration: int | None = shown("last_job_iteration")  # the job's own number
    last_end_ns: int | None = shown("last_end_mono_ns")  # its last iteration's end
    job: GoodputLedger | None = shown("job", omitted_when_none=True)

    @property
    def of_job(self) -> GoodputLedger:
        """The job's ledger across its sessions where it had several, else the session's."""
        return self.job or GoodputLedger(*(getattr(self, f.name)
                                           for f in dataclasses.fields(GoodputLedger)))


@dataclass(slots=True)
class Statistics(CudaFigures):
    """The session's figures so far (``final_statistics``), and what the other sinks
    need of it."""

    flops_per_gpu: float | None = shown("avg_tflops_per_gpu", TFLOPS)
    step_s: float | None = shown("avg_step_time_ms", MS)
    peak_memory_bytes: float | None = shown("peak_memory_gb", GIB)
    memory_kind: Literal["gpu", "rss"] = shown("memory_kind", default="rss")
    tokens_per_s: float | None = shown("avg_tokens_per_sec")
    samples_per_s: float | None = shown("avg_samples_per_sec")
    p50_step_s: float | None = shown("p50_step_time_ms", MS)
    p90_step_s: float | None = shown("p90_step_time_ms", MS)
    p99_step_s: float | None = shown("p99_step_time_ms", MS)
    min_step_s: float | None = shown("min_step_time_ms", MS)
    max_step_s: float | None = shown("max_step_time_ms", MS)
    measured_iterations: int = shown("measured_iterations", default=0)
    iteration_estimator: str | None = shown("iteration_estimator")
    iteration_estimators: Mapping[str, int] = shown("iteration_estimators", empty=dict)
    iteration_clock: Literal["exact", "declared", "estimated"] | None = shown(
        "iteration_clock")
    microbatches_per_step: int | None = shown("microbatches_per_step")
    mfu: float | None = shown("mfu")
    hardware_flops_per_gpu: float | None = shown("avg_hardware_tflops_per_gpu", TFLOPS)
    lost_events: int = shown("lost_events", default=0)
    gpu_utilization: float | None = shown("avg_gpu_utilization_pct", PCT)
    gpu_power_w: float | None = shown("avg_gpu_power_w")
    gpu_throttle_reasons: Mapping[str, int] = shown("gpu_throttle_reasons", empty=dict)
    gpu_events: tuple[Mapping[str, Any], ...] = shown("gpu_events", default=())
    gpu_attribution: Literal["processes", "all_gpus", "none"] | None = shown(
        "gpu_attribution")
    ranks: tuple[RankFigures, ...] = shown("ranks", default=())
    phases: Mapping[str, Any] | None = shown("phases")
    phases_source: Literal["uprobe", "pyspy", "uprobe+pyspy"] | None = shown("phases_source")
    phases_iterations: int | None = shown("phases_iterations")
    kernel_launches_sampled_iterations: int | None = shown(
        "kernel_launches_sampled_iterations", only_with="cuda")
    hangs: tuple[HangEpisode, ...] = shown("hangs", default=())
    stragglers: tuple[StragglerEpisode, ...] = shown("stragglers", default=())
    fail_slow: tuple[FailSlowEvent, ...] = shown("fail_slow", default=())
    goodput: Goodput | None = shown("goodput", omitted_when_none=True)
    pipeline: PipelineFigures | None = shown("pipeline", omitted_when_none=True)
    data_quality: Mapping[str, Any] = shown("data_quality", empty=dict)
    # -- for the other sinks (Prometheus, the console) ---------------------------------
    hung: bool = False  # a hang is open now
    fail_slow_now: FailSlowNow | None = None
    gpu_event_counts: Mapping[str, int] = field(default_factory=dict)
    # (source, counter) -> the value of each source's loss counters (data_quality)
    losses: Mapping[tuple[str, str], float] = field(default_factory=dict)

