"""Which training jobs run on the node: ranks found in a process scan, grouped into jobs.

A *rank* is a Python process with PyTorch mapped whose ancestors are not ranks
themselves (DataLoader workers and other children of a rank are not ranks). A
Python process with PyTorch but without ``RANK`` whose descendants carry ``RANK``
is a *launcher* (torchrun, deepspeed's launcher): its topmost descendants with
``RANK`` are its ranks, and it waits for them all (``expected``) before its job
is attached. Ranks that ``srun`` started (no launcher, no ``RANK``: their rank is
``SLURM_PROCID``) wait for the step's tasks on this node
(``SLURM_STEP_TASKS_PER_NODE``). Ranks are grouped into one job only when they
share their owner (the effective uid) and their pid namespace, and then by, in
order (perfmon.parsers.job_identity):

1. ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` (the same on every node of the job);
2. ``TORCHELASTIC_RUN_ID`` (torchrun's rendezvous id, the same on every node;
   ``none``, torchrun's default without ``--rdzv-id``, does not count);
3. ``MASTER_ADDR:MASTER_PORT`` (the same on every node of a job);
4. the nearest common launcher: the topmost rank or launcher itself.

A job's environment is its user's to set, so another user who copies a run id
or a master address into a process of theirs makes a job of their own (another
key, folder and label set), never a rank of someone else's job.

Only those environment variables are read (perfmon.probes.procfs.ENVIRON_KEYS).
The job's name (its id in labels and folder names) comes from the same
source, reduced to ``[A-Za-z0-9._-]`` and 64 characters (a hash added when
anything was changed), since a job controls its environment.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from perfmon.parsers.job_identity import (
    job_identity,
    local_world_size,
    rank_number,
    slurm_tasks_here,
)
from perfmon.probes.discovery import Snapshot

# Launchers known by name: one is a launcher even before its ranks exist (it has
# PyTorch loaded from its start, and would look like a rank until they do).
_LAUNCHER = re.compile(r"(^|/)(torchrun|deepspeed)$|^torch\.distributed\.(run|launch)$"
                       r"|^deepspeed\.launcher(\.launch)?$")


@dataclass
class FoundJob:
    """One job's ranks on this node as one scan saw them."""

    key: tuple[object, ...]
    name: str
    id_from: str  # TORCHELASTIC_RUN_ID, MASTER_ADDR:MASTER_PORT or launcher
    uid: int  # the owner of every process of the job
    ranks: list[int] = field(default_factory=list)  # pids with PyTorch, rank order
    rank_of: dict[int, int | None] = field(default_factory=dict)  # pid -> RANK
    expected: int = 0  # ranks this node will have (those with RANK, loaded or not)
    launchers: list[int] = field(default_factory=list)
    container_id: str | None = None
    pod_uid: str | None = None  # the Kubernetes pod's, from the cgroup path
    pid_namespace: str | None = None  # when not the agent's
    env: dict[str, str] = field(default_factory=dict)  # a rank's job variables

    @property
    def ready(self) -> bool:
        """Every expected rank has PyTorch loaded."""
        return bool(self.ranks) and len(self.ranks) >= self.expected


def is_launcher_command(argv: list[str]) -> bool:
    """torchrun, ``python -m torch.distributed.run``, deepspeed and its launcher module."""
    return any(_LAUNCHER.search(arg) for arg in argv[:3])


def _job_key(snapshot: Snapshot, rank_env: dict[str, str], root: int
             ) -> tuple[tuple[object, ...], str, str]:
    """(the job's key, name, id_from). The key holds the owner and the pid namespace, so
    that a variable copied by another user (or another container) never joins jobs."""
    info = snapshot.processes[root]
    name, id_from = job_identity(rank_env, f"{info.comm}-{root}")
    _, namespace = snapshot.container(root)
    scope = (info.uid, namespace or "")
    if id_from == "SLURM_JOB_ID":
        key: tuple[object, ...] = ("slurm", *scope, rank_env["SLURM_JOB_ID"],
                                   rank_env.get("SLURM_STEP_ID"))
    elif id_from == "TORCHELASTIC_RUN_ID":
        key = ("run", *scope, rank_env["TORCHELASTIC_RUN_ID"])
    elif id_from == "MASTER_ADDR:MASTER_PORT":
        key = ("master", *scope, rank_env["MASTER_ADDR"], rank_env["MASTER_PORT"])
    else:
        key = ("launcher", root, info.start_ticks)
    return key, name, id_from


def find_jobs(snapshot: Snapshot, accepts: Callable[[str, int], bool],
              skipped: Callable[[int, Exception], None]) -> list[FoundJob]:
    """The jobs of a scan. ``accepts(command line, uid)``: the include/exclude rules,
    applied to every candidate rank and launcher. A process whose data cannot be read
    into a job is that process's problem: ``skipped(pid, error)`` is told and the scan
    goes on with every other job (a user controls what their processes hold)."""
    candidates = {
        pid for pid, info in snapshot.processes.items()
        if snapshot.has_torch(pid) and accepts(" ".join(snapshot.cmdline(pid)), info.uid)
    }
    roots = sorted(p for p in candidates
                   if not any(a in candidates for a in snapshot.ancestors(p)))
    jobs: dict[tuple[object, ...], FoundJob] = {}
    for root in roots:
        try:
            _add_root(snapshot, candidates, root, jobs)
        except Exception as err:  # any bug on data a user controls: that job's alone
            skipped(root, err)
    for job in jobs.values():
        job.rank_of = {pid: rank_number(snapshot.environ(pid)) for pid in job.ranks}
        job.ranks.sort(key=lambda pid: (_sort_rank(job.rank_of[pid]), pid))
    return list(jobs.values())


def _add_root(snapshot: Snapshot, candidates: set[int], root: int,
              jobs: dict[tuple[object, ...], FoundJob]) -> None:
    """The ranks and launcher below one topmost candidate, added to their job."""
    ranks, expected, launcher, srun_task = [root], 1, None, False
    env = snapshot.environ(root)
    if "RANK" not in env:
        below = [d for d in snapshot.descendants(root) if snapshot.is_python(d)]
        with_rank = {d for d in below if "RANK" in snapshot.environ(d)}
        top = [d for d in with_rank
               if not any(a in with_rank for a in snapshot.ancestors(d))]
        if top or is_launcher_command(snapshot.cmdline(root)):
            launcher = root
            ranks = [d for d in top if snapshot.has_torch(d) and d in candidates]
            # All the node's ranks: the launcher may not have started them all yet.
            expected = max([len(top), 1, *(local_world_size(snapshot.environ(d))
                                           for d in top)])
            env = snapshot.environ(top[0]) if top else env
        elif "SLURM_PROCID" in env:  # a task srun started: the step's tasks on this node
            srun_task, expected = True, slurm_tasks_here(env) or 1
    key, name, id_from = _job_key(snapshot, env, root)
    job = jobs.get(key)
    if job is None:
        ids, namespace = snapshot.container(root)
        job = jobs[key] = FoundJob(key, name, id_from, snapshot.processes[root].uid,
                                   container_id=ids.container_id, pod_uid=ids.pod_uid,
                                   pid_namespace=namespace, env=env)
    job.ranks.extend(ranks)
    # (srun's tasks each say how many the node has: counted once)
    job.expected = max(job.expected, expected) if srun_task else job.expected + expected
    if launcher is not None:
        job.launchers.append(launcher)


def _sort_rank(rank: int | None) -> int:
    return rank if rank is not None else 1 << 31
