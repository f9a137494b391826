"""Prometheus metrics of what the agent measures, for one host and the jobs on it.

The session pushes the Summarizer's typed figures as they happen (``job_started``,
``iteration``, ``interval`` with an IntervalFigures, ``statistics`` with the Statistics,
``job_finished``, ``agent``; perfmon.parsers.figures), never the summary file's; each
call only updates plain numbers under a lock (about a microsecond), so the agent's
200 ms loop and its CPU budget (1% of a core per rank) do not feel it. The
exposition is built when Prometheus scrapes (``Metrics.collect``, run by
prometheus_client in the HTTP server's thread, turns each job's series into the
families of perfmon.agent.measure.exposition), from a registry of this object's
own, never the process-wide default one, so nothing happens at import and two
``Metrics`` never share series.

Labels stay bounded: ``job``, ``host`` and ``user`` (the job's owner: two users'
jobs with one run id are two label sets) on everything, ``rank`` only per rank of
a job, ``reason``/``type``/``source``/``counter`` from fixed sets; no per-GPU and
never a per-iteration label. ``job_finished`` removes every series of the job.

A figure that is not known (``None`` or absent) has no sample, never a 0. The
meaning of each metric is in docs/prometheus.md.

``serve`` listens on ``DEFAULT_ADDRESS`` (127.0.0.1:9464, this host only) unless the
caller passes another address: listening on a routable address publishes job names
and figures, unauthenticated, to whoever can reach the port; that is the operator's
explicit choice.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import socket
import statistics
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIServer

from perfmon.agent import agent_version
from perfmon.agent.measure.exposition import (
    FAIL_SLOW_PHASES,
    MAX_THROTTLE_REASONS,
    STEP_TIME_BUCKETS_S,
    JobSeries,
    families,
)
from perfmon.agent.measure.observer import SessionObserver
from perfmon.agent.options import DEFAULT_METRICS_ADDRESS, METRICS_OFF
from perfmon.agent.reducers.goodput import CAUSES
from perfmon.parsers.errors import PerfmonError
from perfmon.parsers.figures import IntervalFigures, Statistics, scaled
from perfmon.parsers.job_identity import safe_name
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

DEFAULT_ADDRESS = DEFAULT_METRICS_ADDRESS  # loopback only (perfmon.agent.options)


class MetricsAddressError(PerfmonError):
    """The metrics address cannot be listened on (malformed, not an IP address, port in use)."""

    exit_code = 2


def parse_address(address: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` or ``[IPV6]:PORT`` into (host, port); port 0 means any free port.

    HOST is an IP address or ``localhost``. Raises MetricsAddressError naming the
    address when it is malformed.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep:
        raise MetricsAddressError(
            f"metrics address {address!r}: expected HOST:PORT, e.g. {DEFAULT_ADDRESS} "
            "or [::1]:9464")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # a bare IPv6 address: its last group would be taken for the port
        raise MetricsAddressError(
            f"metrics address {address!r}: write IPv6 addresses in brackets, e.g. [::1]:9464")
    if not host:
        # An empty host would listen on every interface; that must be said, not implied.
        raise MetricsAddressError(
            f"metrics address {address!r}: no host; give 127.0.0.1:PORT for this host "
            "only, or 0.0.0.0:PORT / [::]:PORT to listen on every interface")
    if host != "localhost":
        # IP literals only: a name would need a DNS lookup when the agent starts (slow or
        # hanging without a resolver) and could resolve elsewhere than the operator meant.
        try:
            ipaddress.ip_address(host.split("%", 1)[0])  # "%eth0": an IPv6 zone
        except ValueError:
            raise MetricsAddressError(
                f"metrics address {address!r}: {host!r} is not an IP address "
                "(give one of this host's addresses, e.g. 127.0.0.1, or localhost)") from None
    if not port_text.isdigit() or int(port_text) > 65535:
        raise MetricsAddressError(
            f"metrics address {address!r}: the port must be a number from 0 to 65535")
    return host, int(port_text)


def _bind_reason(err: OSError, port: int) -> str:
    """One line on why binding failed."""
    if isinstance(err, socket.gaierror):
        return f"unknown host ({err.strerror})"
    if err.errno == errno.EADDRINUSE:
        return f"port {port} is in use (another agent or exporter listens there)"
    if err.errno == errno.EADDRNOTAVAIL:
        return "not an address of this host"
    if err.errno == errno.EACCES:
        return "permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)"
    return err.strerror or str(err)


class Metrics(Collector):
    """The agent's Prometheus metrics on a registry of its own (``registry``).

    Push-style: the session calls the methods as things happen; calls about a job
    that was not started (or has finished) are ignored, so late calls cannot bring
    a finished job's series back. Thread-safe: the HTTP server collects in its own
    thread. Also a context manager (``close`` on exit).
    """

    def __init__(self, host: str | None = None) -> None:
        """``host``: the ``host`` label of the agent's own metrics (default: hostname)."""
        self.host = host if host is not None else socket.gethostname()
        self.registry = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self._jobs: dict[str, JobSeries] = {}
        self._agent: tuple[float, int, int] | None = None  # cpu s, resident bytes, jobs
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._version = agent_version()
        self.registry.register(self)

    # -- what the session pushes ---------------------------------------------------------

    def job_started(self, job: str, host: str, ranks: Sequence[int | None],
                    pids: Sequence[int] | None = None, *, name: str | None = None,
                    user: str = "", scheduler: dict[str, str] | None = None,
                    world_size: int | None = None) -> None:
        """A job is monitored from now on: its series appear (counters at 0).

        ``job``: the job's key in every call; ``name`` its ``job`` label (default: the
        key) and ``user`` its owner's (the ``user`` label). ``ranks``: the RANK of each
        monitored process (None where unset); ``pids``, when given, the processes in
        the same order, so per-rank figures that come by pid (``statistics``' ranks)
        are labelled with the rank. ``scheduler``: perfmon_job_info's SCHEDULER_INFO
        labels (bounded by the caller); ``world_size``: the job's ranks on all hosts.
        Starting a job again replaces its series.
        """
        known = sorted({r for r in ranks if r is not None})
        info = {"ranks": ",".join(map(str, known)), "processes": str(len(ranks)),
                "agent_version": self._version, **(scheduler or {})}
        pid_rank = dict(zip(pids, ranks, strict=True)) if pids is not None else {}
        series = JobSeries(labels=[name if name is not None else job, host, user], info=info,
                           pid_rank=pid_rank)
        series.set_gauge("world_size", world_size)
        with self._lock:
            self._jobs[job] = series

    def iteration(self, job: str, step_time_s: float) -> None:
        """One completed iteration of the job; ``step_time_s``: its primary rank's step
        time (s). A step time that is not a finite number >= 0 is counted but not observed."""
        with self._lock:
            state = self._jobs.get(job)
            if state is None:
                return
            state.iterations += 1
            if step_time_s >= 0 and math.isfinite(step_time_s):
                # bisect_left: the first bound >= the value, i.e. Prometheus' "le" bucket.
                state.step_buckets[bisect_left(STEP_TIME_BUCKETS_S, step_time_s)] += 1
                state.step_sum_s += step_time_s

    def interval(self, job: str, figures: IntervalFigures) -> None:
        """One log interval: throughput, TFLOPS, MFU, memory, GPU figures, and each rank's
        compute and wait. Unknown figures (None) remove the series they feed."""
        with self._lock:
            state = self._jobs.get(job)
            if state is None:
                return
            state.set_gauge("tokens_per_second", figures.tokens_per_s)
            state.set_gauge("samples_per_second", figures.samples_per_s)
            state.set_gauge("tflops_per_gpu", scaled(figures.flops_per_gpu, 1e-12))
            # The latest interval's MFU, which moves with the job, where the whole run's
            # average would hide a drop.
            state.set_gauge("mfu_ratio", figures.mfu)
            state.set_gauge("gpu_utilization_ratio", figures.gpu_utilization)
            state.set_gauge("gpu_power_watts", figures.gpu_power_w)
            state.job_memory_bytes = figures.memory_bytes
            reasons = figures.gpu_throttle_reasons
            if reasons is None:  # unknown
                state.throttled.clear()
            else:
                # Reasons seen before and not now read 0 (a known "no"), so that a
                # "for: 5m" alert sees the throttling end rather than a gap.
                for reason in state.throttled:
                    state.throttled[reason] = 1.0 if reason in reasons else 0.0
                for reason in sorted(set(reasons) - state.throttled.keys()):
                    if len(state.throttled) < MAX_THROTTLE_REASONS:
                        state.throttled[reason] = 1.0
            # Sessions of several ranks: each rank's compute, wait and straggler flag.
            for rank in figures.ranks or ():
                state.set_rank(rank.rank, rank.pid, {
                    "compute_seconds": rank.compute_s, "wait_seconds": rank.wait_s,
                    "p2p_wait_seconds": rank.p2p_wait_s,
                    "straggler": 1.0 if rank.straggler else 0.0})
                if rank.coords is not None:
                    c = rank.coords
                    state.rank_coords[state.rank_label(rank.rank, rank.pid)] = tuple(
                        map(str, (c.dp, c.pp, c.tp, c.cp, c.ep)))
            _host_figures(state)
            p = figures.pipeline
            state.set_gauge("pipeline_bubble_ratio", p.bubble if p else None)
            state.set_gauge("pipeline_ideal_bubble_ratio", p.ideal_bubble if p else None)
            state.set_gauge("pipeline_bounding_stage", p.bounding_stage if p else None)
            state.set_gauge("pipeline_bounding_excess_ratio", p.excess_share if p else None)

    def statistics(self, job: str, stats: Statistics) -> None:
        """The job's figures as of the latest summary: whether it is hung, the per-rank
        peak memory, the GPU event counts, the data-quality loss counters, the memory kind,
        the goodput ledger and the active fail-slow episode."""
        with self._lock:
            state = self._jobs.get(job)
            if state is None:
                return
            state.set_gauge("hung", 1.0 if stats.hung else 0.0)
            if stats.memory_kind is not None:
                state.memory_kind = stats.memory_kind
            memory: dict[tuple[str, str], float] = {}
            for rank in stats.ranks or ():
                label = state.rank_label(None, rank.pid)
                for peak, kind in ((rank.peak_rss_bytes, "rss"),
                                   (rank.peak_gpu_memory_bytes, "gpu")):
                    if peak is not None:
                        memory[(label, kind)] = float(peak)
            # Replaced whole: ranks that left (or got their rank label) leave no series.
            state.memory_bytes = memory
            for kind_name, count in stats.gpu_event_counts.items():
                if kind_name in state.gpu_events:
                    # Counters never go down, even if a caller passes older figures.
                    state.gpu_events[kind_name] = max(count, state.gpu_events[kind_name])
            state.losses = dict(stats.losses)
            # (the job's ledger, across its sessions)
            ledger = stats.goodput.of_job if stats.goodput is not None else None
            state.set_gauge("goodput_ratio", ledger.ratio if ledger is not None else None)
            for cause in CAUSES:
                # (a counter: a cause recognised later may move seconds from unexplained)
                seconds = ledger.lost_s.get(cause) if ledger is not None else None
                if seconds is not None:
                    state.lost_seconds[cause] = max(seconds, state.lost_seconds.get(cause, 0.0))
            now = stats.fail_slow_now
            state.fail_slow = None if now is None else (
                now.ratio, now.phase if now.phase in FAIL_SLOW_PHASES else "unknown")
            state.set_gauge("fail_slow_active", 0.0 if now is None else 1.0)

    def job_finished(self, job: str) -> None:
        """Remove every series of the job (a finished job leaves nothing behind)."""
        with self._lock:
            self._jobs.pop(job, None)

    def agent(self, cpu_seconds_total: float, resident_bytes: int, jobs: int) -> None:
        """The agent's own CPU time (s, since it started), resident memory (bytes) and
        the number of jobs it monitors."""
        with self._lock:
            self._agent = (cpu_seconds_total, resident_bytes, jobs)

    # -- exposition -----------------------------------------------------------------------

    def describe(self) -> Iterator[Metric]:
        """No families up front: the registry then never calls ``collect`` to learn names."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        """Every metric family with the current samples (called by prometheus_client)."""
        with self._lock:
            made = families([s for _, s in sorted(self._jobs.items())], self.host, self._agent)
        return iter(made)

    # -- HTTP ------------------------------------------------------------------------------

    def serve(self, address: str = DEFAULT_ADDRESS) -> tuple[str, int]:
        """Serve this registry over HTTP (any path, e.g. /metrics) from a daemon thread.

        ``address``: ``HOST:PORT`` or ``[IPV6]:PORT``, HOST an IP address or
        ``localhost``; port 0 takes a free port.
        The default listens on this host only; any other address is the caller's
        explicit choice (the figures go out unauthenticated). Returns the (host,
        port) actually listened on. Raises MetricsAddressError (exit code 2) naming
        the address and the reason when it cannot listen (malformed, not an IP address,
        port in use, not this host's address, already serving).
        """
        host, port = parse_address(address)
        if self._server is not None:
            raise MetricsAddressError(
                f"metrics address {address!r}: this agent already serves its metrics")
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:  # socket.gaierror included; the socket is closed on failure
            raise MetricsAddressError(
                f"metrics address {address!r}: {_bind_reason(err, port)}") from err
        except (UnicodeError, ValueError) as err:  # a host name that cannot be encoded
            raise MetricsAddressError(f"metrics address {address!r}: bad host ({err})") from err
        self._server, self._thread = server, thread
        bound = server.server_address  # (host, port) or, for IPv6, (host, port, flow, scope)
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        """Stop the HTTP server, if any, and wait for its thread (idempotent)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()  # returns once serve_forever has stopped (within 0.5 s)
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _host_figures(state: JobSeries) -> None:
    """The host's figures for comparing hosts, from its ranks' latest compute and wait:
    their median compute, and the share of their time spent waiting."""
    compute = state.rank_values.get("compute_seconds", {})
    wait = state.rank_values.get("wait_seconds", {})
    state.set_gauge("host_compute_seconds",
                    statistics.median(compute.values()) if compute else None)
    both = [(compute[r], wait[r]) for r in compute.keys() & wait.keys()]
    total = sum(c + w for c, w in both)
    state.set_gauge("host_wait_ratio", sum(w for _, w in both) / total if total > 0 else None)


class JobMetrics(SessionObserver):
    """A session's figures pushed to ``metrics`` under the job's name (one per session).

    The job's series are replaced when a session (re)starts and removed by the
    caller once the job ends (``Metrics.job_finished``): between two sessions
    of one job (an elastic restart) they stay.
    """

    def __init__(self, metrics: Metrics, job: str, name: str | None = None,
                 user: str = "") -> None:
        self.metrics, self.job, self.name, self.user = metrics, job, name, user

    def started(self, facts: dict[str, Any]) -> None:
        job = facts.get("job") or {}
        slurm, pod = job.get("slurm") or {}, job.get("pod") or {}
        # (the names are the job's own text: reduced to bounded label values)
        scheduler = {"slurm_job_id": str(slurm.get("job_id") or ""),
                     "namespace": safe_name(pod["namespace"]) if pod.get("namespace") else "",
                     "pod": safe_name(pod["name"]) if pod.get("name") else ""}
        self.metrics.job_started(self.job, str(facts.get("host", self.metrics.host)),
                                 facts.get("ranks") or [], facts.get("pids"), name=self.name,
                                 user=self.user or str(job.get("user", "")), scheduler=scheduler,
                                 world_size=(facts.get("workload") or {}).get("world_size"))

    def iterations(self, step_times_s: list[float]) -> None:
        for step_s in step_times_s:
            self.metrics.iteration(self.job, step_s)

    def interval(self, figures: IntervalFigures) -> None:
        self.metrics.interval(self.job, figures)

    def statistics(self, stats: Statistics) -> None:
        self.metrics.statistics(self.job, stats)


def start_metrics(address: str | None, warn: Callable[[str], None],
                  host: str | None = None) -> Metrics | None:
    """Metrics served on ``address`` (None: the default address, skipped with a warning
    when it cannot be listened on; ``off``: none), ``host`` in their host label (None:
    the system's host name). An address given that cannot be listened on is an error
    (MetricsAddressError, exit 2)."""
    if address == METRICS_OFF:
        return None
    metrics = Metrics(host)
    try:
        metrics.serve(address or DEFAULT_ADDRESS)
    except MetricsAddressError as err:
        metrics.close()
        if address is not None:
            raise
        warn(f"no Prometheus metrics: {err}")
        return None
    return metrics
