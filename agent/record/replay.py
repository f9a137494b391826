"""A session rebuilt from its event log: the facts checked, every part's records fed to the
reducers as the live session fed them, in flat memory.

``summarize``, ``report`` and ``trace`` read logs through ``replay``; a log
without a ``session_end`` record (the agent was killed) ends at its last record.
The facts of a log are anyone's: they are kept to the summary's schema (what is
not becomes unknown, one warning), and the few replay needs are refused in one
line when missing or of the wrong type.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from perfmon.agent.record.layout import log_parts
from perfmon.agent.record.summary import build_summary, check_summary, facts_filter
from perfmon.agent.reducers import Summarizer
from perfmon.parsers.errors import EventLogError, InputFileError
from perfmon.parsers.figures import render
from perfmon.parsers.log_reader import EventLogReader
from perfmon.parsers.workload import Workload
from perfmon.probes.files import open_user_file

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
    _, filtered = facts_filter().apply(facts)
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
    log_reader.EventLogReader.read_into): no generator in between, so a big log streams fast.
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
    with the session's facts, returns what gets every iteration_logs entry (as the
    summary shows it) as it completes (before any thinning). Raises
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
        made.append((first["session"], Summarizer.from_facts(first["session"])))
        feed = made[0][1].feed
        if entries is None:
            return feed
        on_entry = sinks[0] = entries(first["session"])

        def sink(record: dict[str, Any]) -> None:
            for entry in feed(record):
                on_entry(render(entry))

        return sink

    warnings, tail_cut, last_ns = replay(parts, start)
    facts, summarizer = made[0]
    if summarizer.end_reason is None:
        for entry in summarizer.feed({"type": "session_end", "t_mono_ns": last_ns,
                                      "reason": "log_truncated"}):
            sinks[0](render(entry))
    summary = build_summary(facts, summarizer)
    summary["session_info"]["rebuilt_from_event_log"] = True
    summary["session_info"]["event_log_tail_cut"] = tail_cut
    summary["session_info"]["event_log_parts"] = len(parts)
    # Its figures are made from the log's records, which anyone may have written: kept
    # to the schema too (at most max_log_entries entries: quick).
    summary, problem = check_summary(summary, str(parts[0]))
    return Rebuilt(summary, parts, fact_warnings + warnings + ([problem] if problem else []))
