"""Every file name the agent writes, and how recorded files are found in a folder: one place.

A session writes a pair into its output folder:

- ``perf_summary_<stamp>[_N].json``: the summary (FlagScale's perf-monitor name);
- ``perf_events_<stamp>[_N].msgpack``: the event log's first part, then
  ``perf_events_<stamp>[_N].part<K>.msgpack`` (K = 1, 2, ...);

with ``<stamp>`` the session's start (``YYYYmmdd_HHMMSS``) and ``_N`` the first
suffix free in the folder (two agents in one second, or a name someone planted).
A hang adds ``hang_report_<stamp>[_N].json``; a hang, a straggler, a fail-slow event or
an abnormal exit a folder ``incident_<stamp>_<kind>[_N]/`` (INCIDENT_FILES in it). The
node service keeps one folder per
job, ``<job>.<user>.<YYYYmmdd-HHMMSS>/``, holding ``job.json`` and the job's pairs.
``summarize`` writes its summary beside the log it read, with the log's stamp.

Finding them: ``recorded_files`` walks a folder (never through a link) for
summaries and first parts of logs; ``log_parts`` lists a log's parts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

SUMMARY_PREFIX, SUMMARY_SUFFIX = "perf_summary_", ".json"
LOG_PREFIX, LOG_SUFFIX = "perf_events_", ".msgpack"
HANG_REPORT_PREFIX = "hang_report_"
JOB_RECORD = "job.json"
INCIDENT_PREFIX = "incident_"
# An incident bundle's files: what happened, every rank's stacks, the job's GPUs, each
# rank's iterations around it, and the trace of that window.
INCIDENT_RECORD, INCIDENT_STACKS, INCIDENT_GPUS = "incident.json", "stacks.json", "gpus.json"
INCIDENT_HISTORY, INCIDENT_TRACE = "history.json", "trace.json"
# As messages and help name them.
SUMMARY_GLOB, LOG_GLOB = f"{SUMMARY_PREFIX}*{SUMMARY_SUFFIX}", f"{LOG_PREFIX}*{LOG_SUFFIX}"
SUMMARY_NAME = f"{SUMMARY_PREFIX}<timestamp>{SUMMARY_SUFFIX}"
LOG_NAME = f"{LOG_PREFIX}<timestamp>{LOG_SUFFIX}"
MAX_SUFFIXES = 1000  # names tried before a folder counts as full

_LOG = re.compile(r"^perf_events_(?P<stem>.+?)(?:\.part(?P<part>\d+))?\.msgpack$")
_SUMMARY = re.compile(r"^perf_summary_(?P<stem>.+?)\.json$")


def stamp(when: datetime) -> str:
    """A session's stamp in its file names."""
    return when.strftime("%Y%m%d_%H%M%S")


@dataclass(frozen=True)
class SessionNames:
    """The names of one session's files, for one suffix."""

    summary: str  # perf_summary_<stamp>[_N].json
    log_stem: str  # perf_events_<stamp>[_N]: the log's parts are log_part(stem, k)

    @property
    def log(self) -> str:
        return log_part(self.log_stem, 0)


def session_names(session_stamp: str) -> Iterator[SessionNames]:
    """The candidate names of a session's pair, the first free one to be taken."""
    for n in range(MAX_SUFFIXES):
        suffix = f"_{n}" if n else ""
        yield SessionNames(f"{SUMMARY_PREFIX}{session_stamp}{suffix}{SUMMARY_SUFFIX}",
                           f"{LOG_PREFIX}{session_stamp}{suffix}")


def log_part(stem: str, part: int) -> str:
    """File name of part ``part`` (0 = the first) of the log ``<stem>.msgpack``."""
    return f"{stem}{LOG_SUFFIX}" if part == 0 else f"{stem}.part{part}{LOG_SUFFIX}"


def hang_report_stem(when: datetime) -> tuple[str, str]:
    """(stem, suffix) of a hang report; OutputDir.publish_unique adds a free ``_N``."""
    return f"{HANG_REPORT_PREFIX}{stamp(when)}", SUMMARY_SUFFIX


def incident_folder(when: datetime, kind: str) -> str:
    """An incident bundle's folder name (``kind``: hang, straggler, fail_slow, exit)."""
    return f"{INCIDENT_PREFIX}{stamp(when)}_{kind}"


def is_incident(name: str) -> bool:
    return name.startswith(INCIDENT_PREFIX)


def job_folder(name: str, user: str, when: datetime) -> str:
    """The node service's folder of one job (``name`` and ``user`` already safe names)."""
    return f"{name}.{user}.{when.strftime('%Y%m%d-%H%M%S')}"


def summary_beside(log: Path) -> Path:
    """Where ``summarize`` writes the summary of the log ``log`` (any part): beside it."""
    match = _LOG.match(log.name)
    stem = match["stem"] if match else log.stem
    return log.with_name(f"{SUMMARY_PREFIX}{stem}{SUMMARY_SUFFIX}")


def is_first_log_part(name: str) -> bool:
    match = _LOG.match(name)
    return match is not None and match["part"] is None


def log_parts(path: Path) -> list[Path]:
    """The parts of the event log that ``path`` (any of its parts) belongs to, in order
    (just ``path`` when it has not a log's name). Raises OSError."""
    match = _LOG.match(path.name)
    if match is None:
        return [path]
    stem = f"{LOG_PREFIX}{match['stem']}"
    first = path.with_name(log_part(stem, 0))
    parts = [first if first.exists() or match["part"] is None else path]
    n = 1
    while (nxt := path.with_name(log_part(stem, n))).exists():
        if nxt != parts[0]:
            parts.append(nxt)
        n += 1
    return parts


def recorded_files(folder: Path, depth: int, *, summaries: bool = True, logs: bool = True,
                   summaries_with_logs: bool = True) -> list[Path]:
    """Summaries and first parts of event logs in ``folder`` and its sub-folders ``depth``
    levels down (never through links), sorted by path within each folder.
    ``summaries_with_logs`` False: a summary whose log is beside it is left out (the
    log says more). Raises OSError for ``folder`` itself."""
    found: list[Path] = []

    def walk(where: Path, level: int) -> None:
        try:
            entries = sorted(os.scandir(where), key=lambda e: e.name)
        except OSError:
            if level == 0:
                raise
            return
        stems = {m["stem"] for e in entries if (m := _LOG.match(e.name)) and not m["part"]}
        below = []
        for entry in entries:
            if entry.is_symlink():
                continue
            if entry.is_dir():
                below.append(Path(entry.path))
            elif not entry.is_file():
                continue
            elif logs and is_first_log_part(entry.name):
                found.append(Path(entry.path))
            elif summaries and (m := _SUMMARY.match(entry.name)) and (
                    summaries_with_logs or not logs or m["stem"] not in stems):
                found.append(Path(entry.path))
        if level < depth:  # a folder's own files first, then its sub-folders'
            for sub in below:
                walk(sub, level + 1)

    walk(folder, 0)
    return found
