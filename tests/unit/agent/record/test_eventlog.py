"""EventLogWriter (perfmon.agent.record.eventlog) over week-long runs: rotated into parts that
replay reads together, its oldest parts coarsened past its cap."""

from __future__ import annotations

from pathlib import Path

import pytest
from perfmon.agent.record.coarsen import COARSE_NS
from perfmon.agent.record.eventlog import EventLogWriter
from perfmon.agent.record.outputs import OutputDir
from perfmon.agent.record.replay import rebuild_from_event_log

from tests import eventlogs


def test_event_log_rotates_into_parts_that_summarize_reads_together(tmp_path: Path):
    out = OutputDir.open(tmp_path / "out")
    writer = EventLogWriter(out, "perf_events_20261130_120000", part_bytes=2 << 10)
    for n, record in enumerate(eventlogs.records(3000)):
        writer.append(record)
        if n % 50 == 0:
            assert writer.flush()
    assert writer.close()
    out.close()
    parts = sorted((tmp_path / "out").iterdir())
    assert len(parts) > 10
    for part in parts:
        assert part.stat().st_size < (2 << 10) + 1024  # a part ends at the first block past it
        first = eventlogs.read_records(part)[0]
        assert first["type"] == ("session_start" if part.name.endswith("0000.msgpack")
                                 else "log_part")
    whole = eventlogs.write_log(tmp_path / "perf_events_20261130_130000.msgpack", 3000)
    expected = rebuild_from_event_log(whole).summary
    for start in (parts[0], parts[7]):  # from the first part or any later one
        rebuilt = rebuild_from_event_log(start)
        assert len(rebuilt.parts) == len(parts)
        assert rebuilt.summary["final_statistics"] == expected["final_statistics"]
        assert rebuilt.summary["iteration_logs"] == expected["iteration_logs"]


def _write_capped(out_dir: Path, max_bytes: int) -> EventLogWriter:
    """A 4-GPU job's 20 minutes as the session logs them, in 48 KiB parts."""
    out = OutputDir.open(out_dir)
    writer = EventLogWriter(out, "perf_events_20261201_120000", part_bytes=48 << 10,
                            max_bytes=max_bytes)
    for record in eventlogs.rows_records(1200, ranks=4, phases=True):
        if record is None:
            assert writer.flush()
        else:
            writer.append(record)
    assert writer.close()  # (and a coarsening under way has finished)
    out.close()
    return writer


def test_a_log_over_its_cap_has_its_oldest_parts_coarser_and_the_summary_says_so(
        tmp_path: Path):
    whole = _write_capped(tmp_path / "whole", 1 << 40)
    capped = _write_capped(tmp_path / "capped", 160 << 10)
    assert whole.part == capped.part >= 8 and capped.take_coarsened()
    sizes = [p.stat().st_size for p in sorted((tmp_path / "capped").iterdir())]
    assert sum(sizes) < 0.6 * whole.total_bytes and sum(sizes) == capped.total_bytes
    coarser = 0
    for part in sorted((tmp_path / "capped").iterdir()):
        records = eventlogs.read_records(part)
        assert records[0]["type"] == ("session_start" if part.name.endswith("0000.msgpack")
                                      else "log_part")
        # The oldest parts: said so first, their rows whole, their samples merged.
        if records[1]["type"] == "coarsened":
            coarser += 1
            said = records[1]
            assert not {r["type"] for r in records} & {"phase", "marker"}
            assert said["dropped"]["phase"] == 40 * sum(
                1 for r in records if r["type"] == "steps")  # 4 spans, 10 steps a second
            kept = [r for r in records if r["type"] == "process" and r["pid"] == eventlogs.PID]
            assert len(kept) <= 2 + (said["until_mono_ns"] - said["from_mono_ns"]) / 60e9
            # A minute's merged memory is its largest: the job's grows, so its last second's.
            assert all((r["t_mono_ns"] + 10**9) // COARSE_NS != r["t_mono_ns"] // COARSE_NS
                       for r in kept[:-1])

    assert coarser >= 3
    expected = rebuild_from_event_log(tmp_path / "whole" / whole.name).summary
    rebuilt = rebuild_from_event_log(tmp_path / "capped" / capped.name).summary
    coarse = rebuilt["session_info"]["event_log_coarsened"]
    assert expected["session_info"]["event_log_coarsened"] is None
    assert coarse["parts"] >= 3 and coarse["merged_per_s"] == 60
    assert coarse["dropped"]["phase"] > 0 and set(coarse["merged"]) == {"gpu", "process"}
    assert coarse["merged"]["process"]["kept"] < coarse["merged"]["process"]["records"] / 30
    # Every iteration is still there: the step times, throughput and ranks' means whole.
    for key in ("measured_iterations", "avg_step_time_ms", "p99_step_time_ms",
                "avg_tokens_per_sec", "peak_memory_gb"):
        assert rebuilt["final_statistics"][key] == expected["final_statistics"][key], key
    assert [{k: v for k, v in r.items() if "memory" not in k and "rss" not in k}
            for r in rebuilt["final_statistics"]["ranks"]] == [
        {k: v for k, v in r.items() if "memory" not in k and "rss" not in k}
        for r in expected["final_statistics"]["ranks"]]
    assert rebuilt["session_info"]["total_iterations"] == 12_000
    # Where spans were dropped, the phases rest on the iterations outside that span.
    for phase, share in expected["final_statistics"]["phases"].items():
        assert rebuilt["final_statistics"]["phases"][phase]["share"] == pytest.approx(
            share["share"], abs=0.01), phase
