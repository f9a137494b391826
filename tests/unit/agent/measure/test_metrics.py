"""Prometheus exposition (perfmon.agent.measure.metrics): the samples the real prometheus_client
writes, unknown figures left out, finished jobs leaving nothing, the HTTP endpoint and
its errors, and the rules and the dashboard using only metrics the agent defines.
(promtool and a real Prometheus: tests/e2e/test_metrics.py.)"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from perfmon.agent.measure.exposition import STEP_TIME_BUCKETS_S
from perfmon.agent.measure.metrics import (
    DEFAULT_ADDRESS,
    JobMetrics,
    Metrics,
    MetricsAddressError,
    parse_address,
)
from perfmon.parsers.figures import (
    FailSlowNow,
    Goodput,
    GoodputLedger,
    IntervalFigures,
    PipelineFigures,
    RankCoords,
    RankFigures,
    Statistics,
)
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.prom import get

ROOT = Path(__file__).resolve().parents[4]
RULES = ROOT / "docs" / "prometheus" / "rules.yml"
DASHBOARD = ROOT / "docs" / "prometheus" / "grafana-dashboard.json"
DOC = ROOT / "docs" / "prometheus.md"
GIB = 1 << 30

Labels = frozenset[tuple[str, str]]


def exposed(metrics: Metrics) -> dict[tuple[str, Labels], float]:
    """(sample name, labels) -> value, parsed back from the text exposition."""
    text = generate_latest(metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, Labels], float], name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def names_with(samples: dict[tuple[str, Labels], float], **labels: str) -> set[str]:
    """Sample names having (at least) these labels."""
    want = set(labels.items())
    return {name for name, lbls in samples if want <= lbls}


# (a pipeline of two stages: rank 1 is stage 1)
RANKS = (RankFigures(pid=4242, rank=0, compute_s=0.10, wait_s=0.10, p2p_wait_s=0.08,
                     straggler=False, coords=RankCoords(dp=0, pp=0)),
         RankFigures(pid=4243, rank=1, compute_s=0.15, wait_s=0.05, p2p_wait_s=0.04,
                     straggler=True, coords=RankCoords(dp=0, pp=1)))
PIPELINE = PipelineFigures(stages=2, microbatches=8, bubble=0.2, ideal_bubble=1 / 9,
                           bounding_stage=1, excess_s=0.05, excess_share=0.5, slow=True)
ENTRY = IntervalFigures(
    iteration=20, timestamp="2026-12-05T10:00:00+00:00", step_s=0.2, tokens_per_s=5120.0,
    samples_per_s=40.0, flops_per_gpu=120e12, mfu=0.3, memory_bytes=2.5 * GIB,
    gpu_utilization=0.87, gpu_power_w=310.0,
    gpu_throttle_reasons=("sw_power_cap", "hw_slowdown"), ranks=RANKS, pipeline=PIPELINE)
UNKNOWN = IntervalFigures(iteration=30, timestamp="2026-12-05T10:00:10+00:00", step_s=0.024,
                          flops_per_gpu=None, tokens_per_s=None, samples_per_s=None,
                          memory_bytes=None)


def final_statistics(**changes: Any) -> Statistics:
    """The figures of a session as the Summarizer gives them (those Metrics reads)."""
    stats = Statistics(
        flops_per_gpu=100e12, mfu=0.25, memory_kind="gpu", peak_memory_bytes=3.0 * GIB,
        ranks=(RankFigures(pid=4242, rank=0, peak_rss_bytes=int(1.5 * GIB),
                           peak_gpu_memory_bytes=3 * GIB, gpu_indices=(0,)),
               RankFigures(pid=4243, rank=1, peak_rss_bytes=int(1.25 * GIB))),
        gpu_event_counts={"xid": 2, "ecc": 0, "gpu_lost": 1, "bogus": 4},
        losses={("uprobes", "events_dropped"): 7.0, ("nvml", "missed_slots"): 0.0,
                ("pyspy", "sampling_errors"): 3.0, ("iterations", "none_measured"): 0.0,
                ("iterations", "ends_estimated"): 40.0},
        # (the job's ledger: Prometheus shows it, not the session's)
        goodput=Goodput(ratio=0.5, job=GoodputLedger(ratio=0.8, lost_s={
            "startup": 4.0, "hang": 10.0, "restart": 20.0, "straggler": 2.0,
            "slowdown": 3.0, "data_stall": 0.0, "unexplained": 1.0})),
        fail_slow_now=FailSlowNow(1.3, "forward"))
    return replace(stats, **changes)


SCHEDULER = {"slurm_job_id": "4242", "namespace": "ml", "pod": "trainer-0"}


def start_job(metrics: Metrics, job: str = "llama", host: str = "node-a") -> None:
    metrics.job_started(job, host, [0, 1], pids=[4242, 4243], user="alice",
                        scheduler=SCHEDULER, world_size=8)


LLAMA = {"job": "llama", "host": "node-a", "user": "alice"}  # the labels of a job's series
SOLO = {**LLAMA, "job": "solo"}


def feed(metrics: Metrics, job: str = "llama", host: str = "node-a") -> None:
    """A job through every call the session makes."""
    start_job(metrics, job, host)
    for step_s in (0.2, 0.2, 0.3, 0.05):
        metrics.iteration(job, step_s)
    metrics.interval(job, ENTRY)
    metrics.statistics(job, final_statistics())
    metrics.agent(cpu_seconds_total=12.5, resident_bytes=150_000_000, jobs=1)


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    with Metrics(host="node-a") as m:
        yield m


# -- the samples ---------------------------------------------------------------------------

def test_step_times_fill_the_histogram_and_count_iterations(metrics: Metrics) -> None:
    feed(metrics)
    s = exposed(metrics)
    job = {"job": "llama", "host": "node-a", "user": "alice"}
    assert value(s, "perfmon_iterations_total", **job) == 4
    assert value(s, "perfmon_step_time_seconds_count", **job) == 4
    assert value(s, "perfmon_step_time_seconds_sum", **job) == pytest.approx(0.75)
    # 0.05 in (0.0316, 0.0562]; 0.2 twice in (0.178, 0.316]; 0.3 too; cumulative counts.
    assert value(s, "perfmon_step_time_seconds_bucket", le="0.0316", **job) == 0
    assert value(s, "perfmon_step_time_seconds_bucket", le="0.0562", **job) == 1
    assert value(s, "perfmon_step_time_seconds_bucket", le="0.178", **job) == 1
    assert value(s, "perfmon_step_time_seconds_bucket", le="0.316", **job) == 4
    assert value(s, "perfmon_step_time_seconds_bucket", le="+Inf", **job) == 4
    les = [float(dict(lbls)["le"]) for name, lbls in s
           if name == "perfmon_step_time_seconds_bucket"]
    assert sorted(les)[:-1] == list(STEP_TIME_BUCKETS_S)
    assert STEP_TIME_BUCKETS_S[0] == 0.001 and STEP_TIME_BUCKETS_S[-1] == 1000
    assert len(STEP_TIME_BUCKETS_S) == 25  # 4 per decade over 6 decades, both ends


def test_interval_and_statistics_in_prometheus_units(metrics: Metrics) -> None:
    feed(metrics)
    s = exposed(metrics)
    job = {"job": "llama", "host": "node-a", "user": "alice"}
    assert value(s, "perfmon_tokens_per_second", **job) == 5120
    assert value(s, "perfmon_samples_per_second", **job) == 40
    assert value(s, "perfmon_tflops_per_gpu", **job) == 120
    # The interval's MFU (the whole run's would hide a drop).
    assert value(s, "perfmon_mfu_ratio", **job) == pytest.approx(0.3)
    assert value(s, "perfmon_gpu_utilization_ratio", **job) == pytest.approx(0.87)
    assert value(s, "perfmon_gpu_power_watts", **job) == 310
    assert value(s, "perfmon_gpu_throttled", reason="sw_power_cap", **job) == 1
    assert value(s, "perfmon_gpu_throttled", reason="hw_slowdown", **job) == 1
    assert value(s, "perfmon_hung", **job) == 0
    # GiB -> bytes, ranks labelled through the pids job_started gave.
    assert value(s, "perfmon_memory_bytes", rank="0", kind="rss", **job) == 1.5 * GIB
    assert value(s, "perfmon_memory_bytes", rank="0", kind="gpu", **job) == 3 * GIB
    assert value(s, "perfmon_memory_bytes", rank="1", kind="rss", **job) == 1.25 * GIB
    assert value(s, "perfmon_memory_bytes", rank="1", kind="gpu", **job) is None
    assert value(s, "perfmon_job_memory_bytes", kind="gpu", **job) == 2.5 * GIB
    assert value(s, "perfmon_gpu_events_total", type="xid", **job) == 2
    assert value(s, "perfmon_gpu_events_total", type="gpu_lost", **job) == 1
    assert value(s, "perfmon_gpu_events_total", type="ecc", **job) == 0
    assert value(s, "perfmon_gpu_events_total", type="bogus", **job) is None
    # The loss counters (0 included) as the reducers give them.
    losses = {(dict(lbls)["source"], dict(lbls)["counter"]): v for (name, lbls), v in s.items()
              if name == "perfmon_data_quality_losses"}
    assert losses == {("uprobes", "events_dropped"): 7, ("nvml", "missed_slots"): 0,
                      ("pyspy", "sampling_errors"): 3, ("iterations", "none_measured"): 0,
                      ("iterations", "ends_estimated"): 40}
    assert value(s, "perfmon_job_info", ranks="0,1", processes="2",
                 agent_version=dict(next(lbls for name, lbls in s
                                         if name == "perfmon_job_info"))["agent_version"],
                 **SCHEDULER, **job) == 1
    assert value(s, "perfmon_job_world_size", **job) == 8
    assert value(s, "perfmon_rank_compute_seconds", rank="1", **job) == 0.15
    assert value(s, "perfmon_rank_wait_seconds", rank="1", **job) == 0.05
    assert value(s, "perfmon_rank_straggler", rank="1", **job) == 1
    # The host's figures for comparing hosts: its ranks' median compute, their wait share.
    assert value(s, "perfmon_host_compute_seconds", **job) == pytest.approx(0.125)
    assert value(s, "perfmon_host_wait_ratio", **job) == pytest.approx(0.15 / 0.40)
    # The episode still open at the end of fail_slow: its ratio to the healthy baseline
    # and the phase that moved most.
    # The job's goodput (its ledger across sessions) and its lost seconds by cause.
    assert value(s, "perfmon_goodput_ratio", **job) == 0.8
    assert value(s, "perfmon_lost_seconds_total", cause="restart", **job) == 20.0
    assert value(s, "perfmon_fail_slow_active", **job) == 1
    assert value(s, "perfmon_fail_slow_ratio", phase="forward", **job) == pytest.approx(1.3)
    assert value(s, "perfmon_agent_cpu_seconds_total", host="node-a") == 12.5
    assert value(s, "perfmon_agent_resident_memory_bytes", host="node-a") == 150_000_000
    assert value(s, "perfmon_jobs", host="node-a") == 1


def test_fail_slow_ratio_while_an_episode_is_open_and_none_once_it_recovered(
        metrics: Metrics) -> None:
    feed(metrics)
    metrics.statistics("llama", final_statistics(fail_slow_now=FailSlowNow(1.5, "unknown")))
    s = exposed(metrics)
    assert value(s, "perfmon_fail_slow_ratio", phase="unknown", **LLAMA) == 1.5
    assert [lbls for name, lbls in s if name == "perfmon_fail_slow_ratio"] == [
        frozenset({**LLAMA, "phase": "unknown"}.items())]
    metrics.statistics("llama", final_statistics(fail_slow_now=None))
    s = exposed(metrics)
    assert value(s, "perfmon_fail_slow_active", **LLAMA) == 0
    assert "perfmon_fail_slow_ratio" not in names_with(s, job="llama")
    # A phase outside the fixed set is "unknown" (the label set stays bounded).
    metrics.statistics("llama", final_statistics(fail_slow_now=FailSlowNow(1.3, "x" * 500)))
    assert value(exposed(metrics), "perfmon_fail_slow_ratio", phase="unknown", **LLAMA) == 1.3


def test_hung_is_one_while_hung(metrics: Metrics) -> None:
    feed(metrics)
    metrics.statistics("llama", final_statistics(hung=True))
    assert value(exposed(metrics), "perfmon_hung", **LLAMA) == 1


def test_unknown_figures_have_no_sample(metrics: Metrics) -> None:
    """None or absent is no sample, never 0; a figure that becomes unknown loses it."""
    start_job(metrics)
    metrics.interval("llama", replace(UNKNOWN, memory_bytes=GIB / 2, ranks=(
        RankFigures(pid=4242, rank=0, wait_s=None, compute_s=None),)))
    metrics.statistics("llama", final_statistics(mfu=None, flops_per_gpu=None,
                                                 memory_kind="rss", gpu_event_counts={}))
    s = exposed(metrics)
    present = names_with(s, job="llama")
    for name in ("perfmon_tokens_per_second", "perfmon_samples_per_second",
                 "perfmon_tflops_per_gpu", "perfmon_mfu_ratio", "perfmon_gpu_utilization_ratio",
                 "perfmon_gpu_power_watts", "perfmon_gpu_throttled", "perfmon_rank_wait_seconds",
                 "perfmon_rank_compute_seconds"):
        assert name not in present, name
    assert value(s, "perfmon_job_memory_bytes", **LLAMA, kind="rss") == GIB / 2
    assert value(s, "perfmon_agent_cpu_seconds_total", host="node-a") is None  # not told yet

    # Known, then unknown again: the sample goes (a stale figure is not shown as current).
    metrics.interval("llama", ENTRY)
    metrics.statistics("llama", final_statistics())
    assert value(exposed(metrics), "perfmon_mfu_ratio", **LLAMA) == 0.3
    metrics.interval("llama", UNKNOWN)
    present = names_with(exposed(metrics), job="llama")
    assert {"perfmon_tokens_per_second", "perfmon_mfu_ratio", "perfmon_gpu_throttled",
            "perfmon_gpu_power_watts", "perfmon_job_memory_bytes"}.isdisjoint(present)


def test_job_memory_waits_for_the_memory_kind(metrics: Metrics) -> None:
    start_job(metrics)
    metrics.interval("llama", replace(UNKNOWN, memory_bytes=float(GIB)))
    assert "perfmon_job_memory_bytes" not in names_with(exposed(metrics), job="llama")
    metrics.statistics("llama", final_statistics(memory_kind="rss"))
    assert value(exposed(metrics), "perfmon_job_memory_bytes", **LLAMA,
                 kind="rss") == GIB


def test_throttle_reason_reads_zero_once_gone(metrics: Metrics) -> None:
    start_job(metrics)
    metrics.interval("llama", ENTRY)
    metrics.interval("llama", replace(ENTRY, gpu_throttle_reasons=("hw_slowdown",)))
    s = exposed(metrics)
    job = {"job": "llama", "host": "node-a", "user": "alice"}
    assert value(s, "perfmon_gpu_throttled", reason="sw_power_cap", **job) == 0
    assert value(s, "perfmon_gpu_throttled", reason="hw_slowdown", **job) == 1


def test_a_sessions_scheduler_names_become_bounded_labels_of_its_info(metrics: Metrics) -> None:
    facts = {"host": "node-a", "ranks": [0], "pids": [11], "workload": {"world_size": 16},
             "job": {"user": "alice", "slurm": {"job_id": 4242, "step_id": 0},
                     "pod": {"uid": None, "name": "trainer/" + "x" * 300,
                             "namespace": 'ml",evil="1'}}}
    JobMetrics(metrics, "llama").started(facts)
    s = exposed(metrics)
    ((_, labels),) = [(n, dict(lbls)) for n, lbls in s if n == "perfmon_job_info"]
    assert labels["slurm_job_id"] == "4242" and labels["job"] == "llama"
    for key in ("namespace", "pod"):
        assert re.fullmatch(r"[A-Za-z0-9._-]{1,64}", labels[key]), labels
    assert value(s, "perfmon_job_world_size", **LLAMA) == 16


def test_ranks_without_rank_are_labelled_by_pid(metrics: Metrics) -> None:
    metrics.job_started("solo", "node-a", [None], user="alice")
    metrics.interval("solo", replace(ENTRY, ranks=(
        RankFigures(pid=777, rank=None, straggler=False),)))
    metrics.statistics("solo", final_statistics(
        ranks=(RankFigures(pid=777, rank=None, peak_rss_bytes=GIB),)))
    s = exposed(metrics)
    assert value(s, "perfmon_rank_straggler", **SOLO, rank="pid:777") == 0
    assert value(s, "perfmon_memory_bytes", **SOLO, rank="pid:777",
                 kind="rss") == GIB
    assert value(s, "perfmon_job_info", **SOLO, ranks="", processes="1",
                 agent_version=dict(next(lbls for name, lbls in s
                                         if name == "perfmon_job_info"))["agent_version"],
                 slurm_job_id="", namespace="", pod="") == 1


def test_job_finished_removes_every_series_of_that_job_only(metrics: Metrics) -> None:
    feed(metrics, "job-a", "node-a")
    feed(metrics, "job-b", "node-a")
    before = exposed(metrics)
    of_b = {k: v for k, v in before.items() if ("job", "job-b") in k[1]}
    assert len(names_with(before, job="job-a")) >= 20

    metrics.job_finished("job-a")
    after = exposed(metrics)
    assert not [k for k in after if ("job", "job-a") in k[1]]
    assert {k: v for k, v in after.items() if ("job", "job-b") in k[1]} == of_b
    # Late calls about the finished job cannot bring its series back.
    metrics.iteration("job-a", 0.1)
    metrics.interval("job-a", ENTRY)
    metrics.statistics("job-a", final_statistics(hung=True))
    assert not [k for k in exposed(metrics) if ("job", "job-a") in k[1]]


def test_statistics_replace_ranks_that_left(metrics: Metrics) -> None:
    feed(metrics)
    metrics.statistics("llama", final_statistics(ranks=(
        RankFigures(pid=4242, rank=0, peak_rss_bytes=2 * GIB),)))
    memory = {k for k in exposed(metrics) if k[0] == "perfmon_memory_bytes"}
    assert memory == {("perfmon_memory_bytes", frozenset(
        {"job": "llama", "host": "node-a", "user": "alice", "rank": "0", "kind": "rss"}.items()))}


def test_calls_are_cheap(metrics: Metrics) -> None:
    """The session calls these in its 200 ms loop under a 1%-of-a-core budget per rank."""
    start_job(metrics)
    fs = final_statistics()
    t0 = time.process_time()
    for i in range(20_000):
        metrics.iteration("llama", 0.01 * (i % 300))
    per_iteration_s = (time.process_time() - t0) / 20_000
    t0 = time.process_time()
    for _ in range(1_000):
        metrics.interval("llama", ENTRY)
        metrics.statistics("llama", fs)
    per_interval_s = (time.process_time() - t0) / 1_000
    # ~1-2 us and ~20 us on the 2-vCPU VM; the bounds leave room for a loaded machine.
    assert per_iteration_s < 50e-6, per_iteration_s
    assert per_interval_s < 1e-3, per_interval_s


# -- the HTTP endpoint ------------------------------------------------------------------------

@pytest.mark.parametrize("address", ["127.0.0.1:0", "[::1]:0"])
def test_serve_on_a_free_port_and_close(metrics: Metrics, address: str) -> None:
    feed(metrics)
    host, port = metrics.serve(address)
    assert host == parse_address(address)[0] and port > 0
    url_host = f"[{host}]" if ":" in host else host
    text = get(f"http://{url_host}:{port}/metrics")
    assert 'perfmon_iterations_total{host="node-a",job="llama",user="alice"} 4.0' in text
    metrics.close()
    metrics.close()  # idempotent
    with pytest.raises(OSError):
        get(f"http://{url_host}:{port}/metrics")


def test_default_address_is_loopback() -> None:
    assert DEFAULT_ADDRESS == "127.0.0.1:9464"
    assert parse_address(DEFAULT_ADDRESS) == ("127.0.0.1", 9464)
    assert parse_address("[::1]:9464") == ("::1", 9464)


@pytest.mark.parametrize("address, reason", [
    ("127.0.0.1", "expected HOST:PORT"),
    ("127.0.0.1:http", "port must be a number"),
    ("127.0.0.1:70000", "port must be a number"),
    (":9464", "no host"),
    ("::1:9464", "in brackets"),
    ("no-such-host.invalid:9464", "is not an IP address"),  # (and no DNS lookup)
    ("192.0.2.1:9464", "not an address of this host"),
])
def test_bad_address_is_one_clear_error(metrics: Metrics, address: str, reason: str) -> None:
    with pytest.raises(MetricsAddressError) as err:
        metrics.serve(address)
    assert err.value.exit_code == 2
    message = str(err.value)
    assert address in message and reason in message and "\n" not in message


def test_port_in_use_is_one_clear_error(metrics: Metrics) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsAddressError) as err:
            metrics.serve(f"127.0.0.1:{port}")
    assert str(err.value) == (f"metrics address '127.0.0.1:{port}': port {port} is in use "
                              "(another agent or exporter listens there)")
    assert err.value.exit_code == 2
    metrics.serve("127.0.0.1:0")  # the failed attempt left nothing behind
    with pytest.raises(MetricsAddressError, match="already serves"):
        metrics.serve("127.0.0.1:0")


# -- rules, dashboard, documentation ---------------------------------------------------------

def defined_names() -> tuple[set[str], set[str]]:
    """(every sample name a fully fed Metrics writes, its metric names as documented:
    histograms and gauges by family name, counters with _total)."""
    with Metrics(host="node-a") as m:
        feed(m)
        families = list(m.registry.collect())
    samples = {s.name for f in families for s in f.samples}
    documented = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert all(f.samples for f in families), "feed() should give every family a sample"
    return samples, documented


def _expressions_of(panels: list[dict[str, Any]]) -> Iterator[str]:
    for panel in panels:
        yield from (t["expr"] for t in panel.get("targets", []))
        yield from _expressions_of(panel.get("panels", []))


def test_dashboard_uses_only_metrics_the_agent_defines() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for name in ("job", "host"):
        assert "label_values(" in variables[name]["definition"]
    expressions = list(_expressions_of(dashboard["panels"]))
    assert len(expressions) >= 12
    used = {n for e in expressions for n in re.findall(r"\bperfmon_[a-z0-9_]+", e)}
    samples, _ = defined_names()
    assert used <= samples, used - samples
    # The figures the brief asks for each have a panel.
    for name in ("perfmon_step_time_seconds_bucket", "perfmon_tokens_per_second",
                 "perfmon_tflops_per_gpu", "perfmon_mfu_ratio", "perfmon_memory_bytes",
                 "perfmon_gpu_utilization_ratio", "perfmon_gpu_power_watts",
                 "perfmon_gpu_throttled", "perfmon_hung", "perfmon_data_quality_losses"):
        assert name in used, name
    # Job-wide figures are averaged across hosts, never summed (each host reports the job's).
    assert not [e for e in expressions if re.search(r"sum[^(]*\(perfmon_tokens_per_second", e)]


def test_rules_use_only_metrics_the_agent_defines() -> None:
    used = set(re.findall(r"(?<![:\w])perfmon_[a-z0-9_]+", RULES.read_text()))
    samples, _ = defined_names()
    assert used <= samples, used - samples


def test_every_metric_is_documented() -> None:
    doc = DOC.read_text()
    _, documented = defined_names()
    missing = {n for n in documented if f"`{n}`" not in doc}
    assert not missing
    assert "127.0.0.1:9464" in doc and "honor_labels: true" in doc


# -- a real Prometheus --------------------------------------------------------------------------


def test_a_pipelines_stages_and_each_ranks_coordinates(metrics: Metrics) -> None:
    feed(metrics)
    s = exposed(metrics)
    assert value(s, "perfmon_pipeline_bubble_ratio", **LLAMA) == 0.2
    assert value(s, "perfmon_pipeline_ideal_bubble_ratio", **LLAMA) == pytest.approx(1 / 9)
    assert value(s, "perfmon_pipeline_bounding_stage", **LLAMA) == 1
    assert value(s, "perfmon_pipeline_bounding_excess_ratio", **LLAMA) == 0.5
    assert value(s, "perfmon_rank_p2p_wait_seconds", rank="1", **LLAMA) == 0.04
    assert value(s, "perfmon_rank_info", rank="1", dp="0", pp="1", tp="0", cp="0", ep="0",
                 **LLAMA) == 1
    # An interval of no pipeline: its series go.
    metrics.interval("llama", replace(ENTRY, pipeline=None))
    assert value(exposed(metrics), "perfmon_pipeline_bubble_ratio", **LLAMA) is None
