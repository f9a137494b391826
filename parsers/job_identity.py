"""A job's identity from its ranks' job variables, and names fit for folders and labels
(pure).

The node service groups ranks into jobs by these (perfmon.agent.daemon.jobs), and
``attach`` names the job of its session the same way, so a job's summaries carry
the same id on every node: ``TORCHELASTIC_RUN_ID``, else ``MASTER_ADDR:MASTER_PORT``,
else the launcher. A job controls its environment: every name is reduced to
``[A-Za-z0-9._-]`` and 64 characters (a short hash added when anything changed).
"""

from __future__ import annotations

import hashlib
import re

NO_RUN_ID = ("", "none")  # torchrun's default rendezvous id
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_NAME = 64


def safe_name(text: str) -> str:
    """``text`` fit for a folder name and a label: [A-Za-z0-9._-], no leading dot, at
    most 64 characters; a short hash of the original is added when anything changed."""
    cleaned = _UNSAFE.sub("_", text).lstrip(".")
    if cleaned == text and 0 < len(text) <= MAX_NAME:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return f"{cleaned[:MAX_NAME - 9] or 'job'}-{digest}"


def job_identity(rank_env: dict[str, str], launcher: str) -> tuple[str, str]:
    """(the job's name, where it came from) given a rank's job variables; ``launcher``
    names the job when they do not (e.g. ``python-1234``)."""
    run_id = rank_env.get("TORCHELASTIC_RUN_ID", "")
    if run_id not in NO_RUN_ID:
        return safe_name(run_id), "TORCHELASTIC_RUN_ID"
    addr, port = rank_env.get("MASTER_ADDR", ""), rank_env.get("MASTER_PORT", "")
    if addr and port:
        return safe_name(f"{addr}-{port}"), "MASTER_ADDR:MASTER_PORT"
    return safe_name(launcher), "launcher"
