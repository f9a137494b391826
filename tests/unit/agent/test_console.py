"""The console (perfmon.agent.console): a table written to a file or a pipe is not cut to
80 columns (a path in it stays whole), the one number formatter, and the live lines of the
typed figures."""

from __future__ import annotations

import io

from perfmon.agent.console import PipeConsole, fmt, progress_line
from perfmon.parsers.figures import IntervalFigures
from rich.table import Table


def test_a_table_in_a_file_keeps_its_long_paths_whole() -> None:
    path = "/var/lib/perfmon-agent/jobs/" + "a-very-long-job-name-" * 8 + "/perf_summary.json"
    out = io.StringIO()
    console = PipeConsole(file=out, highlight=False)
    table = Table("check", "what was found")
    table.add_row("output", path)
    console.print(table)
    assert path in out.getvalue() and "…" not in out.getvalue()


def test_the_formatter_shows_unknown_and_odd_values_as_a_dash() -> None:
    assert [fmt(v, ".1f") for v in (1.25, None, float("nan"), float("inf"), True, "7")] == [
        "1.2", "-", "-", "-", "-", "-"]
    assert fmt(3, "d", " ms") == "3 ms"


def test_a_progress_line_shows_the_figures_in_the_summary_units() -> None:
    line = progress_line(IntervalFigures(
        iteration=40, timestamp="t", step_s=0.125, flops_per_gpu=2.5e13, tokens_per_s=4096.0,
        samples_per_s=2.0, memory_bytes=1.5 * (1 << 30)))
    assert line == ("iter     40 | step 125.00 ms | 4,096 tok/s | 25.00 TFLOPS/GPU | "
                    "mem 1.50 GiB")
