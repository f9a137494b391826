"""The node's processes as the job finder sees them: a cheap walk of /proc, and which of
them train (``training_ranks``: the rule the node service, ``run`` and ``attach --pid``
share).

Measures: every process's parent and start time (/proc/PID/stat), which of
them are Python (the executable's name) and which of those have PyTorch mapped
(/proc/PID/maps), and, for those, the few job variables of their environment
(perfmon.probes.procfs.ENVIRON_KEYS). For the Python processes with PyTorch of a
tree that holds more than one, what says which of them train: the names of
their threads (/proc/PID/task/TID/comm) and, where those do not tell, the CPU their
main thread wanted between two scans (/proc/PID/schedstat: its time on a CPU and its
time runnable, waiting for one: a busy process on a loaded node gets a small share of a
core but wants the rest). Cost: one stat read
per process per scan; an executable's name once per process; maps once per
Python process that has PyTorch, and with a back-off (at most once a minute) for
those that have not loaded it yet; environments once per process; thread names
of the PyTorch processes of trees with more than one, each scan until one says
it trains (then never again); one schedstat read per such tree's root per scan
while nothing else tells. Needs: root (or CAP_SYS_PTRACE) to read other users'
processes; what cannot be read is passed over.

Everything is keyed by (pid, start time, comm): a pid reused by a new process,
or a process that exec'd another program, is a new process here.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from perfmon.parsers import procfs
from perfmon.parsers.job_identity import local_world_size
from perfmon.probes.procfs import ENVIRON_KEYS, TORCH_LIBRARY_PREFIX, believed

_PYTHON_EXE = re.compile(r"^(python|pypy)[0-9.]*[a-z]*$")
_MAPS_LIMIT = 64 << 20
_ENVIRON_LIMIT = 4 << 20
_SMALL_LIMIT = 64 << 10
# A Python process without PyTorch is looked at again after this part of its age
# (it may be importing it), at least every scan and at most every minute.
_RECHECK_AGE_FRACTION = 0.25
_RECHECK_MAX_S = 60.0
# Ancestor chains are followed this far (pid 1 is reached long before).
MAX_DEPTH = 256
# Descendants of one tree looked at: far above any node's ranks and workers.
MAX_DESCENDANTS = 4096
# Processes looked at per scan: far above any node's.
MAX_PROCESSES = 1 << 17
# Threads whose names are read per process and scan.
MAX_THREADS = 1024

# Threads PyTorch names when a process trains: a torch.distributed process group's
# (gloo's loops, NCCL's watchdog and heartbeat monitor, XCCL's) and autograd's device
# threads (``pt_autograd_<device>``: started by the first backward pass on a GPU or
# another accelerator). Not the TCPStore's (``pt_tcpstore*``): torchrun's agent hosts it.
_TRAINING_THREAD = re.compile(r"^(pt_gloo|gloo_|pt_nccl|pt_xccl|pt_autograd_\d)")
# The main thread's name of a DataLoader worker process (PyTorch 2.2+), and of torchrun.
DATA_WORKER = "pt_data_worker"
TORCHRUN = "pt_elastic"
# multiprocessing's own helper processes (never ranks): the fork server (whose children
# keep its command line) and the resource tracker.
_MP_HELPER = re.compile(r"from multiprocessing\.(forkserver|resource_tracker|"
                        r"semaphore_tracker) import main")
# A child started by multiprocessing's spawn method (mp.spawn, spawn DataLoader workers).
MP_SPAWN_CHILD = "--multiprocessing-fork"
# A main thread busy at least this share of a core trains.
BUSY_SHARE = 0.1
# ... measured over at least this long.
MIN_BUSY_WINDOW_S = 0.2

Key = tuple[int, int, str]  # pid, start ticks, comm


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    start_ticks: int
    comm: str
    uid: int  # the owner of /proc/PID: the process's effective uid

    @property
    def key(self) -> Key:
        return self.pid, self.start_ticks, self.comm


@dataclass
class _Known:
    """What was learnt about one process (kept while it lives)."""

    python: bool
    torch: bool = False
    next_check_s: float = 0.0
    environ: dict[str, str] | None = None
    cmdline: list[str] | None = None
    container: tuple[procfs.ContainerIds, str | None] | None = None  # (ids, pid ns)
    # Why it trains, once seen ("threads", "busy", "data workers"): never asked again.
    trains: str | None = None
    cpu: tuple[float, int] | None = None  # (boot-clock s, main thread CPU + run-queue ns)
    launched_s: float | None = None  # (boot-clock s) last seen launching ranks


def _read(path: str, limit: int) -> bytes | None:
    """A /proc file's first ``limit`` bytes, or None (gone, or not ours to read)."""
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


@dataclass
class Snapshot:
    """One scan's view: processes by pid, their children, and what is known of each."""

    processes: dict[int, ProcessInfo]
    children: dict[int, list[int]] = field(default_factory=dict)
    _known: dict[Key, _Known] = field(default_factory=dict)

    def ancestors(self, pid: int) -> list[int]:
        """The parent, its parent... (nearest first), up to pid 1 or a process gone."""
        chain: list[int] = []
        info = self.processes.get(pid)
        while info is not None and info.ppid > 0 and len(chain) < MAX_DEPTH:
            chain.append(info.ppid)
            info = self.processes.get(info.ppid)
        return chain

    def descendants(self, pid: int, limit: int = 4096) -> list[int]:
        """Children, grandchildren... breadth first, at most ``limit``."""
        found: list[int] = []
        queue = list(self.children.get(pid, ()))
        while queue and len(found) < limit:
            child = queue.pop(0)
            found.append(child)
            queue.extend(self.children.get(child, ()))
        return found

    def _entry(self, pid: int) -> _Known | None:
        info = self.processes.get(pid)
        return self._known.get(info.key) if info is not None else None

    def is_python(self, pid: int) -> bool:
        entry = self._entry(pid)
        return entry is not None and entry.python

    def has_torch(self, pid: int) -> bool:
        entry = self._entry(pid)
        return entry is not None and entry.torch

    def environ(self, pid: int) -> dict[str, str]:
        """The job variables of a Python process's environment ({} when unreadable)."""
        entry = self._entry(pid)
        if entry is None or not entry.python:
            return {}
        if entry.environ is None:
            data = _read(f"/proc/{pid}/environ", _ENVIRON_LIMIT)
            entry.environ = procfs.parse_environ(data, ENVIRON_KEYS) if data else {}
        return entry.environ

    def cmdline(self, pid: int) -> list[str]:
        entry = self._entry(pid)
        if entry is None:
            return []
        if entry.cmdline is None:
            data = _read(f"/proc/{pid}/cmdline", 1 << 20)
            entry.cmdline = procfs.parse_cmdline(data) if data else []
        return entry.cmdline

    def container(self, pid: int) -> tuple[procfs.ContainerIds, str | None]:
        """(its container id and pod UID from its cgroup, its pid namespace when not the
        agent's)."""
        entry = self._entry(pid)
        if entry is None:
            return procfs.ContainerIds(), None
        if entry.container is None:
            cgroup = _read(f"/proc/{pid}/cgroup", _SMALL_LIMIT)
            ids = (believed(procfs.container_ids(cgroup.decode("utf-8", "replace")))
                   if cgroup else procfs.ContainerIds())
            try:
                ns = os.readlink(f"/proc/{pid}/ns/pid")
                own = os.readlink("/proc/self/ns/pid")
            except OSError:
                ns = own = ""
            entry.container = (ids, ns if ns != own else None)
        return entry.container

    def start_s(self, pid: int) -> float:
        """When it started, in seconds after boot (CLOCK_BOOTTIME)."""
        return self.processes[pid].start_ticks / _TICKS

    def is_data_worker(self, pid: int) -> bool:
        """A DataLoader worker process: its main thread is named ``pt_data_worker``."""
        info = self.processes.get(pid)
        return info is not None and info.comm == DATA_WORKER

    def is_mp_helper(self, pid: int) -> bool:
        """multiprocessing's fork server or resource tracker (not the fork server's
        children, which keep its command line)."""
        info = self.processes.get(pid)
        if info is None or not any(_MP_HELPER.search(a) for a in self.cmdline(pid)[:4]):
            return False
        return self.cmdline(info.ppid)[:4] != self.cmdline(pid)[:4]

    def is_mp_child(self, pid: int) -> bool:
        """Started by multiprocessing's spawn method (it may not have loaded PyTorch yet)."""
        return MP_SPAWN_CHILD in self.cmdline(pid)[:8]

    def training_threads(self, pid: int) -> bool:
        """One of its threads is a process group's or autograd's device thread (once
        seen, kept: a process does not stop being a rank)."""
        entry = self._entry(pid)
        if entry is None or not entry.python:
            return False
        if entry.trains == "threads":
            return True
        try:
            tids = os.listdir(f"/proc/{pid}/task")[:MAX_THREADS]
        except OSError:
            return False
        for tid in tids:
            name = _read(f"/proc/{pid}/task/{tid}/comm", 64)
            if name and _TRAINING_THREAD.match(name.decode("utf-8", "replace")):
                entry.trains = "threads"
                return True
        return False

    def launched(self, pid: int) -> float | None:
        """When it was last seen as the launcher of ranks that train (seconds after
        boot), or None."""
        entry = self._entry(pid)
        return entry.launched_s if entry is not None else None

    def saw_launch(self, pid: int) -> None:
        entry = self._entry(pid)
        if entry is not None:
            entry.launched_s = time.clock_gettime(time.CLOCK_BOOTTIME)

    def busy(self, pid: int, since_s: float) -> bool | None:
        """Whether its main thread was busy (wanted ``BUSY_SHARE`` of a core: on a CPU or
        runnable, waiting for one, so that a node's load does not make a busy rank look
        idle) between the last look and now, when the last look came after ``since_s``
        (seconds after boot);
        None while no such window is known yet. Busy once is kept. Where its CPU time
        cannot be read (no schedstat), True: it is taken as training."""
        entry = self._entry(pid)
        if entry is None:
            return None
        if entry.trains == "busy":
            return True
        data = _read(f"/proc/{pid}/schedstat", 256)
        sample = procfs.parse_schedstat(data.decode("ascii", "replace")) if data else None
        if sample is None:
            return True
        now_s = time.clock_gettime(time.CLOCK_BOOTTIME)
        previous = entry.cpu
        if previous is not None and now_s - previous[0] < MIN_BUSY_WINDOW_S:
            return None  # (looked at a moment ago: the window is too short to tell)
        entry.cpu = (now_s, sample[0] + sample[1])
        if previous is None or previous[0] < since_s:
            return None
        share = (entry.cpu[1] - previous[1]) / 1e9 / (now_s - previous[0])
        if share >= BUSY_SHARE:
            entry.trains = "busy"
            return True
        return False


@dataclass
class TreeRanks:
    """The processes that train in one tree: a topmost Python process with PyTorch (the
    root) and its descendants (``training_ranks``)."""

    ranks: list[int]  # pids with PyTorch loaded, in the order they started
    launcher: int | None  # the root, when its descendants train and it does not
    expected: int  # ranks the tree will have: complete once len(ranks) >= expected
    # "decided"; "idle": its root is idle while descendants that may train are there
    # (those are the ranks, taken after a wait); "unknown": not yet told (look again)
    state: str = "decided"
    numbered: bool = False  # ranks with no RANK: numbered by start order
    # Its ranks, and those that carry RANK without PyTorch loaded yet: whose variables
    # name the job (None: ``ranks``).
    named_by: list[int] | None = None

    @property
    def decided(self) -> bool:
        return self.state == "decided"


def training_ranks(snapshot: Snapshot, root: int, eligible: set[int],
                   named_launcher: bool = False) -> TreeRanks:
    """Which processes of ``root``'s tree train. ``eligible``: the pids that may be ranks
    (PyTorch loaded; the service's include/exclude rules); ``named_launcher``: the root
    is a launcher by its command line (torchrun, deepspeed) even before its ranks exist.

    A process trains when its environment gives its rank (``RANK``: torchrun and the
    launchers that set it), when one of its threads is a torch.distributed process
    group's or autograd's device thread (whatever started it: ``mp.spawn``, a fork, a
    Lightning or Accelerate launcher), or when it reads batches from DataLoader workers
    (children whose main thread is ``pt_data_worker``). A DataLoader worker, the fork
    server and the resource tracker never train. Then:

    - a root with ``RANK`` is the rank (its children are its workers);
    - a root in a process group is a rank, and so are those of its descendants that are
      in one themselves (Lightning's ``ddp``: rank 0 starts the others);
    - a root with descendants that train, and not in their process group, is their
      launcher: the topmost of them are the ranks (``mp.spawn``'s parent waits in
      ``join``; torchrun);
    - a root with no descendant that has PyTorch (or is a spawn child loading it), or
      only DataLoader workers, is the rank; unless it launched ranks before (they
      have exited) and has not been seen training itself since: then it has none;
    - otherwise (descendants with PyTorch that say nothing yet, e.g. older PyTorch, or
      spawn children still starting) the root is the rank if its main thread is busy
      (``BUSY_SHARE`` of a core over a scan interval in which they were there: it
      computes while they work for it), else they are the likeliest ranks, and it
      their launcher: "idle" (or "unknown" before the first such interval).
    """
    if "RANK" in snapshot.environ(root):
        return TreeRanks([root], None, 1)
    marked, pending, workers = _walk(snapshot, root)
    named_launcher = named_launcher or snapshot.processes[root].comm == TORCHRUN
    if not (marked or pending or named_launcher):
        # Alone, or with DataLoader workers only: the rank; but a launcher whose ranks
        # have exited (mp.spawn's parent returning from join) is none, unless it is
        # seen training itself since.
        launched_s = snapshot.launched(root)
        if (launched_s is None or snapshot.training_threads(root)
                or snapshot.busy(root, launched_s)):
            return TreeRanks([root], None, 1)
        return TreeRanks([], root, 1)
    in_order = sorted(marked, key=lambda p: (snapshot.processes[p].start_ticks, p))
    if snapshot.training_threads(root):
        ranks = [root, *(d for d in in_order if d in eligible and snapshot.training_threads(d))]
        numbered = len(ranks) > 1 and not any("RANK" in snapshot.environ(d) for d in ranks)
        return TreeRanks(ranks, None, len(ranks), numbered=numbered)
    if marked or named_launcher:
        ranks = [d for d in in_order if d in eligible]
        expected = max([len(marked), len(pending), 1,
                        *(local_world_size(snapshot.environ(d)) for d in marked)])
        numbered = not any("RANK" in snapshot.environ(d) for d in ranks)
        if marked:
            snapshot.saw_launch(root)
        return TreeRanks(ranks, root, expected, numbered=numbered, named_by=in_order)
    if workers:
        return TreeRanks([root], None, 1)
    busy = snapshot.busy(root, max(snapshot.start_s(p) for p in pending))
    if busy:
        return TreeRanks([root], None, 1)
    likely = sorted((p for p in pending if p in eligible),
                    key=lambda p: (snapshot.processes[p].start_ticks, p))
    state = "unknown" if busy is None else "idle"
    if not likely:
        return TreeRanks([root], None, 2, state)
    return TreeRanks(likely, root, len(likely) + 1, state, numbered=True)


def _walk(snapshot: Snapshot, root: int) -> tuple[list[int], list[int], bool]:
    """Below ``root``: (the topmost processes that train, the topmost that may (PyTorch
    loaded or a spawn child, nothing said yet), whether the root reads from DataLoader
    workers of its own). Breadth first, at most MAX_DESCENDANTS looked at."""
    marked: list[int] = []
    pending: list[int] = []
    workers = False
    queue = [(c, False) for c in snapshot.children.get(root, ())]  # (pid, below a pending)
    looked = 0
    while queue and looked < MAX_DESCENDANTS:
        pid, below = queue.pop(0)
        looked += 1
        kids = snapshot.children.get(pid, [])
        if snapshot.is_python(pid) and snapshot.is_data_worker(pid):
            workers |= not below
            continue
        if not snapshot.is_python(pid) or snapshot.is_mp_helper(pid):
            queue += [(k, below) for k in kids]
            continue
        if _trains(snapshot, pid):
            marked.append(pid)
            continue
        if snapshot.has_torch(pid) or snapshot.is_mp_child(pid):
            if not below:
                pending.append(pid)
            below = True
        queue += [(k, below) for k in kids]
    return marked, pending, workers


def _trains(snapshot: Snapshot, pid: int) -> bool:
    """A descendant that trains: its rank in its environment, a process group's or
    autograd's thread, or DataLoader workers of its own (through a fork server too)."""
    if "RANK" in snapshot.environ(pid):
        return True
    if not snapshot.has_torch(pid):
        return False
    if snapshot.training_threads(pid):
        return True
    for child in snapshot.children.get(pid, ()):
        if snapshot.is_data_worker(child) or (snapshot.is_mp_helper(child) and any(
                snapshot.is_data_worker(g) for g in snapshot.children.get(child, ()))):
            return True
    return False


class ProcessScan:
    """Scans /proc, remembering what it learnt of each process between scans.

    ``scope_pid``: only that process and its descendants (``perfmon-agent run``).
    """

    def __init__(self, scope_pid: int | None = None) -> None:
        self.scope_pid = scope_pid
        self._known: dict[Key, _Known] = {}

    def scan(self, now_s: float) -> Snapshot:
        processes = _list_processes()
        snapshot = Snapshot(processes)
        for info in processes.values():
            snapshot.children.setdefault(info.ppid, []).append(info.pid)
        if self.scope_pid is not None:
            scope = {self.scope_pid, *snapshot.descendants(self.scope_pid, MAX_PROCESSES)}
            snapshot.processes = {p: i for p, i in processes.items() if p in scope}
        known: dict[Key, _Known] = {}
        for info in snapshot.processes.values():
            entry = self._known.get(info.key) or _Known(python=_is_python(info.pid))
            if entry.python and not entry.torch and now_s >= entry.next_check_s:
                entry.torch = _has_torch(info.pid)
                age_s = max(0.0, _uptime_s() - info.start_ticks / _TICKS)
                entry.next_check_s = now_s + min(_RECHECK_MAX_S, _RECHECK_AGE_FRACTION * age_s)
            known[info.key] = entry
        # Processes gone are forgotten: memory stays flat over any number of jobs.
        self._known = known
        snapshot._known = known
        return snapshot


_TICKS = os.sysconf("SC_CLK_TCK")


def _uptime_s() -> float:
    data = _read("/proc/uptime", 256)
    return float(data.split()[0]) if data else 0.0


def _list_processes() -> dict[int, ProcessInfo]:
    processes: dict[int, ProcessInfo] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return processes
    for name in names:
        if not name.isdigit() or len(processes) >= MAX_PROCESSES:
            continue
        pid = int(name)
        data = _read(f"/proc/{pid}/stat", 4096)
        if not data:
            continue
        try:
            stat = procfs.parse_stat(data.decode("utf-8", "replace"))
            uid = os.stat(f"/proc/{pid}").st_uid
        except (ValueError, OSError):
            continue
        if stat.state in ("Z", "X"):
            continue  # exited: its parent has not reaped it yet
        processes[pid] = ProcessInfo(pid, stat.ppid, stat.start_ticks, stat.comm, uid)
    return processes


def _is_python(pid: int) -> bool:
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False  # a kernel thread, gone, or not ours to read
    name = os.path.basename(exe.removesuffix(" (deleted)"))
    return _PYTHON_EXE.match(name) is not None


def _has_torch(pid: int) -> bool:
    data = _read(f"/proc/{pid}/maps", _MAPS_LIMIT)
    if not data:
        return False
    # A substring test first: most maps have no torch, and parsing them costs more.
    if TORCH_LIBRARY_PREFIX.encode() not in data:
        return False
    return procfs.mapped_file(procfs.parse_maps(data.decode("utf-8", "replace")),
                              TORCH_LIBRARY_PREFIX) is not None
