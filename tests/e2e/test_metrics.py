"""Prometheus exposition end to end: promtool on the rules and their unit tests
(docs/prometheus/rules_test.yml), and a real Prometheus scraping the agent's metrics with
the rules loaded. (The samples themselves: tests/unit/agent/measure/test_metrics.py.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from perfmon.agent.measure.metrics import Metrics

from tests.prom import Prometheus, tool, wait_until
from tests.unit.agent.measure.test_metrics import (
    DASHBOARD,
    ENTRY,
    GIB,
    RULES,
    _expressions_of,
    final_statistics,
)


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    """docs/prometheus/rules_test.yml: healthy jobs of 2 and 3 hosts get no alert; a slow
    host (of 2 and of 3), a straggler rank and a fail-slow episode get theirs, and the
    fail-slow one ends with the episode."""
    result = subprocess.run([tool("promtool"), "test", "rules", "rules_test.yml"],
                            cwd=RULES.parent, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run([tool("promtool"), "check", "rules", str(RULES)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_real_prometheus_scrapes_the_metrics_and_runs_the_rules(tmp_path: Path) -> None:
    binary = tool("prometheus")
    metrics = Metrics(host="node-a")
    prometheus: Prometheus | None = None
    try:
        _, port = metrics.serve("127.0.0.1:0")
        metrics.job_started("llama-test", "node-a", [0, 1], pids=[4242, 4243], user="alice")
        metrics.agent(cpu_seconds_total=1.0, resident_bytes=40_000_000, jobs=1)
        prometheus = Prometheus(binary, tmp_path, [f"127.0.0.1:{port}"])
        prometheus.wait_ready()
        job = 'job="llama-test"'
        # A first scrape with the counters at 0, so that rate() sees the iterations below.
        wait_until(lambda: prometheus.values(f"perfmon_iterations_total{{{job}}}") == [0.0],
                   30, "the first scrape")

        for _ in range(40):
            metrics.iteration("llama-test", 0.2)
        metrics.interval("llama-test", ENTRY)
        metrics.statistics("llama-test", final_statistics(hung=True))
        # A scrape is one snapshot and statistics() came last: once hung is 1, all is in.
        wait_until(lambda: prometheus.values(f"perfmon_hung{{{job}}}") == [1.0],
                   30, "a scrape with everything fed")
        assert prometheus.values(f"perfmon_iterations_total{{{job}}}") == [40.0]

        # The agent's job label survived (honor_labels) next to its host label.
        [series] = prometheus.query(f"perfmon_iterations_total{{{job}}}")
        assert series["metric"]["host"] == "node-a"
        # All 40 steps of 0.2 s lie in the bucket (0.178, 0.316]: Prometheus interpolates
        # the median halfway into it.
        p50 = prometheus.values("histogram_quantile(0.5, "
                                f"rate(perfmon_step_time_seconds_bucket{{{job}}}[1m]))")
        assert p50 == [pytest.approx(0.178 + (0.316 - 0.178) / 2)]
        assert prometheus.values(f"perfmon_mfu_ratio{{{job}}}") == [pytest.approx(0.3)]
        assert prometheus.values(f"perfmon_tokens_per_second{{{job}}}") == [5120.0]
        assert prometheus.values(
            f'perfmon_memory_bytes{{{job},rank="0",kind="gpu"}}') == [3.0 * GIB]
        assert prometheus.values(f"perfmon_gpu_utilization_ratio{{{job}}}") == [
            pytest.approx(0.87)]
        # The agent's own series have no job label: they get the scrape job's.
        assert prometheus.values('perfmon_agent_resident_memory_bytes{job="perfmon"}') == [
            40_000_000.0]

        # The rules file, loaded by the server, records and alerts on these series.
        wait_until(lambda: prometheus.values(
            f"job:perfmon_tokens_per_second:avg{{{job}}}") == [5120.0], 30, "recording rules")
        assert prometheus.values(f"job:perfmon_step_time_seconds:p50_5m{{{job}}}") == [
            pytest.approx(0.247)]
        wait_until(lambda: bool(prometheus.query(
            f'ALERTS{{alertname="PerfmonJobHung",alertstate="firing",{job}}}')),
            30, "PerfmonJobHung to fire")
        wait_until(lambda: bool(prometheus.query(
            f'ALERTS{{alertname="PerfmonGpuLost",alertstate="firing",{job}}}')),
            30, "PerfmonGpuLost to fire")

        # Every dashboard expression is valid PromQL for this server.
        for expr in _expressions_of(json.loads(DASHBOARD.read_text())["panels"]):
            prometheus.query(expr.replace("$__rate_interval", "1m")
                             .replace("$job", ".*").replace("$host", ".*"))

        # A finished job leaves nothing: its series go stale at the next scrape.
        metrics.job_finished("llama-test")
        wait_until(lambda: not prometheus.query(f'{{__name__=~"perfmon_.+",{job}}}'),
                   30, "the finished job's series to go")
        assert prometheus.values('perfmon_agent_resident_memory_bytes{job="perfmon"}') == [
            40_000_000.0]
    finally:
        if prometheus is not None:
            prometheus.stop()
        metrics.close()
    assert prometheus.proc.returncode is not None
