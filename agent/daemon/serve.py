"""``perfmon-agent serve``: the node service around perfmon.agent.daemon.tracker.JobTracker.

Scans the node every ``scan_interval_s``, one folder per job under
``jobs_root/<host>/``, Prometheus metrics, systemd's notify protocol (READY,
WATCHDOG, RELOADING, STOPPING, STATUS); SIGHUP reloads the config, SIGTERM or
SIGINT finalizes every job's summary and exits within 10 s.
"""

from __future__ import annotations

import argparse
import signal
import socket
import time
from pathlib import Path
from typing import Any

from perfmon.agent.argtypes import Command
from perfmon.agent.daemon.config import DEFAULT_CONFIG_PATH, ServiceConfig, load_config
from perfmon.agent.daemon.notify import Notifier
from perfmon.agent.daemon.tracker import JobTracker, agent_figures, log, one_line
from perfmon.agent.measure.exposition import CapabilityGauge
from perfmon.agent.measure.heap import limit_malloc_arenas
from perfmon.agent.measure.metrics import start_metrics
from perfmon.agent.options import DEFAULT_METRICS_ADDRESS, options_from_config
from perfmon.parsers.errors import PerfmonError
from perfmon.parsers.host_facts import capability_values
from perfmon.probes.capabilities import host_checks

STOP_TIMEOUT_S = 9.0  # systemd's TimeoutStopSec is 15 s; the bound is 10 s
SLICE_S = 0.25  # the loop wakes this often to see signals and the watchdog


SERVE_EPILOG = f"""examples:
  sudo perfmon-agent serve
  sudo perfmon-agent serve --config /etc/perfmon-agent/config.yaml --metrics-address 10.0.0.5:9464

Runs until SIGTERM/SIGINT (every job's summary is finalized first); SIGHUP reloads
the config. Under systemd (Type=notify) it reports READY, pings the watchdog and
says what it watches in `systemctl status`. Default config: {DEFAULT_CONFIG_PATH}
(optional); see docs/service.md.
"""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH, metavar="FILE",
                        help="YAML configuration (default: %(default)s, when it exists)")
    parser.add_argument("--jobs-root", type=Path, metavar="DIR",
                        help="one folder per job under DIR/<host>/ (default: the config's "
                        "jobs_root, else /var/lib/perfmon-agent/jobs)")
    parser.add_argument("--host", metavar="NAME",
                        help="this node's name in job folders, records and metrics (default: "
                        "the config's host, else the system's host name)")
    parser.add_argument("--metrics-address", metavar="HOST:PORT",
                        help=f"serve Prometheus metrics there (default: the config's "
                        f"metrics_address, else {DEFAULT_METRICS_ADDRESS}: this host only); "
                        "'off': none")


class _Flags:
    """What the signal handlers ask of the main loop."""

    def __init__(self) -> None:
        self.stop: str | None = None
        self.reload = False

    def on_stop(self, signum: int, _frame: Any) -> None:
        self.stop = signal.Signals(signum).name

    def on_reload(self, _signum: int, _frame: Any) -> None:
        self.reload = True


def serve_main(args: argparse.Namespace) -> int:
    limit_malloc_arenas()
    config = load_config(args.config)
    jobs_root = args.jobs_root or config.jobs_root
    host = args.host or config.host or socket.gethostname()
    address = args.metrics_address or config.metrics_address or DEFAULT_METRICS_ADDRESS
    flags = _Flags()
    signal.signal(signal.SIGTERM, flags.on_stop)
    signal.signal(signal.SIGINT, flags.on_stop)
    signal.signal(signal.SIGHUP, flags.on_reload)
    checks = host_checks()  # before any thread: some checks fork (docs/doctor.md)
    for check in checks:
        if not check.works:
            log(f"capability {check.name} {check.status}: {check.detail}; falls back to "
                f"{check.fallback}")
    metrics = start_metrics(address, log, host)
    if metrics is not None:
        metrics.registry.register(CapabilityGauge(metrics.host, capability_values(checks)))
    notifier = Notifier()
    try:
        tracker = JobTracker(options=options_from_config(config.attach, jobs_root), config=config,
                             log=log, metrics=metrics, jobs_root=jobs_root, host=host)
        log(f"serving: scanning every {config.scan_interval_s:g} s, jobs under "
            f"{tracker.host_folder.path if tracker.host_folder else jobs_root}, metrics "
            f"{'off' if metrics is None else address}")
        notifier.ready("scanning for training jobs")
        next_scan = 0.0
        status = ""
        while flags.stop is None:
            now = time.monotonic()
            if flags.reload:
                flags.reload = False
                notifier.reloading()
                config = _reload(args.config, config, tracker)
                notifier.ready("configuration reloaded")
            if now >= next_scan:
                next_scan = now + config.scan_interval_s
                try:
                    tracker.tick(now)
                except Exception as err:  # never the service's end: the next scan retries
                    log(f"scan failed, retried at the next: {one_line(err)}")
                agent_figures(metrics, tracker.running)
                text = f"watching {tracker.running} job(s)"
                if text != status:
                    status = text
                    notifier.status(text)
            notifier.watchdog(now)
            time.sleep(SLICE_S)
        log(f"stopping ({flags.stop}): finalizing {tracker.running} job(s)")
        notifier.stopping()
        tracker.stop(flags.stop, STOP_TIMEOUT_S)
    finally:
        notifier.close()
        if metrics is not None:
            metrics.close()
    return 0


def _reload(path: Path, current: ServiceConfig, tracker: JobTracker) -> ServiceConfig:
    """The new config (SIGHUP), or the current one when the file is unfit (one line)."""
    try:
        new = load_config(path)
    except PerfmonError as err:
        log(f"reload failed, configuration unchanged: {err}")
        return current
    tracker.reconfigure(new)
    tracker.options = options_from_config(new.attach, tracker.options.output_dir)
    for key in ("jobs_root", "host", "metrics_address"):
        if getattr(new, key) != getattr(current, key):
            log(f"configuration reloaded; {key} changes at the next restart")
    log("configuration reloaded")
    return new


COMMAND = Command(
    "serve", "the node service: find every training job, attach, finalize (systemd)",
    add_serve_arguments, serve_main, description="Watch every PyTorch training job on this "
    "node: jobs are found by a scan of /proc, attached as `attach` does, and finalized when "
    "they end; one folder per job, Prometheus metrics.", epilog=SERVE_EPILOG)
