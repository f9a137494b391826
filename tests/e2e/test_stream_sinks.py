"""Every output is a sink of the Summarizer's typed figures (perfmon.parsers.figures): a real
session in this process, attached with the real uprobes to a real training job, with a
spy on its Prometheus metrics. The metrics never receive a dict (nor the summary), and
what they expose agrees with the summary file the same session wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
from perfmon.agent.measure.metrics import JobMetrics, Metrics
from perfmon.agent.measure.session import MonitorSession, SessionContext
from perfmon.agent.options import AttachOptions
from perfmon.parsers.figures import IntervalFigures, Statistics

from tests.conftest import Target
from tests.unit.agent.measure.test_metrics import GIB, exposed, value


class SpyMetrics(Metrics):
    """Metrics that keep every figure the session hands them."""

    def __init__(self) -> None:
        super().__init__(host="node-a")
        self.calls: list[tuple[str, object]] = []

    def iteration(self, job: str, step_time_s: float) -> None:
        self.calls.append(("iteration", step_time_s))
        super().iteration(job, step_time_s)

    def interval(self, job: str, figures: IntervalFigures) -> None:
        self.calls.append(("interval", figures))
        super().interval(job, figures)

    def statistics(self, job: str, stats: Statistics) -> None:
        self.calls.append(("statistics", stats))
        super().statistics(job, stats)


def test_metrics_take_the_typed_figures_and_agree_with_the_summary(
        ebpf: None, steady_target: Target, out_dir: Path) -> None:
    spy = SpyMetrics()
    options = AttachOptions(pid=steady_target.pid, output_dir=out_dir, duration_s=6.0,
                            log_interval=2)
    context = SessionContext(observer=JobMetrics(spy, "spied"), handle_signals=False)
    result = MonitorSession(options, context=context).run()

    kinds = {name: [a for n, a in spy.calls if n == name]
             for name in ("iteration", "interval", "statistics")}
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}
    assert all(type(a) is float for a in kinds["iteration"])
    assert all(type(a) is IntervalFigures for a in kinds["interval"])
    assert all(type(a) is Statistics for a in kinds["statistics"])
    # The last statistics are those of the summary written at the end.
    assert kinds["statistics"][-1] is result.statistics

    summary = result.summary
    stats, last = summary["final_statistics"], summary["iteration_logs"][-1]
    s = exposed(spy)
    ((_, labels),) = [k for k in s if k[0] == "perfmon_iterations_total"]
    JOB = dict(labels)
    assert JOB["job"] == "spied"
    assert value(s, "perfmon_iterations_total", **JOB) == stats["measured_iterations"]
    assert value(s, "perfmon_step_time_seconds_sum", **JOB) == pytest.approx(
        stats["avg_step_time_ms"] * stats["measured_iterations"] / 1e3)
    assert stats["memory_kind"] == "rss"
    assert value(s, "perfmon_job_memory_bytes", kind="rss", **JOB) == pytest.approx(
        last["memory_GB"] * GIB)
    assert value(s, "perfmon_memory_bytes", rank=f"pid:{steady_target.pid}", kind="rss",
                 **JOB) == pytest.approx(stats["ranks"][0]["peak_rss_gb"] * GIB)
    assert value(s, "perfmon_hung", **JOB) == 0
    # Lost seconds are counters: a cause recognised later moves seconds out of
    # unexplained in the summary, while the counter keeps the most it has been given.
    lost = summary["final_statistics"]["goodput"]["lost_seconds"]
    ledgers = [st.goodput.of_job for st in kinds["statistics"]
               if st.goodput is not None and st.goodput.of_job is not None]
    for cause, seconds in lost.items():
        most = max(ledger.lost_s.get(cause) or 0.0 for ledger in ledgers)
        assert most >= seconds
        assert value(s, "perfmon_lost_seconds_total", cause=cause, **JOB) == most
