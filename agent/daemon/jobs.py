"""Which training jobs run on the node: ranks found in a process scan, grouped into jobs.

**Ranks are the processes that train, whatever launched them**
(perfmon.probes.discovery.training_ranks). Each topmost Python process with
PyTorch (the *root*) and its descendants are looked at:

- A process whose environment gives its rank (``RANK``: torchrun, deepspeed and
  the launchers that set it) is a rank; DataLoader workers, which inherit it, are not
  (the topmost with ``RANK`` are the ranks).
- A process that is in a torch.distributed process group (a thread of gloo's or
  NCCL's), or has run a backward pass on a GPU (autograd's ``pt_autograd_N``
  thread), or reads batches from DataLoader workers of its own (children whose main
  thread PyTorch names ``pt_data_worker``) trains: it is a rank whatever started it
  (``mp.spawn``/``torch.multiprocessing`` children, forked children, Lightning's and
  Accelerate's launchers). A DataLoader worker, multiprocessing's fork server and
  resource tracker never are.
- A root that does not train itself while descendants do is their *launcher*
  (``mp.spawn``'s parent waits in ``join``; torchrun): its ranks are the topmost of
  them, and it waits for them all (``expected``: the node's ``LOCAL_WORLD_SIZE`` or
  as many as there are) before its job is attached. A root in a process group whose
  descendants are in one too is a rank with them (Lightning's ``ddp``: rank 0 starts
  the others).
- A root whose descendants with PyTorch say none of this (older PyTorch; spawn
  children still importing it) is the rank when its main thread is busy while they
  are there (it computes; they work for it); when it is idle they are its ranks,
  attached after ``rank_wait_s`` unless they say sooner. A root with no such
  descendant is the rank, as is one whose only ones are DataLoader workers; not a
  launcher whose ranks have exited (unless it is seen training itself since).

Why these signals: a launcher and a rank with DataLoader workers look alike in
``/proc`` (a Python parent with PyTorch, children with PyTorch, started by
multiprocessing, with the same environment), and what tells them apart is whether
the parent itself trains. What the agent can see of that without probing: the
threads PyTorch names while it trains (a process group's, autograd's device
threads), the ``pt_data_worker`` name PyTorch gives DataLoader workers (2.2+), and
the main thread's CPU time (/proc/PID/schedstat): a parent blocked in ``join``
uses none. A parent seen training stays a rank.

Ranks with no ``RANK`` under a launcher (``mp.spawn``'s children) are numbered by
the order they started (then pid): ``mp.spawn`` starts them in the order of the
index it passes, which is what such scripts use as the rank. Ranks that ``srun``
started (no launcher, no ``RANK``: their rank is ``SLURM_PROCID``) wait for the
step's tasks on this node (``SLURM_STEP_TASKS_PER_NODE``). Include/exclude rules
apply to the command line of a root; its descendants of the same owner are in with
it (a spawn child's command line names no script). Ranks are grouped into one job
only when they share their owner (the effective uid) and their pid namespace, and
then by, in order (perfmon.parsers.job_identity), the ranks' variables (the first
rank that has them, else the root's):

1. ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` (the same on every node of the job);
2. ``TORCHELASTIC_RUN_ID`` (torchrun's rendezvous id, the same on every node;
   ``none``, torchrun's default without ``--rdzv-id``, does not count);
3. ``MASTER_ADDR:MASTER_PORT`` (the same on every node of a job; ``mp.spawn``'s
   children have them when their parent set them before starting them);
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

from perfmon.parsers.job_identity import job_identity, rank_number, slurm_tasks_here
from perfmon.probes.discovery import Snapshot, training_ranks

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
    rank_of: dict[int, int | None] = field(default_factory=dict)  # pid -> its rank
    numbered: bool = False  # ranks without RANK: rank_of is their start order
    expected: int = 0  # ranks this node will have (those with RANK, loaded or not)
    launchers: list[int] = field(default_factory=list)
    started: dict[int, int] = field(default_factory=dict)  # its pids' start ticks
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
    applied to every candidate rank and launcher (a descendant of an accepted one of
    the same owner is in with it). A process whose data cannot be read into a job is
    that process's problem: ``skipped(pid, error)`` is told and the scan goes on with
    every other job (a user controls what their processes hold)."""
    candidates = _candidates(snapshot, accepts)
    roots = sorted(p for p in candidates
                   if not any(a in candidates for a in snapshot.ancestors(p)))
    jobs: dict[tuple[object, ...], FoundJob] = {}
    for root in roots:
        try:
            _add_root(snapshot, candidates, root, jobs)
        except Exception as err:  # any bug on data a user controls: that job's alone
            skipped(root, err)
    for job in jobs.values():
        if job.numbered:  # (no RANK: in the order they started)
            started = sorted(job.ranks, key=lambda p: (snapshot.processes[p].start_ticks, p))
            job.rank_of = {pid: n for n, pid in enumerate(started)}
        else:
            job.rank_of = {pid: rank_number(snapshot.environ(pid)) for pid in job.ranks}
        job.ranks.sort(key=lambda pid: (_sort_rank(job.rank_of[pid]), pid))
    return list(jobs.values())


def _candidates(snapshot: Snapshot, accepts: Callable[[str, int], bool]) -> set[int]:
    """Python processes with PyTorch (not DataLoader workers) the rules accept, by their
    own command line or as descendants of an accepted one of the same owner."""
    torch = {pid for pid in snapshot.processes
             if snapshot.has_torch(pid) and not snapshot.is_data_worker(pid)}
    accepted = {pid for pid in torch
                if accepts(" ".join(snapshot.cmdline(pid)), snapshot.processes[pid].uid)}
    for pid in torch - accepted:
        uid = snapshot.processes[pid].uid
        if any(a in accepted and snapshot.processes[a].uid == uid
               for a in snapshot.ancestors(pid)):
            accepted.add(pid)
    return accepted


def _add_root(snapshot: Snapshot, candidates: set[int], root: int,
              jobs: dict[tuple[object, ...], FoundJob]) -> None:
    """The ranks and launcher below one topmost candidate, added to their job."""
    env = snapshot.environ(root)
    tree = training_ranks(snapshot, root, candidates,
                          is_launcher_command(snapshot.cmdline(root)))
    expected, srun_task = tree.expected, False
    if (tree.decided and tree.ranks == [root] and "RANK" not in env
            and "SLURM_PROCID" in env):  # a task srun started: the step's tasks on this node
        srun_task, expected = True, slurm_tasks_here(env) or 1
    # The job's identity from its ranks (a launcher's children), else the root's.
    named_by = tree.ranks if tree.named_by is None else tree.named_by
    envs = [snapshot.environ(p) for p in named_by if p != root] + [env]
    id_env = next((e for e in envs if job_identity(e, "")[1] != "launcher"), envs[0])
    key, name, id_from = _job_key(snapshot, id_env, root)
    job = jobs.get(key)
    if job is None:
        ids, namespace = snapshot.container(root)
        job = jobs[key] = FoundJob(key, name, id_from, snapshot.processes[root].uid,
                                   container_id=ids.container_id, pod_uid=ids.pod_uid,
                                   pid_namespace=namespace, env=id_env)
    job.ranks.extend(tree.ranks)
    job.numbered |= tree.numbered
    # (srun's tasks each say how many the node has: counted once)
    job.expected = max(job.expected, expected) if srun_task else job.expected + expected
    if tree.launcher is not None:
        job.launchers.append(tree.launcher)
    job.started.update({p: snapshot.processes[p].start_ticks
                        for p in (*tree.ranks, root)})


def _sort_rank(rank: int | None) -> int:
    return rank if rank is not None else 1 << 31
