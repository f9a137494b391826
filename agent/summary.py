"""The perf summary: built from the session facts and the aggregator, written atomically,
and rebuilt from an event log.

The format is FlagScale's in-process perf monitor's (``session_info``,
``final_statistics``, ``iteration_logs``), with extra keys only added, so
existing dashboards keep reading it. parsers/data/perf_summary.schema.json describes it.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from importlib.resources import files
from pathlib import Path
from typing import Any

from perfmon.agent.eventlog import part_name
from perfmon.agent.model import Workload
from perfmon.agent.outputs import WRITE_ERRNOS, OutputDir, json_bytes
from perfmon.agent.reducers import Summarizer
from perfmon.parsers.errors import EventLogError
from perfmon.parsers.events import EventLogReader
from perfmon.parsers.schema_filter import SchemaFilter
from perfmon.probes.files import InputFileError, open_user_file, read_user_file

MAX_SUMMARY_BYTES = 256 << 20  # a summary keeps at most --max-log-entries entries


def build_summary(session: dict[str, Any], summarizer: Summarizer) -> dict[str, Any]:
    """The summary document for the records the summarizer has seen so far (written
    with json_bytes, which turns a NaN or an infinity into null).

    ``end_time`` is null while the session runs; ``end_reason`` says why it
    ended (target_exited, duration, SIGINT, SIGTERM, SIGHUP, stdout_closed, error,
    command_exited, ranks_changed, yielded, or log_truncated for a summary rebuilt from the
    log of an agent that was killed: docs/metrics.md).
    """
    return {
        "session_info": {**session, **summarizer.session_fields()},
        "final_statistics": summarizer.final_statistics(),
        "iteration_logs": summarizer.iteration_logs,
    }


class SummaryFile:
    """The session's ``perf_summary_<ts>.json``, rewritten atomically in ``out``.

    A write the disk refuses is data (``error``), not a failure: the previous
    summary stays in place and the next write tries again.
    """

    def __init__(self, out: OutputDir, name: str) -> None:
        self.out = out
        self.name = name
        self.error: OSError | None = None

    @property
    def path(self) -> Path:
        return self.out.path / self.name

    def write(self, document: dict[str, Any], *, compact: bool = False) -> bool:
        """Replace the file (``compact`` JSON for the frequent rewrites); False when the
        disk refused (``error``)."""
        try:
            self.out.replace(self.name, json_bytes(document, compact=compact))
        except OSError as err:
            if err.errno not in WRITE_ERRNOS:
                raise
            self.error = err
            return False
        self.error = None
        return True


_FACT_TYPES: dict[str, tuple[type, ...]] = {
    "workload": (dict,), "primary_pid": (int,), "attach_monotonic_ns": (int,),
    "start_time": (str,), "log_interval": (int,),
}
_NUMBER = (int, float, type(None))


def check_facts(facts: object, source: str) -> str | None:
    """Keep ``facts`` (a log's session_start facts, changed in place) to what the summary
    schema allows of session_info, and raise EventLogError unless they hold what
    replaying the log needs, rightly typed. Returns one line saying what else became
    unknown (None: nothing did)."""
    if not isinstance(facts, dict):
        raise EventLogError(f"{source}: session_start record lacks session facts")
    _check_needed_facts(facts, source)
    _, filtered = _facts_filter().apply(facts)
    _check_needed_facts(facts, source)  # (an integer out of its range is now unknown)
    if not filtered.changed:
        return None
    return (f"{source}: session facts: {filtered.changed} value(s) not as the summary schema "
            f"allows taken as unknown ({'; '.join(filtered.examples)})")


def _check_needed_facts(facts: dict[str, Any], source: str) -> None:
    """EventLogError unless the facts that replaying needs are there and rightly typed."""
    for name, types in _FACT_TYPES.items():
        if not isinstance(facts.get(name), types) or isinstance(facts.get(name), bool):
            raise EventLogError(f"{source}: session facts: {name!r} missing or of the wrong type")
    if facts["log_interval"] < 1:
        raise EventLogError(f"{source}: session facts: 'log_interval' must be positive")
    limit = facts.get("iteration_logs_max_entries")
    if limit is not None and (not isinstance(limit, int) or limit < 2):
        raise EventLogError(f"{source}: session facts: 'iteration_logs_max_entries' is wrong")
    workload = facts["workload"]
    for key in Workload.__dataclass_fields__:
        value = workload.get(key)
        counts = key in ("world_size", "data_parallel_size") and key in workload
        if (not isinstance(value, _NUMBER) or isinstance(value, bool)
                or (counts and not (isinstance(value, int) and value >= 1))):
            raise EventLogError(f"{source}: session facts: workload {key!r} is not a number "
                                "(in its range)")
    try:
        datetime.fromisoformat(facts["start_time"])
    except ValueError:
        raise EventLogError(f"{source}: session facts: 'start_time' is not a time") from None


def summarizer_for(facts: dict[str, Any]) -> Summarizer:
    """A fresh summarizer for the session that ``facts`` (session_info at start) describe."""
    sampling = facts.get("stack_sampling", False)
    return Summarizer(
        Workload.from_dict(facts["workload"]),
        facts["primary_pid"],
        facts["attach_monotonic_ns"],
        datetime.fromisoformat(facts["start_time"]).timestamp(),
        facts["log_interval"],
        stack_sampling=bool(sampling),
        phases_continuous=facts.get("stack_sampling_mode") != "bursts",
        cuda_counters=bool((facts.get("cuda") or {}).get("available", False)),
        max_log_entries=facts.get("iteration_logs_max_entries"),
        ranks=rank_map(facts),
    )


def rank_map(facts: dict[str, Any]) -> dict[int, int | None]:
    """pid -> rank of the session's targets (from session_info's pids and ranks)."""
    pids, ranks = facts.get("pids") or [facts["primary_pid"]], facts.get("ranks") or []
    return {pid: ranks[i] if i < len(ranks) else None for i, pid in enumerate(pids)
            if isinstance(pid, int)}


_PART = re.compile(r"^(?P<stem>.+?)(?:\.part(?P<part>\d+))?\.msgpack$")


def log_parts(path: Path) -> list[Path]:
    """The parts of the event log that ``path`` (any of its parts) belongs to, in order."""
    match = _PART.match(path.name)
    if match is None:
        return [path]
    stem = match["stem"]
    first = path.with_name(part_name(stem, 0))
    parts = [first if first.exists() or match["part"] is None else path]
    n = 1
    while (nxt := path.with_name(part_name(stem, n))).exists():
        if nxt != parts[0]:
            parts.append(nxt)
        n += 1
    return parts


@dataclass
class Rebuilt:
    summary: dict[str, Any]
    parts: list[Path]
    warnings: list[str] = field(default_factory=list)


def replay(parts: list[Path], start: Callable[[dict[str, Any]], Callable[[dict[str, Any]], object]]
            ) -> tuple[list[str], bool, int]:
    """Feed every record of a log's parts to the sink that ``start(session_start)`` makes.

    Returns (warnings, whether the last part's tail was cut, the latest record time).
    A later part owned by anyone but root, this user or the first part's owner is
    not read (a warning).
    Records go from the decoder to the sink directly (perfmon.parsers.events.
    EventLogReader.read_into): no generator in between, so a big log streams fast.
    """
    warnings: list[str] = []
    skipped, unknown, problem, tail_cut, last_ns = 0, 0, None, False, 0
    sink: Callable[[dict[str, Any]], object] | None = None
    owners = {0, os.geteuid()}
    for index, part in enumerate(parts):
        fd = open_user_file(str(part), "event log")
        owner = os.fstat(fd).st_uid
        if index == 0:
            owners.add(owner)  # the log the user named, and the parts its writer wrote
        elif owner not in owners:
            # Found by its name beside the first part, in a folder others may write
            # (a sticky /tmp): a part planted by another user is not this log's.
            os.close(fd)
            warnings.append(f"{part}: owned by uid {owner}, not by the log's writer: not read")
            continue
        with os.fdopen(fd, "rb", buffering=0) as stream:
            reader = EventLogReader(stream, str(part), os.fstat(fd).st_size)
            first: list[dict[str, Any]] = []
            reader.read_into(first.append, limit=1)
            expected = "session_start" if index == 0 else "log_part"
            if first and first[0]["type"] != expected:
                if index == 0:
                    raise EventLogError(f"{part}: the first part of this event log is missing "
                                        f"(it begins with a {first[0]['type']} record)")
                warnings.append(f"{part}: not a part of this log: not read")
                continue
            if sink is None:
                sink = start(first[0])
            reader.read_into(sink)
        skipped += reader.skipped
        unknown += reader.unknown
        problem = problem or reader.first_problem
        last_ns = max(last_ns, reader.last_t_mono_ns)
        if reader.corrupt:
            warnings.append(f"{part}: {reader.corrupt}: the rest of it is not read")
        tail_cut = reader.tail_cut
    if skipped:
        warnings.append(f"{parts[0]}: {skipped} records of the wrong shape skipped (first: "
                        f"{problem})")
    if unknown:
        warnings.append(f"{parts[0]}: {unknown} records of types this version does not know "
                        "skipped")
    return warnings, tail_cut, last_ns


EntrySink = Callable[[dict[str, Any]], None]


def rebuild_from_event_log(path: Path,
                           entries: Callable[[dict[str, Any]], EntrySink] | None = None
                           ) -> Rebuilt:
    """Rebuild the summary from an event log (all its parts), in flat memory.

    A log without a ``session_end`` record (the agent was killed) ends at its
    last record, with ``end_reason`` ``log_truncated``. ``entries(facts)``, called
    with the session's facts, returns what gets every iteration_logs entry as it
    completes (before any thinning). Raises
    EventLogError or InputFileError (both exit 2) for a file that is no event log.
    """
    try:
        parts = log_parts(path)
    except OSError as err:
        raise InputFileError(f"event log {path}: {err.strerror}") from err
    made: list[tuple[dict[str, Any], Summarizer]] = []
    sinks: list[EntrySink] = [lambda _entry: None]
    fact_warnings: list[str] = []

    def start(first: dict[str, Any]) -> Callable[[dict[str, Any]], object]:
        problem = check_facts(first["session"], str(parts[0]))
        if problem is not None:
            fact_warnings.append(problem)
        made.append((first["session"], summarizer_for(first["session"])))
        feed = made[0][1].feed
        if entries is None:
            return feed
        on_entry = sinks[0] = entries(first["session"])

        def sink(record: dict[str, Any]) -> None:
            for entry in feed(record):
                on_entry(entry)

        return sink

    warnings, tail_cut, last_ns = replay(parts, start)
    facts, summarizer = made[0]
    if summarizer.end_reason is None:
        for entry in summarizer.feed({"type": "session_end", "t_mono_ns": last_ns,
                                      "reason": "log_truncated"}):
            sinks[0](entry)
    summary = build_summary(facts, summarizer)
    summary["session_info"]["rebuilt_from_event_log"] = True
    summary["session_info"]["event_log_tail_cut"] = tail_cut
    summary["session_info"]["event_log_parts"] = len(parts)
    # Its figures are made from the log's records, which anyone may have written: kept
    # to the schema too (at most max_log_entries entries: quick).
    summary, problem = check_summary(summary, str(parts[0]))
    return Rebuilt(summary, parts, fact_warnings + warnings + ([problem] if problem else []))


def describe_event(event: dict[str, Any]) -> str:
    """One line for a straggler or fail-slow event (the live output)."""
    def who(e: dict[str, Any]) -> str:
        return f"rank {e['rank']} (pid {e['pid']})" if e.get("rank") is not None else (
            f"pid {e['pid']}")

    kind = event["event"]
    if kind == "straggler":
        return (f"straggler: {who(event)} since {event['since']}: computes "
                f"{event['compute_ms']:.1f} ms per step against {event['others_compute_ms']:.1f}"
                f" ms on the others, delaying the job ~{event['delay_ms_per_step']:.1f} ms a step")
    if kind == "straggler_ended":
        return f"straggler: {who(event)} no longer lags (since {event['until']})"
    moved = [who(r) for r in event.get("ranks") or [] if r.get("moved")]
    what = "fail-slow" if kind == "fail_slow" else "recovered"
    return (f"{what}: step time {event['before_step_time_ms']:.1f} -> "
            f"{event['after_step_time_ms']:.1f} ms ({event['change_pct']:+.0f}%) since "
            f"{event['timestamp']}" + (f"; compute moved on {', '.join(moved)}" if moved else ""))


@functools.cache
def _summary_schema() -> dict[str, Any]:
    return json.loads(files("perfmon.parsers").joinpath("data", "perf_summary.schema.json")
                      .read_text())  # type: ignore[no-any-return]


@functools.cache
def _summary_filter() -> SchemaFilter:
    return SchemaFilter(_summary_schema())


@functools.cache
def _facts_filter() -> SchemaFilter:
    return SchemaFilter(_summary_schema(), ("properties", "session_info"))


@functools.cache
def entry_filter() -> SchemaFilter:
    """The filter of one iteration_logs entry (SchemaFilter.apply)."""
    return SchemaFilter(_summary_schema(), ("properties", "iteration_logs", "items"))



def read_summary(path: Path) -> tuple[dict[str, Any], str | None]:
    """A perf summary file the user named (report, top, merge), kept to what its schema
    allows, and one line saying what was not (None when everything was).

    Values of the wrong type, out of range or not finite (NaN, Infinity, 1e308)
    become unknown (None): a summary anyone may have written never crashes a view
    nor passes a bad value for a figure. Raises InputFileError (one line) for a file
    that is not JSON, nests deeper than Python's parser goes, or lacks
    session_info, final_statistics or iteration_logs.
    """
    try:
        summary = json.loads(read_user_file(str(path), "summary", MAX_SUMMARY_BYTES))
    except RecursionError:
        raise InputFileError(f"summary {path}: nested too deep to be a perf summary") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise InputFileError(f"summary {path}: not JSON ({err})") from err
    if not (isinstance(summary, dict) and isinstance(summary.get("session_info"), dict)
            and isinstance(summary.get("final_statistics"), dict)
            and isinstance(summary.get("iteration_logs"), list)):
        raise InputFileError(f"summary {path}: not a perf summary (session_info, "
                             "final_statistics and iteration_logs expected)")
    return check_summary(summary, f"summary {path}")


def check_summary(summary: dict[str, Any], source: str) -> tuple[dict[str, Any], str | None]:
    """``summary`` kept to what its schema allows, and one line naming ``source`` and what
    became unknown (None when nothing did)."""
    summary, filtered = _summary_filter().apply(summary)
    if not filtered.changed:
        return summary, None
    return summary, (f"{source}: {filtered.changed} value(s) not as its schema allows "
                     f"shown as unknown ({'; '.join(filtered.examples)})")
