"""The node's processes as the job finder sees them: a cheap walk of /proc.

Measures: every process's parent and start time (/proc/PID/stat), which of
them are Python (the executable's name) and which of those have PyTorch mapped
(/proc/PID/maps), and, for those, the few job variables of their environment
(perfmon.probes.procfs.ENVIRON_KEYS). Cost: one stat read per process per scan;
an executable's name once per process; maps once per Python process that has
PyTorch, and with a back-off (at most once a minute) for those that have not
loaded it yet; environments once per process. Needs: root (or
CAP_SYS_PTRACE) to read other users' processes; what cannot be read is
passed over.

Everything is keyed by (pid, start time, comm): a pid reused by a new process,
or a process that exec'd another program, is a new process here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from perfmon.parsers import procfs
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
# Processes looked at per scan: far above any node's.
MAX_PROCESSES = 1 << 17

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
