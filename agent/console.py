"""What the agent prints: warnings on stderr, output on stdout, and their two hazards; the
one formatter of figures, the live lines and the end table.

- Text a job controls (its paths, its command line, names from its files) can
  reach a warning; control characters in it are escaped, so a job cannot send
  terminal escape sequences to an operator's screen.
- stdout's reader may go away (``perfmon-agent attach --json | head``): then the
  output falls silent and the caller is told once, never a traceback.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

PROG = "perfmon-agent"
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


class PipeConsole(Console):
    """A rich console that reports a closed stdout (rich itself exits with status 1)."""

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
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or (isinstance(value, float) and not math.isfinite(value))):
        return "-"
    return f"{value:{spec}}{unit}"


def progress_line(entry: dict[str, Any]) -> str:
    return (
        f"iter {entry['iteration']:>6} | step {fmt(entry['step_time_ms'], '.2f', ' ms')} | "
        f"{fmt(entry['tokens_per_sec'], ',.0f', ' tok/s')} | "
        f"{fmt(entry['TFLOPS_per_GPU'], '.2f', ' TFLOPS/GPU')} | "
        f"mem {fmt(entry['memory_GB'], '.2f', ' GiB')}"
    )


def _quality_row(stats: dict[str, Any]) -> str:
    losses = (stats.get("data_quality") or {}).get("losses") or []
    return f"{len(losses)} loss(es): see the warnings" if losses else "nothing missed"


def _goodput_row(stats: dict[str, Any]) -> str:
    """The session's goodput, its largest losses, and what it did not see."""
    ledger = stats.get("goodput")
    if not isinstance(ledger, dict):
        return "-"
    lost = ledger.get("lost_seconds")
    lost = lost if isinstance(lost, dict) else {}
    top = sorted(((s, c) for c, s in lost.items() if isinstance(s, int | float) and s >= 0.05),
                 reverse=True)[:3]
    unseen = ledger.get("unobserved_seconds")
    ratio = ledger.get("ratio")
    text = (f"{ratio:.1%} of {fmt(ledger.get('wall_seconds'), '.1f', ' s')}"
            if isinstance(ratio, int | float) else "unknown (no iteration seen)")
    if top:
        text += " (lost: " + ", ".join(f"{c} {s:.1f} s" for s, c in top) + ")"
    if isinstance(unseen, int | float) and unseen > 0:
        text += f"; {unseen:.1f} s not seen"
    return text


def print_summary_table(console: Console, summary: dict[str, Any], path: Path) -> None:
    """The end table. Every figure may be unknown (a summary rebuilt from a log anyone
    may have written is kept to its schema: what is not becomes None)."""
    info, stats = summary["session_info"], summary["final_statistics"]
    table = Table(title=f"perf summary: pid {info.get('pid', '?')} "
                  f"({fmt(info.get('total_iterations'), 'd')} iterations)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("avg step time", fmt(stats.get("avg_step_time_ms"), ".2f", " ms")),
        ("p50 / p90 / p99 step",
         " / ".join(fmt(stats.get(k), ".2f") for k in
                    ("p50_step_time_ms", "p90_step_time_ms", "p99_step_time_ms")) + " ms"),
        ("tokens/s", fmt(stats.get("avg_tokens_per_sec"), ",.0f")),
        ("samples/s", fmt(stats.get("avg_samples_per_sec"), ",.2f")),
        ("TFLOPS per GPU", fmt(stats.get("avg_tflops_per_gpu"), ".3f")),
        ("MFU", fmt(stats.get("mfu"), ".1%")),
        ("micro-batches per step", fmt(stats.get("microbatches_per_step"), "d")),
        ("peak memory", fmt(stats.get("peak_memory_gb"), ".2f", " GiB")),
        ("model source", str((info.get("model") or {}).get("source") or "none")),
        ("iterations from", str(stats.get("iteration_estimator") or "-")),
        ("data quality", _quality_row(stats)),
        ("goodput", _goodput_row(stats)),
        ("ended", str(info.get("end_reason"))),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"summary: {path}")


def describe_event(event: dict[str, Any]) -> str:
    """One line for a straggler or fail-slow event (the live output)."""
    def who(e: dict[str, Any]) -> str:
        return f"rank {e['rank']} (pid {e['pid']})" if e.get("rank") is not None else (
            f"pid {e['pid']}")

    kind = event["event"]
    if kind == "straggler":
        return (f"straggler: {who(event)} since {event['since']}: computes "
                f"{event['compute_ms']:.1f} ms per step against {event['others_compute_ms']:.1f}"
                f" ms on the others, delaying the job ~{event['delay_ms_per_step']:.1f} ms a step")
    if kind == "straggler_ended":
        return f"straggler: {who(event)} no longer lags (since {event['until']})"
    moved = [who(r) for r in event.get("ranks") or [] if r.get("moved")]
    what = {"fail_slow": "fail-slow", "eased": "fail-slow eased",
            "recovered_partly": "recovered partly"}.get(kind, kind)
    # (where the job runs against its healthy pace, once it is no longer the change)
    base = event.get("baseline_step_time_ms")
    against = (f", {event['vs_baseline_pct']:+.0f}% against the healthy {base:.1f} ms"
               if kind in ("eased", "recovered_partly") and base else "")
    return (f"{what}: step time {event['before_step_time_ms']:.1f} -> "
            f"{event['after_step_time_ms']:.1f} ms ({event['change_pct']:+.0f}%{against}) "
            f"since {event['timestamp']}"
            + (f"; compute moved on {', '.join(moved)}" if moved else ""))
