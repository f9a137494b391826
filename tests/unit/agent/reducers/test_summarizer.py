"""The Summarizer (perfmon.agent.reducers) on hand-written record streams: boundaries,
windows and sums."""

from __future__ import annotations

from datetime import datetime

import pytest
from perfmon.agent.reducers import Summarizer
from perfmon.parsers.figures import render
from perfmon.parsers.workload import Workload

MS = 1_000_000


def marker(kind: str, t_ms: float, pid: int = 10) -> dict:
    return {"type": "marker", "kind": kind, "t_mono_ns": int(t_ms * MS), "pid": pid, "tid": pid,
            "name": ""}


def aggregator(workload: Workload | None = None, log_interval: int = 2) -> Summarizer:
    return Summarizer(workload or Workload(), primary_pid=10, start_t_mono_ns=0,
                          start_wall_s=1.8e9, log_interval=log_interval)


def feed(agg: Summarizer, records: list[dict]) -> list[dict]:
    """The iteration_logs entries the records completed, as the summary shows them."""
    return [render(entry) for r in records for entry in agg.feed(r)]


def test_first_step_after_attach_only_opens_the_window():
    agg = aggregator()
    feed(agg, [marker("backward_enter", 5), marker("optimizer_step", 10),
               marker("backward_enter", 40), marker("optimizer_step", 50),
               marker("backward_enter", 80), marker("optimizer_step", 100)])
    stats = render(agg.statistics())
    assert agg.iterations_ended == 3
    assert stats["measured_iterations"] == 2
    assert stats["avg_step_time_ms"] == pytest.approx(45.0)  # (40 + 50) / 2
    assert stats["min_step_time_ms"] == 40 and stats["max_step_time_ms"] == 50


def test_several_optimizers_in_one_iteration_count_once():
    agg = aggregator()
    steps = []
    for t in (0, 100, 200):
        steps += [marker("backward_enter", t + 10), marker("optimizer_step", t + 50),
                  marker("optimizer_step", t + 55)]  # e.g. a dense and an expert optimizer
    feed(agg, steps)
    assert agg.iterations_ended == 3
    assert render(agg.statistics())["avg_step_time_ms"] == pytest.approx(100.0)


def test_without_backward_probe_every_step_ends_an_iteration():
    agg = aggregator()
    feed(agg, [marker("optimizer_step", t) for t in (0, 30, 60, 90)])
    stats = render(agg.statistics())
    assert stats["measured_iterations"] == 3 and stats["microbatches_per_step"] is None


def test_markers_of_other_ranks_and_before_attach_are_ignored():
    agg = Summarizer(Workload(), primary_pid=10, start_t_mono_ns=20 * MS,
                         start_wall_s=1.8e9)
    feed(agg, [marker("optimizer_step", 10), marker("optimizer_step", 30, pid=11),
               marker("optimizer_step", 40), marker("optimizer_step", 70)])
    assert agg.iterations_ended == 2
    assert render(agg.statistics())["avg_step_time_ms"] == pytest.approx(30.0)


def test_interval_entries_and_derived_global_batch():
    # micro batch 2 x 3 backward calls x DP 4 = 24 samples of 8 tokens a step.
    workload = Workload(flops_per_sample=1e12, seq_length=8, micro_batch_size=2,
                        data_parallel_size=4, world_size=8, peak_tflops=10.0)
    agg = aggregator(workload, log_interval=2)
    records = []
    for k in range(5):
        t = k * 500
        records += [marker("backward_enter", t + 1), marker("backward_enter", t + 2),
                    marker("backward_enter", t + 3), marker("optimizer_step", t + 400)]
    records.insert(0, {"type": "process", "t_mono_ns": 600 * MS, "pid": 10,
                       "rss_bytes": 2 << 30, "peak_rss_bytes": 3 << 30})
    # (an older log's markers become rows a block at a time: before the next record)
    records.append({"type": "session_end", "t_mono_ns": 2500 * MS, "reason": "duration"})
    entries = feed(agg, records)
    assert [e["iteration"] for e in entries] == [3, 5]
    first = entries[0]
    assert first["step_time_ms"] == pytest.approx(500.0)
    assert first["samples_per_sec"] == pytest.approx(24 / 0.5)
    assert first["tokens_per_sec"] == pytest.approx(24 * 8 / 0.5)
    # 24 samples x 1e12 FLOPs in 0.5 s over 8 GPUs = 6 TFLOPS per GPU
    assert first["TFLOPS_per_GPU"] == pytest.approx(6.0)
    assert first["memory_GB"] == 2.0  # GiB, as FlagScale's monitor reports memory
    stats = render(agg.statistics())
    assert stats["microbatches_per_step"] == 3
    assert stats["mfu"] == pytest.approx(0.6)
    assert stats["peak_memory_gb"] == 3.0
    # Iteration 3 ended 1.4 s after attach, which was at wall time 1.8e9 s.
    assert datetime.fromisoformat(first["timestamp"]).timestamp() == pytest.approx(1.8e9 + 1.4)


def test_unknown_workload_gives_nulls_not_zeros():
    agg = aggregator()
    feed(agg, [marker("optimizer_step", t) for t in (0, 10, 20)])
    stats = render(agg.statistics())
    assert stats["avg_tokens_per_sec"] is None and stats["avg_tflops_per_gpu"] is None
    assert stats["mfu"] is None and stats["peak_memory_gb"] is None


def test_percentiles_interpolate_between_ranks():
    agg = aggregator()
    times = [0.0]
    for step in [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]:
        times.append(times[-1] + step)
    feed(agg, [marker("optimizer_step", t) for t in times])
    stats = render(agg.statistics())
    assert stats["p50_step_time_ms"] == pytest.approx(55.0)
    assert stats["p90_step_time_ms"] == pytest.approx(91.0)
    assert stats["p99_step_time_ms"] == pytest.approx(99.1)


def test_in_bursts_an_interval_waits_for_the_window_started_before_it_ended():
    # A 1 s burst starts at 50 ms; the interval ends at 400 ms, while it samples; its
    # samples (data loading, then forward) come at 1100 ms, with the window's end.
    def window(t_ms: float, start_ms: float, samples_in: bool) -> dict:
        return {"type": "stack_window", "t_mono_ns": int(t_ms * MS), "pid": 10,
                "start_mono_ns": int(start_ms * MS), "samples_in": samples_in}

    def phase(start_ms: float, end_ms: float, name: str) -> dict:
        return {"type": "phase", "t_mono_ns": int(start_ms * MS),
                "end_mono_ns": int(end_ms * MS), "pid": 10, "phase": name}

    agg = Summarizer(Workload(), primary_pid=10, start_t_mono_ns=0, start_wall_s=1.8e9,
                     log_interval=2, stack_sampling=True, phases_continuous=False)
    entries = feed(agg, [window(50, 50, False), marker("optimizer_step", 0),
                         marker("optimizer_step", 200), marker("optimizer_step", 400)])
    assert entries == []  # its samples are still to come
    entries = feed(agg, [phase(60, 160, "data_loading"), phase(160, 400, "forward"),
                         window(1100, 50, True)])
    (entry,) = entries
    assert entry["phases"]["data_loading"]["share"] == pytest.approx(100 / 340)
    # Once that window is in, the next interval is complete when it ends (a window
    # started after it is not waited for): no samples, no phases.
    later = feed(agg, [marker("optimizer_step", 1300), marker("optimizer_step", 1500),
                       window(1600, 1600, False)])
    assert [e["phases"] for e in later] == [None]
    assert render(agg.statistics())["phases_iterations"] == 2
