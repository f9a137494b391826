"""The report's runs: each recorded run (perfmon.agent.record.runs) with its series over
time, every iteration_logs entry folded into a bounded number of points as it is read.

An event log is replayed (the numbers ``summarize`` gives) and every entry the
reducers complete becomes part of the series, not only those the summary file
keeps (``--max-log-entries``); a summary alone gives its own ``iteration_logs``.
Each series is folded into at most ``--max-points`` points in flat memory: every
point stands for the same number of consecutive log intervals (a power of two,
doubled whenever the points would exceed the limit), with their mean and extremes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from perfmon.agent.record.runs import RecordedRun, load_runs
from perfmon.agent.record.summary import entry_filter
from perfmon.parsers.errors import InputFileError, PerfmonError
from perfmon.parsers.schema_filter import Filtered

DEFAULT_MAX_POINTS = 2000
_SERIES = ("step_time_ms", "tokens_per_sec", "samples_per_sec", "TFLOPS_per_GPU", "memory_GB",
           "gpu_utilization_pct", "gpu_power_w")

def phase_figures(phases: Any) -> dict[str, tuple[float | None, float | None]]:
    """(ms per iteration, share) of each phase of a ``phases`` object; {} without one."""
    if not isinstance(phases, dict):
        return {}
    return {p: (number(v.get("ms")), number(v.get("share"))) for p, v in phases.items()
            if isinstance(v, dict)}


def objects(items: Any) -> list[dict[str, Any]]:
    """The objects of a summary's list (an item may be unknown: None)."""
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


class Point:
    """Consecutive log intervals folded into one point: means, extremes, phase time."""

    __slots__ = ("counts", "end_ns", "intervals", "iteration", "memory_max_gb", "phase_intervals",
                 "phase_ms", "start_ns", "step_max_ms", "step_min_ms", "sums", "throttle")

    def __init__(self, entry: dict[str, Any], log_interval: int) -> None:
        step_ms = entry["step_time_ms"]
        self.end_ns: int = entry["end_monotonic_ns"]
        # The entry covers log_interval iterations of step_time_ms each (their mean).
        self.start_ns: int = self.end_ns - round(step_ms * 1e6 * log_interval)
        self.intervals = 1
        self.iteration = entry.get("iteration")
        self.sums = {k: float(v) for k in _SERIES if isinstance(v := entry.get(k), int | float)}
        self.counts = dict.fromkeys(self.sums, 1)
        self.step_min_ms = self.step_max_ms = step_ms
        self.memory_max_gb = entry.get("memory_GB")
        self.phase_ms = {p: ms for p, (ms, _) in phase_figures(entry.get("phases")).items()
                         if ms is not None}
        self.phase_intervals = 1 if self.phase_ms else 0
        self.throttle = set(entry.get("gpu_throttle_reasons") or ())

    def merge(self, later: Point) -> None:
        """Fold the point right after this one into it."""
        self.end_ns, self.iteration = later.end_ns, later.iteration
        self.intervals += later.intervals
        for k, v in later.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
            self.counts[k] = self.counts.get(k, 0) + later.counts[k]
        self.step_min_ms = min(self.step_min_ms, later.step_min_ms)
        self.step_max_ms = max(self.step_max_ms, later.step_max_ms)
        if later.memory_max_gb is not None:
            self.memory_max_gb = max(self.memory_max_gb or 0.0, later.memory_max_gb)
        for p, ms in later.phase_ms.items():
            self.phase_ms[p] = self.phase_ms.get(p, 0.0) + ms
        self.phase_intervals += later.phase_intervals
        self.throttle |= later.throttle

    def mean(self, name: str) -> float | None:
        count = self.counts.get(name)
        return self.sums[name] / count if count else None

    def value(self, name: str) -> float:
        """The mean, NaN when unknown (matplotlib leaves a gap there)."""
        mean = self.mean(name)
        return math.nan if mean is None else mean

    def phase_shares(self) -> dict[str, float] | None:
        total = sum(self.phase_ms.values())
        return {p: ms / total for p, ms in self.phase_ms.items()} if total > 0 else None


class IntervalSeries:
    """Every log interval of a run, in at most ``max_points`` points of ``stride`` intervals.

    When the points would exceed the limit, neighbours are merged in pairs and the
    stride doubles, so every point (but the newest, still filling) covers the same
    number of intervals, and memory stays flat however long the run.
    """

    def __init__(self, max_points: int, log_interval: int) -> None:
        self.max_points = max(2, max_points - max_points % 2)
        self.log_interval = log_interval
        self.stride = 1
        self.intervals = 0
        self.thinned_by_agent = 1  # a summary's own iteration_logs_kept_one_in
        self._closed: list[Point] = []
        self._open: Point | None = None

    def add(self, entry: dict[str, Any]) -> None:
        self.intervals += 1
        point = Point(entry, self.log_interval)
        if self._open is None:
            self._open = point
        else:
            self._open.merge(point)
        if self._open.intervals < self.stride:
            return
        self._closed.append(self._open)
        self._open = None
        if len(self._closed) >= self.max_points:
            pairs = self._closed
            for a, b in zip(pairs[::2], pairs[1::2], strict=True):
                a.merge(b)
            self._closed = pairs[::2]
            self.stride *= 2

    @property
    def points(self) -> list[Point]:
        return self._closed + ([self._open] if self._open is not None else [])

    @property
    def downsampled(self) -> bool:
        return self.stride > 1


# -- inputs --------------------------------------------------------------------------


class Run(RecordedRun):
    """A recorded run and its series, for the page."""

    series: IntervalSeries

    @property
    def attach_ns(self) -> int:
        return int(self.info["attach_monotonic_ns"])  # type: ignore[arg-type]

    def title(self) -> str:
        info = self.info
        ranks = [r for r in info.get("ranks") or [] if r is not None]
        who = f"ranks {ranges(ranks)}" if len(ranks) > 1 else (
            f"rank {ranks[0]}" if ranks else "")
        parts = [str(info.get("host", "?")), f"pid {info.get('primary_pid', info.get('pid'))}",
                 who, str(info.get("start_time", ""))]
        return " · ".join(p for p in parts if p)


def ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for v in sorted(set(values)):
        if spans and spans[-1][1] == v - 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


class _SeriesSink:
    """Takes a replayed log's every entry into its series (kept to the entry schema first:
    made from the log's records, a figure out of range would overflow a plot)."""

    def __init__(self, max_points: int, log_interval: int) -> None:
        self.series = IntervalSeries(max_points, log_interval)
        self.changed = Filtered()

    def __call__(self, entry: dict[str, Any]) -> None:
        _, filtered = entry_filter().apply(entry)
        self.changed.changed += filtered.changed
        self.changed.examples += filtered.examples[:1]
        self.series.add(entry)


def load_report_runs(path: Path, max_points: int = DEFAULT_MAX_POINTS) -> list[Run]:
    """The runs of a log, a summary or a folder (and one level down), each with its series,
    sorted by host, rank and pid. A bad file among several is a warning.

    Raises InputFileError or EventLogError (exit 2).
    """
    found = load_runs(path, lambda _source, facts: _SeriesSink(max_points, facts["log_interval"]))
    runs: list[Run] = []
    errors: list[PerfmonError] = []
    carried: list[str] = []  # load_runs's own "skipped:" lines, when their run goes too
    for recorded in found:
        try:
            runs.append(_with_series(recorded, max_points))
        except InputFileError as err:
            errors.append(err)
            carried += [w for w in recorded.warnings if w.startswith("skipped: ")]
    if not runs:
        raise errors[0]
    runs[0].warnings += carried + [f"skipped: {error}" for error in errors]
    runs.sort(key=lambda r: (str(r.info.get("host", "")), _first_rank(r),
                             r.info.get("primary_pid") or 0, str(r.source)))
    return runs


def _with_series(recorded: RecordedRun, max_points: int) -> Run:
    run = Run(recorded.source, recorded.kind, recorded.summary, warnings=recorded.warnings,
              mtime_s=recorded.mtime_s, sink=recorded.sink)
    if isinstance(recorded.sink, _SeriesSink):
        run.series, changed = recorded.sink.series, recorded.sink.changed
        if changed.changed:
            run.warnings.append(f"{run.source}: {changed.changed} interval figure(s) out of "
                                f"range shown as unknown (first: {changed.examples[0]})")
        return run
    info = run.info
    if not isinstance(info.get("attach_monotonic_ns"), int):
        raise InputFileError(f"summary {run.source}: session_info has no attach_monotonic_ns")
    log_interval = info.get("log_interval")
    run.series = IntervalSeries(max_points, log_interval if isinstance(log_interval, int)
                                and log_interval > 0 else 1)
    run.series.thinned_by_agent = int(info.get("iteration_logs_kept_one_in") or 1)
    for entry in run.entries:
        if (isinstance(entry.get("end_monotonic_ns"), int)
                and isinstance(entry.get("step_time_ms"), int | float)):
            run.series.add(entry)
    return run


def _first_rank(run: Run) -> float:
    ranks = [r for r in run.info.get("ranks") or [] if isinstance(r, int)]
    return min(ranks) if ranks else math.inf
