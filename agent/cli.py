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
    non_negative_float,
    pid,
    positive_float,
    positive_int,
    power_of_two,
    regex,
)
from perfmon.agent.budget import DEFAULT_BUDGET_PCT
from perfmon.agent.console import (
    PROG,
    Output,
    printable,
    quiet_broken_pipe,
    warn,
)
from perfmon.agent.eventlog import DEFAULT_PART_BYTES
from perfmon.agent.flops_report import FLOPS_EPILOG, add_flops_arguments, flops_main
from perfmon.agent.health import HEALTH_DESCRIPTION, add_health_arguments, health_main
from perfmon.agent.outputs import json_bytes, write_user_file
from perfmon.agent.reducers import DEFAULT_MAX_LOG_ENTRIES
from perfmon.agent.session import AttachOptions, MonitorSession
from perfmon.agent.stacks import add_stacks_arguments, stacks_main
from perfmon.agent.summary import rebuild_from_event_log
from perfmon.parsers.errors import PerfmonError
from perfmon.parsers.peak_tflops import DTYPES
from perfmon.probes.cuda import LAUNCH_MODES
from perfmon.probes.pyspy import DEFAULT_RATE_HZ
from perfmon.probes.uprobes import DEFAULT_RING_PAGES
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
    attach.add_argument("--model-config", metavar="FILE", help="model dimensions, YAML or JSON")
    attach.add_argument("--model-preset", metavar="NAME", help="a well-known model shape")
    attach.add_argument(
        "--output-dir", type=Path, default=Path("outputs/logs/perf_monitor"),
        help="where the summary and event log go (default: %(default)s); it must belong to "
        "root or this user and not be writable by others unless sticky",
    )
    attach.add_argument(
        "--allow-shared-output-dir", action="store_true",
        help="write into an output dir another user owns or may write (files are still "
        "created exclusively, never through links)")
    attach.add_argument(
        "--max-log-entries", type=positive_int, default=DEFAULT_MAX_LOG_ENTRIES, metavar="N",
        help="iteration_logs entries kept in the summary; older ones are thinned evenly "
        "(default: %(default)s)")
    attach.add_argument(
        "--event-log-part-mib", type=positive_int, default=DEFAULT_PART_BYTES >> 20,
        metavar="MIB", help="start a new event log part after this many MiB "
        "(default: %(default)s)")
    attach.add_argument(
        "--log-interval", type=positive_int, default=10, metavar="N",
        help="iterations per iteration_logs entry (default: %(default)s)",
    )
    attach.add_argument(
        "--duration", type=positive_float, metavar="SECONDS",
        help="stop after this long (default: until the job exits or SIGINT/SIGTERM)",
    )
    attach.add_argument(
        "--peak-tflops", type=positive_float, metavar="TFLOPS",
        help="dense peak per GPU for MFU (default: from the device table; none on CPU)",
    )
    attach.add_argument(
        "--dtype", choices=DTYPES, default="bf16",
        help="training precision, for the device's peak in MFU (default: %(default)s)",
    )
    attach.add_argument(
        "--health-check", action="store_true",
        help="check the GPUs first (as `perfmon-agent health`) and record it in session_info",
    )
    attach.add_argument(
        "--iteration-source", choices=("auto", "uprobe", "pyspy"), default="auto",
        help="uprobe: exact, needs eBPF; pyspy: from stack samples, needs only ptrace; "
        "auto: uprobe, else pyspy with a warning (default: %(default)s)",
    )
    attach.add_argument(
        "--probe-backend", choices=("auto", "bcc", "tracefs"), default="auto",
        help="how uprobes are attached: bcc (eBPF; needs bcc and kernel headers), tracefs "
        "(dynamic uprobe events; no compiler, no headers), auto: bcc, else tracefs with a "
        "warning (default: %(default)s)")
    attach.add_argument(
        "--ring-buffer-pages", type=power_of_two, default=DEFAULT_RING_PAGES, metavar="N",
        help="the bcc marker probe's ring buffer, a power of two of 4 KiB pages; raise it "
        "when data_quality reports events_dropped (default: %(default)s)")
    attach.add_argument("--iteration-function", type=regex, metavar="REGEX",
                        help="pyspy mode: an iteration starts on entering a function whose "
                        "name matches (default: torch.optim Optimizer.step)")
    attach.add_argument("--iteration-variable", metavar="NAME",
                        help="the job's own iteration counter, a local variable (default: "
                        "iteration, iter_num, step, global_step)")
    attach.add_argument("--no-stack-sampling", action="store_true",
                        help="no py-spy sampling in uprobe mode (no phase breakdown)")
    attach.add_argument(
        "--cpu-budget", type=non_negative_float, default=DEFAULT_BUDGET_PCT, metavar="PCT",
        help="the agent's CPU (py-spy included) per monitored rank, in %% of a core: stacks "
        "are sampled in bursts to fit; 0 samples them continuously (default: %(default)s)")
    attach.add_argument(
        "--cuda-launches", choices=LAUNCH_MODES, default="sampled",
        help="count kernel launches on one iteration in every N, N adapted to keep the "
        "cost under 0.5%% of the step time (sampled), on every iteration (always: a "
        "~11 us trap per launch), or not at all (off) (default: %(default)s)")
    attach.add_argument("--stack-rate", type=positive_int, default=DEFAULT_RATE_HZ,
                        metavar="HZ", help="py-spy samples a second (default: %(default)s)")
    attach.add_argument("--hang-factor", type=positive_float, default=10.0, metavar="K",
                        help="hung after K x the median step time without an iteration "
                        "(default: %(default)s) ...")
    attach.add_argument("--hang-timeout", type=positive_float, default=120.0,
                        metavar="SECONDS", help="... and at least this long (default: %(default)s)")
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
    info, stats = summary["session_info"], summary["final_statistics"]
    table = Table(title=f"perf summary: pid {info['pid']} ({info['total_iterations']} iterations)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("avg step time", _fmt(stats["avg_step_time_ms"], ".2f", " ms")),
        ("p50 / p90 / p99 step",
         " / ".join(_fmt(stats[k], ".2f") for k in
                    ("p50_step_time_ms", "p90_step_time_ms", "p99_step_time_ms")) + " ms"),
        ("tokens/s", _fmt(stats["avg_tokens_per_sec"], ",.0f")),
        ("samples/s", _fmt(stats["avg_samples_per_sec"], ",.2f")),
        ("TFLOPS per GPU", _fmt(stats["avg_tflops_per_gpu"], ".3f")),
        ("MFU", _fmt(stats["mfu"], ".1%")),
        ("micro-batches per step", _fmt(stats["microbatches_per_step"], "d")),
        ("peak memory", _fmt(stats["peak_memory_gb"], ".2f", " GB")),
        ("model source", str(info["model"].get("source", "none"))),
        ("iterations from", str(stats.get("iteration_estimator") or "-")),
        ("data quality", _quality_row(stats)),
        ("ended", str(info["end_reason"])),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"summary: {path}")


def _attach(args: argparse.Namespace) -> int:
    # With --json, stdout carries only the summary; the progress goes to stderr.
    out = Output(stderr=args.json)
    options = AttachOptions(
        pid=args.pid, model_config=args.model_config, model_preset=args.model_preset,
        output_dir=args.output_dir, log_interval=args.log_interval, duration_s=args.duration,
        peak_tflops=args.peak_tflops, dtype=args.dtype, health_check=args.health_check,
        iteration_source=args.iteration_source, probe_backend=args.probe_backend,
        ring_pages=args.ring_buffer_pages, cpu_budget_pct=args.cpu_budget,
        cuda_launches=args.cuda_launches,
        iteration_function=args.iteration_function,
        iteration_variable=args.iteration_variable, stack_sampling=not args.no_stack_sampling,
        stack_rate_hz=args.stack_rate, hang_factor=args.hang_factor,
        hang_timeout_s=args.hang_timeout, allow_shared_output_dir=args.allow_shared_output_dir,
        max_log_entries=args.max_log_entries,
        event_log_part_bytes=args.event_log_part_mib << 20,
    )
    session = MonitorSession(options, lambda entry: out.print(progress_line(entry)), warn=warn)
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


COMMANDS = {"attach": _attach, "summarize": _summarize, "flops": flops_main,
            "health": health_main, "stacks": stacks_main}


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
