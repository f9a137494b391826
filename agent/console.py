"""What the agent prints: warnings on stderr, output on stdout, and their two hazards; the
one formatter of figures, the live lines and the end table.

- Text a job controls (its paths, its command line, names from its files) can
  reach a warning; control characters in it are escaped, so a job cannot send
  terminal escape sequences to an operator's screen.
- stdout's reader may go away (``perfmon-agent attach --json | head``): then the
  output falls silent and the caller is told once, never a traceback.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from perfmon.parsers.figures import (
    FailSlowEvent,
    IntervalFigures,
    Statistics,
    StragglerEpisode,
    finite,
    scaled,
)
from rich.console import Console
from rich.table import Table

PROG = "perfmon-agent"
GIB = 1 << 30
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with control characters (ESC, CR, ...) shown as \\xNN; one line."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text.replace("\n", " "))


def warn(line: str) -> None:
    """One warning line on stderr."""
    print(f"{PROG}: warning: {printable(line)}", file=sys.stderr, flush=True)


def note(line: str) -> None:
    """One note line on stderr (--verbose): nothing to act on, nothing made wrong."""
    print(f"{PROG}: note: {printable(line)}", file=sys.stderr, flush=True)


def quiet_broken_pipe() -> None:
    """After stdout's reader went away: no more writes, no traceback at exit.

    Python's documented way: point stdout at /dev/null so that the flush at
    exit does not raise again.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)


# The width of a table written to a file or a pipe: rich's default there is 80 columns,
# which cuts paths with an ellipsis; a file has no width to fit.
FILE_WIDTH = 1000


class PipeConsole(Console):
    """A rich console that reports a closed stdout (rich itself exits with status 1), and
    fits where it writes: a terminal's width, or no cut at all in a file or a pipe."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not self.is_terminal and "width" not in kwargs:
            self.width = FILE_WIDTH

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


class Output:
    """stdout through a rich console, until its reader goes away; then silence.

    ``on_closed`` is called once when that happens (a session then ends quietly
    and still writes its summary file).
    """

    def __init__(self, *, stderr: bool = False) -> None:
        self.console = PipeConsole(stderr=stderr, highlight=False)
        self.closed = False
        self.on_closed: Callable[[], None] | None = None

    def _guard(self, action: Callable[[], object]) -> None:
        if self.closed:
            return
        try:
            action()
            self.console.file.flush()
        except BrokenPipeError:
            self.closed = True
            quiet_broken_pipe()
            if self.on_closed is not None:
                self.on_closed()

    def print(self, text: str) -> None:
        self._guard(lambda: self.console.print(text))

    def write(self, text: str) -> None:
        self._guard(lambda: sys.stdout.write(text))

    def table(self, draw: Callable[[], object]) -> None:
        """Run ``draw`` (which prints on ``console``) unless stdout is gone."""
        self._guard(draw)


# -- figures -----------------------------------------------------------------------

def fmt(value: Any, spec: str, unit: str = "") -> str:
    """A figure as ``spec`` formats it, with its unit; ``-`` when it is not a finite number
    (unknown, or not a number at all: every view prints through this)."""
    if finite(value) is None:
        return "-"
    return f"{value:{spec}}{unit}"


def progress_line(figures: IntervalFigures) -> str:
    return (
        f"iter {figures.iteration:>6} | step {fmt(scaled(figures.step_s, 1e3), '.2f', ' ms')} | "
        f"{fmt(figures.tokens_per_s, ',.0f', ' tok/s')} | "
        f"{fmt(scaled(figures.flops_per_gpu, 1e-12), '.2f', ' TFLOPS/GPU')} | "
        f"mem {fmt(scaled(figures.memory_bytes, 1 / GIB), '.2f', ' GiB')}"
    )


def _quality_row(stats: Statistics) -> str:
    losses = (stats.data_quality or {}).get("losses") or []
    return f"{len(losses)} loss(es): see the warnings" if losses else "nothing missed"


def _goodput_row(stats: Statistics) -> str:
    """The session's goodput, its largest losses, and what it did not see."""
    ledger = stats.goodput
    if ledger is None:
        return "-"
    top = sorted(((s, c) for c, s in ledger.lost_s.items()
                  if finite(s) is not None and s >= 0.05), reverse=True)[:3]
    ratio, unseen = finite(ledger.ratio), finite(ledger.unobserved_s)
    text = (f"{ratio:.1%} of {fmt(ledger.wall_s, '.1f', ' s')}"
            if ratio is not None else "unknown (no iteration seen)")
    if top:
        text += " (lost: " + ", ".join(f"{c} {s:.1f} s" for s, c in top) + ")"
    if unseen is not None and unseen > 0:
        text += f"; {unseen:.1f} s not seen"
    return text


def _pipeline_row(stats: Statistics) -> str | None:
    """A pipeline job's bubble against the schedule's, and its slow stage (None: no
    pipeline)."""
    p = stats.pipeline
    if p is None:
        return None
    text = f"{p.stages} stages: bubble {fmt(p.bubble, '.1%')} (ideal {fmt(p.ideal_bubble, '.1%')})"
    if p.slow:
        text += (f"; stage {p.bounding_stage} bounds it, "
                 f"+{fmt(scaled(p.excess_s, 1e3), '.1f', ' ms')} a step "
                 f"({fmt(scaled(p.excess_per_microbatch_s, 1e3), '.1f', ' ms')} a micro-batch)")
    return text


def _layout_row(info: Mapping[str, Any]) -> str:
    """The job's parallel layout as session_info.layout states it."""
    layout = info.get("layout") or {}
    sizes = layout.get("sizes") if layout.get("stated") else None
    if not isinstance(sizes, Mapping):
        return "not stated"
    return " x ".join(f"{k.upper()} {sizes.get(k)}" for k in ("dp", "pp", "tp", "cp", "ep")
                      if sizes.get(k) not in (None, 1) or k == "dp")


def print_summary_table(console: Console, stats: Statistics, info: Mapping[str, Any],
                        path: Path) -> None:
    """The end table of a session's figures and facts (``info``: its session_info). Every
    figure may be unknown (a summary rebuilt from a log anyone may have written is kept to
    its schema: what is not becomes None)."""
    def ms(value: float | None) -> float | None:
        return scaled(value, 1e3)

    table = Table(title=f"perf summary: pid {info.get('pid', '?')} "
                  f"({fmt(info.get('total_iterations'), 'd')} iterations)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("avg step time", fmt(ms(stats.step_s), ".2f", " ms")),
        ("p50 / p90 / p99 step",
         " / ".join(fmt(ms(v), ".2f") for v in
                    (stats.p50_step_s, stats.p90_step_s, stats.p99_step_s)) + " ms"),
        ("tokens/s", fmt(stats.tokens_per_s, ",.0f")),
        ("samples/s", fmt(stats.samples_per_s, ",.2f")),
        ("TFLOPS per GPU", fmt(scaled(stats.flops_per_gpu, 1e-12), ".3f")),
        ("MFU", fmt(stats.mfu, ".1%")),
        ("micro-batches per step", fmt(stats.microbatches_per_step, "d")),
        ("peak memory", fmt(scaled(stats.peak_memory_bytes, 1 / GIB), ".2f", " GiB")),
        ("model source", str((info.get("model") or {}).get("source") or "none")),
        ("iterations from", str(stats.iteration_estimator or "-")),
        ("data quality", _quality_row(stats)),
        ("goodput", _goodput_row(stats)),
        ("ended", str(info.get("end_reason"))),
    ]
    if len(stats.ranks or ()) > 1:
        rows.insert(-3, ("parallel layout", _layout_row(info)))
    pipeline = _pipeline_row(stats)
    if pipeline is not None:
        rows.insert(-3, ("pipeline", pipeline))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"summary: {path}")


def describe_event(event: StragglerEpisode | FailSlowEvent) -> str:
    """One line for a straggler or fail-slow event (the live output)."""
    def who(pid: int, rank: int | None, stage: int | None = None) -> str:
        name = f"rank {rank} (pid {pid})" if rank is not None else f"pid {pid}"
        return f"pipeline stage {stage}: {name}" if stage is not None else name

    def ms(seconds: float | None) -> str:
        return fmt(scaled(seconds, 1e3), ".1f")

    if isinstance(event, StragglerEpisode):
        if event.until is not None:
            return (f"straggler: {who(event.pid, event.rank, event.stage)} no longer lags "
                    f"(since {event.until})")
        others = "the others" if event.stage is None else "its stage's other replicas"
        return (f"straggler: {who(event.pid, event.rank, event.stage)} since {event.since}: "
                f"computes {ms(event.compute_s)} ms per step against "
                f"{ms(event.others_compute_s)} ms on {others}, delaying the job "
                f"~{ms(event.delay_per_step_s)} ms a step")
    moved = [who(r.pid, r.rank, r.stage) for r in event.ranks if r.moved]
    kind = event.event
    what = {"fail_slow": "fail-slow", "eased": "fail-slow eased",
            "recovered_partly": "recovered partly"}.get(kind, kind)
    # (where the job runs against its healthy pace, once it is no longer the change)
    base = event.baseline_step_s
    against = (f", {event.vs_baseline:+.0%} against the healthy {ms(base)} ms"
               if kind in ("eased", "recovered_partly") and base else "")
    return (f"{what}: step time {ms(event.before_step_s)} -> {ms(event.after_step_s)} ms "
            f"({event.change:+.0%}{against}) since {event.timestamp}"
            + (f"; compute moved on {', '.join(moved)}" if moved else ""))
