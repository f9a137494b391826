"""One reader of recorded runs: a summary file or an event log (replayed), or a folder of
them, as one RecordedRun each. ``report``, ``trace``, ``top`` and ``merge`` are built on
it.

A summary is kept to its schema (perfmon.agent.record.summary.read_summary); a
log is replayed through the reducers as ``summarize`` does, and the caller may
take every iteration_logs entry as it completes (``entries_for``: the summary
itself keeps at most --max-log-entries). Files are found by their names
(perfmon.agent.record.layout), never through links; a bad file among several is a
warning, not the end.

Folders may be shared (a sticky job folder every user can write), so a file found in
one is believed only when root or the job's own user owns it (``distrust``, issue 36):
the job's user is the one its summary names (``session_info.job.user``, a name or a uid
this node knows); when it names none this node knows, only root's files and those of
the user running the command are. A file refused is one line and gives no figure.
"""

from __future__ import annotations

import functools
import os
import pwd
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from perfmon.agent.record.layout import LOG_GLOB, SUMMARY_GLOB, recorded_files
from perfmon.agent.record.replay import EntrySink, rebuild_from_event_log
from perfmon.agent.record.summary import MAX_SUMMARY_BYTES, parse_summary
from perfmon.agent.record.summary_types import FinalStatistics, SessionInfo
from perfmon.agent.reducers import rank_map
from perfmon.parsers.errors import InputFileError, PerfmonError
from perfmon.parsers.figures import IntervalFigures, Statistics, parse
from perfmon.parsers.job_identity import decimal_number
from perfmon.probes.files import open_user_file, read_user_file_and_status

# Given a run's source and its facts, what takes every entry of a replayed log.
EntriesFor = Callable[[Path, dict[str, Any]], EntrySink]


class RecordedRun:
    """One session's recorded summary (read, or rebuilt from its log)."""

    def __init__(self, source: Path, kind: str, summary: dict[str, Any], *,
                 warnings: list[str] | None = None, mtime_s: float | None = None,
                 sink: EntrySink | None = None, owner_uid: int | None = None) -> None:
        self.source = source  # the summary file, or the event log's first part
        self.owner_uid = owner_uid  # its owner's, when read from a file
        self.kind = kind  # "summary" or "event log"
        self.summary = summary
        self.warnings = warnings or []  # each names its file
        self.mtime_s = mtime_s  # a summary file's, when read
        self.sink = sink  # what took a replayed log's every entry (EntriesFor), if asked

    @property
    def info(self) -> SessionInfo:
        return self.summary["session_info"]  # type: ignore[no-any-return]

    @property
    def stats(self) -> FinalStatistics:
        return self.summary["final_statistics"]  # type: ignore[no-any-return]

    @functools.cached_property
    def figures(self) -> Statistics:
        """Its final statistics as the typed figures (perfmon.parsers.figures)."""
        return parse(Statistics, self.stats)

    @functools.cached_property
    def intervals(self) -> list[IntervalFigures]:
        """Its iteration_logs entries as the typed figures (an unknown one left out)."""
        return [parse(IntervalFigures, e) for e in self.entries]

    @property
    def entries(self) -> list[dict[str, Any]]:
        """Its iteration_logs entries (objects only: an unknown one is left out)."""
        return [e for e in self.summary.get("iteration_logs") or [] if isinstance(e, dict)]

    @functools.cached_property
    def _rank_by_pid(self) -> dict[int, int | None]:
        return rank_map(self.info)

    def rank_of(self, pid: int) -> int | None:
        return self._rank_by_pid.get(pid)

    @property
    def started_s(self) -> float | None:
        """The session's start (wall clock, s), when known."""
        try:
            return datetime.fromisoformat(str(self.info.get("start_time"))).timestamp()
        except ValueError:
            return None

    @property
    def host(self) -> str:
        return str(self.info.get("host") or "?")


def is_folder_input(path: Path) -> bool:
    """Whether a LOG_OR_DIR argument is a folder; raises InputFileError (exit 2) when it
    names nothing."""
    try:
        is_dir = path.is_dir()
        exists = is_dir or path.exists() or path.is_symlink()
    except OSError as err:
        raise InputFileError(f"input {path}: {err.strerror}") from err
    if not exists:
        raise InputFileError(f"input {path}: no such file or folder")
    return is_dir


def is_summary_file(path: Path) -> bool:
    """Whether a file the user named is JSON (a summary) rather than msgpack (a log)."""
    fd = open_user_file(str(path), "input")
    try:
        head = os.read(fd, 64)
    except OSError as err:
        raise InputFileError(f"input {path}: cannot read: {err.strerror}") from err
    finally:
        os.close(fd)
    return head.lstrip()[:1] == b"{"


def read_summary_run(path: Path) -> RecordedRun:
    """A summary file as a run (its schema's problems as a warning), with its owner.
    InputFileError."""
    data, st = read_user_file_and_status(str(path), "summary", MAX_SUMMARY_BYTES)
    summary, problem = parse_summary(data, path)
    return RecordedRun(path, "summary", summary, warnings=[problem] if problem else [],
                       mtime_s=st.st_mtime, owner_uid=st.st_uid)


def job_user(info: SessionInfo) -> tuple[str | None, int | None]:
    """The job's user a run names (``session_info.job.user``) and that user's uid here:
    the account of that name, else the name as a uid (the agent writes the uid when the
    node has no name for it); None for a user this node does not know."""
    job = info.get("job")
    name = job.get("user") if isinstance(job, dict) else None
    if not isinstance(name, str) or not name:
        return None, None
    try:
        return name, pwd.getpwnam(name).pw_uid
    except KeyError:
        return name, decimal_number(name, 10)


def distrust(run: RecordedRun) -> str | None:
    """Why a run found in a folder is not to be believed, one line naming its file (None
    when it is): its file is owned by neither root nor the job's user (``job_user``);
    when that user is not known here, by neither root nor the user running this."""
    owner = run.owner_uid
    if owner == 0:
        return None
    if owner is None:
        return f"{run.kind} {run.source}: its owner is not known: not read"
    name, uid = job_user(run.info)
    if uid is not None:
        if owner == uid:
            return None
        return (f"{run.kind} {run.source}: owned by uid {owner}, neither root nor the job's "
                f"user ({name}, uid {uid}): not read")
    me = os.geteuid()
    if owner == me:
        return None
    named = "names no user" if name is None else f"names user {name!r}, unknown here"
    return (f"{run.kind} {run.source}: owned by uid {owner}; its job {named}, so only root's "
            f"and uid {me}'s files are read: not read")


def replay_run(path: Path, entries_for: EntriesFor | None = None) -> RecordedRun:
    """An event log (any part) replayed as a run. EventLogError, InputFileError."""
    sinks: list[EntrySink] = []

    def start(facts: dict[str, Any]) -> EntrySink:
        assert entries_for is not None
        sinks.append(entries_for(path, facts))
        return sinks[0]

    rebuilt = rebuild_from_event_log(path, start if entries_for else None)
    try:
        owner: int | None = os.stat(rebuilt.parts[0], follow_symlinks=False).st_uid
    except OSError:
        owner = None  # gone since: not believed from a folder (distrust)
    return RecordedRun(rebuilt.parts[0], "event log", rebuilt.summary, warnings=rebuilt.warnings,
                       sink=sinks[0] if sinks else None, owner_uid=owner)


def load_run(path: Path, entries_for: EntriesFor | None = None) -> RecordedRun:
    """A summary file or an event log, told apart by their content."""
    if is_summary_file(path):
        return read_summary_run(path)
    return replay_run(path, entries_for)


def find_runs(folder: Path, depth: int, *, summaries: bool = True, logs: bool = True,
              summaries_with_logs: bool = False) -> list[Path]:
    """The event logs (first parts) and summaries under ``folder``, ``depth`` levels down;
    a summary whose log is beside it only with ``summaries_with_logs`` (its log says
    more). InputFileError for a folder that cannot be read."""
    try:
        return recorded_files(folder, depth, summaries=summaries, logs=logs,
                              summaries_with_logs=summaries_with_logs)
    except OSError as err:
        raise InputFileError(f"folder {folder}: {err.strerror}") from err


def load_runs(path: Path, entries_for: EntriesFor | None = None, *,
              depth: int = 1) -> list[RecordedRun]:
    """The runs of a log, a summary, or a folder (its files and sub-folders ``depth``
    levels down: one per node or job). A bad file among several, or one of a folder's
    that is not believed (``distrust``), is a warning of the first run (``skipped:
    ...``). Raises InputFileError or EventLogError (exit 2) when no run is left."""
    if not is_folder_input(path):
        return [load_run(path, entries_for)]
    inputs = find_runs(path, depth)
    if not inputs:
        raise InputFileError(f"folder {path}: no {LOG_GLOB} or {SUMMARY_GLOB} "
                             "in it or in its sub-folders")
    runs, errors = [], []
    for item in inputs:
        try:
            run = load_run(item, entries_for)
        except PerfmonError as err:
            errors.append(err)
            continue
        refusal = distrust(run)
        if refusal is None:
            runs.append(run)
        else:
            errors.append(InputFileError(refusal))
    if not runs:
        raise errors[0]
    runs[0].warnings += [f"skipped: {error}" for error in errors]
    return runs


class SummaryCache:
    """The summaries in some folders (and one level down), each re-read only when it
    changed (``top`` redraws every second); one not believed (``distrust``) is a problem."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders = folders
        self._cache: dict[Path, tuple[tuple[int, int, int], RecordedRun | str]] = {}
        self.problems: list[str] = []

    def runs(self) -> list[RecordedRun]:
        """Every summary readable now; ``problems`` says what was not."""
        self.problems = []
        found: list[RecordedRun] = []
        seen = set()
        for folder in self.folders:
            try:
                paths = recorded_files(folder, 1, logs=False)
            except OSError:
                continue
            for path in paths:
                seen.add(path)
                run = self._read(path)
                if isinstance(run, str):
                    self.problems.append(run)
                elif run is not None:
                    found.append(run)
                    self.problems += run.warnings
        self._cache = {p: v for p, v in self._cache.items() if p in seen}
        return found

    def _read(self, path: Path) -> RecordedRun | str | None:
        """The run, or why it is not believed; None when it cannot be read."""
        try:
            st = os.stat(path)
        except OSError:
            return None  # gone since the listing
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        cached = self._cache.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            run = read_summary_run(path)
        except InputFileError as err:
            if "no such file" not in str(err):
                self.problems.append(str(err))
            return None
        run.mtime_s = st.st_mtime
        read: RecordedRun | str = distrust(run) or run
        self._cache[path] = (stamp, read)
        return read
