"""The report's plots: matplotlib figures of a run's series and events, as inline SVG for
the page and as PNG files.

Every plot has a stable id (``plot-step-time``, ``plot-phases``, ``plot-memory``,
``plot-gpu`` for GPU jobs, ``plot-throughput``; ``-<n>`` per section when a page
shows several runs, and ``plot-step-time-combined``). The SVG keeps text as text
and has no metadata or fixed size; ids inside it are prefixed with the plot's.
"""

from __future__ import annotations

import html
import io
import re
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from perfmon.agent.console import printable
from perfmon.agent.reducers.phases import PHASES
from perfmon.agent.views.series import Run, phase_figures

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PHASE_COLORS = {"data_loading": "#e6a31a", "forward": "#3a78c2", "backward": "#9b4fb0",
                "optimizer": "#3d9a50", "other": "#b8b8b8"}


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
        slow = event.get("event") in ("fail_slow", "eased")  # (the episode still open)
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
    """Where the time goes: the whole run's breakdown (every sampled burst, with the
    iterations it rests on) beside a bar per log interval; an interval no burst covered
    is drawn hatched, "not sampled", never as an empty stretch that reads as zero."""
    fig = _figure(2.8)
    whole_ax, ax = fig.subplots(1, 2, width_ratios=(1, 12))
    axis = _axis(run)
    whole = phase_figures(run.stats.get("phases"))
    rests_on = _int(run.stats.get("phases_iterations"))
    if whole:
        bottom = 0.0
        for p in PHASES:
            share = (whole.get(p, (None, None))[1] or 0.0) * 100
            whole_ax.bar([0], [share], bottom=bottom, color=PHASE_COLORS[p], width=0.7)
            bottom += share
        whole_ax.set_ylim(0, 100)
        whole_ax.set_ylabel("share of step time (%)")
    else:
        _no_data(whole_ax, "none")
    whole_ax.set_xticks([0], ["whole run" + (f"\n{rests_on:,} it." if rests_on else "")],
                        fontsize=7)
    sampled = unsampled = 0
    for point in run.series.points:
        x0, width = axis.x(point.start_ns), axis.x(point.end_ns) - axis.x(point.start_ns)
        shares = point.phase_shares()
        if shares is None:
            unsampled += 1
            ax.bar([x0], [100], width=width, align="edge", color="#f1f3f5",
                   edgecolor="#adb5bd", hatch="///", lw=0,
                   label="not sampled" if unsampled == 1 else None)
            continue
        sampled += 1
        bottom = 0.0
        for p in PHASES:
            share = shares.get(p, 0.0) * 100
            ax.bar([x0], [share], width=width, bottom=bottom, align="edge",
                   color=PHASE_COLORS[p], lw=0, label=p if sampled == 1 else None)
            bottom += share
    if sampled or unsampled:
        ax.set_ylim(0, 100)
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=7, ncols=len(PHASES) + 1,
                  frameon=False)
    else:
        _no_data(ax, "no log interval yet")
    axis.apply(ax)
    ax.set_yticks([])
    total = sampled + unsampled
    return Plot(plot_id, "Phases",
                f"Where the time goes ({run.stats.get('phases_source') or 'no source'}): the "
                f"whole run on the left, from every stack sample"
                + (f" ({rests_on:,} iterations sampled)" if rests_on else "")
                + f"; each log interval on the right, {sampled} of {total} sampled (py-spy "
                "samples in bursts within the CPU budget; hatched: not sampled, not zero).",
                fig)


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


# The ledger's parts, productive first, in the colours of a traffic light's gradient.
_LEDGER = (("productive", "#2a9d8f"), ("startup", "#8ecae6"), ("restart", "#219ebc"),
           ("hang", "#e63946"), ("straggler", "#f4a261"), ("slowdown", "#e76f51"),
           ("data_stall", "#e9c46a"), ("unexplained", "#adb5bd"))
_UNOBSERVED = "#ffffff"  # (drawn hatched, outside the ratio: what the agent did not see)


def plot_goodput(run: Run, plot_id: str) -> Plot | None:
    """Where the GPU-hours went: one bar, productive then each cause (the job's ledger
    across its sessions where it had several, else the session's); None without one."""
    goodput = run.stats.get("goodput")
    if not isinstance(goodput, dict):
        return None
    ledger = goodput["job"] if isinstance(goodput.get("job"), dict) else goodput
    lost = ledger.get("lost_gpu_hours") or {}
    parts = [(name, colour, hours) for name, colour in _LEDGER
             if isinstance(hours := ledger.get("productive_gpu_hours") if name == "productive"
                           else lost.get(name), int | float) and hours > 0]
    unseen = ledger.get("unobserved_gpu_hours")
    if isinstance(unseen, int | float) and unseen > 0:
        parts.append(("unobserved (not in the ratio)", _UNOBSERVED, unseen))
    if not parts:  # (a session that ended before its first iteration: nothing to draw)
        return None
    fig = _figure(2.4)  # (one bar, and its legend of up to nine parts below it)
    ax = fig.add_subplot()
    left = 0.0
    for name, colour, hours in parts:
        unseen_part = colour == _UNOBSERVED
        ax.barh([0], [hours], left=left, color=colour, label=f"{name} {hours:.3g}",
                hatch="//" if unseen_part else None,
                edgecolor="#6c757d" if unseen_part else None)
        left += hours
    ax.set_yticks([])
    ax.set_xlabel("GPU-hours")
    # ("outside": the constrained layout makes room for it; a legend anchored below the
    # axes by hand fell off the figure's bottom edge.)
    fig.legend(loc="outside lower center", ncols=4, fontsize=7)
    ratio = ledger.get("ratio")
    title = "Goodput" + (f" {ratio:.1%}" if isinstance(ratio, int | float) else "")
    return Plot(plot_id, title,
                "Where the GPU-hours went (docs/metrics.md, Goodput): the iterations at the "
                "job's healthy pace, the time lost by cause, and (hatched) the time the "
                "agent could not see, outside the ratio; across the job's sessions "
                "(restarts included) where it had several.", fig)


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
    goodput = plot_goodput(run, f"plot-goodput{suffix}")
    if goodput is not None:
        plots.append(goodput)
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
