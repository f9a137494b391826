"""perfmon-agent: measure running PyTorch training jobs from outside, with no code change.

Every error the agent knows about is one line on stderr and an exit code
(see perfmon.parsers.errors); a traceback means a bug in the agent.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from perfmon.agent.argtypes import (
    OneLineParser,
    pid,
    positive_float,
)
from perfmon.agent.attach_args import (
    add_metrics_argument,
    add_session_arguments,
    session_options,
    start_metrics,
)
from perfmon.agent.console import (
    PROG,
    Output,
    printable,
    quiet_broken_pipe,
    warn,
)
from perfmon.agent.flops_report import FLOPS_EPILOG, add_flops_arguments, flops_main
from perfmon.agent.health import HEALTH_DESCRIPTION, add_health_arguments, health_main
from perfmon.agent.merge import MERGE_DESCRIPTION, MERGE_EPILOG, add_merge_arguments, merge_main
from perfmon.agent.metrics import JobMetrics, Metrics
from perfmon.agent.outputs import json_bytes, write_user_file
from perfmon.agent.report import (
    REPORT_DESCRIPTION,
    REPORT_EPILOG,
    add_report_arguments,
    report_main,
)
from perfmon.agent.serve import (
    RUN_EPILOG,
    SERVE_EPILOG,
    add_run_arguments,
    add_serve_arguments,
    run_main,
    serve_main,
)
from perfmon.agent.session import MonitorSession, SessionContext, SessionObserver, SessionResult
from perfmon.agent.stacks import add_stacks_arguments, stacks_main
from perfmon.agent.summary import rebuild_from_event_log
from perfmon.agent.top import TOP_DESCRIPTION, TOP_EPILOG, add_top_arguments, top_main
from perfmon.agent.trace import (
    TRACE_DESCRIPTION,
    TRACE_EPILOG,
    add_trace_arguments,
    trace_main,
)
from perfmon.parsers.errors import PerfmonError
from rich.console import Console
from rich.table import Table

ATTACH_EPILOG = """examples:
  sudo perfmon-agent attach --pid 12345 --model-config llama7b.yaml
  sudo perfmon-agent attach --pid 12345 --duration 60 --json > summary.json
  sudo perfmon-agent attach --pid $(pgrep -f torchrun) --log-interval 50

The pid may be a training process or a launcher (torchrun, deepspeed): a
launcher expands to its ranks. Stops when the job exits, on SIGINT/SIGTERM,
or after --duration; the summary is rewritten atomically as it goes.
"""

SUMMARIZE_EPILOG = """examples:
  perfmon-agent summarize outputs/logs/perf_monitor/perf_events_20261130_120000.msgpack
  perfmon-agent summarize events.msgpack --json | jq .final_statistics
"""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Measure running PyTorch/Megatron/FlagScale training jobs from outside.",
    )
    sub = parser.add_subparsers(parser_class=OneLineParser, dest="command", required=True,
                                metavar="COMMAND")

    attach = sub.add_parser(
        "attach",
        help="monitor a running training job and write its perf summary",
        description="Attach to a running PyTorch job with eBPF uprobes and write "
        "perf_summary_<timestamp>.json (FlagScale perf monitor format).",
        epilog=ATTACH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    attach.add_argument("--pid", type=pid, required=True, help="training (or launcher) pid")
    add_session_arguments(attach)
    attach.add_argument(
        "--duration", type=positive_float, metavar="SECONDS",
        help="stop after this long (default: until the job exits or SIGINT/SIGTERM)",
    )
    add_metrics_argument(attach)
    attach.add_argument("--json", action="store_true", help="print the final summary to stdout")

    summarize = sub.add_parser(
        "summarize",
        help="rebuild a perf summary from an event log",
        description="Rebuild the summary from perf_events_<timestamp>.msgpack, e.g. "
        "after the agent was killed.",
        epilog=SUMMARIZE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    summarize.add_argument("event_log", type=Path, metavar="FILE.msgpack")
    summarize.add_argument(
        "--output", type=Path, metavar="FILE",
        help="where to write the summary (default: perf_summary_<ts>.json beside the log)",
    )
    summarize.add_argument("--json", action="store_true", help="print the summary to stdout")

    flops = sub.add_parser(
        "flops",
        help="print model FLOPs per iteration and per token, with their breakdown",
        description="Model FLOPs as Megatron-LM's num_floating_point_operations counts them.",
        epilog=FLOPS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flops_arguments(flops)

    health = sub.add_parser(
        "health", help="check each GPU (driver, temperature, ECC, XID, throttling, links)",
        description=HEALTH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_health_arguments(health)

    serve = sub.add_parser(
        "serve", help="the node service: find every training job, attach, finalize (systemd)",
        description="Watch every PyTorch training job on this node: jobs are found by a "
        "scan of /proc, attached as `attach` does, and finalized when they end; one folder "
        "per job, Prometheus metrics.",
        epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(serve)

    run = sub.add_parser(
        "run", help="start a command and watch every training rank it starts",
        description="Start COMMAND, watch every training process among its descendants, "
        "write their summaries when it exits, and exit with its status.",
        epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(run)

    report = sub.add_parser("report", help="an HTML report (plots) of event logs or summaries",
                            description=REPORT_DESCRIPTION, epilog=REPORT_EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_report_arguments(report)
    trace = sub.add_parser("trace", help="write event logs as a Chrome/Perfetto trace",
                           description=TRACE_DESCRIPTION, epilog=TRACE_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_arguments(trace)
    merge = sub.add_parser("merge", help="one job summary from the summaries of several nodes",
                           description=MERGE_DESCRIPTION, epilog=MERGE_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_merge_arguments(merge)
    top = sub.add_parser("top", help="a live terminal view of the jobs in some folders",
                         description=TOP_DESCRIPTION, epilog=TOP_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    add_top_arguments(top)

    stacks = sub.add_parser(
        "stacks", help="dump the Python stacks of a job's ranks (py-spy, non-blocking)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_stacks_arguments(stacks)
    return parser


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def progress_line(entry: dict[str, Any]) -> str:
    return (
        f"iter {entry['iteration']:>6} | step {_fmt(entry['step_time_ms'], '.2f', ' ms')} | "
        f"{_fmt(entry['tokens_per_sec'], ',.0f', ' tok/s')} | "
        f"{_fmt(entry['TFLOPS_per_GPU'], '.2f', ' TFLOPS/GPU')} | "
        f"mem {_fmt(entry['memory_GB'], '.2f', ' GB')}"
    )


def _quality_row(stats: dict[str, Any]) -> str:
    losses = (stats.get("data_quality") or {}).get("losses") or []
    return f"{len(losses)} loss(es): see the warnings" if losses else "nothing missed"


def print_summary_table(console: Console, summary: dict[str, Any], path: Path) -> None:
    """The end table. Every figure may be unknown (a summary rebuilt from a log anyone
    may have written is kept to its schema: what is not becomes None)."""
    info, stats = summary["session_info"], summary["final_statistics"]
    table = Table(title=f"perf summary: pid {info.get('pid', '?')} "
                  f"({_fmt(info.get('total_iterations'), 'd')} iterations)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("avg step time", _fmt(stats.get("avg_step_time_ms"), ".2f", " ms")),
        ("p50 / p90 / p99 step",
         " / ".join(_fmt(stats.get(k), ".2f") for k in
                    ("p50_step_time_ms", "p90_step_time_ms", "p99_step_time_ms")) + " ms"),
        ("tokens/s", _fmt(stats.get("avg_tokens_per_sec"), ",.0f")),
        ("samples/s", _fmt(stats.get("avg_samples_per_sec"), ",.2f")),
        ("TFLOPS per GPU", _fmt(stats.get("avg_tflops_per_gpu"), ".3f")),
        ("MFU", _fmt(stats.get("mfu"), ".1%")),
        ("micro-batches per step", _fmt(stats.get("microbatches_per_step"), "d")),
        ("peak memory", _fmt(stats.get("peak_memory_gb"), ".2f", " GB")),
        ("model source", str((info.get("model") or {}).get("source") or "none")),
        ("iterations from", str(stats.get("iteration_estimator") or "-")),
        ("data quality", _quality_row(stats)),
        ("ended", str(info.get("end_reason"))),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"summary: {path}")


class _AttachMetrics(JobMetrics):
    """The job's metrics, named once the session knows its ranks (as serve names it)."""

    def __init__(self, metrics: Metrics) -> None:
        super().__init__(metrics, "")

    def started(self, facts: dict[str, Any]) -> None:
        self.job = facts["job"]["name"]
        super().started(facts)


def _attach(args: argparse.Namespace) -> int:
    # With --json, stdout carries only the summary; the progress goes to stderr.
    out = Output(stderr=args.json)
    options = session_options(args, args.pid, duration_s=args.duration)
    metrics = start_metrics(args.metrics_address)
    observer = SessionObserver() if metrics is None else _AttachMetrics(metrics)
    session = MonitorSession(options, lambda entry: out.print(progress_line(entry)), warn=warn,
                             context=SessionContext(observer=observer))
    out.on_closed = lambda: session.stop("stdout_closed")
    out.print(f"Attaching to pid {args.pid}... Ctrl-C to end.")
    result = session.run()
    if args.json:
        out.write(json_bytes(result.summary).decode())
    else:
        out.table(lambda: print_summary_table(out.console, result.summary, result.summary_path))
    for loss in result.summary["final_statistics"]["data_quality"]["losses"]:
        warn(f"data quality: {loss}")
    if result.write_error is not None:
        raise result.write_error
    return 0


def _summarize(args: argparse.Namespace) -> int:
    rebuilt = rebuild_from_event_log(args.event_log)
    for line in rebuilt.warnings:
        warn(line)
    first = rebuilt.parts[0]
    stamp = first.name.removeprefix("perf_events_").removesuffix(".msgpack")
    output = args.output or first.with_name(f"perf_summary_{stamp}.json")
    write_user_file(output, json_bytes(rebuilt.summary))
    out = Output()
    if args.json:
        out.write(json_bytes(rebuilt.summary).decode())
    else:
        out.table(lambda: print_summary_table(out.console, rebuilt.summary, output))
    return 0


def _run(args: argparse.Namespace) -> int:
    # stdout belongs to COMMAND: the agent's lines and tables go to stderr.
    out = Output(stderr=True)

    def show(result: SessionResult) -> None:
        out.table(lambda: print_summary_table(out.console, result.summary,
                                              result.summary_path))

    return run_main(args, show)


COMMANDS = {"attach": _attach, "summarize": _summarize, "flops": flops_main,
            "health": health_main, "stacks": stacks_main, "serve": serve_main, "run": _run,
            "report": report_main, "trace": trace_main, "top": top_main, "merge": merge_main}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except PerfmonError as err:
        print(f"{PROG}: error: {printable(str(err))}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        quiet_broken_pipe()  # stdout's reader went away: nothing more to say
        return 0


if __name__ == "__main__":
    sys.exit(main())
