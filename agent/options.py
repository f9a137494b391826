"""How a job is measured: AttachOptions, declared once.

Each field says how it is given: its command-line flag (``attach`` and ``run``), its
help, its argparse type, and whether the node service's config file may set it
(``attach:`` in /etc/perfmon-agent/config.yaml). The argparse arguments
(``add_attach_arguments``), the options of parsed arguments (``attach_options``),
the config's schema (``config_schema``) and the options of a config
(``options_from_config``) are all derived from these declarations, so a new option
is one field here.

Also ``--metrics-address`` (attach, run and serve) and its defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perfmon.agent.argtypes import (
    non_negative_float,
    positive_float,
    positive_int,
    power_of_two,
    regex,
)
from perfmon.agent.record.eventlog import DEFAULT_MAX_BYTES, DEFAULT_PART_BYTES
from perfmon.agent.reducers import DEFAULT_MAX_LOG_ENTRIES
from perfmon.parsers.peak_tflops import DTYPES
from perfmon.probes.cuda import LAUNCH_MODES
from perfmon.probes.pyspy import DEFAULT_RATE_HZ
from perfmon.probes.stacks import COUNTING_RATE_HZ
from perfmon.probes.uprobes import DEFAULT_RING_PAGES

# Loopback only: the agent runs as root and its figures name jobs; exposing them to
# the network is for the operator to decide.
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9464"
METRICS_OFF = "off"
DEFAULT_BUDGET_PCT = 1.0  # of a core per rank, py-spy included (perfmon.agent.measure.budget)
ITERATION_SOURCES = ("auto", "uprobe", "pyspy")
PROBE_BACKENDS = ("auto", "bcc", "tracefs")
MIB = 1 << 20
DEFAULT_OUTPUT_DIR = Path("outputs/logs/perf_monitor")

# argparse types -> what the config schema asks of the same value
_SCHEMA_OF_TYPE: dict[Callable[[str], Any], dict[str, Any]] = {
    positive_int: {"type": "integer", "minimum": 1},
    positive_float: {"type": "number", "exclusiveMinimum": 0},
    non_negative_float: {"type": "number", "minimum": 0},
}


@dataclass(frozen=True)
class Option:
    """How one AttachOptions field is given."""

    flag: str | None  # on the command line (None: the config file only)
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    negated: bool = False  # a boolean given as --no-... (the field is its opposite)
    unit: int = 1  # field value = flag value x unit (MiB -> bytes)
    config: bool = False  # the service's config may set it
    schema: dict[str, Any] | None = None  # the config's check, beyond what type gives


def _option(default: Any, flag: str | None, help_: str, **kw: Any) -> Any:
    return dataclasses.field(default=default, metadata={"option": Option(flag, help_, **kw)})


@dataclass(frozen=True)
class AttachOptions:
    """How one job is measured and where its files go."""

    pid: int = 0  # the process given (a rank or a launcher); 0: the service chose the ranks
    model_config: str | None = _option(None, "--model-config", "model dimensions, YAML or JSON",
                                       metavar="FILE")
    model_preset: str | None = _option(None, "--model-preset", "a well-known model shape",
                                       metavar="NAME")
    output_dir: Path = _option(
        DEFAULT_OUTPUT_DIR, "--output-dir",
        "where the summary and event log go (default: %(default)s); it must belong to root "
        "or this user and not be writable by others unless sticky", type=Path)
    allow_shared_output_dir: bool = _option(
        False, "--allow-shared-output-dir",
        "write into an output dir another user owns or may write (files are still created "
        "exclusively, never through links)")
    max_log_entries: int = _option(
        DEFAULT_MAX_LOG_ENTRIES, "--max-log-entries",
        "iteration_logs entries kept in the summary; older ones are thinned evenly "
        "(default: %(default)s)", type=positive_int, metavar="N", config=True)
    event_log_part_bytes: int = _option(
        DEFAULT_PART_BYTES, "--event-log-part-mib",
        "start a new event log part after this many MiB (default: %(default)s)",
        type=positive_int, metavar="MIB", unit=MIB)
    event_log_max_bytes: int = _option(
        DEFAULT_MAX_BYTES, "--event-log-max-mib",
        "cap on the event log's parts together: beyond it the oldest parts are rewritten "
        "coarser (every iteration kept, samples one a minute; the summary says so) "
        "(default: %(default)s)", type=positive_int, metavar="MIB", unit=MIB, config=True,
        schema={"minimum": MIB})
    log_interval: int = _option(10, "--log-interval",
                                "iterations per iteration_logs entry (default: %(default)s)",
                                type=positive_int, metavar="N", config=True,
                                schema={"maximum": 1000000})
    duration_s: float | None = None  # attach --duration
    peak_tflops: float | None = _option(
        None, "--peak-tflops",
        "dense peak per GPU for MFU (default: from the device table; none on CPU)",
        type=positive_float, metavar="TFLOPS", config=True)
    dtype: str = _option("bf16", "--dtype",
                         "training precision, for the device's peak in MFU (default: "
                         "%(default)s)", choices=DTYPES, config=True)
    memory_interval_s: float = _option(1.0, None, "seconds between memory samples",
                                       config=True, type=positive_float,
                                       schema={"minimum": 0.1, "maximum": 3600})
    gpu_interval_s: float = _option(1.0, None, "seconds between NVML samples", config=True,
                                    type=positive_float, schema={"minimum": 0.1, "maximum": 3600})
    health_check: bool = _option(
        False, "--health-check",
        "check the GPUs first (as `perfmon-agent health`) and record it in session_info")
    verbose: bool = _option(
        False, "--verbose",
        "also print the notes: what the job does not use (no CUDA on a CPU job, output to a "
        "terminal, pipe or /dev/null) and losses within their harmless range; they are in "
        "session_info.notes and data_quality.minor either way")
    raw_markers: bool = _option(
        False, "--raw-markers",
        "log every collective wait's entry and return (wait_enter/wait_exit markers), not "
        "only each step's wait totals: a tensor-parallel job makes hundreds a step, so "
        "by default they are logged only during a suspected hang or a fail-slow window",
        config=True)
    wait_probe_budget_pct: float = _option(
        0.5, "--wait-probe-budget",
        "the collective-wait probes' estimated cost on the job, in %% of its step: beyond "
        "it the waits are probed on one iteration in every N (per-rank waits and "
        "stragglers rest on those); 0 probes every wait (default: %(default)s)",
        type=non_negative_float, metavar="PCT", config=True, schema={"maximum": 100})
    iteration_source: str = _option(
        "auto", "--iteration-source",
        "uprobe: exact, needs eBPF; pyspy: from stack samples, needs only ptrace; auto: "
        "uprobe, else pyspy with a warning (default: %(default)s)", choices=ITERATION_SOURCES,
        config=True)
    probe_backend: str = _option(
        "auto", "--probe-backend",
        "how uprobes are attached: bcc (eBPF; needs bcc and kernel headers), tracefs "
        "(dynamic uprobe events; no compiler, no headers), auto: bcc, else tracefs with a "
        "warning (default: %(default)s)", choices=PROBE_BACKENDS, config=True)
    ring_pages: int = _option(
        DEFAULT_RING_PAGES, "--ring-buffer-pages",
        "the bcc marker probe's ring buffer, a power of two of 4 KiB pages; raise it when "
        "data_quality reports events_dropped (default: %(default)s)", type=power_of_two,
        metavar="N")
    iteration_function: str | None = _option(
        None, "--iteration-function",
        "pyspy mode: an iteration starts on entering a function whose name matches "
        "(default: torch.optim Optimizer.step)", type=regex, metavar="REGEX")
    iteration_variable: str | None = _option(
        None, "--iteration-variable",
        "the job's own iteration counter, a local variable (default: iteration, iter_num, "
        "step, global_step)", metavar="NAME")
    microbatches: int | None = _option(
        None, "--microbatches",
        "backward passes per update, for a job whose updates no probe sees (no torch.optim "
        "step, no gradient read: e.g. it steps on what torch.autograd.grad returns): every "
        "K backward passes end an iteration; a job whose updates are seen keeps its own "
        "clock", type=positive_int, metavar="K", config=True)
    stack_sampling: bool = _option(True, "--no-stack-sampling",
                                   "no py-spy sampling in uprobe mode (no phase breakdown)",
                                   negated=True, config=True)
    cpu_budget_pct: float = _option(
        DEFAULT_BUDGET_PCT, "--cpu-budget",
        "the agent's CPU (py-spy included) per monitored rank, in %% of a core: stacks are "
        "sampled in bursts to fit; 0 samples them continuously (default: %(default)s)",
        type=non_negative_float, metavar="PCT")
    cuda_launches: str = _option(
        "sampled", "--cuda-launches",
        "count kernel launches on one iteration in every N, N adapted to keep the cost "
        "under 0.5%% of the step time (sampled), on every iteration (always: a ~11 us trap "
        "per launch), or not at all (off) (default: %(default)s)", choices=LAUNCH_MODES,
        config=True)
    stack_rate_hz: int | None = _option(
        None, "--stack-rate",
        f"py-spy samples a second (default: {DEFAULT_RATE_HZ}, or {COUNTING_RATE_HZ} while "
        "iterations are counted from stack samples without the job's own counter)",
        type=positive_int, metavar="HZ")
    hang_factor: float = _option(10.0, "--hang-factor",
                                 "hung after K x the median step time without an iteration "
                                 "(default: %(default)s) ...", type=positive_float,
                                 metavar="K", config=True)
    hang_timeout_s: float = _option(120.0, "--hang-timeout",
                                    "... and at least this long (default: %(default)s)",
                                    type=positive_float, metavar="SECONDS", config=True)


def _options() -> list[tuple[dataclasses.Field[Any], Option]]:
    return [(f, f.metadata["option"]) for f in dataclasses.fields(AttachOptions)
            if "option" in f.metadata]


def _dest(option: Option) -> str:
    assert option.flag is not None
    return option.flag.removeprefix("--").replace("-", "_")


def add_attach_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option with a flag, as ``attach`` and ``run`` take them."""
    for f, option in _options():
        if option.flag is None:
            continue
        if f.type in (bool, "bool"):
            parser.add_argument(option.flag, action="store_true", help=option.help)
            continue
        default = f.default // option.unit if isinstance(f.default, int) else f.default
        typed: dict[str, Any] = {"type": option.type} if option.type is not None else {}
        parser.add_argument(option.flag, choices=option.choices, default=default,
                            metavar=option.metavar, help=option.help, **typed)


def attach_options(args: argparse.Namespace, pid: int, *,
                   duration_s: float | None = None) -> AttachOptions:
    """The AttachOptions of arguments parsed with ``add_attach_arguments``."""
    values: dict[str, Any] = {}
    for f, option in _options():
        if option.flag is None:
            continue
        value = getattr(args, _dest(option))
        if option.negated:
            value = not value
        elif option.unit != 1:
            value *= option.unit
        values[f.name] = value
    return AttachOptions(pid=pid, duration_s=duration_s, **values)


def config_schema() -> dict[str, Any]:
    """The schema of the service config's ``attach:`` (the fields ``config`` marks)."""
    properties: dict[str, Any] = {}
    for f, option in _options():
        if not option.config:
            continue
        if f.type in (bool, "bool"):
            schema: dict[str, Any] = {"type": "boolean"}
        elif option.choices is not None:
            schema = {"enum": list(option.choices)}
        else:
            schema = dict(_SCHEMA_OF_TYPE.get(option.type, {}) if option.type else {})
        properties[f.name] = {**schema, **(option.schema or {})}
    return {"type": "object", "additionalProperties": False, "properties": properties}


def options_from_config(attach: dict[str, Any], output_dir: Path) -> AttachOptions:
    """The service's AttachOptions: a config's ``attach:`` (checked against config_schema)
    over the defaults, writing into ``output_dir``."""
    return AttachOptions(output_dir=output_dir, **attach)


def add_metrics_argument(parser: argparse.ArgumentParser, *, default: str | None = None) -> None:
    parser.add_argument(
        "--metrics-address", metavar="HOST:PORT", default=default,
        help=f"serve Prometheus metrics there (default: {DEFAULT_METRICS_ADDRESS}, this host "
        f"only; when that port is taken, e.g. by the node service, none, with a warning); "
        f"'{METRICS_OFF}': none. Another address publishes job names and figures to "
        "whoever reaches it")
