"""The metric families Prometheus scrapes, built from what is exposed of each job
(JobSeries) and of the agent itself: names, help texts, label sets and buckets, in one
place (docs/prometheus.md says what each means).

perfmon.agent.measure.metrics keeps the JobSeries up to date as the session pushes
figures; ``families`` turns them into samples when Prometheus scrapes. Labels stay
bounded: ``job``, ``host`` and ``user`` on everything, ``rank`` only per rank of a
job, ``reason``/``type``/``source``/``counter``/``kind`` from fixed sets.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from perfmon.agent.reducers.phases import PHASES
from perfmon.agent.reducers.resources import GPU_EVENT_TYPES
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Step-time histogram bounds (s): 1 ms .. 1000 s, 4 per decade, 3 significant digits
# (0.001, 0.00178, 0.00316, 0.00562, 0.01, ...). A quantile interpolated inside a
# bucket is off by at most a factor 1.78, and 26 series per job keep a scrape small.
STEP_TIME_BUCKETS_S: tuple[float, ...] = tuple(
    float(f"{10 ** (k / 4 - 3):.3g}") for k in range(25))
_BUCKET_LE = (*(floatToGoString(b) for b in STEP_TIME_BUCKETS_S), "+Inf")

# Per-rank figures other parts of the agent compute: name -> help text. Each becomes
# the gauge perfmon_rank_<name>; other names are ignored (labels and names stay fixed).
RANK_VALUE_NAMES: dict[str, str] = {
    "compute_seconds": "Seconds per iteration the rank spent computing (not waiting), "
                       "as the agent's rank analysis measured it.",
    "wait_seconds": "Seconds per iteration the rank spent waiting for the others "
                    "(collectives, synchronisation), as the agent's rank analysis measured it.",
    "p2p_wait_seconds": "Of the rank's wait seconds per iteration, those in point-to-point "
                        "sends and receives (a pipeline's activations and gradients: its "
                        "bubble).",
    "straggler": "1 while the agent counts the rank as a straggler (the others wait for "
                 "it; in a pipeline, its stage's other replicas), else 0.",
}
# perfmon_rank_info's coordinates: the rank's place in the job's stated layout.
COORD_LABELS = ("dp", "pp", "tp", "cp", "ep")

# GPU_EVENT_TYPES (perfmon.agent.reducers.resources): a fixed set, every one exposed from
# the job's start so that increase() sees its first event.

# NVML reports at most 64 clock-event reason bits (named ones, the rest "unknown_0x..."):
# a cap of the same size keeps a buggy caller from growing the label set.
MAX_THROTTLE_REASONS = 64

JOB_LABELS = ("job", "host", "user")

# Job-level gauges: key in JobSeries.gauges -> (metric name, help).
JOB_GAUGES: dict[str, tuple[str, str]] = {
    "tokens_per_second": (
        "perfmon_tokens_per_second",
        "Tokens per second of the whole job (global batch) over the latest log interval, "
        "as this host's primary rank saw it; every host reports the same job-wide figure."),
    "samples_per_second": (
        "perfmon_samples_per_second",
        "Samples per second of the whole job over the latest log interval (see tokens)."),
    "tflops_per_gpu": (
        "perfmon_tflops_per_gpu",
        "Model TFLOPS per GPU (job FLOPs / (step time x world size) / 1e12) over the "
        "latest log interval."),
    "mfu_ratio": (
        "perfmon_mfu_ratio",
        "Model FLOPs utilization (0..1) over the latest log interval: TFLOPS per GPU over "
        "the device's dense peak."),
    "gpu_utilization_ratio": (
        "perfmon_gpu_utilization_ratio",
        "Mean NVML utilization (0..1) of the job's GPUs on this host over the latest "
        "log interval."),
    "gpu_power_watts": (
        "perfmon_gpu_power_watts",
        "Mean power draw (W) per GPU of the job's GPUs on this host over the latest "
        "log interval."),
    "hung": (
        "perfmon_hung",
        "1 while the job is hung (no iteration for the hang threshold), else 0."),
    "goodput_ratio": (
        "perfmon_goodput_ratio",
        "The job's goodput on this host so far: its ranks' productive time over their wall "
        "time, across its sessions (restarts included); docs/metrics.md, Goodput."),
    "world_size": (
        "perfmon_job_world_size",
        "The job's ranks on all its hosts (WORLD_SIZE, else Slurm's SLURM_NTASKS), as this "
        "host's ranks say it."),
    "host_compute_seconds": (
        "perfmon_host_compute_seconds",
        "Median over the job's ranks on this host of their compute seconds per iteration "
        "(perfmon_rank_compute_seconds): the host's figure when the job's hosts are "
        "compared."),
    "host_wait_ratio": (
        "perfmon_host_wait_ratio",
        "Share (0..1) of the step time the job's ranks on this host spent waiting: their "
        "wait seconds over their wait plus compute seconds."),
    "pipeline_bubble_ratio": (
        "perfmon_pipeline_bubble_ratio",
        "A pipeline-parallel job's measured bubble over the latest log interval: the mean "
        "over its stages (on this host) of their point-to-point wait over their step "
        "(docs/pipeline.md)."),
    "pipeline_ideal_bubble_ratio": (
        "perfmon_pipeline_ideal_bubble_ratio",
        "The schedule's bubble for the job's stages and micro-batches: (p - 1) / (v m + "
        "p - 1)."),
    "pipeline_bounding_stage": (
        "perfmon_pipeline_bounding_stage",
        "The pipeline stage with the most compute over the latest log interval (the one "
        "the others wait for)."),
    "pipeline_bounding_excess_ratio": (
        "perfmon_pipeline_bounding_excess_ratio",
        "That stage's compute over the median of the other stages', less 1, in every "
        "data-parallel replica (the least of the replicas'): PerfmonPipelineStageBound "
        "alerts beyond StageRule's share."),
    "fail_slow_active": (
        "perfmon_fail_slow_active",
        "1 while the job's step time is in a fail-slow episode (a sustained rise not yet "
        "recovered, fully or partly), else 0."),
}

# perfmon_job_info's labels from the schedulers ("" where none): the Slurm job id, the
# Kubernetes namespace and pod (one series a job, names reduced to [A-Za-z0-9._-] and
# 64 characters), so jobs are found by the names operators know them by.
SCHEDULER_INFO = ("slurm_job_id", "namespace", "pod")

# perfmon_fail_slow_ratio's phase label: the phase whose time moved most (a fixed set),
# "unknown" until stack samples tell.
FAIL_SLOW_PHASES = (*PHASES, "unknown")


@dataclass
class JobSeries:
    """What is exposed for one job; all figures in the metric's unit (s, bytes, 0..1)."""

    labels: list[str]  # job, host, user
    info: dict[str, str]  # perfmon_job_info's labels beyond those
    pid_rank: dict[int, int | None]
    iterations: int = 0
    step_buckets: list[int] = field(default_factory=lambda: [0] * len(_BUCKET_LE))
    step_sum_s: float = 0.0
    gauges: dict[str, float] = field(default_factory=dict)  # JOB_GAUGES keys
    throttled: dict[str, float] = field(default_factory=dict)  # reason -> 0/1
    memory_bytes: dict[tuple[str, str], float] = field(default_factory=dict)  # (rank, kind)
    job_memory_bytes: float | None = None  # the latest interval's, kind still to be known
    memory_kind: str | None = None  # final_statistics.memory_kind: gpu or rss
    gpu_events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GPU_EVENT_TYPES, 0))
    losses: dict[tuple[str, str], float] = field(default_factory=dict)  # (source, counter)
    rank_values: dict[str, dict[str, float]] = field(default_factory=dict)  # name->rank->v
    fail_slow: tuple[float, str] | None = None  # the active episode: (ratio, phase)
    lost_seconds: dict[str, float] = field(default_factory=dict)  # cause -> s (the job's)
    rank_coords: dict[str, tuple[str, ...]] = field(default_factory=dict)  # rank -> coords

    def rank_label(self, rank: int | None, pid: int) -> str:
        """The ``rank`` label: the rank, or ``pid:<pid>`` for a process without RANK."""
        if rank is None:
            rank = self.pid_rank.get(pid)
        return str(rank) if rank is not None else f"pid:{pid}"

    def set_gauge(self, key: str, value: float | None) -> None:
        if value is None:
            self.gauges.pop(key, None)  # unknown now: no sample rather than a stale one
        else:
            self.gauges[key] = value

    def set_rank(self, rank: int | None, pid: int, values: dict[str, float | None]) -> None:
        """Per-rank figures (RANK_VALUE_NAMES); None removes the rank's series."""
        if rank is not None:
            self.pid_rank[pid] = rank
        label = self.rank_label(rank, pid)
        for name, value in values.items():
            per_rank = self.rank_values.setdefault(name, {})
            if value is None:
                per_rank.pop(label, None)
            else:
                per_rank[label] = value


def families(jobs: list[JobSeries], host: str, agent: tuple[float, int, int] | None
             ) -> list[Metric]:
    """Every family with the current samples: the jobs' (in the order given), then the
    agent's own (``agent``: CPU seconds, resident bytes, jobs; None before the first)."""
    return [*_step_families(jobs), *_gauge_families(jobs), *_labelled_families(jobs),
            *_rank_families(jobs), *_agent_families(host, agent)]


def _step_families(jobs: list[JobSeries]) -> list[Metric]:
    step = HistogramMetricFamily(
        "perfmon_step_time_seconds",
        "Step time (s) of the job's iterations, measured on this host's primary rank.",
        labels=JOB_LABELS)
    iterations = CounterMetricFamily(
        "perfmon_iterations", "Iterations of the job completed since the agent attached.",
        labels=JOB_LABELS)
    for s in jobs:
        cumulative, buckets = 0, []
        for le, count in zip(_BUCKET_LE, s.step_buckets, strict=True):
            cumulative += count
            buckets.append((le, float(cumulative)))
        step.add_metric(s.labels, buckets, s.step_sum_s)
        iterations.add_metric(s.labels, float(s.iterations))
    return [step, iterations]


def _gauge_families(jobs: list[JobSeries]) -> list[Metric]:
    out: list[Metric] = []
    for key, (name, doc) in JOB_GAUGES.items():
        gauge = GaugeMetricFamily(name, doc, labels=JOB_LABELS)
        for s in jobs:
            if key in s.gauges:
                gauge.add_metric(s.labels, s.gauges[key])
        out.append(gauge)
    return out


def _labelled_families(jobs: list[JobSeries]) -> list[Metric]:
    """The job's families with one more label from a fixed set (rank and kind, reason,
    type, source and counter, phase) and its info."""
    memory = GaugeMetricFamily(
        "perfmon_memory_bytes",
        "Peak memory (bytes) of each rank so far: resident set (kind=rss) and GPU "
        "memory the driver reports for it (kind=gpu).",
        labels=[*JOB_LABELS, "rank", "kind"])
    job_memory = GaugeMetricFamily(
        "perfmon_job_memory_bytes",
        "Memory (bytes) of the job's largest rank, mean over the latest log interval; "
        "kind=gpu for GPU jobs, rss otherwise.",
        labels=[*JOB_LABELS, "kind"])
    throttled = GaugeMetricFamily(
        "perfmon_gpu_throttled",
        "1 while the latest log interval saw this clock-event (throttle) reason on the "
        "job's GPUs, 0 once it is gone.",
        labels=[*JOB_LABELS, "reason"])
    events = CounterMetricFamily(
        "perfmon_gpu_events", "GPU events (xid, ecc, gpu_lost) the job's session saw on "
        "this host's GPUs since the agent attached.", labels=[*JOB_LABELS, "type"])
    lost = CounterMetricFamily(
        "perfmon_lost_seconds", "Wall seconds the job lost on this host, by cause (startup, "
        "hang, restart, straggler, slowdown, data_stall, unexplained), across its sessions; "
        "x perfmon_job_world_size's share of ranks here for GPU-seconds (docs/metrics.md).",
        labels=[*JOB_LABELS, "cause"])
    losses = GaugeMetricFamily(
        "perfmon_data_quality_losses",
        "Current value of each source's loss counter (final_statistics.data_quality).",
        labels=[*JOB_LABELS, "source", "counter"])
    fail_slow = GaugeMetricFamily(
        "perfmon_fail_slow_ratio",
        "The step time of the active fail-slow episode over the job's healthy baseline "
        "(no sample when none is active); phase: the phase whose time moved most.",
        labels=[*JOB_LABELS, "phase"])
    info = GaugeMetricFamily(
        "perfmon_job_info", "A job this agent monitors (value 1), with static facts.",
        labels=[*JOB_LABELS, "ranks", "processes", "agent_version", *SCHEDULER_INFO])
    for s in jobs:
        for (rank, kind), value in sorted(s.memory_bytes.items()):
            memory.add_metric([*s.labels, rank, kind], value)
        if s.job_memory_bytes is not None and s.memory_kind is not None:
            job_memory.add_metric([*s.labels, s.memory_kind], s.job_memory_bytes)
        for reason, value in sorted(s.throttled.items()):
            throttled.add_metric([*s.labels, reason], value)
        for kind, count in s.gpu_events.items():
            events.add_metric([*s.labels, kind], float(count))
        for cause, seconds in sorted(s.lost_seconds.items()):
            lost.add_metric([*s.labels, cause], seconds)
        for (source, counter), value in sorted(s.losses.items()):
            losses.add_metric([*s.labels, source, counter], value)
        if s.fail_slow is not None:
            fail_slow.add_metric([*s.labels, s.fail_slow[1]], s.fail_slow[0])
        info.add_metric([*s.labels, s.info["ranks"], s.info["processes"],
                         s.info["agent_version"], *(s.info.get(k, "") for k in SCHEDULER_INFO)],
                        1.0)
    return [memory, job_memory, throttled, events, lost, losses, fail_slow, info]


def _rank_families(jobs: list[JobSeries]) -> list[Metric]:
    out: list[Metric] = []
    for name, doc in RANK_VALUE_NAMES.items():
        gauge = GaugeMetricFamily(f"perfmon_rank_{name}", doc, labels=[*JOB_LABELS, "rank"])
        for s in jobs:
            for rank, value in sorted(s.rank_values.get(name, {}).items()):
                gauge.add_metric([*s.labels, rank], value)
        out.append(gauge)
    info = GaugeMetricFamily(
        "perfmon_rank_info", "A rank's place in the job's stated parallel layout (value 1): "
        "its data-parallel replica, pipeline stage, tensor-, context- and expert-parallel "
        "ranks (docs/pipeline.md).", labels=[*JOB_LABELS, "rank", *COORD_LABELS])
    for s in jobs:
        for rank, coords in sorted(s.rank_coords.items()):
            info.add_metric([*s.labels, rank, *coords], 1.0)
    out.append(info)
    return out


def _agent_families(host: str, agent: tuple[float, int, int] | None) -> list[Metric]:
    cpu = CounterMetricFamily(
        "perfmon_agent_cpu_seconds", "CPU time (s) the agent used since it started "
        "(user + system, its py-spy children included).", labels=["host"])
    resident = GaugeMetricFamily(
        "perfmon_agent_resident_memory_bytes", "The agent's resident memory (bytes).",
        labels=["host"])
    jobs_gauge = GaugeMetricFamily(
        "perfmon_jobs", "Jobs the agent monitors now.", labels=["host"])
    if agent is not None:
        cpu_s, rss, n_jobs = agent
        cpu.add_metric([host], cpu_s)
        resident.add_metric([host], float(rss))
        jobs_gauge.add_metric([host], float(n_jobs))
    return [cpu, resident, jobs_gauge]


class CapabilityGauge(Collector):
    """``perfmon_capability{host, check}``: the host checks ``serve`` ran at start
    (perfmon.probes.capabilities, as ``doctor`` shows them), 1 where the check works or
    is not needed on the node, 0 where the agent is degraded by it. ``check`` takes the
    checks' fixed names (HOST_CHECK_NAMES): one series per check."""

    def __init__(self, host: str, works: Mapping[str, bool]) -> None:
        self.host, self.works = host, dict(works)

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "perfmon_capability", "1 when the agent's host check works (or is not needed "
            "on this node), 0 when the agent is degraded by it; run when the service started "
            "(docs/doctor.md).", labels=["host", "check"])
        for name, works in sorted(self.works.items()):
            gauge.add_metric([self.host, name], 1.0 if works else 0.0)
        return iter([gauge])
