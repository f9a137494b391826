"""The options ``attach`` and ``run`` share (how a job is measured and where its files
go), turned into AttachOptions in one place; and ``--metrics-address`` for attach,
run and serve."""

from __future__ import annotations

import argparse
from pathlib import Path

from perfmon.agent.argtypes import (
    non_negative_float,
    positive_float,
    positive_int,
    power_of_two,
    regex,
)
from perfmon.agent.budget import DEFAULT_BUDGET_PCT
from perfmon.agent.console import warn
from perfmon.agent.eventlog import DEFAULT_PART_BYTES
from perfmon.agent.metrics import DEFAULT_ADDRESS, Metrics, MetricsAddressError
from perfmon.agent.reducers import DEFAULT_MAX_LOG_ENTRIES
from perfmon.agent.session import AttachOptions
from perfmon.parsers.peak_tflops import DTYPES
from perfmon.probes.cuda import LAUNCH_MODES
from perfmon.probes.pyspy import DEFAULT_RATE_HZ
from perfmon.probes.uprobes import DEFAULT_RING_PAGES

METRICS_OFF = "off"


def add_session_arguments(parser: argparse.ArgumentParser) -> None:
    """How a job is measured and where its files go (attach and run)."""
    parser.add_argument("--model-config", metavar="FILE", help="model dimensions, YAML or JSON")
    parser.add_argument("--model-preset", metavar="NAME", help="a well-known model shape")
    parser.add_argument(
        "--output-dir", type=Path, default=Path("outputs/logs/perf_monitor"),
        help="where the summary and event log go (default: %(default)s); it must belong to "
        "root or this user and not be writable by others unless sticky",
    )
    parser.add_argument(
        "--allow-shared-output-dir", action="store_true",
        help="write into an output dir another user owns or may write (files are still "
        "created exclusively, never through links)")
    parser.add_argument(
        "--max-log-entries", type=positive_int, default=DEFAULT_MAX_LOG_ENTRIES, metavar="N",
        help="iteration_logs entries kept in the summary; older ones are thinned evenly "
        "(default: %(default)s)")
    parser.add_argument(
        "--event-log-part-mib", type=positive_int, default=DEFAULT_PART_BYTES >> 20,
        metavar="MIB", help="start a new event log part after this many MiB "
        "(default: %(default)s)")
    parser.add_argument(
        "--log-interval", type=positive_int, default=10, metavar="N",
        help="iterations per iteration_logs entry (default: %(default)s)",
    )
    parser.add_argument(
        "--peak-tflops", type=positive_float, metavar="TFLOPS",
        help="dense peak per GPU for MFU (default: from the device table; none on CPU)",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="bf16",
        help="training precision, for the device's peak in MFU (default: %(default)s)",
    )
    parser.add_argument(
        "--health-check", action="store_true",
        help="check the GPUs first (as `perfmon-agent health`) and record it in session_info",
    )
    parser.add_argument(
        "--iteration-source", choices=("auto", "uprobe", "pyspy"), default="auto",
        help="uprobe: exact, needs eBPF; pyspy: from stack samples, needs only ptrace; "
        "auto: uprobe, else pyspy with a warning (default: %(default)s)",
    )
    parser.add_argument(
        "--probe-backend", choices=("auto", "bcc", "tracefs"), default="auto",
        help="how uprobes are attached: bcc (eBPF; needs bcc and kernel headers), tracefs "
        "(dynamic uprobe events; no compiler, no headers), auto: bcc, else tracefs with a "
        "warning (default: %(default)s)")
    parser.add_argument(
        "--ring-buffer-pages", type=power_of_two, default=DEFAULT_RING_PAGES, metavar="N",
        help="the bcc marker probe's ring buffer, a power of two of 4 KiB pages; raise it "
        "when data_quality reports events_dropped (default: %(default)s)")
    parser.add_argument("--iteration-function", type=regex, metavar="REGEX",
                        help="pyspy mode: an iteration starts on entering a function whose "
                        "name matches (default: torch.optim Optimizer.step)")
    parser.add_argument("--iteration-variable", metavar="NAME",
                        help="the job's own iteration counter, a local variable (default: "
                        "iteration, iter_num, step, global_step)")
    parser.add_argument("--no-stack-sampling", action="store_true",
                        help="no py-spy sampling in uprobe mode (no phase breakdown)")
    parser.add_argument(
        "--cpu-budget", type=non_negative_float, default=DEFAULT_BUDGET_PCT, metavar="PCT",
        help="the agent's CPU (py-spy included) per monitored rank, in %% of a core: stacks "
        "are sampled in bursts to fit; 0 samples them continuously (default: %(default)s)")
    parser.add_argument(
        "--cuda-launches", choices=LAUNCH_MODES, default="sampled",
        help="count kernel launches on one iteration in every N, N adapted to keep the "
        "cost under 0.5%% of the step time (sampled), on every iteration (always: a "
        "~11 us trap per launch), or not at all (off) (default: %(default)s)")
    parser.add_argument("--stack-rate", type=positive_int, default=DEFAULT_RATE_HZ,
                        metavar="HZ", help="py-spy samples a second (default: %(default)s)")
    parser.add_argument("--hang-factor", type=positive_float, default=10.0, metavar="K",
                        help="hung after K x the median step time without an iteration "
                        "(default: %(default)s) ...")
    parser.add_argument("--hang-timeout", type=positive_float, default=120.0,
                        metavar="SECONDS", help="... and at least this long (default: %(default)s)")


def session_options(args: argparse.Namespace, pid: int, *,
                    duration_s: float | None = None) -> AttachOptions:
    """The AttachOptions of parsed ``add_session_arguments`` options."""
    return AttachOptions(
        pid=pid, model_config=args.model_config, model_preset=args.model_preset,
        output_dir=args.output_dir, log_interval=args.log_interval, duration_s=duration_s,
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


def add_metrics_argument(parser: argparse.ArgumentParser, *, default: str | None = None) -> None:
    parser.add_argument(
        "--metrics-address", metavar="HOST:PORT", default=default,
        help=f"serve Prometheus metrics there (default: {DEFAULT_ADDRESS}, this host only; "
        f"when that port is taken, e.g. by the node service, none, with a warning); "
        f"'{METRICS_OFF}': none. Another address publishes job names and figures to "
        "whoever reaches it")


def start_metrics(address: str | None) -> Metrics | None:
    """Metrics served on ``address`` (None: the default address, skipped with a warning
    when it cannot be listened on; ``off``: none). An address given that cannot be
    listened on is an error (MetricsAddressError, exit 2)."""
    if address == METRICS_OFF:
        return None
    metrics = Metrics()
    try:
        metrics.serve(address or DEFAULT_ADDRESS)
    except MetricsAddressError as err:
        metrics.close()
        if address is not None:
            raise
        warn(f"no Prometheus metrics: {err}")
        return None
    return metrics
