"""The event log's record types: one definition for the sources, the log, the reducers
and the docs."""

from __future__ import annotations

from pathlib import Path

import pytest
from perfmon.parsers.events import (
    BY_TYPE,
    RECORD_TYPES,
    Marker,
    Quality,
    record_problem,
    records_table,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "events.md"


def test_the_docs_table_is_the_one_the_record_classes_generate():
    text = DOCS.read_text()
    table = text.split("<!-- records table: generated, do not edit -->\n")[1].split(
        "<!-- end of records table -->")[0]
    assert table == records_table(), (
        "docs/events.md is out of date: regenerate its table with "
        "`python -m perfmon.parsers.events`")


@pytest.mark.parametrize("cls", RECORD_TYPES, ids=lambda c: c.TYPE)
def test_every_record_round_trips_and_checks(cls):
    example = {
        "session_start": {"session": {"pid": 1}}, "log_part": {"part": 1},
        "quality": {"source": "uprobes", "counters": {"events": 3}},
        "cuda": {"pid": 1, "at_step": True, "kernel_launches": 7, "sync_wait_ns": 5,
                 "graph_launches": 0, "nccl_calls": {"all_reduce": 1},
                 "nccl_bytes": {"all_reduce": 4096}},
        "waits": {"pid": 1, "wait_ns": 5_000_000, "waits": 12},
        "marker": {"pid": 1, "tid": 1, "kind": "optimizer_step", "name": "x"},
        "job_iteration": {"end_mono_ns": 2, "pid": 1, "value": 9, "name": "iteration"},
        "phase": {"end_mono_ns": 2, "pid": 1, "phase": "forward"},
        "process": {"pid": 1, "rss_bytes": 10, "peak_rss_bytes": None},
        "gpu": {"gpus": [{"index": 0}]}, "xid": {"gpu_index": 0, "xid": 79},
        "ecc": {"gpu_index": 0, "kind": "corrected", "count": 2},
        "hang": {"last_iteration_mono_ns": 0, "threshold_s": 120.0, "frame": "f",
                 "report": "r"},
        "hang_recovered": {}, "session_end": {"reason": "duration"},
        "rank_exit": {"pid": 1, "exit_code": 1, "signal": None, "core_dumped": False,
                      "oom_killed": None, "source": "proc_connector", "rank": 0,
                      "log_tail_cause": {"cause": "cuda_out_of_memory", "message": "m"}},
    }[cls.TYPE]
    record = cls(t_mono_ns=1, **example).to_record()
    assert record["type"] == cls.TYPE and record_problem(record) is None
    assert BY_TYPE[cls.TYPE].from_record(record) == cls(t_mono_ns=1, **example)
    for name in example:
        broken = {**record, name: object()}
        assert record_problem(broken) is not None


def test_malformed_records_are_named():
    good = Marker(5, 1, 1, "optimizer_step", "n").to_record()
    assert record_problem({**good, "kind": "lunch"}) == "marker record of unknown kind"
    assert record_problem({**good, "pid": True}) == "marker record with 'pid' of type bool"
    assert record_problem({k: v for k, v in good.items() if k != "tid"}) == (
        "marker record without 'tid'")
    assert record_problem([good]) == "a list, not a map"
    assert record_problem({"type": "a_newer_kind", "t_mono_ns": 1}) is None  # skipped, unknown
    with pytest.raises(ValueError, match="without 'source'"):
        Quality.from_record({"type": "quality", "t_mono_ns": 1})
