"""`perfmon-agent trace`: an event log (or several: the ranks or nodes of one job) as a
Chrome / Perfetto trace (perfmon.agent.record.trace says what goes where)."""

from __future__ import annotations

import argparse
from pathlib import Path

from perfmon.agent.argtypes import Command
from perfmon.agent.console import printable, warn
from perfmon.agent.record.layout import LOG_GLOB
from perfmon.agent.record.outputs import write_user_file
from perfmon.agent.record.runs import find_runs, is_folder_input, is_summary_file
from perfmon.agent.record.trace import MIB, build_trace
from perfmon.parsers.errors import InputFileError

TRACE_DESCRIPTION = ("Write an event log (or a folder of them: the ranks or nodes of one job) as "
                     "a Chrome/Perfetto trace (JSON trace-event format).")
TRACE_EPILOG = """examples:
  perfmon-agent trace outputs/logs/perf_monitor/perf_events_20261130_120000.msgpack
  perfmon-agent trace /shared/job-42/perf_logs/ -o job42.json

Open the file in https://ui.perfetto.dev or chrome://tracing (both load it locally).
A folder gives one process per rank of every event log in it.
"""


def trace_inputs(path: Path) -> list[Path]:
    """The event logs a LOG_OR_DIR argument names. Raises InputFileError (exit 2)."""
    if not is_folder_input(path):
        if is_summary_file(path):
            raise InputFileError(f"input {path}: a summary, not an event log: the trace needs "
                                 f"the {LOG_GLOB} beside it")
        return [path]
    logs = find_runs(path, 1, summaries=False)
    if not logs:
        raise InputFileError(f"folder {path}: no {LOG_GLOB} in it or in its "
                             "sub-folders")
    return logs


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the trace command's arguments to a (sub-)parser."""
    parser.add_argument("source", type=Path, metavar="LOG_OR_DIR",
                        help="an event log (any part) or a folder of event logs")
    parser.add_argument("-o", "--output", type=Path, default=Path("trace.json"), metavar="FILE",
                        help="the trace file to write (default: %(default)s)")


def trace_main(args: argparse.Namespace) -> int:
    """Write the trace; 0 on success. Raises PerfmonError subclasses."""
    builder = build_trace(trace_inputs(args.source))
    for line in builder.warnings:
        warn(line)
    data = builder.document()
    write_user_file(args.output, data)
    ranks = sum(len(log["ranks"]) for log in builder.logs)
    print(printable(f"trace: {args.output} ({len(builder.logs)} event log"
                    f"{'s' if len(builder.logs) > 1 else ''}, {ranks} rank"
                    f"{'s' if ranks > 1 else ''}, {len(builder.events):,} events, "
                    f"{len(data) / MIB:,.1f} MiB): open it in ui.perfetto.dev or "
                    "chrome://tracing"))
    return 0


COMMAND = Command("trace", "write event logs as a Chrome/Perfetto trace", add_trace_arguments,
                  trace_main, description=TRACE_DESCRIPTION, epilog=TRACE_EPILOG)
