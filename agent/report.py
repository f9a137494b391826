"""`perfmon-agent report`: one self-contained HTML page of a session (or of several ranks'
or nodes' sessions of one job), and optionally its plots as PNG files.

Inputs: an event log (``perf_events_<ts>.msgpack``, any of its parts), a summary
(``perf_summary_<ts>.json``), or a folder holding several of them (and its
sub-folders, one level down: one per node). An event log is replayed through the
agent's own Summarizer (perfmon.agent.summary, the code ``summarize`` runs), so the
page shows the numbers ``summarize`` gives; the series over time are the
``iteration_logs`` entries the Summarizer completes, every one of them (the
summary file itself keeps at most ``--max-log-entries``). A summary alone gives
its own ``iteration_logs``.

Long runs: each series is folded into at most ``--max-points`` points (2,000) as
it is read, in flat memory: every point stands for the same number of consecutive
log intervals (a power of two, doubled whenever the points would exceed the
limit), with their mean, and the step-time plot draws their min-max band so a
slow interval still shows. The page says when this happened and by how much.

The page has no script, and no external style, font or image: the plots are
inline SVG (matplotlib's svg backend, text as text); ``--png DIR`` writes the
same plots as PNG files (Agg) for tickets and chats. Every plot is a
``<figure>`` with a stable id: ``plot-step-time``, ``plot-phases``,
``plot-memory``, ``plot-gpu`` (GPU jobs), ``plot-throughput``; with several logs
each section's ids end in ``-<n>`` (n = 1, 2, ... in the page's order) and
``plot-step-time-combined`` overlays every log's step time.
"""

from __future__ import annotations

import argparse
import functools
import html
import io
import math
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perfmon.agent.argtypes import positive_int
from perfmon.agent.console import printable, warn
from perfmon.agent.outputs import OutputDir, OutputNotWritable, json_bytes, write_user_file
from perfmon.agent.rank_table import describe_rest, select_ranks
from perfmon.agent.reducers.phases import PHASES
from perfmon.agent.summary import entry_filter, read_summary, rebuild_from_event_log
from perfmon.parsers.errors import PerfmonError
from perfmon.parsers.schema_filter import Filtered
from perfmon.probes.files import InputFileError, open_user_file

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DEFAULT_MAX_POINTS = 2000
RANKS_EACH_WAY = 64  # a job of more ranks: the 64 slowest and fastest, the rest in one row
GIB = 1 << 30

REPORT_DESCRIPTION = ("Write one self-contained HTML page (inline SVG plots, no scripts) of a "
                      "session's event log or summary, or of a folder of several.")
REPORT_EPILOG = """examples:
  perfmon-agent report outputs/logs/perf_monitor/perf_events_20261130_120000.msgpack
  perfmon-agent report outputs/logs/perf_monitor/perf_summary_20261130_120000.json -o run.html
  perfmon-agent report /shared/job-42/perf_logs/ -o job42.html --png job42-plots/

A folder gives one section per event log (a rank or a node of one job) and a
combined table. Series longer than --max-points are averaged over equal groups of
consecutive log intervals; the page says so. The page needs no network.
"""

PHASE_COLORS = {"data_loading": "#e6a31a", "forward": "#3a78c2", "backward": "#9b4fb0",
                "optimizer": "#3d9a50", "other": "#b8b8b8"}
_SERIES = ("step_time_ms", "tokens_per_sec", "samples_per_sec", "TFLOPS_per_GPU", "memory_GB",
           "gpu_utilization_pct", "gpu_power_w")


# -- the series: iteration_logs entries folded into a bounded number of points -------

def phase_figures(phases: Any) -> dict[str, tuple[float | None, float | None]]:
    """(ms per iteration, share) of each phase of a ``phases`` object; {} without one."""
    if not isinstance(phases, dict):
        return {}
    return {p: (_float(v.get("ms")), _float(v.get("share"))) for p, v in phases.items()
            if isinstance(v, dict)}


def _dicts(items: Any) -> list[dict[str, Any]]:
    """The objects of a summary's list (an item may be unknown: None)."""
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _float(value: Any) -> float | None:
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

@dataclass
class Run:
    """One session's data for the page."""

    source: Path  # the event log's first part, or the summary file
    kind: str  # "event log" or "summary"
    summary: dict[str, Any]
    series: IntervalSeries
    warnings: list[str] = field(default_factory=list)

    @property
    def info(self) -> dict[str, Any]:
        return self.summary["session_info"]

    @property
    def stats(self) -> dict[str, Any]:
        return self.summary["final_statistics"]

    @property
    def attach_ns(self) -> int:
        return int(self.info["attach_monotonic_ns"])

    @functools.cached_property
    def _rank_by_pid(self) -> dict[int, int | None]:
        pids, ranks = self.info.get("pids") or [], self.info.get("ranks") or []
        return {pid: ranks[i] if i < len(ranks) else None for i, pid in enumerate(pids)
                if isinstance(pid, int)}

    def rank_of(self, pid: int) -> int | None:
        return self._rank_by_pid.get(pid)

    def title(self) -> str:
        info = self.info
        ranks = [r for r in info.get("ranks") or [] if r is not None]
        who = f"ranks {_ranges(ranks)}" if len(ranks) > 1 else (
            f"rank {ranks[0]}" if ranks else "")
        parts = [str(info.get("host", "?")), f"pid {info.get('primary_pid', info.get('pid'))}",
                 who, str(info.get("start_time", ""))]
        return " · ".join(p for p in parts if p)


def load_event_log(path: Path, max_points: int = DEFAULT_MAX_POINTS) -> Run:
    """Replay an event log (all its parts) through the Summarizer; the summary it gives
    (as ``summarize`` would) and every interval entry as a bounded series.

    Raises EventLogError or InputFileError (exit 2) for a file that is no event log.
    """
    series: list[IntervalSeries] = []
    entries = entry_filter()
    changed = Filtered()

    def start(facts: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
        series.append(IntervalSeries(max_points, facts["log_interval"]))

        def add(entry: dict[str, Any]) -> None:
            # Made from the log's records: a figure out of range would overflow a plot.
            _, filtered = entries.apply(entry)
            changed.changed += filtered.changed
            changed.examples += filtered.examples[:1]
            series[0].add(entry)
        return add

    rebuilt = rebuild_from_event_log(path, start)
    warnings = rebuilt.warnings + ([
        f"{rebuilt.parts[0]}: {changed.changed} interval figure(s) out of range shown as "
        f"unknown (first: {changed.examples[0]})"] if changed.changed else [])
    return Run(rebuilt.parts[0], "event log", rebuilt.summary, series[0], warnings)


def load_summary_file(path: Path, max_points: int = DEFAULT_MAX_POINTS) -> Run:
    """A perf summary JSON file; its own iteration_logs give the series. InputFileError."""
    summary, problem = read_summary(path)
    if not isinstance(summary["session_info"].get("attach_monotonic_ns"), int):
        raise InputFileError(f"summary {path}: session_info has no attach_monotonic_ns")
    info = summary["session_info"]
    log_interval = info.get("log_interval")
    series = IntervalSeries(max_points, log_interval if isinstance(log_interval, int)
                            and log_interval > 0 else 1)
    series.thinned_by_agent = int(info.get("iteration_logs_kept_one_in") or 1)
    for entry in summary["iteration_logs"]:
        if (isinstance(entry, dict) and isinstance(entry.get("end_monotonic_ns"), int)
                and isinstance(entry.get("step_time_ms"), int | float)):
            series.add(entry)
    return Run(path, "summary", summary, series, [problem] if problem else [])


def is_summary_file(path: Path) -> bool:
    """Whether a file the user named is JSON (a summary) rather than msgpack (a log)."""
    fd = open_user_file(str(path), "input")
    try:
        head = os.read(fd, 64)
    except OSError as err:
        raise InputFileError(f"input {path}: cannot read: {err.strerror}") from err
    finally:
        os.close(fd)
    return head.lstrip()[:1] == b"{"


_LOG = re.compile(r"^perf_events_(?P<stem>.+?)\.msgpack$")
_PART = re.compile(r"\.part\d+$")
_SUMMARY = re.compile(r"^perf_summary_(?P<stem>.+?)\.json$")


def is_folder_input(path: Path) -> bool:
    """Whether a LOG_OR_DIR argument is a folder; raises InputFileError (exit 2) when it
    names nothing."""
    try:
        is_dir = path.is_dir()
        exists = is_dir or path.exists() or path.is_symlink()
    except OSError as err:
        raise InputFileError(f"input {path}: {err.strerror}") from err
    if not exists:
        raise InputFileError(f"input {path}: no such file or folder")
    return is_dir


def find_inputs(folder: Path) -> list[Path]:
    """The event logs (first parts) in ``folder`` and its sub-folders, and the summaries
    there whose event log is not beside them, sorted by path."""
    found: list[Path] = []
    try:
        folders = [folder, *sorted(p for p in folder.iterdir()
                                   if p.is_dir() and not p.is_symlink())]
    except OSError as err:
        raise InputFileError(f"folder {folder}: {err.strerror}") from err
    for where in folders:
        try:
            names = sorted(os.listdir(where))
        except OSError:
            continue
        stems = set()
        for name in names:
            match = _LOG.match(name)
            if match and not _PART.search(match["stem"]):
                stems.add(match["stem"])
                found.append(where / name)
        for name in names:
            match = _SUMMARY.match(name)
            if match and match["stem"] not in stems:
                found.append(where / name)
    return found


def load_runs(path: Path, max_points: int = DEFAULT_MAX_POINTS) -> list[Run]:
    """The runs of a log, a summary or a folder (a bad file among several is a warning).

    Raises InputFileError or EventLogError (exit 2).
    """
    if not is_folder_input(path):
        return [_load(path, max_points)]
    inputs = find_inputs(path)
    if not inputs:
        raise InputFileError(f"folder {path}: no perf_events_*.msgpack or perf_summary_*.json "
                             "in it or in its sub-folders")
    runs, errors = [], []
    for item in inputs:
        try:
            runs.append(_load(item, max_points))
        except PerfmonError as err:
            errors.append(err)
    if not runs:
        raise errors[0]
    for error in errors:
        runs[0].warnings.append(f"skipped: {error}")
    runs.sort(key=lambda r: (str(r.info.get("host", "")), _first_rank(r),
                             r.info.get("primary_pid") or 0, str(r.source)))
    return runs


def _load(path: Path, max_points: int) -> Run:
    if is_summary_file(path):
        return load_summary_file(path, max_points)
    return load_event_log(path, max_points)


def _first_rank(run: Run) -> float:
    ranks = [r for r in run.info.get("ranks") or [] if isinstance(r, int)]
    return min(ranks) if ranks else math.inf


# -- formatting ----------------------------------------------------------------------

def _fmt(value: Any, spec: str, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:{spec}}{unit}"


def _text(value: Any) -> str:
    """Text a job may control (paths, command lines, hosts), safe in HTML and on one line."""
    return html.escape(printable(str(value)))


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for v in sorted(set(values)):
        if spans and spans[-1][1] == v - 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _how_iterations(run: Run) -> str:
    info, stats = run.info, run.stats
    source = info.get("iteration_source")
    how = {"uprobe": "eBPF uprobes on Optimizer.step (exact)",
           "pyspy": "py-spy stack samples (estimated)"}.get(str(source), str(source or "-"))
    backend = info.get("probe_backend")
    if source == "uprobe" and backend:
        how += f", {backend}"
    estimators = stats.get("iteration_estimators") or {}
    if estimators and set(estimators) != {"uprobe"}:
        how += "; ends by " + ", ".join(f"{k}: {v:,}" for k, v in sorted(estimators.items()))
    numbering = info.get("iteration_numbering")
    if numbering:
        how += f"; numbered {numbering}"
    return how


def _losses(run: Run) -> list[str]:
    return list((run.stats.get("data_quality") or {}).get("losses") or [])


def summary_rows(run: Run) -> list[tuple[str, str]]:
    """The summary table's (metric, value) rows, plain text."""
    info, s = run.info, run.stats
    mem_kind = {"gpu": "GPU memory", "rss": "resident memory"}.get(str(s.get("memory_kind")), "")
    losses = _losses(run)
    return [
        ("step time avg", _fmt(s.get("avg_step_time_ms"), ".2f", " ms")),
        ("step time p50 / p90 / p99", " / ".join(
            _fmt(s.get(k), ".2f") for k in ("p50_step_time_ms", "p90_step_time_ms",
                                              "p99_step_time_ms")) + " ms"),
        ("step time min / max", " / ".join(
            _fmt(s.get(k), ".2f") for k in ("min_step_time_ms", "max_step_time_ms")) + " ms"),
        ("tokens/s", _fmt(s.get("avg_tokens_per_sec"), ",.0f")),
        ("samples/s", _fmt(s.get("avg_samples_per_sec"), ",.2f")),
        ("TFLOPS per GPU", _fmt(s.get("avg_tflops_per_gpu"), ".3f")),
        ("MFU", _fmt(s.get("mfu"), ".1%")),
        ("peak memory", _fmt(s.get("peak_memory_gb"), ".2f", f" GiB {mem_kind}".rstrip())),
        ("iterations", f"{_fmt(info.get('total_iterations'), ',d')} ended, "
                       f"{_fmt(s.get('measured_iterations'), ',d')} measured "
                       "(the first end only opens the window)"),
        ("how iterations were found", _how_iterations(run)),
        ("micro-batches per step", _fmt(s.get("microbatches_per_step"), "d")),
        ("GPU utilization / power", (f"{_fmt(s.get('avg_gpu_utilization_pct'), '.1f', ' %')} / "
                                     f"{_fmt(s.get('avg_gpu_power_w'), '.0f', ' W')}")),
        ("phases from", str(s.get("phases_source") or "-")),
        ("data-quality losses", f"{len(losses)}: see below" if losses else "none"),
        ("model", str((info.get("model") or {}).get("source", "-"))),
        ("window", f"{info.get('start_time', '-')} .. {info.get('end_time') or 'running'} "
                   f"({info.get('end_reason') or 'running'})"),
        ("source", f"{run.kind} {run.source}"),
    ]


# -- plots ---------------------------------------------------------------------------

@dataclass
class Plot:
    plot_id: str
    title: str
    caption: str
    figure: Figure
    context: str = ""  # what run it shows: the PNG's title says it (the page's headings do)


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s <= 600:
        return 1.0, "seconds since attach"
    if span_s <= 10 * 3600:
        return 60.0, "minutes since attach"
    return 3600.0, "hours since attach"


class _Axis:
    """CLOCK_MONOTONIC ns to the x axis of a run: time since attach, in a unit that fits."""

    def __init__(self, attach_ns: int, end_ns: int) -> None:
        self.attach_ns, self.end_ns = attach_ns, end_ns
        self.div, self.label = _time_unit(max(0.0, (end_ns - attach_ns) / 1e9))

    def x(self, t_ns: int | float) -> float:
        return (t_ns - self.attach_ns) / 1e9 / self.div

    def apply(self, ax: Axes) -> None:
        """The whole window on the x axis, so that every plot of a run lines up."""
        ax.set_xlabel(self.label)
        if self.end_ns > self.attach_ns:
            ax.set_xlim(0, self.x(self.end_ns))


def _axis(run: Run) -> _Axis:
    points = run.series.points
    end = run.info.get("detach_monotonic_ns") or (points[-1].end_ns if points else run.attach_ns)
    return _Axis(run.attach_ns, int(end))


def _figure(height_in: float = 3.0) -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11.0, height_in), dpi=100, layout="constrained")
    return fig


def _no_data(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")
    ax.set_yticks([])


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _wall_to_mono(run: Run, iso: Any) -> int | None:
    """A wall-clock ISO time of the session back to CLOCK_MONOTONIC (hang recoveries)."""
    if not isinstance(iso, str) or not iso:
        return None
    try:
        wall = datetime.fromisoformat(iso).timestamp()
        start = datetime.fromisoformat(str(run.info["start_time"])).timestamp()
    except (ValueError, KeyError, OverflowError):
        return None
    return run.attach_ns + round((wall - start) * 1e9)


def _mark_events(ax: Axes, run: Run, axis: _Axis) -> None:
    """Hangs (shaded, until their recovery), GPU events (lines), fail-slow and recovery
    (dashed lines), stragglers (shaded), throttling (ticks on top)."""
    end_ns = _int(run.info.get("detach_monotonic_ns")) or (
        run.series.points[-1].end_ns if run.series.points else run.attach_ns)
    hangs = [h for h in run.stats.get("hangs") or []
             if isinstance(h, dict) and isinstance(h.get("t_mono_ns"), int)]
    for i, hang in enumerate(hangs):
        stalled = _int(hang.get("last_iteration_mono_ns")) or hang["t_mono_ns"]
        recovered = _wall_to_mono(run, hang.get("recovered_at"))
        ax.axvspan(axis.x(stalled), axis.x(recovered or end_ns), color="#d62728", alpha=0.15,
                   lw=0, label="hang (no iteration) until recovery" if i == 0 else None)
        ax.axvline(axis.x(hang["t_mono_ns"]), color="#d62728", lw=1,
                   label="hang detected" if i == 0 else None)
    labelled: set[str] = set()
    for event in run.stats.get("gpu_events") or []:
        if not isinstance(event, dict) or not isinstance(event.get("t_mono_ns"), int):
            continue
        kind = str(event.get("type", "gpu"))
        label = {"xid": "XID", "ecc": "ECC errors", "gpu_lost": "GPU lost"}.get(kind, kind)
        ax.axvline(axis.x(event["t_mono_ns"]), color="#7f3fbf", lw=1, ls=":",
                   label=label if label not in labelled else None)
        labelled.add(label)
        detail = (f"XID {event.get('xid')}" if kind == "xid" else
                  f"ECC {event.get('kind', '')}" if kind == "ecc" else "lost")
        ax.annotate(f"GPU {event.get('gpu_index', '?')}: {detail}",
                    (axis.x(event["t_mono_ns"]), 0.98), xycoords=ax.get_xaxis_transform(),
                    rotation=90, va="top", ha="right", fontsize=7, color="#7f3fbf")
    for event in run.stats.get("fail_slow") or []:
        if not isinstance(event, dict) or not isinstance(event.get("t_mono_ns"), int):
            continue
        slow = event.get("event") == "fail_slow"
        ax.axvline(axis.x(event["t_mono_ns"]), color="#8c564b" if slow else "#2ca02c", lw=1,
                   ls="--", label=("fail-slow" if slow else "recovered")
                   if ("fail-slow" if slow else "recovered") not in labelled else None)
        labelled.add("fail-slow" if slow else "recovered")
    for event in run.stats.get("stragglers") or []:
        if isinstance(event, dict) and isinstance(event.get("since_mono_ns"), int):
            until = _int(event.get("until_mono_ns")) or end_ns
            ax.axvspan(axis.x(event["since_mono_ns"]), axis.x(until), color="#bcbd22",
                       alpha=0.15, lw=0,
                       label="straggler" if "straggler" not in labelled else None)
            labelled.add("straggler")
    throttled = [axis.x(p.end_ns) for p in run.series.points if p.throttle]
    if throttled:
        ax.plot(throttled, [0.99] * len(throttled), transform=ax.get_xaxis_transform(),
                ls="none", marker="|", ms=8, color="#ff7f0e", label="GPU throttled")


def plot_step_time(run: Run, plot_id: str) -> Plot:
    fig = _figure(3.2)
    ax = fig.add_subplot()
    axis, points, stats = _axis(run), run.series.points, run.stats
    if points:
        x = [axis.x(p.end_ns) for p in points]
        if run.series.downsampled:
            ax.fill_between(x, [p.step_min_ms for p in points], [p.step_max_ms for p in points],
                            color="#1f77b4", alpha=0.2, lw=0,
                            label=f"min-max of the {run.series.stride} intervals in a point")
        ax.plot(x, [p.value("step_time_ms") for p in points], color="#1f77b4", lw=1.2,
                label="step time (mean per log interval)")
        for key, style, name in (("p50_step_time_ms", "--", "p50"),
                                 ("p90_step_time_ms", ":", "p90")):
            if stats.get(key) is not None:
                ax.axhline(stats[key], color="#444444", ls=style, lw=1,
                           label=f"{name} {stats[key]:.2f} ms (whole run)")
        _mark_events(ax, run, axis)
        top = max([p.step_max_ms for p in points] + [stats.get("p90_step_time_ms") or 0.0])
        ax.set_ylim(0, top * 1.12 or 1.0)
        ax.legend(loc="lower left", fontsize=7, ncols=3, framealpha=0.85)
    else:
        _no_data(ax, "no log interval completed (fewer iterations than --log-interval)")
    axis.apply(ax)
    ax.set_ylabel("step time (ms)")
    ax.grid(alpha=0.3)
    log_interval = run.series.log_interval
    return Plot(plot_id, "Step time",
                f"Mean step time of each log interval ({log_interval} iterations), the whole "
                "run's p50 and p90, and events: hangs (shaded until iterations resumed), XID / "
                "ECC / lost GPUs, GPU throttling.", fig)


def plot_phases(run: Run, plot_id: str) -> Plot:
    import numpy as np

    fig = _figure(2.8)
    ax = fig.add_subplot()
    axis = _axis(run)
    xs: list[float] = []
    tops: dict[str, list[float]] = {p: [] for p in PHASES}
    previous_end: int | None = None
    covered = 0
    for point in run.series.points:
        shares = point.phase_shares()
        if shares is None:
            previous_end = None
            continue
        covered += 1
        if xs and previous_end is None:  # a gap: break the areas there
            xs.append(math.nan)
            for p in PHASES:
                tops[p].append(math.nan)
        cumulative = 0.0
        for p in PHASES:
            cumulative += shares.get(p, 0.0) * 100
            tops[p] += [cumulative, cumulative]
        xs += [axis.x(point.start_ns), axis.x(point.end_ns)]
        previous_end = point.end_ns
    if covered:
        x = np.array(xs)
        lower = np.where(np.isnan(x), np.nan, 0.0)
        for p in PHASES:
            upper = np.array(tops[p])
            ax.fill_between(x, lower, upper, color=PHASE_COLORS[p], lw=0, label=p)
            lower = upper
        ax.set_ylim(0, 100)
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=7, ncols=len(PHASES),
                  frameon=False)
    else:
        _no_data(ax, "no stack samples covered a log interval (stack sampling off, or too "
                     "short a run)")
    axis.apply(ax)
    ax.set_ylabel("share of step time (%)")
    total = len(run.series.points)
    return Plot(plot_id, "Phases",
                f"Where each interval's time went ({run.stats.get('phases_source') or 'no source'}"
                f"); {covered} of {total} points have phases: blank where no stack samples "
                "covered the interval (py-spy samples in bursts within the CPU budget).", fig)


def plot_memory(run: Run, plot_id: str) -> Plot:
    fig = _figure(2.6)
    ax = fig.add_subplot()
    axis, stats = _axis(run), run.stats
    pts = [p for p in run.series.points if p.mean("memory_GB") is not None]
    kind = {"gpu": "GPU memory of the largest rank",
            "rss": "resident memory of the largest rank"}.get(str(stats.get("memory_kind")),
                                                            "memory")
    if pts:
        ax.plot([axis.x(p.end_ns) for p in pts], [p.value("memory_GB") for p in pts],
                color="#2a9d8f", lw=1.2, label=f"{kind} (mean per interval)")
        top = max(p.memory_max_gb or 0.0 for p in pts)
        if stats.get("peak_memory_gb") is not None:
            ax.axhline(stats["peak_memory_gb"], color="#264653", ls="--", lw=1,
                       label=f"peak {stats['peak_memory_gb']:.2f} GiB")
            top = max(top, stats["peak_memory_gb"])
        ax.set_ylim(0, top * 1.15 or 1.0)
        ax.legend(loc="lower right", fontsize=7)
    else:
        _no_data(ax, "no memory samples")
    axis.apply(ax)
    ax.set_ylabel("GiB (bytes / 1024³)")
    ax.grid(alpha=0.3)
    return Plot(plot_id, "Memory", f"memory_GB per log interval: {kind}, in GiB.", fig)


def plot_gpu(run: Run, plot_id: str) -> Plot | None:
    util = [p for p in run.series.points if p.mean("gpu_utilization_pct") is not None]
    power = [p for p in run.series.points if p.mean("gpu_power_w") is not None]
    if not util and not power:
        return None
    fig = _figure(2.6)
    ax = fig.add_subplot()
    axis = _axis(run)
    if util:
        ax.plot([axis.x(p.end_ns) for p in util], [p.value("gpu_utilization_pct") for p in util],
                color="#e76f51", lw=1.2, label="utilization (%)")
    ax.set_ylim(0, 105)
    ax.set_ylabel("GPU utilization (%)")
    axis.apply(ax)
    handles, labels = ax.get_legend_handles_labels()
    if power:
        right = ax.twinx()
        right.plot([axis.x(p.end_ns) for p in power], [p.value("gpu_power_w") for p in power],
                   color="#6d597a", lw=1.0, label="power (W)")
        right.set_ylim(bottom=0)
        right.set_ylabel("power per GPU (W)")
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="lower right", fontsize=7)
    ax.grid(alpha=0.3)
    return Plot(plot_id, "GPU utilization and power",
                "Mean over the job's GPUs, per log interval (NVML, sampled once a second).", fig)


class _Scale:
    """A second y scale proportional to the first (matplotlib's secondary_yaxis)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def forward(self, y: Any) -> Any:
        return y * self.factor

    def inverse(self, y: Any) -> Any:
        return y / self.factor


def plot_throughput(run: Run, plot_id: str) -> Plot:
    """Tokens/s (or samples/s) per interval, with TFLOPS per GPU or MFU as a second scale:
    all three are proportional (TFLOPS = tokens/s x FLOPs per token / world size / 1e12,
    MFU = TFLOPS / peak), so one line and two scales say it all."""
    fig = _figure(2.6)
    ax = fig.add_subplot()
    axis, points = _axis(run), run.series.points
    peak = (run.info.get("workload") or {}).get("peak_tflops")
    left_key, left_label = next(
        ((k, n) for k, n in (("tokens_per_sec", "tokens/s"), ("samples_per_sec", "samples/s"))
         if any(p.mean(k) is not None for p in points)), (None, ""))
    if left_key:
        pts = [p for p in points if p.mean(left_key) is not None]
        ax.plot([axis.x(p.end_ns) for p in pts], [p.value(left_key) for p in pts],
                color="#1d3557", lw=1.2, label=left_label)
        ax.set_ylabel(left_label)
        ax.set_ylim(bottom=0)
        both = next((p for p in pts if p.mean("TFLOPS_per_GPU") and p.mean(left_key)), None)
        if both is not None:
            ratio = both.value("TFLOPS_per_GPU") / both.value(left_key)  # TFLOPS per unit
            if peak:
                ratio, right_label = ratio / peak * 100, "MFU (%)"
            else:
                right_label = "TFLOPS per GPU"
            scale = _Scale(ratio)
            right = ax.secondary_yaxis("right", functions=(scale.forward, scale.inverse))
            right.set_ylabel(right_label)
        ax.legend(loc="lower right", fontsize=7)
    else:
        _no_data(ax, "no throughput: the batch size, sequence length or model dimensions "
                     "were unknown (give --model-config)")
    axis.apply(ax)
    ax.grid(alpha=0.3)
    return Plot(plot_id, "Throughput",
                "Tokens/s (or samples/s) per log interval; the right scale reads the same line "
                "as MFU (TFLOPS per GPU over the device's dense peak) or, without a known peak "
                "(CPU jobs; --peak-tflops), as TFLOPS per GPU.", fig)


def plot_combined_step_time(runs: list[Run], plot_id: str) -> Plot:
    fig = _figure(3.2)
    ax = fig.add_subplot()
    # One axis for all: time since the earliest attach (CLOCK_MONOTONIC lines up ranks of
    # one host; across hosts each log keeps its own attach as zero).
    hosts = {r.info.get("host") for r in runs}
    same_host = len(hosts) == 1
    attach = min(r.attach_ns for r in runs)
    end = max(r.info.get("detach_monotonic_ns") or r.attach_ns for r in runs)
    axis = _Axis(attach, end)
    for run in runs:
        points = run.series.points
        shift = 0 if same_host else attach - run.attach_ns
        if points:
            ax.plot([axis.x(p.end_ns + shift) for p in points],
                    [p.value("step_time_ms") for p in points], lw=1.0, label=run.title())
    if any(r.series.points for r in runs):
        ax.legend(loc="lower left", fontsize=7, ncols=2)
        ax.set_ylim(bottom=0)
    else:
        _no_data(ax, "no log interval completed in any log")
    ax.set_xlabel(axis.label + ("" if same_host else " (each log from its own attach)"))
    ax.set_ylabel("step time (ms)")
    ax.grid(alpha=0.3)
    return Plot(plot_id, "Step time, every log",
                "Each log's step time per log interval on one axis: a rank or node that is "
                "slower than the others stands out.", fig)


def run_plots(run: Run, suffix: str = "") -> list[Plot]:
    plots = [plot_step_time(run, f"plot-step-time{suffix}"),
             plot_phases(run, f"plot-phases{suffix}"),
             plot_memory(run, f"plot-memory{suffix}")]
    gpu = plot_gpu(run, f"plot-gpu{suffix}")
    if gpu is not None:
        plots.append(gpu)
    plots.append(plot_throughput(run, f"plot-throughput{suffix}"))
    for plot in plots:
        plot.context = printable(run.title())
    return plots


_ID = re.compile(r'\bid="([^"]+)"')
_REF = re.compile(r'(url\(#|href="#)([^)"]+)')


def svg_markup(plot: Plot) -> str:
    """The figure as inline SVG: text as text, ids prefixed with the plot's id (so several
    plots on one page never share one), no XML prologue, metadata or fixed size."""
    import matplotlib

    buffer = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": plot.plot_id}):
        plot.figure.savefig(buffer, format="svg", metadata={"Date": None})
    svg = buffer.getvalue().decode()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, count=1, flags=re.S)
    svg = re.sub(r'^<svg([^>]*?) width="[^"]*" height="[^"]*"', r"<svg\1", svg, count=1)
    svg = _ID.sub(lambda m: f'id="{plot.plot_id}-{m[1]}"', svg)
    svg = _REF.sub(lambda m: f"{m[1]}{plot.plot_id}-{m[2]}", svg)
    return svg.replace("<svg", f'<svg role="img" aria-label="{html.escape(plot.title)}"', 1)


def png_bytes(plot: Plot) -> bytes:
    """The figure as PNG (Agg), titled, since a PNG travels without the page around it."""
    buffer = io.BytesIO()
    title = plot.figure.suptitle(f"{plot.title}: {plot.context}" if plot.context else plot.title,
                                 fontsize=9)
    try:
        plot.figure.savefig(buffer, format="png", dpi=110, metadata={"Software": None})
    finally:
        title.remove()
    return buffer.getvalue()


# -- the page ------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       margin: 1.5em auto; max-width: 1180px; padding: 0 1em; color: #1b1b1b; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.25em; margin-top: 2em;
     border-bottom: 1px solid #ccc; } h3 { font-size: 1.05em; margin-bottom: 0.3em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #d0d0d0; padding: 0.25em 0.6em; text-align: left;
         vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
th { background: #f2f2f2; }
figure.plot { margin: 1em 0; } figure.plot svg { width: 100%; height: auto; }
figcaption { font-size: 0.85em; color: #444; }
.note { background: #fff6d6; border-left: 4px solid #e6a31a; padding: 0.4em 0.8em; }
.muted { color: #666; font-size: 0.85em; } code { font-size: 0.9em; }
ul.quality li { margin: 0.15em 0; }
"""


def _table(rows: Iterable[Iterable[str]], header: list[str] | None = None,
           table_id: str = "", numeric: set[int] | None = None) -> str:
    numeric = numeric or set()
    out = [f'<table id="{table_id}">' if table_id else "<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{_text(h)}</th>" for h in header) + "</tr>")
    for row in rows:
        cells = [f'<td class="num">{_text(c)}</td>' if i in numeric else f"<td>{_text(c)}</td>"
                 for i, c in enumerate(row)]
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _figure_html(plot: Plot) -> str:
    return (f'<figure class="plot" id="{plot.plot_id}">\n<h3>{_text(plot.title)}</h3>\n'
            f"{svg_markup(plot)}\n<figcaption>{_text(plot.caption)}</figcaption>\n</figure>")


def downsampling_note(run: Run) -> str | None:
    """What the page did to a long series, in words (None when it shows every interval)."""
    series, notes = run.series, []
    if series.downsampled:
        notes.append(
            f"Downsampled: {series.intervals:,} log intervals "
            f"({series.intervals * series.log_interval:,} iterations) are drawn as "
            f"{len(series.points):,} points, each the mean of {series.stride} consecutive "
            f"intervals (1 point in {series.stride}); the step-time plot shades their "
            "min-max band. The summary table covers every iteration.")
    if series.thinned_by_agent > 1:
        notes.append(
            f"The summary file itself kept one older interval in {series.thinned_by_agent} "
            "(--max-log-entries); give the event log for every interval.")
    return " ".join(notes) or None


def _rank_rows(run: Run) -> tuple[list[str], list[list[str]]]:
    stragglers = run.stats.get("stragglers")
    flagged: dict[int, str] = {}
    if isinstance(stragglers, list):
        for item in stragglers:
            if isinstance(item, dict) and isinstance(item.get("pid"), int):
                delay = item.get("delay_ms_per_step")
                detail = (f"+{delay:.1f} ms/step" if isinstance(delay, int | float)
                          else "straggler")
                if item.get("since"):
                    detail += f" from {str(item['since'])[11:19]}"
                if item.get("until"):
                    detail += f" to {str(item['until'])[11:19]}"
                previous = flagged.get(item["pid"])
                flagged[item["pid"]] = f"{previous}; {detail}" if previous else detail
            elif isinstance(item, int):
                flagged[item] = "straggler"
    header = ["rank", "pid", "role", "step (ms)", "wait (ms)", "compute (ms)",
              "peak resident (GiB)", "peak GPU memory (GiB)", "GPUs"]
    if isinstance(stragglers, list):
        header.append("straggler")
    by_pid = {r["pid"]: r for r in run.stats.get("ranks") or []
              if isinstance(r, dict) and isinstance(r.get("pid"), int)}
    listed = [p for p in run.info.get("pids") or [] if isinstance(p, int)]
    pids = list(dict.fromkeys(listed + list(by_pid)))
    selection = select_ranks([by_pid.get(pid) or {"pid": pid} for pid in pids], RANKS_EACH_WAY)
    rows = []
    for peaks in selection.shown:
        pid = peaks["pid"]
        row = [_fmt(run.rank_of(pid), "d"), str(pid),
               "primary" if pid == run.info.get("primary_pid") else "",
               _fmt(peaks.get("avg_step_time_ms"), ".1f"), _fmt(peaks.get("avg_wait_ms"), ".1f"),
               _fmt(peaks.get("avg_compute_ms"), ".1f"),
               _fmt(peaks.get("peak_rss_gb"), ".2f"), _fmt(peaks.get("peak_gpu_memory_gb"), ".2f"),
               ", ".join(str(g) for g in peaks.get("gpu_indices") or []) or "-"]
        if isinstance(stragglers, list):
            row.append(flagged.get(pid, ""))
        rows.append(row)
    if selection.rest:
        rows.insert(selection.rest_at, [describe_rest(selection)] + [""] * (len(header) - 1))
    return header, rows


def quality_notes(run: Run) -> list[str]:
    info, stats = run.info, run.stats
    notes = [f"loss: {line}" for line in _losses(run)]
    notes += [f"replay: {w}" for w in run.warnings]
    notes += [f"session: {w}" for w in info.get("warnings") or []]
    if stats.get("lost_events"):
        notes.append(f"{stats['lost_events']:,} marker events were dropped by the kernel")
    if info.get("event_log_tail_cut"):
        notes.append("the event log's last record was cut (the agent was killed while writing)")
    if info.get("end_reason") == "log_truncated":
        notes.append("the log has no session_end (the session is still running, or its agent "
                     "was killed): the window ends at its last record")
    for hang in _dicts(stats.get("hangs")):
        notes.append(f"hang at {hang.get('timestamp')}: no iteration for "
                     f"{hang.get('threshold_s')} s, in {hang.get('frame')}; "
                     f"recovered at {hang.get('recovered_at') or 'never'}")
    for event in _dicts(stats.get("gpu_events")):
        shown = {k: v for k, v in event.items() if k not in ("t_mono_ns", "type")}
        notes.append(f"GPU event {event.get('type')}: {shown}")
    for source, counters in sorted(((stats.get("data_quality") or {}).get("sources")
                                    or {}).items()):
        listed = ", ".join(f"{k} {v}" for k, v in sorted((counters or {}).items()))
        notes.append(f"source {source}: {listed}")
    return notes


def _section(run: Run, index: int, count: int) -> tuple[str, list[Plot]]:
    suffix = "" if count == 1 else f"-{index}"
    plots = run_plots(run, suffix)
    parts = [f'<section class="run" id="run{suffix or "-1"}">',
             f"<h2>{_text(run.title())}</h2>",
             f'<p class="muted">{_text(" ".join(map(str, run.info.get("command_line") or [])))}'
             "</p>",
             _table(summary_rows(run), ["metric", "value"], f"summary-table{suffix}")]
    phases = phase_figures(run.stats.get("phases"))
    if phases:
        parts.append("<h3>Phases, whole run (mean per iteration)</h3>")
        parts.append(_table(
            ([p, _fmt(ms, ".2f", " ms"), _fmt(share, ".1%")] for p, (ms, share) in phases.items()),
            ["phase", "time", "share"], f"phases-table{suffix}", {1, 2}))
    note = downsampling_note(run)
    if note:
        parts.append(f'<p class="note" id="downsampling{suffix}">{_text(note)}</p>')
    parts += [_figure_html(p) for p in plots]
    header, rows = _rank_rows(run)
    parts.append("<h3>Ranks</h3>")
    parts.append(_table(rows, header, f"ranks-table{suffix}", {0, 1, 3, 4}))
    parts.append("<h3>Data quality</h3>")
    notes = quality_notes(run)
    parts.append(f'<ul class="quality" id="data-quality{suffix}">'
                 + "".join(f"<li>{_text(n)}</li>" for n in notes) + "</ul>")
    parts.append("</section>")
    return "\n".join(parts), plots


def _combined_table(runs: list[Run]) -> str:
    rows = []
    for i, run in enumerate(runs, 1):
        s = run.stats
        rows.append([str(i), str(run.info.get("host", "-")),
                     _ranges([r for r in run.info.get("ranks") or [] if isinstance(r, int)])
                     or "-", _pids_cell(run.info.get("pids") or []),
                     _fmt(run.info.get("total_iterations"), ",d"),
                     _fmt(s.get("avg_step_time_ms"), ".2f"), _fmt(s.get("p50_step_time_ms"), ".2f"),
                     _fmt(s.get("p90_step_time_ms"), ".2f"), _fmt(s.get("p99_step_time_ms"), ".2f"),
                     _fmt(s.get("avg_tokens_per_sec"), ",.0f"),
                     _fmt(s.get("avg_tflops_per_gpu"), ".3f"), _fmt(s.get("mfu"), ".1%"),
                     _fmt(s.get("peak_memory_gb"), ".2f"), str(len(_losses(run))),
                     str(run.info.get("end_reason") or "running")])
    header = ["#", "host", "ranks", "pids", "iterations", "avg step (ms)", "p50", "p90", "p99",
              "tokens/s", "TFLOPS/GPU", "MFU", "peak mem (GiB)", "losses", "end"]
    return _table(rows, header, "combined-table", set(range(4, 14)))


def _pids_cell(pids: list[Any]) -> str:
    return ", ".join(map(str, pids)) if len(pids) <= 8 else f"{len(pids):,} processes"


def render_report(runs: list[Run]) -> tuple[str, list[Plot]]:
    """The HTML page of the runs (one section each) and the plots on it."""
    count = len(runs)
    title = runs[0].title() if count == 1 else f"{count} logs"
    body = ["<header>", "<h1>perfmon-agent report</h1>",
            f'<p class="muted">{_text(title)}; made from {count} '
            f"{'input' if count == 1 else 'inputs'}: "
            + ", ".join(f"<code>{_text(r.source.name)}</code>" for r in runs)
            + ". Times are seconds (or minutes, hours) since the agent attached; memory is "
            "GiB (bytes / 1024³).</p>", "</header>"]
    plots: list[Plot] = []
    if count > 1:
        combined = plot_combined_step_time(runs, "plot-step-time-combined")
        plots.append(combined)
        body += ['<section id="combined">', "<h2>All logs</h2>", _combined_table(runs),
                 _figure_html(combined), "</section>"]
    for i, run in enumerate(runs, 1):
        section, section_plots = _section(run, i, count)
        body.append(section)
        plots += section_plots
    body.append('<footer class="muted"><p>Made by <code>perfmon-agent report</code>; see '
                "docs/report.md for what each plot shows and the downsampling rule.</p></footer>")
    page = ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>perfmon-agent report: {_text(title)}</title>\n<style>{_CSS}</style>\n"
            "</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n")
    return page, plots


# -- the command ---------------------------------------------------------------------

def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the report command's arguments to a (sub-)parser."""
    parser.add_argument("source", type=Path, metavar="LOG_OR_DIR",
                        help="an event log (any part), a perf summary JSON, or a folder of them")
    parser.add_argument("-o", "--output", type=Path, default=Path("report.html"), metavar="FILE",
                        help="the HTML file to write (default: %(default)s)")
    parser.add_argument("--png", type=Path, metavar="DIR",
                        help="also write every plot as DIR/<plot id>.png (the folder is made "
                        "when missing)")
    parser.add_argument("--max-points", type=positive_int, default=DEFAULT_MAX_POINTS,
                        metavar="N", help="at most N points per series on the page; longer "
                        "series are averaged over equal groups of intervals (default: "
                        "%(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="print what was written as JSON on stdout")


def report_main(args: argparse.Namespace) -> int:
    """Write the report (and PNGs); 0 on success. Raises PerfmonError subclasses."""
    runs = load_runs(args.source, max(2, args.max_points))
    for run in runs:
        for line in run.warnings:
            warn(line)  # each names its file
    page, plots = render_report(runs)
    data = page.encode()
    write_user_file(args.output, data)
    pngs: list[str] = []
    if args.png is not None:
        folder = OutputDir.open(args.png, allow_shared=False, create=True)
        try:
            for plot in plots:
                name = f"{plot.plot_id}.png"
                try:
                    folder.replace(name, png_bytes(plot))
                except OSError as err:
                    raise OutputNotWritable(f"output not writable: {args.png / name}: "
                                            f"{err.strerror}") from err
                pngs.append(str(args.png / name))
        finally:
            folder.close()
    downsampled = [r for r in runs if r.series.downsampled]
    if args.json:
        sys.stdout.write(json_bytes({
            "report": str(args.output), "bytes": len(data), "inputs": [str(r.source) for r in runs],
            "plots": [p.plot_id for p in plots], "png": pngs,
            "downsampled": [{"input": str(r.source), "intervals": r.series.intervals,
                             "points": len(r.series.points), "stride": r.series.stride}
                            for r in downsampled]}).decode())
        return 0
    print(printable(f"report: {args.output} ({len(runs)} input{'s' if len(runs) > 1 else ''}, "
                    f"{len(plots)} plots, {len(data) / 1024:,.0f} KiB)"))
    for r in downsampled:
        print(printable(f"  {r.source.name}: {r.series.intervals:,} intervals drawn as "
                        f"{len(r.series.points):,} points (1 in {r.series.stride})"))
    for path in pngs:
        print(printable(f"png: {path}"))
    return 0
