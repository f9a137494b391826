"""The event log's record types: one definition for the sources, the log, the reducers
and the docs."""

from __future__ import annotations

from pathlib import Path

import pytest
from perfmon.parsers.events import (
    BY_TYPE,
    RECORD_TYPES,
    Marker,
    Phase,
    Quality,
    Steps,
    cut_to_window,
    record_problem,
    records_table,
)
from perfmon.parsers.step_rows import decode_steps

_STEPS = Steps.encode(1, [(7, 1, 2, 30, 4, 0, 0, 1, 1, 0), (7, 9, 2, 5, 1, 1, 4, 3, 8, 2)],
                      ["uprobe", "optimizer_frame"])

DOCS = Path(__file__).resolve().parents[3] / "docs" / "events.md"


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
        "steps": {"columns": _STEPS.columns, "rows": _STEPS.rows, "hows": _STEPS.hows},
        "job_iteration": {"end_mono_ns": 2, "pid": 1, "value": 9, "name": "iteration"},
        "phase": {"end_mono_ns": 2, "pid": 1, "phase": "forward"},
        "process": {"pid": 1, "rss_bytes": 10, "peak_rss_bytes": None},
        "gpu": {"gpus": [{"index": 0}]}, "xid": {"gpu_index": 0, "xid": 79},
        "ecc": {"gpu_index": 0, "kind": "corrected", "count": 2},
        "hang": {"last_iteration_mono_ns": 0, "threshold_s": 120.0, "frame": "f",
                 "report": "r"},
        "hang_recovered": {}, "session_end": {"reason": "duration"},
        "stack_window": {"pid": 1, "start_mono_ns": 1, "samples_in": True},
        "coarsened": {"part": 0, "from_mono_ns": 1, "until_mono_ns": 9, "interval_s": 60,
                      "merged": {"process": [60, 1]}, "dropped": {"phase": 240}},
        "rank_exit": {"pid": 1, "exit_code": 1, "signal": None, "core_dumped": False,
                      "oom_killed": None, "source": "proc_connector", "rank": 0,
                      "log_tail_cause": {"cause": "cuda_out_of_memory", "message": "m"}},
    }[cls.TYPE]
    record = cls(t_mono_ns=1, **example).to_record()
    assert record["type"] == cls.TYPE and record_problem(record) is None
    assert BY_TYPE[cls.TYPE](**{k: v for k, v in record.items() if k != "type"}) == cls(
        t_mono_ns=1, **example)
    for name in example:
        broken = {**record, name: object()}
        assert record_problem(broken) is not None


def test_steps_rows_decode_as_they_were_made_and_crafted_ones_are_refused():
    block = decode_steps(_STEPS.to_record())
    assert block.pid.tolist() == [7, 7] and block.end_ns.tolist() == [1, 9]
    assert block.wait_ns.tolist() == [30, 5] and block.backward_to_ns.tolist() == [1, 8]
    assert [block.hows[i] for i in block.how.tolist()] == ["uprobe", "optimizer_frame"]
    good = _STEPS.to_record()
    table = bytearray(good["rows"])
    table[5 * 16:5 * 16 + 8] = (2).to_bytes(8, "little")  # the first row's how: no such
    unprobed, below = bytearray(good["rows"]), bytearray(good["rows"])
    unprobed[4 * 16:4 * 16 + 8] = (-1).to_bytes(8, "little", signed=True)  # waits: not probed
    below[4 * 16:4 * 16 + 8] = (-2).to_bytes(8, "little", signed=True)
    assert record_problem({**good, "rows": bytes(unprobed)}) is None
    assert not decode_steps({**good, "rows": bytes(unprobed)}).probed[0]
    assert block.p2p_wait_ns.tolist() == [0, 2]
    # An older agent's record, without the point-to-point column: none of its wait.
    older = {**good, "columns": good["columns"][:-1], "rows": good["rows"][:-16]}
    assert good["columns"][-1] == "p2p_wait_ns" and record_problem(older) is None
    assert decode_steps(older).p2p_wait_ns.tolist() == [0, 0]
    assert decode_steps(older).wait_ns.tolist() == [30, 5]
    for broken, problem in (
            ({"rows": good["rows"][:-8]}, "rows do not fill its columns"),
            ({"rows": b""}, "rows do not fill its columns"),
            ({"columns": [c for c in good["columns"] if c != "wait_ns"]},
             "without its columns"),
            ({"columns": [*good["columns"][:-1], "pid"]}, "without its columns"),
            ({"hows": ["x"] * 17}, "wrong 'hows'"),
            ({"rows": bytes(table)}, "out of its range"),
            ({"rows": bytes(below)}, "out of its range"),
            ({"t_mono_ns": 1 << 62}, "out of its range")):
        assert problem in (record_problem({**good, **broken}) or ""), broken


def test_malformed_records_are_named():
    good = Marker(5, 1, 1, "optimizer_step", "n").to_record()
    assert record_problem({**good, "kind": "lunch"}) == "marker record of unknown kind"
    assert record_problem({**good, "pid": True}) == "marker record with 'pid' of type bool"
    assert record_problem({k: v for k, v in good.items() if k != "tid"}) == (
        "marker record without 'tid'")
    assert record_problem([good]) == "a list, not a map"
    assert record_problem({"type": "a_newer_kind", "t_mono_ns": 1}) is None  # skipped, unknown
    assert record_problem({"type": "quality", "t_mono_ns": 1}) == (
        "quality record without 'source'")


def test_a_window_keeps_what_came_before_its_end_and_cuts_spans_to_it():
    records = [Marker(9, 1, 1, "optimizer_step", "x").to_record(),
               Marker(11, 1, 1, "optimizer_step", "x").to_record(),
               Phase(5, 15, 1, "forward").to_record(), Phase(10, 12, 1, "backward").to_record(),
               Quality(12, "pyspy", {"samples": 3}).to_record()]
    kept = cut_to_window(records, 10)
    assert [(r["type"], r["t_mono_ns"], r.get("end_mono_ns")) for r in kept] == [
        ("marker", 9, None), ("phase", 5, 10), ("quality", 12, None)]
