"""Coarser records for the oldest parts of an event log that outgrew its cap.

Every iteration's row is kept (``steps`` records: a few bytes a rank and iteration,
what the summary's figures rest on), and so is every record that is an event (hangs,
exits, GPU errors, reads of the job's counter, quality counters). What comes with time
rather than with iterations is merged into one record per rank (or per GPU sample) and
minute: memory (the minute's largest resident set, its peak, the last CPU counters),
NVML (the minute's sample whose GPUs held the most memory), CUDA snapshots (the last of
the minute: their counters are cumulative, so totals stay). Stack-sample spans (with
their windows' records) and raw markers (whose waits the rows already hold) are
dropped. A ``coarsened`` record right after the part's first one says what was merged
and dropped, over which span (so a replay knows it before the records: two passes
over the part).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgpack
import zstandard
from perfmon.agent.record.outputs import OutputDir, write_all
from perfmon.parsers.errors import EventLogError
from perfmon.parsers.log_reader import EventLogReader

COARSE_NS = 60_000_000_000  # one merged record per rank and minute
DROPPED = frozenset(("phase", "stack_window", "marker", "waits"))
MERGED = frozenset(("process", "gpu", "cuda"))


def _gpu_memory(record: dict[str, Any]) -> int:
    return sum(g.get("memory_used_bytes") or 0 for g in record["gpus"] if isinstance(g, dict))


def _merge(kept: dict[tuple[str, int, bool], dict[str, Any]], record: dict[str, Any]) -> None:
    """Fold one time-borne record into its minute's merged record (per type and rank)."""
    kind = record["type"]
    key = (kind, record.get("pid", -1), bool(record.get("at_step")))
    old = kept.get(key)
    if old is None:
        kept[key] = dict(record)
    elif kind == "process":
        if record["rss_bytes"] >= old["rss_bytes"]:
            old["t_mono_ns"], old["rss_bytes"] = record["t_mono_ns"], record["rss_bytes"]
        peaks = [p for p in (old["peak_rss_bytes"], record["peak_rss_bytes"]) if p is not None]
        old["peak_rss_bytes"] = max(peaks) if peaks else None
        for name in ("cpu_ns", "run_delay_ns"):  # cumulative: the latest
            if record.get(name) is not None:
                old[name] = record[name]
    elif kind == "gpu":
        if _gpu_memory(record) >= _gpu_memory(old):
            kept[key] = dict(record)
    else:  # cuda: cumulative counters, the latest
        kept[key] = dict(record)


def coarsen(records: Iterable[dict[str, Any]], part: int, now: Callable[[], int]
            ) -> Iterator[dict[str, Any]]:
    """The records of one part, coarser (in time order, minute by minute), then its
    ``coarsened`` record."""
    merged_in: Counter[str] = Counter()
    merged_out: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    kept: dict[tuple[str, int, bool], dict[str, Any]] = {}
    minute: int | None = None
    first_ns: int | None = None
    last_ns = 0

    def close_minute() -> Iterator[dict[str, Any]]:
        for record in sorted(kept.values(), key=lambda r: r["t_mono_ns"]):
            merged_out[record["type"]] += 1
            yield record
        kept.clear()

    for record in records:
        kind, t = record["type"], record["t_mono_ns"]
        if kind not in ("session_start", "log_part"):
            first_ns = t if first_ns is None else min(first_ns, t)
            last_ns = max(last_ns, t)
        if kind in DROPPED:
            dropped[kind] += 1
            continue
        if kind not in MERGED:
            yield record
            continue
        if minute is not None and t // COARSE_NS != minute:
            yield from close_minute()
        minute = t // COARSE_NS
        merged_in[kind] += 1
        _merge(kept, record)
    yield from close_minute()
    yield {"type": "coarsened", "t_mono_ns": now(), "part": part,
           "from_mono_ns": first_ns if first_ns is not None else last_ns,
           "until_mono_ns": last_ns, "interval_s": COARSE_NS // 1_000_000_000,
           "merged": {k: [merged_in[k], merged_out[k]] for k in sorted(merged_in)},
           "dropped": dict(sorted(dropped.items()))}


def coarsen_part(out: OutputDir, name: str, part: int, now: Callable[[], int],
                 compressor: Callable[[], zstandard.ZstdCompressionObj]
                 ) -> tuple[dict[str, Any], int]:
    """Rewrite the closed log part ``name`` of ``out`` coarser, atomically (a reader sees
    the old part or the new one); (its ``coarsened`` record, its new size in bytes).
    Raises OSError, or EventLogError for a part that does not decode."""
    summary: dict[str, Any] = {}
    for record in coarsen(_records(out, name), part, now):  # the first pass: what it does
        summary = record
    packer = msgpack.Packer()
    stream = compressor()
    with out.rewrite(name) as fd:
        pending: list[bytes] = []
        size = 0
        for n, record in enumerate(coarsen(_records(out, name), part, now)):
            if record["type"] == "coarsened":
                continue  # (this pass's: the first pass's goes after the part's first record)
            pending += [packer.pack(record)] + ([packer.pack(summary)] if n == 0 else [])
            size += len(pending[-1])
            if size >= 1 << 20:
                write_all(fd, stream.compress(b"".join(pending))
                          + stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
                pending, size = [], 0
        write_all(fd, stream.compress(b"".join(pending))
                  + stream.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
        written = os.fstat(fd).st_size
    return summary, written


def _records(out: OutputDir, name: str) -> Iterator[dict[str, Any]]:
    """The records of a part of this agent's (EventLogError when it does not decode)."""
    with os.fdopen(out.open_read(name), "rb", buffering=0) as source:
        reader = EventLogReader(source, name, os.fstat(source.fileno()).st_size)
        yield from reader
        if reader.corrupt:
            raise EventLogError(f"{name}: {reader.corrupt}")
