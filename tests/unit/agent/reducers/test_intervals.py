"""Interval windows (perfmon.agent.reducers.intervals): iteration_logs thinned evenly past
--max-log-entries (the live session's: tests/e2e/test_outputs.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from perfmon.agent.record.replay import rebuild_from_event_log

from tests import eventlogs


@pytest.mark.slow  # (5-8 s: make test runs it; make test-fast stays quick)
def test_iteration_logs_are_thinned_evenly_and_marked_beyond_the_limit(tmp_path: Path):
    log = eventlogs.write_log(tmp_path / "perf_events_x.msgpack", 30_001, log_interval=10,
                              max_log_entries=100)
    summary = rebuild_from_event_log(log).summary
    logs = summary["iteration_logs"]
    assert len(logs) <= 100
    stride = summary["session_info"]["iteration_logs_kept_one_in"]
    assert stride > 1
    recent = [e for e in logs if "kept_one_in" not in e]
    older = [e for e in logs if "kept_one_in" in e]
    assert len(recent) >= 50 and older and all(e["kept_one_in"] == stride for e in older)
    assert logs == older + recent  # older first, in order
    # The newest entries are every interval; the older ones every stride-th, evenly.
    gaps = [b["iteration"] - a["iteration"] for a, b in itertools.pairwise(logs)]
    assert set(gaps[len(older):]) == {10}
    assert set(gaps[: len(older) - 1]) == {10 * stride}
    # The statistics still cover every iteration.
    assert summary["final_statistics"]["measured_iterations"] == 30_000
