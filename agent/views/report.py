"""`perfmon-agent report`: one self-contained HTML page of a session (or of several ranks'
or nodes' sessions of one job), and optionally its plots as PNG files.

Inputs: an event log (``perf_events_<ts>.msgpack``, any of its parts), a summary
(``perf_summary_<ts>.json``), or a folder holding several of them (and its
sub-folders, one level down: one per node), read by perfmon.agent.record.runs: an event
log is replayed as ``summarize`` replays it, so the page shows the numbers
``summarize`` gives. The series over time and their bound (``--max-points``) are
perfmon.agent.views.series's, the plots perfmon.agent.views.plots's; the step-time
plot draws a downsampled point's min-max band so a slow interval still shows, and
the page says when and by how much a series was folded.

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
import html
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from perfmon.agent.argtypes import Command, positive_int
from perfmon.agent.console import fmt, printable, warn
from perfmon.agent.record.incidents import find_incidents
from perfmon.agent.record.outputs import OutputDir, OutputNotWritable, json_bytes, write_user_file
from perfmon.agent.views.plots import (
    Plot,
    plot_combined_step_time,
    png_bytes,
    run_plots,
    svg_markup,
)
from perfmon.agent.views.rank_table import describe_rest, select_ranks
from perfmon.agent.views.series import (
    DEFAULT_MAX_POINTS,
    Run,
    load_report_runs,
    objects,
    phase_figures,
    ranges,
)
from perfmon.parsers.errors import PerfmonError

RANKS_EACH_WAY = 64  # a job of more ranks: the 64 slowest and fastest, the rest in one row

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



# -- formatting ----------------------------------------------------------------------

def _text(value: Any) -> str:
    """Text a job may control (paths, command lines, hosts), safe in HTML and on one line."""
    return html.escape(printable(str(value)))




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
    if info.get("iteration_numbering") == "job_counter":
        how += f"; numbered as the job's own counter ({info.get('iteration_counter')})"
    elif info.get("iteration_numbering") == "attach":
        how += "; numbered from attach"
    return how


def _losses(run: Run) -> list[str]:
    return list((run.stats.get("data_quality") or {}).get("losses") or [])


def summary_rows(run: Run) -> list[tuple[str, str]]:
    """The summary table's (metric, value) rows, plain text."""
    info, s = run.info, run.stats
    mem_kind = {"gpu": "GPU memory", "rss": "resident memory"}.get(str(s.get("memory_kind")), "")
    losses = _losses(run)
    return [
        ("step time avg", fmt(s.get("avg_step_time_ms"), ".2f", " ms")),
        ("step time p50 / p90 / p99", " / ".join(
            fmt(s.get(k), ".2f") for k in ("p50_step_time_ms", "p90_step_time_ms",
                                              "p99_step_time_ms")) + " ms"),
        ("step time min / max", " / ".join(
            fmt(s.get(k), ".2f") for k in ("min_step_time_ms", "max_step_time_ms")) + " ms"),
        ("tokens/s", fmt(s.get("avg_tokens_per_sec"), ",.0f")),
        ("samples/s", fmt(s.get("avg_samples_per_sec"), ",.2f")),
        ("TFLOPS per GPU", fmt(s.get("avg_tflops_per_gpu"), ".3f")),
        ("MFU", fmt(s.get("mfu"), ".1%")),
        ("peak memory", fmt(s.get("peak_memory_gb"), ".2f", f" GiB {mem_kind}".rstrip())),
        ("iterations", f"{fmt(info.get('total_iterations'), ',d')} ended, "
                       f"{fmt(s.get('measured_iterations'), ',d')} measured "
                       "(the first end only opens the window)"),
        ("how iterations were found", _how_iterations(run)),
        ("micro-batches per step", fmt(s.get("microbatches_per_step"), "d")),
        ("GPU utilization / power", (f"{fmt(s.get('avg_gpu_utilization_pct'), '.1f', ' %')} / "
                                     f"{fmt(s.get('avg_gpu_power_w'), '.0f', ' W')}")),
        ("phases from", str(s.get("phases_source") or "-")),
        ("data-quality losses", f"{len(losses)}: see below" if losses else "none"),
        ("model", str((info.get("model") or {}).get("source", "-"))),
        ("window", f"{info.get('start_time', '-')} .. {info.get('end_time') or 'running'} "
                   f"({info.get('end_reason') or 'running'})"),
        ("source", f"{run.kind} {run.source}"),
    ]


# -- plots ---------------------------------------------------------------------------


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
        row = [fmt(run.rank_of(pid), "d"), str(pid),
               "primary" if pid == run.info.get("primary_pid") else "",
               fmt(peaks.get("avg_step_time_ms"), ".1f"), fmt(peaks.get("avg_wait_ms"), ".1f"),
               fmt(peaks.get("avg_compute_ms"), ".1f"),
               fmt(peaks.get("peak_rss_gb"), ".2f"), fmt(peaks.get("peak_gpu_memory_gb"), ".2f"),
               ", ".join(str(g) for g in peaks.get("gpu_indices") or []) or "-"]
        if isinstance(stragglers, list):
            row.append(flagged.get(pid, ""))
        rows.append(row)
    if selection.rest:
        rows.insert(selection.rest_at, [describe_rest(selection)] + [""] * (len(header) - 1))
    return header, rows


def _pipeline_html(run: Run, suffix: str) -> list[str]:
    """A pipeline job's bubble against the schedule's, its slow stage and its stages
    (docs/pipeline.md); nothing for a job with no stages."""
    p = run.stats.get("pipeline")
    if not isinstance(p, dict):
        return []
    line = (f"{_text(p.get('stages'))} stages, {_text(p.get('microbatches'))} micro-batches: "
            f"bubble {fmt(p.get('bubble_fraction'), '.1%')} measured against "
            f"{fmt(p.get('ideal_bubble_fraction'), '.1%')} for the schedule "
            "((p - 1) / (v m + p - 1)). ")
    if p.get("slow_stage"):
        line += (f"Stage {_text(p.get('bounding_stage'))} bounds the pipeline: it computes "
                 f"{fmt(p.get('bounding_excess_ms'), '.1f', ' ms')} a step "
                 f"({fmt(p.get('bounding_excess_per_microbatch_ms'), '.1f', ' ms')} a "
                 "micro-batch) more than the other stages' median.")
    else:
        line += "No stage bounds it beyond the rule (10% of the others' compute)."
    stages = [s for s in p.get("per_stage") or [] if isinstance(s, dict)]
    rows = ([_text(s.get("stage")), _text(",".join(map(str, s.get("ranks") or []))),
             fmt(s.get("avg_step_time_ms"), ".2f"), fmt(s.get("avg_compute_ms"), ".2f"),
             fmt(s.get("avg_bubble_ms"), ".2f"), fmt(s.get("avg_collective_wait_ms"), ".2f"),
             fmt(s.get("bubble_share"), ".1%")] for s in stages)
    return ["<h3>Pipeline stages</h3>", f'<p id="pipeline{suffix}">{line}</p>',
            _table(rows, ["stage", "ranks", "step ms", "compute ms", "bubble ms",
                          "collective wait ms", "bubble share"],
                   f"pipeline-table{suffix}", {0, 2, 3, 4, 5, 6})]


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
    for hang in objects(stats.get("hangs")):
        notes.append(f"hang at {hang.get('timestamp')}: no iteration for "
                     f"{hang.get('threshold_s')} s, in {hang.get('frame')}; "
                     f"recovered at {hang.get('recovered_at') or 'never'}")
    for event in objects(stats.get("gpu_events")):
        shown = {k: v for k, v in event.items() if k not in ("t_mono_ns", "type")}
        notes.append(f"GPU event {event.get('type')}: {shown}")
    for source, counters in sorted(((stats.get("data_quality") or {}).get("sources")
                                    or {}).items()):
        listed = ", ".join(f"{k} {v}" for k, v in sorted((counters or {}).items()))
        notes.append(f"source {source}: {listed}")
    return notes


def _incidents_html(run: Run, suffix: str, page_folder: Path | None) -> str:
    """The incident bundles beside the run's file, linked (none: nothing)."""
    try:
        found = find_incidents(run.source.parent, depth=0)
    except PerfmonError:
        return ""
    if not found:
        return ""
    items = []
    for i in found:
        href = os.path.relpath(i.folder, page_folder) if page_folder else str(i.folder)
        items.append(f'<li><a href="{html.escape(href)}/">{_text(i.time)} {_text(i.kind)}</a>: '
                     f"{_text(i.what)}</li>")
    return (f'<h3>Incidents</h3>\n<ul class="incidents" id="incidents{suffix}">'
            + "".join(items) + "</ul>")


def _incident_problems(runs: list[Run]) -> list[str]:
    """A line for each unfit incident record beside the runs (the page leaves it out)."""
    problems: list[str] = []
    for folder in sorted({run.source.parent for run in runs}):
        try:
            find_incidents(folder, depth=0, problems=problems)
        except PerfmonError:
            continue
    return problems


def _section(run: Run, index: int, count: int, page_folder: Path | None = None
             ) -> tuple[str, list[Plot]]:
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
            ([p, fmt(ms, ".2f", " ms"), fmt(share, ".1%")] for p, (ms, share) in phases.items()),
            ["phase", "time", "share"], f"phases-table{suffix}", {1, 2}))
    note = downsampling_note(run)
    if note:
        parts.append(f'<p class="note" id="downsampling{suffix}">{_text(note)}</p>')
    parts += [_figure_html(p) for p in plots]
    header, rows = _rank_rows(run)
    parts.append("<h3>Ranks</h3>")
    parts.append(_table(rows, header, f"ranks-table{suffix}", {0, 1, 3, 4}))
    parts += _pipeline_html(run, suffix)
    parts.append(_incidents_html(run, suffix, page_folder))
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
                     ranges([r for r in run.info.get("ranks") or [] if isinstance(r, int)])
                     or "-", _pids_cell(run.info.get("pids") or []),
                     fmt(run.info.get("total_iterations"), ",d"),
                     fmt(s.get("avg_step_time_ms"), ".2f"), fmt(s.get("p50_step_time_ms"), ".2f"),
                     fmt(s.get("p90_step_time_ms"), ".2f"), fmt(s.get("p99_step_time_ms"), ".2f"),
                     fmt(s.get("avg_tokens_per_sec"), ",.0f"),
                     fmt(s.get("avg_tflops_per_gpu"), ".3f"), fmt(s.get("mfu"), ".1%"),
                     fmt(s.get("peak_memory_gb"), ".2f"), str(len(_losses(run))),
                     str(run.info.get("end_reason") or "running")])
    header = ["#", "host", "ranks", "pids", "iterations", "avg step (ms)", "p50", "p90", "p99",
              "tokens/s", "TFLOPS/GPU", "MFU", "peak mem (GiB)", "losses", "end"]
    return _table(rows, header, "combined-table", set(range(4, 14)))


def _pids_cell(pids: list[Any]) -> str:
    return ", ".join(map(str, pids)) if len(pids) <= 8 else f"{len(pids):,} processes"


def render_report(runs: list[Run], page_folder: Path | None = None) -> tuple[str, list[Plot]]:
    """The HTML page of the runs (one section each) and the plots on it; links to the
    incident bundles beside the runs are relative to ``page_folder`` (the page's)."""
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
        section, section_plots = _section(run, i, count, page_folder)
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
    runs = load_report_runs(args.source, max(2, args.max_points))
    for run in runs:
        for line in run.warnings:
            warn(line)  # each names its file
    for line in _incident_problems(runs):
        warn(line)
    page, plots = render_report(runs, args.output.resolve().parent)
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


COMMAND = Command("report", "an HTML report (plots) of event logs or summaries",
                  add_report_arguments, report_main, description=REPORT_DESCRIPTION,
                  epilog=REPORT_EPILOG)
