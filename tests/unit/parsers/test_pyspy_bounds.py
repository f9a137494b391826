"""py-spy output is bounded: deep stacks, many threads or long names cannot blow the agent's
memory (security issue 36: a job of 65 threads 950 frames deep made one py-spy window
608 MB, and the agent reading it whole was OOM-killed).

Generated chrometrace and dump documents, each with the truth it states: which frames
a sample keeps (the outermost and innermost 128), what is counted as cut, and the
parser's peak memory. (The JSON stream under them: test_json_stream.py; bounded reads of
a child's output and the real agent on a real deep-stack job:
tests/e2e/test_pyspy_bounds.py.)
"""

from __future__ import annotations

import io
import json
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from perfmon.parsers import pyspy as parser
from perfmon.parsers.pyspy import (
    KEEP_FRAMES,
    MAX_INNER_FRAMES,
    MAX_NAME_CHARS,
    MAX_OUTER_FRAMES,
    MAX_THREADS,
    Cuts,
    Frame,
    PySpyOutputError,
    PySpyOutputTooLarge,
    parse_chrometrace,
    parse_dump,
)
from perfmon.parsers.stack_analysis import classify_phase

PID = 4242


# ---------------------------------------------------------------- generated documents

def _names(depth: int, name_length: int, tag: str = "f") -> list[str]:
    """Function names, outermost first, unique in their last characters."""
    return [(tag * name_length)[: max(0, name_length - 8)] + f"_{level:07d}"
            for level in range(depth)]


def _begin(name: str, file: str, line: int, tid: int, ts: int) -> dict[str, Any]:
    return {"args": {"filename": file, "line": line}, "cat": "py-spy", "name": name,
            "ph": "B", "pid": PID, "tid": tid, "ts": ts}


def _end(tid: int, ts: int) -> dict[str, Any]:
    return {"args": {"filename": "", "line": 0}, "cat": "py-spy", "name": "", "ph": "E",
            "pid": PID, "tid": tid, "ts": ts}


def _static_trace(threads: int, depth: int, names: list[str], file: str,
                  main_last: bool = True) -> list[dict[str, Any]]:
    """Every thread's stack (``names`` outermost first) seen at ts 10 and held to ts 1000.
    Thread ids 1000...; the main thread (tid == PID) comes last when ``main_last``."""
    tids = [1000 + k for k in range(threads - 1)]
    tids = [*tids, PID] if main_last else [PID, *tids]
    events = [_begin(n, file, level + 1, tid, 10) for tid in tids
              for level, n in enumerate(names[:depth])]
    return events + [_end(tid, 1000) for tid in tids for _ in range(depth)]


def _expected(stack_outer_first: list[Frame]) -> tuple[Frame, ...]:
    """A stack as the parser keeps it: innermost first, its middle cut past KEEP_FRAMES."""
    inner_first = stack_outer_first[::-1]
    if len(inner_first) <= KEEP_FRAMES:
        return tuple(inner_first)
    cut = len(inner_first) - KEEP_FRAMES
    return (*inner_first[:MAX_INNER_FRAMES], parser.cut_marker(cut),
            *inner_first[-MAX_OUTER_FRAMES:])


def _shortened(text: str) -> str:
    return text if len(text) <= MAX_NAME_CHARS else "…" + text[1 - MAX_NAME_CHARS:]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(threads=st.integers(1, MAX_THREADS + 6), depth=st.integers(1, 700),
       name_length=st.integers(8, 900), file_length=st.integers(1, 900))
def test_a_static_trace_keeps_both_ends_of_each_stack_and_counts_every_cut(
        threads, depth, name_length, file_length):
    names = _names(depth, name_length)
    file = "/" + "p" * (file_length - 1)
    cuts = Cuts()
    samples = parse_chrometrace(json.dumps(_static_trace(threads, depth, names, file)),
                                origin_mono_ns=0, cuts=cuts)
    kept = min(threads, MAX_THREADS)  # the main thread, last in the file, is always kept
    assert len(samples) == kept
    assert PID in {s.tid for s in samples}
    truth = _expected([Frame(_shortened(n), _shortened(file), level + 1)
                       for level, n in enumerate(names)])
    for s in samples:
        assert s.frames == truth
        assert (s.t_mono_ns, s.duration_ns) == (10_000, 990_000)
    deep = depth > KEEP_FRAMES
    assert cuts.stacks == (kept if deep else 0)
    assert cuts.frames == (kept * (depth - KEEP_FRAMES) if deep else 0)
    assert cuts.threads == threads - kept
    assert cuts.names == (depth if name_length > MAX_NAME_CHARS else 0) + (
        1 if file_length > MAX_NAME_CHARS else 0)
    # One Frame object per distinct frame and one tuple per distinct stack, however
    # many threads show it (a 950-deep stack is not copied per sample).
    assert len({id(s.frames) for s in samples}) == 1


@settings(max_examples=25, deadline=None)
@given(depth=st.integers(1, 600), flips=st.integers(1, 12),
       phase_inside=st.sampled_from(["backward", "forward", "optimizer", "data_loading"]))
def test_changing_stacks_keep_the_training_loop_and_torch_frames_that_name_the_phase(
        depth, flips, phase_inside):
    # The training loop outermost, torch's frame innermost, `depth` frames of the job's
    # own between them; every sample a different stack (a different line in the loop),
    # so every sample is a new stack the parser must cut.
    torch_frame = {
        "backward": ("_engine_run_backward", "/v/site-packages/torch/autograd/graph.py"),
        "forward": ("Module._call_impl", "/v/site-packages/torch/nn/modules/module.py"),
        "optimizer": ("Adam.step", "/v/site-packages/torch/optim/adam.py"),
        "data_loading": ("_BaseDataLoaderIter.__next__",
                         "/v/site-packages/torch/utils/data/dataloader.py"),
    }[phase_inside]
    events, truths = [], []
    for k in range(flips):
        stack = [Frame("<module>", "/job/train.py", 1), Frame("train", "/job/train.py", 10 + k),
                 *(Frame(n, "/job/model.py", 5) for n in _names(depth, 20)),
                 Frame(*torch_frame, 7)]
        ts = 10 + 100 * k
        if truths:
            events += [_end(PID, ts)] * len(truths[-1])
        events += [_begin(f.function, f.file, f.line, PID, ts) for f in stack]
        truths.append(stack)
    events += [_end(PID, 10 + 100 * flips) for _ in range(len(truths[-1]))]
    cuts = Cuts()
    samples = parse_chrometrace(json.dumps(events), origin_mono_ns=0, cuts=cuts)
    assert [s.frames for s in samples] == [_expected(t) for t in truths]
    assert all(classify_phase(s.frames) == phase_inside for s in samples)
    assert [s.frames[-2].line for s in samples] == [10 + k for k in range(flips)]
    total = depth + 3
    assert cuts.stacks == (flips if total > KEEP_FRAMES else 0)
    assert cuts.frames == (flips * (total - KEEP_FRAMES) if total > KEEP_FRAMES else 0)


def test_a_window_over_its_frame_budget_drops_other_threads_samples_not_the_main_ones(
        monkeypatch):
    monkeypatch.setattr(parser, "MAX_WINDOW_FRAMES", 1000)
    # 5 threads, 300 deep (each stack costs 257 references): the main thread, last in
    # the file, is made first; two others fit after it, the last two are cut.
    events = _static_trace(5, 300, _names(300, 10), "/f.py")
    cuts = Cuts()
    samples = parse_chrometrace(json.dumps(events), origin_mono_ns=0, cuts=cuts)
    # One distinct stack for every thread: made once, shared, within the budget.
    assert len(samples) == 5 and cuts.samples == 0
    assert len({id(s.frames) for s in samples}) == 1
    events = []
    for k, tid in enumerate([1000, 1001, 1002, 1003, PID]):
        events += [_begin(n, "/f.py", 1, tid, 10) for n in _names(300, 10, tag="abcde"[k])]
        events += [_end(tid, 1000) for _ in range(300)]
    samples = parse_chrometrace(json.dumps(events), origin_mono_ns=0, cuts=cuts)
    assert [s.tid for s in samples].count(PID) == 1
    assert len(samples) == 3 and cuts.samples == 2


def _flipping_trace(threads: int, depth: int, samples: int, name_length: int) -> bytes:
    """Every thread's whole stack written again at every sample (two chains alternating)."""
    chains = [_names(depth, name_length, tag) for tag in "ab"]
    out = io.StringIO()
    out.write("[")
    first = True
    for k in range(samples + 1):
        for t in range(threads):
            tid = PID if t == 0 else 1000 + t
            events = [] if k == 0 else [_end(tid, 10 + k) for _ in range(depth)]
            if k < samples:
                events += [_begin(n, "/job/deep.py", 3, tid, 10 + k) for n in chains[k % 2]]
            for e in events:
                out.write(("" if first else ",") + json.dumps(e, separators=(",", ":")))
                first = False
    out.write("]")
    return out.getvalue().encode()


def test_parsing_a_large_deep_window_peaks_far_below_its_size(tmp_path):
    path = tmp_path / "window.json"
    path.write_bytes(_flipping_trace(threads=8, depth=950, samples=4, name_length=120))
    size = path.stat().st_size
    assert size > 6_000_000
    cuts = Cuts()
    tracemalloc.start()
    try:
        with path.open("rb") as f:
            samples = parse_chrometrace(f, origin_mono_ns=0, cuts=cuts)
        _, streamed = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        events = json.loads(path.read_bytes())
        _, whole = tracemalloc.get_traced_memory()
        del events
    finally:
        tracemalloc.stop()
    assert len(samples) == 8 * 4 and cuts.stacks == 32 and cuts.frames == 32 * (950 - 256)
    # Read event by event, one stack tuple per distinct stack: a few MB whatever the
    # window's size (measured: 5.5 MB for 10 MB, 4.6 MB for 57 MB: the read buffer),
    # where json.loads held 5 times the text.
    assert streamed < 8_000_000 < size < whole / 4, (streamed, size, whole)


def test_a_window_past_its_byte_cap_raises_too_large():
    data = _flipping_trace(threads=2, depth=50, samples=3, name_length=10)
    with pytest.raises(PySpyOutputTooLarge):
        parse_chrometrace(io.BytesIO(data), origin_mono_ns=0, max_bytes=len(data) - 1)
    assert len(parse_chrometrace(io.BytesIO(data), origin_mono_ns=0, max_bytes=len(data))) == 6


# Text a job controls in py-spy's output: its function, file, thread and variable names.
JOB_TEXT = st.text(max_size=40) | st.sampled_from(["\0", "\ud800", "9" * 5000, "é" * 600])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["B", "E", "M", "X"]), JOB_TEXT, JOB_TEXT,
                          st.integers(0, 3), st.integers(-5, 10**6)), max_size=30))
def test_any_names_in_a_trace_give_samples_or_one_documented_error(events):
    trace = [{"ph": ph, "name": name, "args": {"filename": file, "name": file, "line": 3},
              "pid": PID, "tid": tid, "ts": ts} for ph, name, file, tid, ts in events]
    data = json.dumps(trace, ensure_ascii=False).encode("utf-8", "surrogatepass")
    try:
        samples = parse_chrometrace(data, origin_mono_ns=0)
    except PySpyOutputError:
        return
    assert all(len(f.function) <= MAX_NAME_CHARS for s in samples for f in s.frames)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_give_samples_threads_or_one_documented_error(data):
    for parse in (lambda d: parse_chrometrace(d, origin_mono_ns=0), parse_dump):
        try:
            parse(data)
        except PySpyOutputError:
            pass


# ---------------------------------------------------------------- dumps

def _dump(threads: int, depth: int, name_length: int, locals_per_frame: int) -> bytes:
    """py-spy dump --json --locals, pretty-printed as py-spy does, main thread last."""
    names = _names(depth, name_length)[::-1]  # innermost first
    doc = []
    for t in range(threads):
        tid = PID if t == threads - 1 else 1000 + t
        doc.append({
            "pid": PID, "thread_id": 140000000000 + t, "thread_name": f"T{t}",
            "os_thread_id": tid, "active": True, "owns_gil": False,
            "frames": [{"name": n, "filename": "/job/deep.py", "module": None,
                        "short_filename": "deep.py", "line": depth - i,
                        "locals": [{"name": f"v{j}", "addr": 1, "arg": False,
                                    "repr": str(j) * (1 + j % 3)}
                                   for j in range(locals_per_frame)]}
                       for i, n in enumerate(names)]})
    return json.dumps(doc, indent=2).encode()


@pytest.mark.slow  # (5-8 s: make test runs it; make test-fast stays quick)
@settings(max_examples=30, deadline=None)
@given(threads=st.integers(1, MAX_THREADS + 4), depth=st.integers(1, 400),
       name_length=st.integers(8, 700), locals_per_frame=st.sampled_from([0, 2, 300]))
def test_a_dump_keeps_both_ends_aligned_with_their_locals_and_counts_every_cut(
        threads, depth, name_length, locals_per_frame):
    # Each case kept small: many threads come with fewer frames (still past 256), many
    # frames with fewer locals.
    depth = min(depth, max(1, 20_000 // threads))
    if threads * depth * max(1, locals_per_frame) > 200_000:
        locals_per_frame = 0
    cuts = Cuts()
    stacks = parse_dump(_dump(threads, depth, name_length, locals_per_frame), cuts=cuts)
    kept = min(threads, MAX_THREADS)
    assert len(stacks) == kept and stacks[-1].tid == PID  # the main thread always kept
    names = [_shortened(n) for n in _names(depth, name_length)]
    truth = _expected([Frame(n, "/job/deep.py", level + 1) for level, n in enumerate(names)])
    for thread in stacks:
        assert thread.frames == truth
        assert len(thread.frame_locals) == len(thread.frames)
        for frame, variables in zip(thread.frames, thread.frame_locals, strict=True):
            marker = frame.function.endswith("frames cut by perfmon-agent>")
            assert len(variables) == (0 if marker else min(locals_per_frame, 256))
    deep = depth > KEEP_FRAMES
    assert cuts.threads == threads - kept
    assert cuts.stacks == (kept if deep else 0)
    assert cuts.frames == (kept * (depth - KEEP_FRAMES) if deep else 0)
    assert cuts.locals == kept * min(depth, KEEP_FRAMES) * max(0, locals_per_frame - 256)
    # (the names of the frames kept: those cut from the middle are not read)
    assert cuts.names == (min(depth, KEEP_FRAMES) if name_length > MAX_NAME_CHARS else 0)


def test_a_dump_cut_at_its_byte_cap_keeps_the_threads_whole_within_it():
    data = _dump(threads=6, depth=40, name_length=30, locals_per_frame=2)
    whole = parse_dump(data)
    cuts = Cuts()
    part = parse_dump(data[: len(data) * 2 // 3], cut=True, cuts=cuts)
    assert 0 < len(part) < len(whole) and part == whole[: len(part)]
    assert cuts.dumps == 1
    with pytest.raises(PySpyOutputError):
        parse_dump(data[: len(data) * 2 // 3])  # not cut by the reader: a broken dump


# ---------------------------------------------------------------- the JSON stream


# ---------------------------------------------------------------- reading a child's output


# ---------------------------------------------------------------- the agent on a real job
