"""`perfmon-agent top`: a live terminal view of every job whose perf summaries are in some
folders: per job a row with its step-time history, step time, tokens/s, TFLOPS, MFU,
memory, GPU utilization, phases and flags (hung, stragglers, stale), and a row per rank.

It only reads ``perf_summary_*.json`` files (the agents rewrite them atomically every
few seconds): no privilege beyond reading them, no probe, no effect on the jobs. A
folder's sub-folders one level down are read too (one per job or node). Several
summaries of one job (an agent restarted on it) show as one: the newest. A file
that disappears between the listing and the read is skipped.

Plain terminals over ssh: no mouse, redrawn in place (the alternate screen, left
on exit), ``q`` quits, and so do Ctrl-C, SIGTERM and SIGHUP, restoring the
terminal. Keys are read without blocking (termios cbreak mode, select); when stdin
is not a terminal only the signals end it. With stdout not a terminal each refresh
prints a new frame; ``--once`` prints one frame and exits.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import termios
import time
import tty
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from perfmon.agent.argtypes import Command, positive_float
from perfmon.agent.console import GIB, fmt, printable
from perfmon.agent.record.layout import SUMMARY_GLOB
from perfmon.agent.record.runs import RecordedRun, SummaryCache
from perfmon.agent.reducers.phases import PHASES
from perfmon.agent.views.rank_table import describe_rest, select_ranks
from perfmon.parsers.errors import InputFileError
from perfmon.parsers.figures import Statistics, finite, scaled
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

DEFAULT_DIRS = (Path("outputs/logs/perf_monitor"), Path("/var/lib/perfmon-agent/jobs"))
STALE_S = 30.0  # a running session's summary is rewritten at least every 5 s (stretching)
SPARK_POINTS = 24
BLOCKS = "▁▂▃▄▅▆▇█"
ASCII_BLOCKS = "_.-=+*#@"
PHASE_BAR_WIDTH = 16
RANKS_EACH_WAY = 8  # a job of more ranks: the 8 slowest and fastest rows, the rest in one
PHASE_STYLE = {"data_loading": ("D", "black on yellow"), "forward": ("F", "white on blue"),
               "backward": ("B", "white on magenta"), "optimizer": ("O", "black on green"),
               "other": ("-", "black on white")}

TOP_DESCRIPTION = "A live terminal view of the jobs whose perf summaries are in some folders."
TOP_EPILOG = """examples:
  perfmon-agent top                                   # the default folders
  perfmon-agent top /shared/job-42/perf_logs --interval 2
  perfmon-agent top outputs/logs/perf_monitor --once  # one frame, for scripts

Keys: q quits (Ctrl-C too). Phases: D data loading, F forward, B backward,
O optimizer, - other. Flags: HUNG (no iteration for the hang threshold), STRAGGLER
(final_statistics.stragglers names the rank), STALE (a running session's summary
was not rewritten for 30 s: the agent may be gone).
"""


class _Stop(Exception):
    """SIGTERM or SIGHUP: leave the loop as on q."""


def _key(run: RecordedRun) -> tuple[str, int, tuple[int, ...]]:
    """Which job a summary is of: host, primary pid and pids (an agent restarted on a job
    writes a new summary of the same key)."""
    info = run.info
    pids = tuple(p for p in info.get("pids") or () if isinstance(p, int))
    return (run.host, int(info.get("primary_pid") or 0), pids)


def _started(run: RecordedRun) -> float:
    started = run.started_s
    return started if started is not None else (run.mtime_s or 0.0)


def newest_jobs(cache: SummaryCache) -> list[RecordedRun]:
    """The newest summary of every job in the cache's folders; live sessions first, then by
    host and pid. ``cache.problems`` says what could not be read or was not as its
    schema allows."""
    newest: dict[tuple[str, int, tuple[int, ...]], RecordedRun] = {}
    for run in cache.runs():
        key = _key(run)
        old = newest.get(key)
        if old is None or (_started(run), run.mtime_s or 0.0) > (_started(old),
                                                                 old.mtime_s or 0.0):
            newest[key] = run
    return sorted(newest.values(), key=lambda j: (j.info.get("end_time") is not None,
                                                  _key(j)[0], _key(j)[1]))


# -- cells ---------------------------------------------------------------------------

def sparkline(values: list[float], blocks: str = BLOCKS) -> str:
    """One character per value, from the lowest block (the smallest) to the highest."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    top = len(blocks) - 1
    if hi <= lo:
        return blocks[top // 2] * len(values)
    return "".join(blocks[round((v - lo) / (hi - lo) * top)] for v in values)


def phase_bar(phases: Mapping[str, Any] | None, width: int = PHASE_BAR_WIDTH) -> Text:
    """The phase shares as ``width`` letters (largest remainders), coloured."""
    if not isinstance(phases, dict):
        return Text("no samples", style="dim")
    shares = {p: float((phases.get(p) or {}).get("share") or 0.0) for p in PHASES}
    total = sum(shares.values())
    if total <= 0:
        return Text("no samples", style="dim")
    exact = {p: shares[p] / total * width for p in PHASES}
    cells = {p: int(v) for p, v in exact.items()}
    for p in sorted(PHASES, key=lambda p: exact[p] - cells[p], reverse=True)[
            :width - sum(cells.values())]:
        cells[p] += 1
    bar = Text()
    for p in PHASES:
        letter, style = PHASE_STYLE[p]
        if cells[p]:
            bar.append(letter * cells[p], style=style)
    return bar


def _latest_phases(job: RecordedRun) -> Mapping[str, Any] | None:
    """The newest interval's phases when it has them (continuous sampling), else the
    whole run's from every sampled burst: an older interval's would be minutes stale."""
    logs = job.intervals
    if logs and logs[-1].phases:
        return logs[-1].phases
    return job.figures.phases


def _stragglers(job: RecordedRun) -> tuple[list[Any] | None, set[int], set[int]]:
    """(final_statistics.stragglers when the summary has that list, their pids, their
    ranks). Each item names a rank by ``pid`` and/or ``rank`` (or is a pid)."""
    items = job.stats.get("stragglers")
    if not isinstance(items, list):
        return None, set(), set()
    pids, ranks = set(), set()
    items = [i for i in items if not (isinstance(i, dict) and i.get("until"))]  # still open
    for item in items:
        if isinstance(item, dict):
            if isinstance(item.get("pid"), int):
                pids.add(item["pid"])
            if isinstance(item.get("rank"), int):
                ranks.add(item["rank"])
        elif isinstance(item, int):
            pids.add(item)
    return items, pids, ranks


def _state(job: RecordedRun, now_s: float) -> Text:
    info = job.info
    if info.get("end_time") is not None:
        return Text(f"ended: {info.get('end_reason') or '?'}", style="dim")
    age = now_s - (job.mtime_s or now_s)
    if age > STALE_S:
        return Text(f"STALE {age:.0f}s", style="bold yellow")
    return Text("running", style="green")


def _goodput_ratio(stats: Statistics) -> float | None:
    """The job's goodput (across its sessions where it had several), else the session's."""
    return finite(stats.goodput.of_job.ratio) if stats.goodput is not None else None


def _step_history(job: RecordedRun) -> list[float]:
    """The logged intervals' step times (ms)."""
    return [s.step_s * 1e3 for s in job.intervals
            if finite(s.step_s) is not None][-SPARK_POINTS:]


# Columns: (name, justify, min_width); a column no job has a value for is left out, and
# on a narrow terminal the step history shortens.
COLUMNS = (("job", "left", 10), ("state", "left", 7), ("step history", "left", 0),
           ("step", "right", 9), ("last", "right", 6), ("tok/s", "right", 5),
           ("TFLOPS", "right", 6), ("MFU", "right", 5), ("mem GiB", "right", 7),
           ("GPU %", "right", 5), ("goodput", "right", 7), ("phases", "left", 0),
           ("flags", "left", 5))
_EMPTY = ("", "-", "- / -")


def frame(jobs: list[RecordedRun], dirs: list[Path], problems: list[str], *, unicode: bool = True,
          now_s: float | None = None, footer: str = "", width: int = 160) -> Group:
    """One screen: a header line, the jobs table (a row per job, one per rank of a
    multi-rank job), problems and a footer."""
    now_s = time.time() if now_s is None else now_s
    blocks = BLOCKS if unicode else ASCII_BLOCKS
    spark = SPARK_POINTS if width >= 130 else 12 if width >= 100 else 6
    header = Text.assemble(
        ("perfmon-agent top", "bold"),
        f"  {len(jobs)} job{'s' if len(jobs) != 1 else ''} in "
        f"{', '.join(printable(str(d)) for d in dirs)}  "
        f"{datetime.fromtimestamp(now_s).strftime('%H:%M:%S')}")
    rows: list[tuple[bool, list[Text | str]]] = []  # (a job's row, cells)
    for job in jobs:
        rows += _job_rows(job, now_s, blocks, spark)
    keep = [i for i, (name, _, _) in enumerate(COLUMNS)
            if name in ("job", "state", "step")
            or any(str(cells[i]) not in _EMPTY for is_job, cells in rows if is_job)]
    table = Table(box=None, header_style="bold", pad_edge=False, expand=False)
    for i in keep:
        name, justify, min_width = COLUMNS[i]
        table.add_column(name, justify=justify, no_wrap=True,  # type: ignore[arg-type]
                         min_width=min_width or None, overflow="ellipsis")
    for _, cells in rows:
        table.add_row(*(cells[i] for i in keep))
    parts: list[Any] = [header, table]
    if not jobs:
        parts.append(Text(f"no {SUMMARY_GLOB} here yet (start `perfmon-agent attach "
                          "--output-dir DIR`)", style="dim"))
    parts += [Text(printable(p), style="yellow") for p in problems[:5]]
    if footer:
        parts.append(Text(footer, style="dim"))
    return Group(*parts)


def _job_rows(job: RecordedRun, now_s: float, blocks: str, spark: int
              ) -> list[tuple[bool, list[Text | str]]]:
    info, stats = job.info, job.figures
    history = _step_history(job)
    host = printable(str(info.get("host", "?")))
    flags = []
    if info.get("hung"):
        flags.append(Text("HUNG", style="bold white on red"))
    stragglers, straggler_pids, straggler_ranks = _stragglers(job)
    if stragglers:
        flags.append(Text(f"STRAGGLERS {len(stragglers)}", style="bold yellow"))
    losses = (stats.data_quality or {}).get("losses") or []
    if losses:
        flags.append(Text(f"{len(losses)} loss{'es' if len(losses) > 1 else ''}",
                          style="yellow"))
    pids = list(info.get("pids") or [])
    last_memory = job.intervals[-1].memory_bytes if job.intervals else None
    rows: list[tuple[bool, list[Text | str]]] = [(True, [
        Text(f"{host}:{info.get('primary_pid', '?')}"
             + (f" ({len(pids)} ranks)" if len(pids) > 1 else "")),
        _state(job, now_s),
        Text(sparkline(history[-spark:], blocks), style="cyan"),
        fmt(scaled(stats.step_s, 1e3), ".2f", " ms"),
        fmt(history[-1] if history else None, ".2f"),
        fmt(stats.tokens_per_s, ",.0f"),
        fmt(scaled(stats.flops_per_gpu, 1e-12), ".2f"),
        fmt(stats.mfu, ".1%"),
        f"{fmt(scaled(last_memory, 1 / GIB), '.2f')} / "
        f"{fmt(scaled(stats.peak_memory_bytes, 1 / GIB), '.2f')}",
        fmt(scaled(stats.gpu_utilization, 100), ".0f"),
        fmt(_goodput_ratio(stats), ".1%"),
        phase_bar(_latest_phases(job)),
        Text(" ").join(flags) if flags else "",
    ])]
    if len(pids) <= 1 and not stragglers:
        return rows
    peaks = {r["pid"]: r for r in job.stats.get("ranks") or []
             if isinstance(r, dict) and isinstance(r.get("pid"), int)}
    selection = select_ranks([peaks.get(pid) or {"pid": pid} for pid in pids
                              if isinstance(pid, int)], RANKS_EACH_WAY)
    rank_rows: list[tuple[bool, list[Text | str]]] = []
    for peak in selection.shown:
        pid = peak["pid"]
        rank = job.rank_of(pid)
        rank_memory = peak.get("peak_gpu_memory_gb") or peak.get("peak_rss_gb")
        flag: Text | str = ""
        if pid in straggler_pids or (rank is not None and rank in straggler_ranks):
            flag = Text("STRAGGLER", style="bold yellow")
        rank_rows.append((False, [Text(f" rank {'?' if rank is None else rank} pid {pid}"),
                                  "", "", "", "", "", "", "",
                                  f"peak {fmt(rank_memory, '.2f')}", "", "", "", flag]))
    if selection.rest:
        rank_rows.insert(selection.rest_at, (False, [
            Text(f" {describe_rest(selection)}", style="dim"), *[""] * (len(COLUMNS) - 1)]))
    rows += rank_rows
    return rows


# -- the loop ------------------------------------------------------------------------

def _check_dirs(dirs: list[Path], given: bool) -> None:
    if not given:
        return
    for d in dirs:
        if not d.is_dir():
            what = "not a folder" if d.exists() else "no such folder"
            raise InputFileError(f"folder {d}: {what}")


def _raise_stop(signum: int, frame_: FrameType | None) -> None:
    raise _Stop(signum)


def _keys_pressed(fd: int | None, timeout_s: float) -> bytes:
    """Wait up to ``timeout_s`` for keys on ``fd`` (None: just wait); what was typed."""
    if fd is None:
        time.sleep(max(0.0, timeout_s))
        return b""
    ready, _, _ = select.select([fd], [], [], max(0.0, timeout_s))
    if not ready:
        return b""
    try:
        data = os.read(fd, 64)
    except OSError:
        return b""
    if not data:  # the terminal went away
        raise _Stop(0)
    return data


def run_top(dirs: list[Path], interval_s: float, console: Console) -> int:
    """Redraw every ``interval_s`` until q, Ctrl-C, SIGTERM or SIGHUP; 0."""
    cache = SummaryCache(dirs)
    unicode = console.encoding.lower().startswith("utf")
    stdin_fd: int | None = None
    saved = None
    if sys.stdin is not None and sys.stdin.isatty():
        stdin_fd = sys.stdin.fileno()
        saved = termios.tcgetattr(stdin_fd)
    footer = "q quits" if stdin_fd is not None else "Ctrl-C quits"
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)}

    def draw() -> Group:
        return frame(newest_jobs(cache), dirs, cache.problems, unicode=unicode,
                     footer=f"{footer}; refreshed every {interval_s:g} s",
                     width=console.size.width)

    live: Live | None = None
    try:
        if stdin_fd is not None:
            # cbreak: keys arrive one by one, unechoed; Ctrl-C still raises SIGINT.
            tty.setcbreak(stdin_fd, termios.TCSANOW)
        if console.is_terminal:
            live = Live(draw(), console=console, screen=True, auto_refresh=False,
                        redirect_stdout=False, redirect_stderr=False)
            live.start()
        else:
            console.print(draw())
        start = time.monotonic()
        k = 1
        while True:
            # Drift-free: frame k is due at start + k * interval (a slow read skips ahead).
            due = start + k * interval_s
            while (left := due - time.monotonic()) > 0:
                if b"q" in _keys_pressed(stdin_fd, left).lower():
                    return 0
            k = max(k + 1, int((time.monotonic() - start) / interval_s) + 1)
            if live is not None:
                live.update(draw(), refresh=True)
            else:
                console.print(draw())
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        if live is not None:
            live.stop()
        if saved is not None and stdin_fd is not None:
            termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_top_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the top command's arguments to a (sub-)parser."""
    parser.add_argument("dirs", nargs="*", type=Path, metavar="DIR",
                        help=f"folders holding {SUMMARY_GLOB} (default: "
                        + " and ".join(str(d) for d in DEFAULT_DIRS) + ")")
    parser.add_argument("--interval", type=positive_float, default=1.0, metavar="SECONDS",
                        help="seconds between refreshes (default: %(default)s)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")


def top_main(args: argparse.Namespace) -> int:
    """The live view (or one frame with --once); 0. Raises InputFileError for a named
    folder that does not exist."""
    dirs = list(args.dirs) or list(DEFAULT_DIRS)
    _check_dirs(dirs, bool(args.dirs))
    console = Console(highlight=False)
    if args.once:
        cache = SummaryCache(dirs)
        console.print(frame(newest_jobs(cache), dirs, cache.problems,
                            unicode=console.encoding.lower().startswith("utf"),
                            width=console.size.width))
        return 0
    return run_top(dirs, args.interval, console)


COMMAND = Command("top", "a live terminal view of the jobs in some folders", add_top_arguments,
                  top_main, description=TOP_DESCRIPTION, epilog=TOP_EPILOG)
