"""``perfmon-agent attach --pid N``: measure a running job until it exits, a signal or the
duration, printing a line per log interval and the table at the end."""

from __future__ import annotations

import argparse
from typing import Any

from perfmon.agent.argtypes import Command, pid, positive_float
from perfmon.agent.console import Output, note, print_summary_table, progress_line, warn
from perfmon.agent.measure.metrics import JobMetrics, Metrics, start_metrics
from perfmon.agent.measure.observer import ObserverGroup, ProgressLines, SessionObserver
from perfmon.agent.measure.session import MonitorSession, SessionContext
from perfmon.agent.options import add_attach_arguments, add_metrics_argument, attach_options
from perfmon.agent.record.layout import SUMMARY_NAME
from perfmon.agent.record.outputs import json_bytes

ATTACH_EPILOG = """examples:
  sudo perfmon-agent attach --pid 12345 --model-config llama7b.yaml
  sudo perfmon-agent attach --pid 12345 --duration 60 --json > summary.json
  sudo perfmon-agent attach --pid $(pgrep -f torchrun) --log-interval 50

The pid may be a training process or a launcher (torchrun, deepspeed): a
launcher expands to its ranks. Stops when the job exits, on SIGINT/SIGTERM,
or after --duration; the summary is rewritten atomically as it goes.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pid", type=pid, required=True, help="training (or launcher) pid")
    add_attach_arguments(parser)
    parser.add_argument(
        "--duration", type=positive_float, metavar="SECONDS",
        help="stop after this long (default: until the job exits or SIGINT/SIGTERM)")
    add_metrics_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the final summary to stdout")


class _AttachMetrics(JobMetrics):
    """The job's metrics, named once the session knows its ranks (as serve names it)."""

    def __init__(self, metrics: Metrics) -> None:
        super().__init__(metrics, "")

    def started(self, facts: dict[str, Any]) -> None:
        self.job = facts["job"]["name"]
        super().started(facts)


def attach_main(args: argparse.Namespace) -> int:
    # With --json, stdout carries only the summary; the progress goes to stderr.
    out = Output(stderr=args.json)
    options = attach_options(args, args.pid, duration_s=args.duration)
    metrics = start_metrics(args.metrics_address, warn)
    observers: list[SessionObserver] = [ProgressLines(lambda e: out.print(progress_line(e)))]
    if metrics is not None:
        observers.append(_AttachMetrics(metrics))
    session = MonitorSession(options, warn=warn, note=note,
                             context=SessionContext(observer=ObserverGroup(observers)))
    out.on_closed = lambda: session.stop("stdout_closed")
    out.print(f"Attaching to pid {args.pid}... Ctrl-C to end.")
    result = session.run()
    if args.json:
        out.write(json_bytes(result.summary).decode())
    else:
        out.table(lambda: print_summary_table(out.console, result.statistics,
                                              result.summary["session_info"],
                                              result.summary_path))
    quality = result.statistics.data_quality or {}
    for loss in quality.get("losses") or ():
        warn(f"data quality: {loss}")
    for loss in quality.get("minor") or () if options.verbose else ():
        note(f"data quality: {loss}")
    if result.write_error is not None:
        raise result.write_error
    return 0


COMMAND = Command(
    "attach", "monitor a running training job and write its perf summary", add_arguments,
    attach_main, description="Attach to a running PyTorch job with eBPF uprobes and write "
    f"{SUMMARY_NAME} (FlagScale perf monitor format).", epilog=ATTACH_EPILOG)
