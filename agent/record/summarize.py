"""``perfmon-agent summarize LOG``: the summary rebuilt from an event log (e.g. after the
agent was killed), beside it or where --output says."""

from __future__ import annotations

import argparse
from pathlib import Path

from perfmon.agent.argtypes import Command
from perfmon.agent.console import Output, print_summary_table, warn
from perfmon.agent.record.layout import LOG_NAME, SUMMARY_NAME, summary_beside
from perfmon.agent.record.outputs import json_bytes, write_user_file
from perfmon.agent.record.replay import rebuild_from_event_log
from perfmon.parsers.figures import Statistics, parse

SUMMARIZE_EPILOG = """examples:
  perfmon-agent summarize outputs/logs/perf_monitor/perf_events_20261130_120000.msgpack
  perfmon-agent summarize events.msgpack --json | jq .final_statistics
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("event_log", type=Path, metavar="EVENT_LOG")
    parser.add_argument(
        "--output", type=Path, metavar="FILE",
        help=f"where to write the summary (default: {SUMMARY_NAME} beside the log, with "
             "its timestamp)")
    parser.add_argument("--json", action="store_true", help="print the summary to stdout")


def summarize_main(args: argparse.Namespace) -> int:
    rebuilt = rebuild_from_event_log(args.event_log)
    for line in rebuilt.warnings:
        warn(line)
    output = args.output or summary_beside(rebuilt.parts[0])
    write_user_file(output, json_bytes(rebuilt.summary))
    out = Output()
    if args.json:
        out.write(json_bytes(rebuilt.summary).decode())
    else:
        # (the figures as the summary, kept to its schema, has them)
        stats = parse(Statistics, rebuilt.summary["final_statistics"])
        out.table(lambda: print_summary_table(out.console, stats,
                                              rebuilt.summary["session_info"], output))
    return 0


COMMAND = Command("summarize", "rebuild a perf summary from an event log", add_arguments,
                  summarize_main, description="Rebuild the summary from "
                  f"{LOG_NAME}, e.g. after the agent was killed.",
                  epilog=SUMMARIZE_EPILOG)
