"""A session rebuilt from its event log (perfmon.agent.record.replay) when the log is cut or
corrupt (`summarize` on bad logs: tests/e2e/test_outputs.py)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgpack
from perfmon.agent.record.eventlog import EventLogWriter
from perfmon.agent.record.outputs import OutputDir
from perfmon.agent.record.replay import rebuild_from_event_log

from tests import eventlogs


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
