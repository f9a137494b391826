"""The perf summary: built from the session facts and the aggregator, written atomically,
and rebuilt from an event log.

The format is FlagScale's in-process perf monitor's (``session_info``,
``final_statistics``, ``iteration_logs``), with extra keys only added, so
existing dashboards keep reading it. parsers/data/perf_summary.schema.json describes it.
"""

from __future__ import annotations

import functools
import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from perfmon.agent.record.eventlog import EventLogWriter
from perfmon.agent.record.layout import session_names
from perfmon.agent.record.outputs import (
    OutputDir,
    OutputDirError,
    json_bytes,
    json_document,
    refused,
)
from perfmon.agent.reducers import Summarizer
from perfmon.parsers.errors import InputFileError
from perfmon.parsers.figures import Statistics, render
from perfmon.parsers.schema_filter import SchemaFilter
from perfmon.probes.files import read_user_file

MAX_SUMMARY_BYTES = 256 << 20  # a summary keeps at most --max-log-entries entries

def build_summary(session: dict[str, Any], summarizer: Summarizer,
                  stats: Statistics | None = None) -> dict[str, Any]:
    """The summary document for the records the summarizer has seen so far, its figures
    rendered in the summary's keys and units (``stats``: its statistics, when the caller
    has them already). Written with json_bytes, which turns a NaN or an infinity into null.

    ``end_time`` is null while the session runs; ``end_reason`` says why it
    ended (target_exited, duration, SIGINT, SIGTERM, SIGHUP, stdout_closed, error,
    command_exited, ranks_changed, yielded, or log_truncated for a summary rebuilt from the
    log of an agent that was killed: docs/metrics.md).
    """
    return {
        "session_info": {**session, **summarizer.session_fields()},
        "final_statistics": render(stats if stats is not None else summarizer.statistics()),
        "iteration_logs": [render(e) for e in summarizer.intervals_logged],
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
            self.error = refused(err)
            return False
        self.error = None
        return True


@functools.cache
def _summary_schema() -> dict[str, Any]:
    return json.loads(files("perfmon.parsers").joinpath("data", "perf_summary.schema.json")
                      .read_text())  # type: ignore[no-any-return]


@functools.cache
def _summary_filter() -> SchemaFilter:
    return SchemaFilter(_summary_schema())


@functools.cache
def facts_filter() -> SchemaFilter:
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
    return parse_summary(read_user_file(str(path), "summary", MAX_SUMMARY_BYTES), path)


def parse_summary(data: bytes, path: Path) -> tuple[dict[str, Any], str | None]:
    """The summary in ``data`` (read from ``path``), as read_summary keeps it."""
    summary = json_document(data, f"summary {path}")
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


def claim_session_files(out: OutputDir, session_stamp: str, first_summary: bytes,
                        part_bytes: int, max_bytes: int) -> tuple[SummaryFile, EventLogWriter]:
    """A session's pair under a fresh stem (perfmon.agent.record.layout.session_names).

    The summary is published (complete, ``first_summary``) under a name no file has, and
    the event log created exclusively beside it; when either name is taken (two agents
    in one second, or anything planted there), the next suffix is tried.
    """
    for names in session_names(session_stamp):
        try:
            out.publish_new(names.summary, first_summary)
        except FileExistsError:
            continue
        try:
            log = EventLogWriter(out, names.log_stem, part_bytes=part_bytes, max_bytes=max_bytes)
        except FileExistsError:
            out.unlink(names.summary)
            continue
        return SummaryFile(out, names.summary), log
    raise OutputDirError(f"output dir {out.path}: no free file name for {session_stamp}")
