"""py-spy output parsers against real output captured from tests/targets/train_gpt.py.

Captured with py-spy 0.4.3 (tests/data/):
  pyspy_chrometrace_train_gpt.json   record -f chrometrace -r 100 -d 2 --nonblocking --idle
                                     --full-filenames, target --hidden-size 512 --num-layers 2
  pyspy_chrometrace_data_delay.json  the same for 1 s, target --data-delay-ms 30
  pyspy_dump_locals_train_gpt.json   dump --json --locals --nonblocking, first target; its
                                     last written timestamp was iteration 12 (inside step 12)
  pyspy_dump_stalled_train_gpt.json  dump --json --nonblocking, target --stall-at 3
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from perfmon.parsers.pyspy import PySpyOutputError, parse_chrometrace, parse_dump

DATA = Path(__file__).resolve().parents[2] / "data"
TRACE = (DATA / "pyspy_chrometrace_train_gpt.json").read_bytes()
ORIGIN_NS = 5_000_000_000


def test_chrometrace_ts_becomes_origin_plus_microseconds():
    events = json.loads(TRACE)
    samples = parse_chrometrace(TRACE, origin_mono_ns=ORIGIN_NS)
    first_us = min(e["ts"] for e in events)
    last_us = max(e["ts"] for e in events)
    assert samples[0].t_mono_ns == ORIGIN_NS + first_us * 1000
    # States chain without holes from the first sample to the file's final end events.
    assert max(s.t_mono_ns + s.duration_ns for s in samples) == ORIGIN_NS + last_us * 1000
    assert sum(s.duration_ns for s in samples) == (last_us - first_us) * 1000
    assert [s.t_mono_ns for s in samples] == sorted(s.t_mono_ns for s in samples)
    assert all(s.duration_ns > 0 for s in samples)


def test_chrometrace_rebuilds_whole_stacks_innermost_first():
    samples = parse_chrometrace(TRACE, origin_mono_ns=0)
    # Every state is a full stack of the main thread, rooted in the script.
    assert all(s.frames[-1].function == "<module>" for s in samples)
    assert all(s.frames[-2].function == "train" for s in samples)
    assert all(s.frames[-1].file.endswith("tests/targets/train_gpt.py") for s in samples)
    step = [s for s in samples if any("profile_hook_step" in f.function for f in s.frames)]
    assert step, "the capture spans several optimizer steps"
    names = [f.function for f in step[0].frames]
    # The optimizer wrapper sits between train() and the Adam internals.
    assert names.index("Optimizer.profile_hook_step.<locals>.wrapper") == names.index("train") - 1
    assert all(f.line > 0 for s in samples for f in s.frames)


def test_chrometrace_maps_pyspy_thread_ids_to_kernel_tids():
    (pyspy_tid,) = {s.tid for s in parse_chrometrace(TRACE, origin_mono_ns=0)}
    assert pyspy_tid > 2**22  # a pthread_t, which can never be a kernel tid
    mapped = parse_chrometrace(TRACE, origin_mono_ns=0, kernel_tids={pyspy_tid: 4242})
    assert {s.tid for s in mapped} == {4242}


def test_chrometrace_of_newer_pyspy_reads_thread_name_metadata():
    # py-spy after 0.4 remaps tids to 0, 1, ... and names "<thread id>: <name>" in M events.
    trace = [
        {"args": {"filename": "", "line": None, "name": "140129557188672: MainThread"},
         "cat": "py-spy", "name": "thread_name", "ph": "M", "pid": 7, "tid": 0, "ts": 0},
        {"args": {"filename": "/x/train.py", "line": 3}, "cat": "py-spy", "name": "<module>",
         "ph": "B", "pid": 7, "tid": 0, "ts": 100},
        {"args": {"filename": "/x/train.py", "line": 3}, "cat": "py-spy", "name": "<module>",
         "ph": "E", "pid": 7, "tid": 0, "ts": 300},
    ]
    (sample,) = parse_chrometrace(json.dumps(trace), origin_mono_ns=0,
                                  kernel_tids={140129557188672: 7})
    assert (sample.pid, sample.tid) == (7, 7)
    assert (sample.t_mono_ns, sample.duration_ns) == (100_000, 200_000)


@pytest.mark.parametrize("data", [TRACE[: len(TRACE) // 2], b"{}", b'[{"ph": "B"}]'])
def test_chrometrace_that_is_truncated_or_malformed_raises(data):
    with pytest.raises(PySpyOutputError):
        parse_chrometrace(data, origin_mono_ns=0)


def test_dump_gives_kernel_tid_names_frames_and_locals():
    (thread,) = parse_dump((DATA / "pyspy_dump_locals_train_gpt.json").read_bytes())
    assert thread.tid == thread.pid and thread.thread_name == "MainThread"
    assert thread.pyspy_thread_id > 2**22
    assert thread.frames[0].function == "_single_tensor_adam"
    assert thread.frames[-1].function == "<module>"
    assert len(thread.frame_locals) == len(thread.frames)
    train = [f.function for f in thread.frames].index("train")
    assert thread.frame_locals[train]["iteration"] == "11"
    assert thread.frame_locals[train]["optimizer"].startswith("<AdamW at 0x")


def test_dump_without_locals_has_empty_locals():
    (thread,) = parse_dump((DATA / "pyspy_dump_stalled_train_gpt.json").read_bytes())
    assert [f.function for f in thread.frames] == [
        "deliberately_stalled_collective", "train", "<module>"]
    assert thread.frame_locals == ({}, {}, {})
    assert not thread.active  # sleeping


@pytest.mark.parametrize("data", [b"", b"{}", b'[{"pid": 1}]'])
def test_dump_that_is_malformed_raises(data):
    with pytest.raises(PySpyOutputError):
        parse_dump(data)
