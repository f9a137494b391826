"""`perfmon-agent incidents DIR`: the incident bundles in folders (perfmon.agent.measure.
incidents writes one per hang, straggler, fail-slow event and abnormal exit), newest
first: when, what, which ranks, where. An unfit record (too deep, not JSON, owned by
another user) is one warning line; the others are still listed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from perfmon.agent.argtypes import Command
from perfmon.agent.console import printable, warn
from perfmon.agent.record.incidents import find_incidents

INCIDENTS_EPILOG = """examples:
  perfmon-agent incidents outputs/logs/perf_monitor/
  perfmon-agent incidents /var/lib/perfmon-agent/jobs/ --json

Each bundle holds incident.json, every rank's stacks (stacks.json), the job's GPUs
(gpus.json), each rank's iterations around it (history.json) and the trace of that
window (trace.json: open it in ui.perfetto.dev).
"""


def add_incidents_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folders", nargs="+", type=Path, metavar="DIR",
                        help="folders to look in (and their sub-folders, 3 levels)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")


def incidents_main(args: argparse.Namespace) -> int:
    problems: list[str] = []
    found = [i for folder in args.folders for i in find_incidents(folder, problems=problems)]
    for line in problems:
        warn(line)
    if args.json:
        print(json.dumps({"incidents": [i.to_dict() for i in found], "problems": problems},
                         indent=1))
        return 0
    if not found:
        print("no incident bundles")
        return 0
    for i in found:
        ranks = ",".join("-" if r is None else str(r) for r in i.ranks) or "-"
        print(printable(f"{i.time}  {i.kind:<9}  ranks {ranks:<8}  {i.what}\n    {i.folder}"))
    return 0


COMMAND = Command("incidents", "list the incident bundles in folders", add_incidents_arguments,
                  incidents_main, description="List the incident bundles (one per hang, "
                  "straggler, fail-slow event and abnormal exit) in folders, newest first.",
                  epilog=INCIDENTS_EPILOG)
