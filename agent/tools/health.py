"""``perfmon-agent health``: is each GPU fit to run a training job now (the checks:
perfmon.agent.measure.health)."""

from __future__ import annotations

import argparse
import json

from perfmon.agent.argtypes import Command, int_list, non_negative_float
from perfmon.agent.console import PipeConsole
from perfmon.agent.measure.health import SCHEMA_VERSION, HealthReport, run_health_check
from perfmon.parsers.errors import PerfmonError
from rich.markup import escape
from rich.table import Table

HEALTH_DESCRIPTION = """\
Is each GPU fit to run a training job right now? Watches the GPUs for a window,
reads their error counters, and reports pass/warn/fail per check (docs/gpu.md).
"""
HEALTH_EPILOG = """\
examples:
  perfmon-agent health                      # all GPUs, 5 s window, table
  perfmon-agent health --gpus 0,1 --json    # two GPUs, JSON (docs/health_report.schema.json)
  perfmon-agent health --window 30 --pids 4242,4243   # other processes on the GPUs warn

exit status: 0 no check failed (warnings allowed), 1 a check failed,
             3 no such GPU, 5 NVML unavailable (no driver)
"""


def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``health`` options (--json, --gpus, --window, --pids) to ``parser``."""
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON instead of a table")
    parser.add_argument("--gpus", type=int_list, default=None, metavar="0,1",
                        help="NVML indices (PCI bus order, not CUDA_VISIBLE_DEVICES); "
                             "default: all")
    parser.add_argument("--window", type=non_negative_float, default=5.0, metavar="SECONDS",
                        help="watch XID events, temperature, power and clock events this "
                             "long (default: 5)")
    parser.add_argument("--pids", type=int_list, default=None, metavar="PID,...",
                        help="the job's processes; any other process on a GPU warns")


def health_main(args: argparse.Namespace) -> int:
    """Run the check from parsed arguments, print it; return the exit status.

    With ``--json`` stdout always holds a JSON document: the report, or, when
    no report can be made (no driver, no such GPU), ``status: error`` with the
    reason and the same exit status as the one line on stderr.
    """
    try:
        report = run_health_check(args.gpus, args.window, set(args.pids or ()))
    except PerfmonError as err:
        if args.json:
            print(json.dumps({"schema_version": SCHEMA_VERSION, "status": "error",
                              "exit_code": err.exit_code, "error": str(err)}, indent=2))
        raise
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _print_table(report)
    return report.exit_code


_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skipped": "dim"}


def _print_table(report: HealthReport) -> None:
    table = Table(title=f"GPU health: {report.status.upper()} (driver {report.driver_version}, "
                        f"{report.window_s:g} s window)")
    for column in ("GPU", "check", "status", "reason"):
        table.add_column(column)
    for gpu in report.gpus:
        for i, check in enumerate(gpu.checks):
            label = f"{gpu.index} {gpu.name or ''}".strip() if i == 0 else ""
            style = _STYLE[check.status]
            table.add_row(escape(label), check.name, f"[{style}]{check.status}[/]",
                          escape(check.reason))
        table.add_section()
    PipeConsole().print(table)


COMMAND = Command("health", "check each GPU (driver, temperature, ECC, XID, throttling, links)",
                  add_health_arguments, health_main, description=HEALTH_DESCRIPTION,
                  epilog=HEALTH_EPILOG)
