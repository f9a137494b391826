"""Nothing is lost: a full or read-only disk, signals, a closed stdout, week-long runs
(rotated event logs, thinned summaries) and event logs that are cut, malformed or big."""

from __future__ import annotations

import functools
import io
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zstandard
from perfmon.agent.record.coarsen import COARSE_NS
from perfmon.agent.record.eventlog import EventLogWriter
from perfmon.agent.record.outputs import OutputDir
from perfmon.agent.record.replay import rebuild_from_event_log

from tests import eventlogs
from tests.conftest import load_summary, wait_for

pytestmark = pytest.mark.usefixtures("ebpf")


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 3 MiB tmpfs of our own, to fill up or make read-only."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0750", "tmpfs", str(mount)],
                   check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> Path:
    """Fill the filesystem of ``folder`` up to the last byte."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 16, 1 << 12, 1):  # down to the last byte
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def _summary(out: Path) -> dict | None:
    try:
        return load_summary(out)
    except (ValueError, FileNotFoundError):
        return None


def test_full_disk_keeps_measuring_says_so_once_and_writes_everything_once_space_returns(
    steady_target, agent, small_fs
):
    target = steady_target
    out = small_fs / "out"
    proc = agent.start("attach", "--pid", str(target.pid), "--output-dir", str(out),
                       "--log-interval", "5")
    wait_for(lambda: (s := _summary(out)) and s["session_info"]["total_iterations"] > 5,
             30, "the first summary")
    # The log's last tmpfs page has room for what a slow day's job logs in a few
    # seconds (one run wrote nothing past it in 8 s): keep the disk full until the
    # log has had more than a page to write, at the rate it grows now.
    (log,) = out.glob("perf_events_*")
    size, started = log.stat().st_size, time.monotonic()
    time.sleep(3)
    rate = (log.stat().st_size - size) / (time.monotonic() - started)
    filler = fill(small_fs)
    time.sleep(min(60.0, max(8.0, 3 * 4096 / max(rate, 1.0))))  # (and a summary try)
    during = _summary(out)  # the last good summary stays in place, whole
    assert during is not None and during["session_info"]["end_time"] is None
    filler.unlink()
    time.sleep(7)  # the summary is rewritten at most every 5 s
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    full = [li for li in err.splitlines() if "No space left on device" in li]
    assert len([li for li in full if "cannot write the summary" in li]) == 1, err
    assert len([li for li in full if "cannot write the event log" in li]) == 1, err
    assert "the summary is written again" in err
    summary = load_summary(out)
    info = summary["session_info"]
    truth = [t for _, t in target.timestamps()
             if info["attach_monotonic_ns"] <= t <= info["detach_monotonic_ns"]]
    assert abs(info["total_iterations"] - len(truth)) <= 1  # no iteration missed
    # The records that waited in memory reached the log: it rebuilds the same summary.
    rebuilt = rebuild_from_event_log(out / info["event_log"]).summary
    assert rebuilt["final_statistics"] == summary["final_statistics"]
    assert rebuilt["iteration_logs"] == summary["iteration_logs"]


def test_output_that_stays_unwritable_ends_with_exit_7_naming_the_file(
    steady_target, agent, small_fs
):
    target = steady_target
    out = small_fs / "out"
    proc = agent.start("attach", "--pid", str(target.pid), "--output-dir", str(out),
                       "--duration", "6")
    wait_for(lambda: _summary(out), 30, "the first summary")
    # (A filesystem cannot be remounted read-only under a file open for writing, so
    # a full one stands for every refusing disk; EROFS, EIO and EDQUOT take the same path.)
    fill(small_fs)
    reason = "No space left on device"
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("perfmon-agent: error: output not writable: ")
    assert "perf_summary_" in last and reason in last
    assert _summary(out) is not None  # the last good summary is still there


def test_unwritable_output_dir_is_refused_before_anything_attaches(
    steady_target, agent, small_fs
):
    target = steady_target
    (small_fs / "out").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    started = time.monotonic()
    run = agent.run("attach", "--pid", str(target.pid), "--output-dir", str(small_fs / "out"))
    assert time.monotonic() - started < 10
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert "output dir" in line and "not writable: Read-only file system" in line


def test_closed_stdout_ends_the_session_quietly_and_keeps_the_summary(
    steady_target, agent, out_dir
):
    target = steady_target
    proc = agent.start("attach", "--pid", str(target.pid), "--output-dir", str(out_dir),
                       "--log-interval", "5")
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("Attaching to pid")
    proc.stdout.close()  # like `| head -1`
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert load_summary(out_dir)["session_info"]["end_reason"] == "stdout_closed"


def test_json_into_a_closed_pipe_is_quiet(steady_target, out_dir):
    target = steady_target
    agent_cmd = [sys.executable, "-m", "perfmon.agent.cli", "attach", "--pid", str(target.pid),
                 "--duration", "2", "--json", "--output-dir", str(out_dir)]
    done = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | head -c 10 >/dev/null',
                           "bash", *agent_cmd], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
    assert load_summary(out_dir)["session_info"]["end_reason"] == "duration"


# -- week-long runs: bounded files --------------------------------------------------------

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


def test_live_thinned_summary_equals_the_one_rebuilt_from_its_log(steady_target, agent, out_dir):
    target = steady_target
    run = agent.run("attach", "--pid", str(target.pid), "--output-dir", str(out_dir),
                    "--duration", "5", "--log-interval", "2", "--max-log-entries", "8")
    assert run.returncode == 0, run.stderr
    live = load_summary(out_dir)
    assert len(live["iteration_logs"]) <= 8
    assert any("kept_one_in" in e for e in live["iteration_logs"])
    rebuilt = rebuild_from_event_log(out_dir / live["session_info"]["event_log"]).summary
    assert rebuilt["iteration_logs"] == live["iteration_logs"]
    assert rebuilt["final_statistics"] == live["final_statistics"]


@pytest.mark.parametrize("signum", [signal.SIGHUP])
def test_sighup_ends_the_session_like_sigterm(steady_target, agent, out_dir, signum):
    target = steady_target
    proc = agent.start("attach", "--pid", str(target.pid), "--output-dir", str(out_dir))
    wait_for(lambda: (s := _summary(out_dir)) and s["session_info"]["total_iterations"] > 10,
             30, "iterations in the live summary")
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    info = load_summary(out_dir)["session_info"]
    assert info["end_reason"] == "SIGHUP" and info["end_time"] is not None
    assert target.proc.poll() is None


# -- event logs that are cut, malformed or big -------------------------------------------

def _summarize(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "perfmon.agent.cli", "summarize", *args],
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def test_records_of_the_wrong_shape_are_counted_and_skipped_with_one_warning(tmp_path: Path):
    clean = list(eventlogs.records(200))
    bad = [{"type": "marker", "t_mono_ns": "soon", "pid": 1, "tid": 1, "kind": "optimizer_step",
            "name": ""},
           {"type": "phase", "t_mono_ns": 5},  # fields missing
           [1, 2, 3], "a string", {"no": "type"},
           {"type": "process", "t_mono_ns": 1, "pid": 1, "rss_bytes": None,
            "peak_rss_bytes": None},
           {"type": "gpu", "t_mono_ns": 1, "gpus": "none"}]
    mixed = [*clean[:100], *bad, *clean[100:]]
    log = tmp_path / "perf_events_bad.msgpack"
    with open(log, "wb") as f:
        eventlogs.write(f, iter(mixed))
    done = _summarize(str(log), "--output", str(tmp_path / "s.json"))
    assert done.returncode == 0, done.stderr
    (warning,) = done.stderr.splitlines()
    assert warning.startswith(f"perfmon-agent: warning: {log}: 7 records of the wrong shape "
                              "skipped")
    expected = rebuild_from_event_log(eventlogs.write_log(tmp_path / "perf_events_ok.msgpack",
                                                          200)).summary
    assert json.loads((tmp_path / "s.json").read_text())["final_statistics"] == \
        expected["final_statistics"]


def test_a_log_cut_anywhere_rebuilds_up_to_the_cut(tmp_path: Path):
    whole = eventlogs.write_log(tmp_path / "perf_events_whole.msgpack", 300).read_bytes()
    rng = random.Random(7)
    cuts = sorted(rng.sample(range(200, len(whole)), 25))
    counts = []
    for cut in cuts:
        part = tmp_path / f"perf_events_cut{cut}.msgpack"
        part.write_bytes(whole[:cut])
        rebuilt = rebuild_from_event_log(part)
        info = rebuilt.summary["session_info"]
        assert info["end_reason"] == "log_truncated"
        counts.append(info["total_iterations"])
    assert counts == sorted(counts) and counts[-1] > 250


def test_the_agents_compressed_log_cut_anywhere_rebuilds_up_to_its_last_whole_block(
        tmp_path: Path):
    # As the session writes it: a zstd stream, one block per flush (a second's records).
    out = OutputDir.open(tmp_path / "out")
    writer = EventLogWriter(out, "perf_events_20261201_120000")
    flushes: list[tuple[int, int]] = []  # (file size after a flush, records in it)
    records = list(eventlogs.records(300, end=False))
    for n, record in enumerate(records, 1):
        writer.append(record)
        if n % 40 == 0:
            assert writer.flush()
            flushes.append((os.stat(out.path / writer.name).st_size, n))
    assert writer.close()
    out.close()
    log = tmp_path / "out" / "perf_events_20261201_120000.msgpack"
    whole = log.read_bytes()
    assert whole.startswith(b"\x28\xb5\x2f\xfd")  # zstd
    plain = sum(len(msgpack.packb(r)) for r in records)
    assert len(whole) < plain / 5, (len(whole), plain)  # records repeat: compressed well
    decoded = eventlogs.read_records(log)
    assert [(r["type"], r["t_mono_ns"]) for r in decoded] == [
        (r["type"], r["t_mono_ns"]) for r in records]

    def rebuilt_from(path: Path) -> dict:
        summary = rebuild_from_event_log(path).summary
        return {"info": summary["session_info"]["total_iterations"],
                "stats": summary["final_statistics"]}

    rng = random.Random(11)
    for cut in sorted(rng.sample(range(flushes[0][0], len(whole)), 25)):
        part = tmp_path / f"perf_events_cut{cut}.msgpack"
        part.write_bytes(whole[:cut])
        assert rebuild_from_event_log(part).summary["session_info"]["end_reason"] == \
            "log_truncated"
        # The same as the records of every block wholly before the cut, as plain msgpack.
        kept = max(n for size, n in flushes if size <= cut)
        same = tmp_path / f"perf_events_plain{cut}.msgpack"
        with open(same, "wb") as f:
            eventlogs.write(f, iter(records[:kept]))
        assert rebuilt_from(part) == rebuilt_from(same), cut


@pytest.mark.parametrize(("content", "needle"), [
    (msgpack.packb({"type": "session_start", "t_mono_ns": 1, "session": {"log_interval": "x"}}),
     "session facts"),
    (msgpack.packb({"type": "session_start", "t_mono_ns": 1, "session": {
        **eventlogs.session_facts(), "workload": {"flops_per_sample": "lots"}}}),
     "workload 'flops_per_sample' is not a number"),
    (b"\xdb\xff\xff\xff\xff" + b"x" * 100, "not a perfmon event log"),  # a 4 GiB string header
    (b"\x91" * 100_000, "not a perfmon event log"),  # arrays nested 100,000 deep
    (b"", "not a perfmon event log"),
    # A zstd stream asking for a 128 MiB window: refused, not given the memory.
    (zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
        3, window_log=27, write_content_size=False)).compressobj().compress(msgpack.packb(
            {"type": "session_start", "t_mono_ns": 1, "session": {}}) * 100_000),
     "too much memory"),
])
def test_logs_that_are_not_event_logs_are_one_line(tmp_path: Path, content: bytes, needle: str):
    log = tmp_path / "perf_events_bogus.msgpack"
    log.write_bytes(content)
    done = _summarize(str(log), timeout_s=30)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("perfmon-agent: error: ") and needle in line


def test_corrupt_bytes_in_the_middle_stop_reading_there_with_a_warning(tmp_path: Path):
    data = bytearray(eventlogs.write_log(tmp_path / "perf_events_w.msgpack", 300).read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = b"\xc1" * 8  # 0xc1 is never used by msgpack
    log = tmp_path / "perf_events_corrupt.msgpack"
    log.write_bytes(bytes(data))
    rebuilt = rebuild_from_event_log(log)
    (warning,) = [w for w in rebuilt.warnings if "undecodable data after byte" in w]
    # The offset named is where the last whole record ended (records here are < 200 B).
    after = int(warning.split("undecodable data after byte ")[1].split(":")[0])
    assert middle - 200 < after <= middle, warning
    assert 100 < rebuilt.summary["session_info"]["total_iterations"] < 200


def test_a_1_gib_log_is_rebuilt_in_flat_memory(tmp_path: Path):
    log = tmp_path / "perf_events_20261130_120000.msgpack"
    iterations = (1 << 30) // 10_200  # bytes an iteration takes in write_node_log
    with open(log, "wb", buffering=1 << 20) as f:
        size = eventlogs.write_node_log(f, iterations)
    assert size >= 1 << 30
    # VmHWM: this process's own peak (ru_maxrss would include the forking parent's,
    # which Linux carries across exec).
    code = ("import re, sys; from perfmon.agent.cli import main; rc = main(sys.argv[1:]); "
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1], "
            "file=sys.stderr); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, "summarize", str(log), "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    peak_mb = int(done.stderr.strip().splitlines()[-1]) / 1024
    assert peak_mb <= 200, peak_mb
    summary = json.loads(done.stdout)
    assert summary["session_info"]["total_iterations"] == iterations
    assert summary["final_statistics"]["kernels_per_iter"] == 3000


def test_the_fast_node_log_holds_the_records_of_the_node_mix():
    # The 1 GiB log above is written from templates: the same records, decoded.
    for iterations in (0, 1, 3, 7):
        plain, fast = io.BytesIO(), io.BytesIO()
        eventlogs.write(plain, eventlogs.node_records(iterations))
        eventlogs.write_node_log(fast, iterations)
        decode = functools.partial(msgpack.Unpacker, raw=False, strict_map_key=False)
        assert list(decode(io.BytesIO(fast.getvalue()))) == list(
            decode(io.BytesIO(plain.getvalue())))
