"""The node service's job records: ``job.json`` in each job's folder (who the job is, its
sessions, how it ended), and pruning the folders of finished jobs.

A record is the service's own file: only folders holding a record this agent wrote
(``"agent": "perfmon-agent"``) are ever pruned, so a folder someone else made under
the jobs root is left alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Any

from perfmon.agent.record.layout import JOB_RECORD
from perfmon.agent.record.outputs import OutputDir, json_bytes

MAX_JOB_RECORD_BYTES = 1 << 20


def write_job_record(folder: OutputDir, record: dict[str, Any], shown: str,
                     log: Callable[[str], None]) -> None:
    """Replace the record atomically; a disk that refuses is one log line, not an error."""
    try:
        folder.replace(JOB_RECORD, json_bytes(record))
    except OSError as err:
        log(f"job {shown}: cannot write {JOB_RECORD}: {err.strerror}")


def read_job_record(folder: OutputDir, name: str) -> tuple[dict[str, Any], float] | None:
    """The job record this agent wrote in subfolder ``name``, and its mtime (None: none
    there, or not one of ours)."""
    found = folder.read_file(f"{name}/{JOB_RECORD}", MAX_JOB_RECORD_BYTES)
    if found is None:
        return None
    try:
        record = json.loads(found[0])
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("agent") != "perfmon-agent":
        return None
    return record, found[1]


def prune_job_folders(host_folder: OutputDir, active: Collection[str], *, keep_jobs: int,
                      keep_days: float, now_wall_s: float, log: Callable[[str], None]) -> None:
    """Remove finished job folders beyond ``keep_jobs`` and older than ``keep_days``.

    Only folders holding a job record of this agent are candidates, never one in
    ``active`` (a job being watched); age is the record's last change.
    """
    finished = []
    for name in host_folder.subdirs():
        found = read_job_record(host_folder, name) if name not in active else None
        if found is not None:
            finished.append((found[1], name))
    finished.sort(reverse=True)
    for i, (mtime, name) in enumerate(finished):
        if i >= keep_jobs or now_wall_s - mtime > keep_days * 86400:
            try:
                host_folder.remove_subdir(name)
            except OSError as err:
                log(f"cannot remove the old job folder {name}: {err.strerror}")
