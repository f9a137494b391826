"""Memory and GPU figures over time: resident and GPU memory per rank, GPU utilization,
power and throttling, and GPU events (XID, ECC, a GPU lost)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from perfmon.parsers.figures import scaled
from perfmon.parsers.gpu_samples import job_gpu_indices

# The GPU events a session records (final_statistics.gpu_events' types): a fixed set.
GPU_EVENT_TYPES = ("xid", "ecc", "gpu_lost")



class Series:
    """Samples of one quantity over time: window means for intervals, a whole-run mean and max.

    Queries are pure; ``prune`` forgets what lies before an instant (intervals
    are asked in time order), so a week-long session holds a few seconds of samples.
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
        return sum(window) / len(window) if window else None

    def prune(self, before_ns: int) -> None:
        """Keep the samples from ``before_ns`` on, and the latest one before it (the next
        window's figure when no sample falls in it; later samples may be in already)."""
        before = [m for m in self._recent if m[0] < before_ns][-1:]
        self._recent = before + [m for m in self._recent if m[0] >= before_ns]

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


class Resources:
    """Feeds on ``process``, ``gpu``, ``xid`` and ``ecc`` records."""

    def __init__(self, wall_time: Callable[[int], str]) -> None:
        self.wall_time = wall_time
        # Job figures over time: the largest rank's RSS and GPU memory (bytes), and the
        # mean utilization (%) and power (W) of the job's GPUs.
        self.series = {k: Series() for k in ("rss", "gpu_memory", "gpu_util", "gpu_power")}
        self.gpu_events: list[dict[str, Any]] = []  # xid, ecc, lost
        self.gpu_attribution: str | None = None
        self._job_gpus: set[int] = set()
        self._throttle: dict[str, int] = {}  # reason -> samples, whole run
        self._interval_throttle: set[str] = set()
        self._rank_peaks: dict[int, dict[str, int]] = {}  # pid -> name -> bytes
        self._rank_gpus: dict[int, list[int]] = {}
        self._lost_gpus: set[int] = set()

    def on_process(self, record: dict[str, Any]) -> None:
        rss, peak = record["rss_bytes"], record["peak_rss_bytes"]
        self.series["rss"].add(record["t_mono_ns"], rss, peak)
        self._rank_peak(record["pid"], "rss_bytes", max(rss, peak or 0))

    def on_gpu_event(self, record: dict[str, Any]) -> None:
        self.gpu_events.append({**record, "timestamp": self.wall_time(record["t_mono_ns"])})

    def on_gpu(self, record: dict[str, Any]) -> None:
        """One NVML sample of every GPU: GPU memory per rank, utilization, power, throttling.

        The job's GPUs are those where NVML showed one of its processes; see
        job_gpu_indices for when every GPU, or none, counts.
        """
        t_ns, gpus = record["t_mono_ns"], record["gpus"]
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
            self.series["gpu_memory"].add(t_ns, max(per_rank.values()))
        indices, how = job_gpu_indices(gpus)
        if self.gpu_attribution != "processes":
            self.gpu_attribution = how
        if self._job_gpus:
            indices = self._job_gpus
        mine = [g for g in gpus if not g["lost"] and g["index"] in indices]
        util = [g["utilization_gpu_pct"] for g in mine if g["utilization_gpu_pct"] is not None]
        power = [g["power_w"] for g in mine if g["power_w"] is not None]
        if util:
            self.series["gpu_util"].add(t_ns, sum(util) / len(util))
        if power:
            self.series["gpu_power"].add(t_ns, sum(power) / len(power))
        for g in mine:
            for reason in g["throttle_reasons"] or []:
                self._throttle[reason] = self._throttle.get(reason, 0) + 1
                self._interval_throttle.add(reason)

    def _rank_peak(self, pid: int, name: str, value: int) -> None:
        peaks = self._rank_peaks.setdefault(pid, {})
        peaks[name] = max(value, peaks.get(name, 0))

    def _memory(self) -> Series:
        """GPU memory for GPU jobs, resident memory otherwise."""
        gpu = self.series["gpu_memory"]
        return gpu if gpu.count else self.series["rss"]

    def interval(self, start: int, end: int) -> dict[str, Any]:
        """The memory and GPU figures (perfmon.parsers.figures.IntervalFigures' fields)
        of an interval; GPU ones only for GPU jobs."""
        fields: dict[str, Any] = {"memory_bytes": self._memory().window_mean(start, end)}
        if self.series["gpu_util"].count or self.series["gpu_power"].count:
            fields.update(
                gpu_utilization=scaled(self.series["gpu_util"].window_mean(start, end), 0.01),
                gpu_power_w=self.series["gpu_power"].window_mean(start, end),
                gpu_throttle_reasons=tuple(sorted(self._interval_throttle)))
        return fields

    def prune(self, before_ns: int) -> None:
        """After an interval entry: forget its samples and its throttle reasons."""
        for series in self.series.values():
            series.prune(before_ns)
        self._interval_throttle = set()

    def summary(self) -> dict[str, Any]:
        """The whole session's figures (perfmon.parsers.figures.Statistics' fields)."""
        counts = dict.fromkeys(GPU_EVENT_TYPES, 0)
        for event in self.gpu_events:
            counts[event["type"]] = counts.get(event["type"], 0) + 1
        return {
            "peak_memory_bytes": self._memory().peak,
            "memory_kind": "gpu" if self.series["gpu_memory"].count else "rss",
            "gpu_utilization": scaled(self.series["gpu_util"].mean, 0.01),
            "gpu_power_w": self.series["gpu_power"].mean,
            "gpu_throttle_reasons": dict(self._throttle),
            "gpu_events": tuple(self.gpu_events),
            "gpu_event_counts": counts,
            "gpu_attribution": self.gpu_attribution,
        }

    def rank_peaks(self) -> dict[int, dict[str, Any]]:
        """pid -> the rank's peaks (perfmon.parsers.figures.RankFigures' fields)."""
        return {pid: {"peak_rss_bytes": peaks.get("rss_bytes"),
                      "peak_gpu_memory_bytes": peaks.get("gpu_memory_bytes"),
                      "gpu_indices": tuple(self._rank_gpus.get(pid, []))}
                for pid, peaks in sorted(self._rank_peaks.items())}
