"""A job's identity from its ranks' job variables, and names fit for folders and labels
(pure).

The node service groups ranks into jobs by these (perfmon.agent.daemon.jobs), and
``attach`` names the job of its session the same way, so a job's summaries carry
the same id on every node:

1. ``SLURM_JOB_ID`` (and ``SLURM_STEP_ID`` of an ``srun`` step): ``slurm-<id>`` for
   the batch step, ``slurm-<id>.<step>`` for a step, the same on every node of the
   allocation, which is how operators look a job up;
2. ``TORCHELASTIC_RUN_ID`` (torchrun's rendezvous id; its default ``none`` does not
   count);
3. ``MASTER_ADDR:MASTER_PORT``;
4. else the launcher.

A job controls its environment: every name is reduced to ``[A-Za-z0-9._-]`` and 64
characters (a short hash added when anything changed), every other value kept is
at most ``MAX_VALUE`` characters, and only the variables named here are ever read
(perfmon.probes.procfs.ENVIRON_KEYS).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

NO_RUN_ID = ("", "none")  # torchrun's default rendezvous id
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_NAME = 64
MAX_VALUE = 128  # a Slurm job name, a partition, a pod's name (Kubernetes: 63-253)
MAX_ID_DIGITS = 12

# The variables that say which job and rank a process is.
TORCH_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
              "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
# Slurm's, for ranks started by srun (no RANK: SLURM_PROCID) and the job's record.
SLURM_KEYS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODEID",
              "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_USER", "SLURM_JOB_NAME",
              "SLURM_JOB_PARTITION")
# Kubernetes' downward API, where the pod sets them (docs/deploy/README.md).
POD_KEYS = ("POD_NAME", "POD_NAMESPACE")
JOB_KEYS = (*TORCH_KEYS, *SLURM_KEYS, *POD_KEYS)

_TASKS = re.compile(r"(\d{1,6})(?:\(x(\d{1,6})\))?", re.ASCII)


def safe_name(text: str) -> str:
    """``text`` fit for a folder name and a label: [A-Za-z0-9._-], no leading dot, at
    most 64 characters; a short hash of the original is added when anything changed."""
    cleaned = _UNSAFE.sub("_", text).lstrip(".")
    if cleaned == text and 0 < len(text) <= MAX_NAME:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return f"{cleaned[:MAX_NAME - 9] or 'job'}-{digest}"


def decimal_number(value: str | None, max_digits: int = MAX_ID_DIGITS) -> int | None:
    """A count or an id a process wrote: ASCII digits only, at most ``max_digits`` of
    them; anything else (a sign, a space, ``'²'``, whose ``isdigit()`` is true and
    ``int()`` raises, 10^30, an empty value) is None. Total: never raises."""
    if not value or len(value) > max_digits or not (value.isascii() and value.isdigit()):
        return None
    return int(value)



def _text(value: str | None) -> str | None:
    """A value kept as data (never a path or a label): bounded, printable."""
    if not value:
        return None
    kept = "".join(c if c.isprintable() else "?" for c in value[:MAX_VALUE])
    return kept + "..." if len(value) > MAX_VALUE else kept


def rank_number(env: dict[str, str]) -> int | None:
    """The process's rank: ``RANK``, else ``SLURM_PROCID`` (ranks started by srun)."""
    rank = decimal_number(env.get("RANK"))
    return rank if rank is not None or "RANK" in env else decimal_number(env.get("SLURM_PROCID"))


def world_size(env: dict[str, str]) -> int | None:
    """The job's ranks: ``WORLD_SIZE``, else ``SLURM_NTASKS`` (srun)."""
    size = decimal_number(env.get("WORLD_SIZE"))
    return size if size is not None or "RANK" in env else decimal_number(env.get("SLURM_NTASKS"))


def local_rank(env: dict[str, str]) -> int | None:
    """The rank on this node: ``LOCAL_RANK``."""
    return decimal_number(env.get("LOCAL_RANK"))


def local_world_size(env: dict[str, str]) -> int:
    """The ranks on this node the launcher says it starts (``LOCAL_WORLD_SIZE``), 0 when
    not said (or beyond 10^5: not a node's ranks)."""
    return decimal_number(env.get("LOCAL_WORLD_SIZE"), 5) or 0


def slurm_tasks_here(env: dict[str, str]) -> int | None:
    """How many tasks of the srun step run on this node: this node's entry
    (``SLURM_NODEID``) of ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: 2 on each of the
    first three nodes, 1 on the fourth)."""
    node = decimal_number(env.get("SLURM_NODEID"))
    text = env.get("SLURM_STEP_TASKS_PER_NODE", "")
    if node is None or not text or len(text) > 1024:
        return None
    for part in text.split(","):
        match = _TASKS.fullmatch(part)
        if match is None:
            return None
        count, times = int(match[1]), int(match[2] or 1)
        if node < times:
            return count
        node -= times
    return None


def slurm_job(env: dict[str, str]) -> dict[str, Any] | None:
    """The Slurm job a rank belongs to (None: not started by Slurm): its id, step (None:
    the batch step), user, name and partition as Slurm set them."""
    job_id = decimal_number(env.get("SLURM_JOB_ID"))
    if job_id is None:
        return None
    return {"job_id": job_id, "step_id": decimal_number(env.get("SLURM_STEP_ID")),
            "user": _text(env.get("SLURM_JOB_USER")),
            "job_name": _text(env.get("SLURM_JOB_NAME")),
            "partition": _text(env.get("SLURM_JOB_PARTITION"))}


def pod(env: dict[str, str], pod_uid: str | None) -> dict[str, str | None] | None:
    """The Kubernetes pod a rank runs in (None: none): its UID (from a cgroup a kubelet
    made) and its name and namespace (from the downward API's variables, where set).
    Without the UID there is no pod: any process can set the variables, and a pod's
    name and namespace label its metrics."""
    if pod_uid is None:
        return None
    return {"uid": pod_uid, "name": _text(env.get("POD_NAME")),
            "namespace": _text(env.get("POD_NAMESPACE"))}


def scheduler_fields(env: dict[str, str], pod_uid: str | None) -> dict[str, Any]:
    """What the schedulers say of the job, for its record and session_info.job."""
    return {"slurm": slurm_job(env), "pod": pod(env, pod_uid)}


def job_identity(rank_env: dict[str, str], launcher: str) -> tuple[str, str]:
    """(the job's name, where it came from) given a rank's job variables; ``launcher``
    names the job when they do not (e.g. ``python-1234``)."""
    slurm = slurm_job(rank_env)
    if slurm is not None:
        step = slurm["step_id"]
        return (safe_name(f"slurm-{slurm['job_id']}" + (f".{step}" if step is not None else "")),
                "SLURM_JOB_ID")
    run_id = rank_env.get("TORCHELASTIC_RUN_ID", "")
    if run_id not in NO_RUN_ID:
        return safe_name(run_id), "TORCHELASTIC_RUN_ID"
    addr, port = rank_env.get("MASTER_ADDR", ""), rank_env.get("MASTER_PORT", "")
    if addr and port:
        return safe_name(f"{addr}-{port}"), "MASTER_ADDR:MASTER_PORT"
    return safe_name(launcher), "launcher"
