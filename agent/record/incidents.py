"""Incident bundles found in folders (``incident_<stamp>_<kind>/``, written by
perfmon.agent.measure.incidents): their ``incident.json``, read bounded and kept to what
the views need, for ``perfmon-agent incidents`` and the report.

A record is read as summaries are (perfmon.agent.record.runs): at most 1 MiB, nested
at most 32 levels (perfmon.parsers.schema_filter; deeper than Python's parser goes is
refused outright), and only when root or the user running the command owns it (a
record names no job user, and folders may be shared: issue 36). A record that is
unfit is one line (``find_incidents``'s ``problems``); the others are still listed.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perfmon.agent.record.layout import INCIDENT_RECORD, is_incident
from perfmon.agent.record.outputs import json_document
from perfmon.parsers.errors import InputFileError
from perfmon.parsers.schema_filter import SchemaFilter
from perfmon.probes.files import read_user_file_and_status

MAX_RECORD_BYTES = 1 << 20
MAX_DEPTH = 3
KNOWN_KINDS = ("hang", "straggler", "fail_slow", "exit")
# What the views read of a record; the rest stays open (any JSON, nested at most 32 levels).
RECORD_SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "agent": {"type": "string"}, "kind": {"type": "string"}, "time": {"type": "string"},
    "what": {"type": "string"}, "files": {"type": "array", "items": {"type": "string"}},
    "ranks": {"type": "array", "items": {"type": "object", "properties": {
        "pid": {"type": "integer"}, "rank": {"type": "integer"}}}}}}


@functools.cache
def _record_filter() -> SchemaFilter:
    return SchemaFilter(RECORD_SCHEMA)


@dataclass(frozen=True)
class Incident:
    folder: Path
    kind: str
    time: str
    what: str
    ranks: tuple[int | None, ...]
    files: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "kind": self.kind, "time": self.time,
                "what": self.what, "ranks": list(self.ranks), "files": list(self.files)}


def read_incident(folder: Path) -> Incident | None:
    """The bundle in ``folder`` (None: no record there, or not this agent's). Raises
    InputFileError (one line naming the record) for a record that is unfit: not JSON,
    too big, nested too deep, or owned by neither root nor the user running this."""
    path = folder / INCIDENT_RECORD
    try:
        raw, st = read_user_file_and_status(str(path), "incident", MAX_RECORD_BYTES)
    except InputFileError as err:
        if "no such file" in str(err):
            return None
        raise
    me = os.geteuid()
    if st.st_uid not in (0, me):
        raise InputFileError(f"incident {path}: owned by uid {st.st_uid}, neither root nor "
                             f"uid {me} (this user): not listed")
    parsed = json_document(raw, f"incident {path}", ": not listed")
    data, filtered = _record_filter().apply(parsed)
    if not isinstance(data, dict):
        why = "; ".join(filtered.examples) or "not an object"
        raise InputFileError(f"incident {path}: {why}: not listed")
    if data.get("agent") != "perfmon-agent":
        return None
    kind = data.get("kind") if data.get("kind") in KNOWN_KINDS else "unknown"
    ranks: list[Any] = data["ranks"] if isinstance(data.get("ranks"), list) else []
    files: list[Any] = data["files"] if isinstance(data.get("files"), list) else []
    return Incident(folder, str(kind), str(data.get("time") or "?")[:64],
                    str(data.get("what") or "")[:500],
                    tuple(r.get("rank") if isinstance(r, dict) and isinstance(r.get("rank"), int)
                          else None for r in ranks[:4096]),
                    tuple(str(f)[:64] for f in files[:16]))


def find_incidents(folder: Path, depth: int = MAX_DEPTH,
                   problems: list[str] | None = None) -> list[Incident]:
    """The bundles in ``folder`` and its sub-folders ``depth`` levels down (never through
    links), newest first; a line for each unfit record goes to ``problems``. Raises
    InputFileError when ``folder`` is not a folder."""
    if not folder.is_dir() or folder.is_symlink():
        raise InputFileError(f"folder {folder}: not a folder")
    found: list[Incident] = []

    def walk(where: Path, level: int) -> None:
        try:
            entries = sorted(os.scandir(where), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if entry.is_symlink() or not entry.is_dir():
                continue
            if is_incident(entry.name):
                try:
                    incident = read_incident(Path(entry.path))
                except InputFileError as err:
                    if problems is not None:
                        problems.append(str(err))
                    continue
                if incident is not None:
                    found.append(incident)
            elif level < depth:
                walk(Path(entry.path), level + 1)

    walk(folder, 0)
    return sorted(found, key=lambda i: (i.time, str(i.folder)), reverse=True)
