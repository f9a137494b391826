"""The target processes: who they are, what they loaded, and their memory.

Measures: identity and loaded libraries of a training process (from
/proc/PID/{maps,cmdline,environ,status}) and its resident memory (psutil and
/proc/PID/status), sampled at 1 Hz by default (``MemorySource``). Cost: a few /proc reads per
sample. Needs: read access to the target's /proc files, which for another
user's process means root or CAP_SYS_PTRACE. Linux only.

Only the environment variables in ENVIRON_KEYS are ever read from a target;
the rest of its environment (which may hold secrets) is dropped while parsing.
"""

from __future__ import annotations

import os
import pwd
import re
import time
from dataclasses import dataclass, replace
from stat import S_ISDIR
from typing import Any

import psutil
from perfmon.parsers import procfs
from perfmon.parsers.events import ProcessSample, Record
from perfmon.parsers.job_identity import (
    JOB_KEYS,
    job_identity,
    rank_number,
    safe_name,
    scheduler_fields,
)
from perfmon.probes.errors import (
    NoSuchProcess,
    PrivilegeError,
    ProbeError,
    UnsuitableTarget,
    process_errors,
)
from perfmon.probes.sampler import Source, monotonic_ns

# Which job and rank a process is (the node service groups ranks by these; Slurm's and
# the downward API's few for the job's record), and which GPUs it sees.
ENVIRON_KEYS = ("CUDA_VISIBLE_DEVICES", *JOB_KEYS)
TORCH_LIBRARY_PREFIX = "libtorch_cpu"
_PYTHON_EXE = re.compile(r"^(python|pypy)[0-9.]*[a-z]*$")


@dataclass(frozen=True)
class TargetProcess:
    pid: int
    name: str
    cmdline: list[str]
    environ: dict[str, str]
    torch_library: str  # path as the target sees it (inside its mount namespace)
    create_time: float  # wall-clock seconds: for showing and dating, never for identity
    torch_mapping: procfs.MappedFile | None = None  # its first mapping (for map_files)
    uid: int = -1  # its effective uid (the owner of its /proc entry); -1: not read
    # Clock ticks after boot (/proc/PID/stat field 22): with the pid, names one process
    # for good. create_time adds the kernel's btime, which moves by a second when the
    # wall clock is slewed, so comparing it took live ranks for exited ones.
    start_ticks: int = -1
    # Its rank by start order among its launcher's ranks, where its environment gives
    # none (mp.spawn's children: perfmon.probes.discovery.training_ranks).
    order_rank: int | None = None
    # "<comm>-<pid>" of the launcher that started it: the job's name where its variables
    # name none (as the node service names it).
    launcher: str | None = None

    @property
    def rank(self) -> int | None:
        rank = rank_number(self.environ)
        return rank if rank is not None else self.order_rank

    @property
    def start_monotonic_ns(self) -> int:
        """When it started, on CLOCK_MONOTONIC (its start time is the wall clock's)."""
        return monotonic_ns() - int((time.time() - self.create_time) * 1e9)

    @property
    def shown_cmdline(self) -> list[str]:
        """The command line as the summary keeps it: each argument and the whole bounded."""
        shown: list[str] = []
        total = 0
        for arg in self.cmdline:
            if total >= CMDLINE_TOTAL_CHARS:
                shown.append(f"... ({len(self.cmdline) - len(shown)} more arguments)")
                break
            kept = arg if len(arg) <= CMDLINE_ARG_CHARS else (
                arg[:CMDLINE_ARG_CHARS] + f"... ({len(arg)} characters)")
            shown.append(kept)
            total += len(kept)
        return shown


# Upper bounds on what is read from a target's /proc files: a job controls the
# size of its argv and environment (up to a quarter of its stack limit, which
# may be unlimited) and, within vm.max_map_count, of its maps.
_READ_LIMITS = {"cmdline": 1 << 20, "environ": 4 << 20, "maps": 64 << 20, "status": 64 << 10,
                "schedstat": 256, "cgroup": 64 << 10, "stat": 4096}
# What of a command line is kept in the summary (each argument, and in all).
CMDLINE_ARG_CHARS = 4096
CMDLINE_TOTAL_CHARS = 65536
# A tree that does not say which of its processes train yet is looked at this many
# times, this far apart (a parent's CPU time over the interval tells).
RESOLVE_LOOKS = 4
RESOLVE_INTERVAL_S = 0.5


def read_proc(pid: int, name: str, binary: bool = False, proc: str = "/proc") -> str | bytes:
    """``/proc/<pid>/<name>``, at most its size limit; NoSuchProcess or PrivilegeError.
    ``proc``: another root for /proc (captured files)."""
    path = f"{proc}/{pid}/{name}"
    with process_errors(pid, reading=path), open(path, "rb") as f:
        data = f.read(_READ_LIMITS[name])
    return data if binary else data.decode("utf-8", "replace")


def thread_ids(pid: int) -> list[int]:
    """The thread ids of a process ([] when it is gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit()]
    except OSError:
        return []


def thread_group(tid: int) -> int | None:
    """The process (tgid) of thread ``tid``, from /proc/TID/status; None when it is gone."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def user_name(uid: int) -> str:
    """The name of user ``uid`` on this node (the uid itself where the node has none for
    it, e.g. a container's user)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


# Where the cgroup hierarchies are mounted: v2 (or v1's one folder per hierarchy) under
# the first, v2 under the second on a hybrid host.
CGROUP_MOUNTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")


def _made_by_root(folder: str) -> bool:
    """Whether the cgroup ``folder`` (relative to the mounts) is root's: a kubelet's,
    not one that a user made in a subtree delegated to them (those folders are the
    user's). Never followed through a link."""
    for mount in CGROUP_MOUNTS:
        try:
            st = os.lstat(os.path.join(mount, folder))
        except OSError:
            continue
        return S_ISDIR(st.st_mode) and st.st_uid == 0
    return False


def believed(ids: procfs.ContainerIds) -> procfs.ContainerIds:
    """``ids`` without the pod where its cgroup folder is not root's."""
    if ids.pod_cgroup is None or _made_by_root(ids.pod_cgroup):
        return ids
    return replace(ids, pod_uid=None, pod_cgroup=None)


def container_of(pid: int) -> procfs.ContainerIds:
    """The container id and Kubernetes pod UID of a process, from its cgroup path (None
    each when it has none, or is gone; no pod where a user, not a kubelet, made it)."""
    try:
        text = read_proc(pid, "cgroup")
    except (NoSuchProcess, PrivilegeError):
        return procfs.ContainerIds()
    return believed(procfs.container_ids(str(text)))


def target_job(target: TargetProcess, host: str) -> dict[str, Any]:
    """The job a process belongs to, as the node service would name it from the same
    variables (perfmon.agent.daemon.jobs): ``session_info.job`` of ``attach``."""
    name, id_from = job_identity(target.environ, target.launcher or f"{target.name}-{target.pid}")
    ids = container_of(target.pid)
    return {"id": name, "name": name, "id_from": id_from, "host": host, "uid": target.uid,
            "user": safe_name(user_name(target.uid)), "container_id": ids.container_id,
            **scheduler_fields(target.environ, ids.pod_uid)}


def inspect_process(pid: int) -> TargetProcess:
    """Identity of one process that must be a Python process with PyTorch loaded.

    Raises NoSuchProcess, PrivilegeError or UnsuitableTarget, each naming the pid.
    """
    if pid <= 0:
        raise NoSuchProcess(f"pid {pid}: not a valid process id")
    with process_errors(pid):
        proc = psutil.Process(pid)
        name, create_time, state = proc.name(), proc.create_time(), proc.status()
        uid = proc.uids().effective
    if state == psutil.STATUS_ZOMBIE:
        raise UnsuitableTarget(
            f"pid {pid} ({name}): is a zombie (it exited; its parent has not reaped it)")
    start_ticks = _stat(pid).start_ticks
    cmdline = procfs.parse_cmdline(read_proc(pid, "cmdline", binary=True))  # type: ignore[arg-type]
    mappings = procfs.parse_maps(read_proc(pid, "maps"))  # type: ignore[arg-type]
    exe = os.path.basename(cmdline[0]) if cmdline else name
    is_python = (
        _PYTHON_EXE.match(name) is not None
        or _PYTHON_EXE.match(exe) is not None
        or procfs.mapped_library(mappings, "libpython") is not None
    )
    if not is_python:
        raise UnsuitableTarget(f"pid {pid} ({name}): not a Python process")
    torch_mapping = procfs.mapped_file(mappings, TORCH_LIBRARY_PREFIX)
    if torch_mapping is None:
        raise UnsuitableTarget(
            f"pid {pid} ({name}): PyTorch is not loaded "
            f"(no {TORCH_LIBRARY_PREFIX}.so in /proc/{pid}/maps)"
        )
    environ = procfs.parse_environ(
        read_proc(pid, "environ", binary=True), ENVIRON_KEYS  # type: ignore[arg-type]
    )
    return TargetProcess(pid, name, cmdline, environ, torch_mapping.path, create_time,
                         torch_mapping, uid, start_ticks)


def resolve_targets(pid: int) -> list[TargetProcess]:
    """The training processes behind a pid, ordered by rank: the node service's rule
    (perfmon.probes.discovery.training_ranks) applied to the pid's tree.

    - A launcher (torchrun, deepspeed, mpirun, ``mp.spawn``'s parent: a process whose
      descendants train while it does not) expands to the topmost of them; ranks
      without RANK are numbered by start order. DataLoader workers are never ranks.
    - A PyTorch process that trains (or has no descendant with PyTorch) is itself the
      target.
    - Anything else (a shell wrapper, srun) expands to what its topmost descendants with
      PyTorch expand to; with none, the pid's own error is raised.

    Where the tree does not say yet (a parent whose children with PyTorch name neither
    a process group nor DataLoader workers), it is looked at again for up to
    ``RESOLVE_LOOKS`` x ``RESOLVE_INTERVAL_S``: a busy parent is the rank, an idle one
    the launcher of its children.
    """
    from perfmon.probes.discovery import ProcessScan, training_ranks  # (it imports this)

    with process_errors(pid):
        psutil.Process(pid)  # NoSuchProcess or PrivilegeError, naming the pid
    scan = ProcessScan(pid)
    for look in range(RESOLVE_LOOKS):
        snapshot = scan.scan(time.monotonic())
        torch = {p for p in snapshot.processes
                 if snapshot.has_torch(p) and not snapshot.is_data_worker(p)}
        roots = [p for p in sorted(torch) if not any(a in torch for a in snapshot.ancestors(p))]
        trees = [training_ranks(snapshot, root, torch) for root in roots]
        if all(t.state != "unknown" for t in trees) or look == RESOLVE_LOOKS - 1:
            break
        time.sleep(RESOLVE_INTERVAL_S)
    found: list[TargetProcess] = []
    for tree in trees:
        launcher = snapshot.processes[tree.launcher] if tree.launcher is not None else None
        for n, rank in enumerate(tree.ranks):
            try:
                target = inspect_process(rank)
            except (NoSuchProcess, UnsuitableTarget):
                if rank == pid:
                    raise
                continue
            found.append(replace(
                target, order_rank=n if tree.numbered else None,
                launcher=f"{launcher.comm}-{launcher.pid}" if launcher is not None else None))
    if not found:
        return [inspect_process(pid)]  # (not Python, or no PyTorch: its own error)
    return sorted(found, key=lambda t: (t.rank is None, t.rank, t.pid))


def _stat(pid: int, proc: str = "/proc") -> procfs.ProcStat:
    """/proc/PID/stat parsed; NoSuchProcess or PrivilegeError (ValueError: not a stat)."""
    return procfs.parse_stat(read_proc(pid, "stat", proc=proc))  # type: ignore[arg-type]


def process_state(target: TargetProcess, proc: str = "/proc") -> str:
    """"alive", "zombie" (exited, not reaped), "gone" (reaped, or its pid reused: another
    start time) or "unknown" (cannot be read now: look again later). Never the boot
    time (btime), which moves with the wall clock: ``proc`` is another root for /proc."""
    try:
        stat = _stat(target.pid, proc)
    except NoSuchProcess:
        return "gone"
    except (ProbeError, ValueError):
        return "unknown"
    if stat.start_ticks != target.start_ticks:
        return "gone"
    return "zombie" if stat.state == "Z" else "alive"


def is_running(target: TargetProcess) -> bool:
    """True while the same process (pid and start time) is alive and not a zombie."""
    return process_state(target) == "alive"


def agent_capabilities() -> int:
    """The effective capability set of this agent process."""
    with open("/proc/self/status") as f:
        return procfs.parse_status(f.read()).effective_capabilities


class MemorySource(Source):
    """Resident memory of each target, every ``interval_s`` (drift-free schedule).

    Records: ``process`` (perfmon.parsers.events.ProcessSample). A read that fails
    because a rank exited is counted (``read_errors``), not raised.
    """

    name = "memory"

    def __init__(self, pids: list[int], interval_s: float = 1.0) -> None:
        super().__init__()
        self.pids = pids
        self.interval_ns = int(interval_s * 1e9)
        self.samples = 0
        self.errors = 0
        self._start_ns = 0
        self._next_ns = 0
        self._first: list[Record] = []

    def _start(self) -> None:
        self._start_ns = monotonic_ns()
        self._next_ns = self._start_ns + self.interval_ns
        # One sample now, before the session's window opens: its first log interval
        # (which may end before the first poll) has a memory figure.
        self._first = self._sample(self._start_ns)

    def _poll(self) -> list[Record]:
        first, self._first = self._first, []
        now = monotonic_ns()
        if now < self._next_ns:
            return first
        # Drift-free: next = start + k * interval, skipping slots missed while busy.
        k = (now - self._start_ns) // self.interval_ns + 1
        self._next_ns = self._start_ns + k * self.interval_ns
        return first + self._sample(now)

    def _sample(self, now: int) -> list[Record]:
        samples: list[Record] = []
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/status", "rb") as f:
                    status = procfs.parse_status(
                        f.read(_READ_LIMITS["status"]).decode("utf-8", "replace"))
            except OSError:
                self.errors += 1
                continue
            # CPU time and run-queue wait: a rank starved of CPU (a noisy neighbour)
            # shows here; the kernel may lack schedstats (None then).
            try:
                with open(f"/proc/{pid}/schedstat", "rb") as f:
                    sched = procfs.parse_schedstat(
                        f.read(_READ_LIMITS["schedstat"]).decode("ascii", "replace"))
            except OSError:
                sched = None
            if status.rss_bytes is not None:
                samples.append(ProcessSample(now, pid, status.rss_bytes, status.peak_rss_bytes,
                                             *(sched or (None, None))))
        self.samples += len(samples)
        return samples

    def quality(self) -> dict[str, Any]:
        return {"samples": self.samples, "read_errors": self.errors}

    def _close(self) -> None:
        pass
