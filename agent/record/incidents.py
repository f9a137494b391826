"""Incident bundles found in folders (``incident_<stamp>_<kind>/``, written by
perfmon.agent.measure.incidents): their ``incident.json``, read bounded and kept to what
the views need, for ``perfmon-agent incidents`` and the report."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perfmon.agent.record.layout import INCIDENT_RECORD, is_incident
from perfmon.parsers.errors import InputFileError
from perfmon.probes.files import read_user_file

MAX_RECORD_BYTES = 1 << 20
MAX_DEPTH = 3
KNOWN_KINDS = ("hang", "straggler", "fail_slow", "exit")


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
    """The bundle in ``folder`` (None: no record of this agent's there, or unfit)."""
    try:
        data = json.loads(read_user_file(str(folder / INCIDENT_RECORD), "incident",
                                         MAX_RECORD_BYTES))
    except (InputFileError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("agent") != "perfmon-agent":
        return None
    kind = data.get("kind") if data.get("kind") in KNOWN_KINDS else "unknown"
    ranks: list[Any] = data["ranks"] if isinstance(data.get("ranks"), list) else []
    files: list[Any] = data["files"] if isinstance(data.get("files"), list) else []
    return Incident(folder, str(kind), str(data.get("time") or "?")[:64],
                    str(data.get("what") or "")[:500],
                    tuple(r.get("rank") if isinstance(r, dict) and isinstance(r.get("rank"), int)
                          else None for r in ranks[:4096]),
                    tuple(str(f)[:64] for f in files[:16]))


def find_incidents(folder: Path, depth: int = MAX_DEPTH) -> list[Incident]:
    """The bundles in ``folder`` and its sub-folders ``depth`` levels down (never through
    links), newest first. Raises InputFileError when ``folder`` is not a folder."""
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
                if (incident := read_incident(Path(entry.path))) is not None:
                    found.append(incident)
            elif level < depth:
                walk(Path(entry.path), level + 1)

    walk(folder, 0)
    return sorted(found, key=lambda i: (i.time, str(i.folder)), reverse=True)
