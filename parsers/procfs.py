"""Parsers for /proc files: text or bytes in, data out (no I/O).

Tested against files captured from real processes in tests/data/.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# Linux capability numbers (include/uapi/linux/capability.h).
CAP_SYS_ADMIN = 21
CAP_SYS_PTRACE = 19
CAP_PERFMON = 38
CAP_BPF = 39
CAPABILITY_NAMES = {
    CAP_SYS_PTRACE: "CAP_SYS_PTRACE",
    CAP_SYS_ADMIN: "CAP_SYS_ADMIN",
    CAP_PERFMON: "CAP_PERFMON",
    CAP_BPF: "CAP_BPF",
}


@dataclass(frozen=True)
class MappedFile:
    path: str
    start_address: int
    offset_bytes: int
    executable: bool
    end_address: int = 0
    device: tuple[int, int] = (0, 0)  # (major, minor) of the file's filesystem
    inode: int = 0

    @property
    def range_name(self) -> str:
        """The mapping's name under /proc/PID/map_files/ ("start-end", lowercase hex)."""
        return f"{self.start_address:x}-{self.end_address:x}"


def parse_maps(text: str) -> list[MappedFile]:
    """File-backed mappings of /proc/PID/maps, in file order (anonymous ones dropped)."""
    mappings = []
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        start, _, end = parts[0].partition("-")
        major, _, minor = parts[3].partition(":")
        path = parts[5]
        # A file deleted or replaced since it was mapped (e.g. a reinstall under a
        # running job) shows " (deleted)"; the mapping is still probe-able through
        # /proc/PID/map_files but not through its path, so keep the marker visible.
        mappings.append(MappedFile(path, int(start, 16), int(parts[2], 16), "x" in parts[1],
                                   int(end, 16), (int(major, 16), int(minor or "0", 16)),
                                   int(parts[4])))
    return mappings


def mapped_file(mappings: Iterable[MappedFile], basename_prefix: str) -> MappedFile | None:
    """The first mapping of a file whose basename starts with the prefix (e.g. 'libtorch_cpu')."""
    for m in mappings:
        if m.path.rsplit("/", 1)[-1].startswith(basename_prefix):
            return m
    return None


def mapped_library(mappings: Iterable[MappedFile], basename_prefix: str) -> str | None:
    """Path of the first mapped file whose basename starts with the prefix (e.g. 'libtorch_cpu')."""
    found = mapped_file(mappings, basename_prefix)
    return found.path if found else None


def address_span(mappings: Iterable[MappedFile], path: str) -> tuple[int, int] | None:
    """Lowest start and highest end address of the mappings of one file."""
    spans = [(m.start_address, m.end_address) for m in mappings if m.path == path]
    if not spans:
        return None
    return min(lo for lo, _ in spans), max(hi for _, hi in spans)


def parse_environ(data: bytes, wanted: Iterable[str]) -> dict[str, str]:
    """Only the wanted variables of /proc/PID/environ (NUL-separated).

    Everything else is dropped here, at the first place it is seen, because a
    training job's environment often holds credentials.
    """
    keep = set(wanted)
    found: dict[str, str] = {}
    for entry in data.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key.decode("utf-8", "replace") in keep:
            found[key.decode()] = value.decode("utf-8", "replace")
    return found


def parse_cmdline(data: bytes) -> list[str]:
    """argv from /proc/PID/cmdline."""
    if not data:
        return []  # kernel threads and zombies have an empty cmdline
    return [a.decode("utf-8", "replace") for a in data.rstrip(b"\0").split(b"\0")]


@dataclass(frozen=True)
class ProcStatus:
    name: str
    effective_capabilities: int
    rss_bytes: int | None
    peak_rss_bytes: int | None
    fs_uid: int | None = None  # the uid (and gid) the kernel checks file access with
    fs_gid: int | None = None
    groups: tuple[int, ...] = ()
    state: str = ""  # "R (running)", "Z (zombie)", ...


def parse_schedstat(text: str) -> tuple[int, int] | None:
    """(CPU time ns, run-queue wait ns) from /proc/PID/schedstat (three integers:
    time on a CPU, time runnable waiting for one, timeslices); None when malformed."""
    fields = text.split()
    if len(fields) < 2 or not all(f.isdigit() for f in fields[:2]):
        return None
    return int(fields[0]), int(fields[1])


def parse_status(text: str) -> ProcStatus:
    """The few fields of /proc/PID/status the agent uses."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()

    def kib(key: str) -> int | None:
        value = fields.get(key)
        return int(value.split()[0]) * 1024 if value else None

    def fourth(key: str) -> int | None:
        # Uid/Gid: real, effective, saved set and filesystem ids.
        ids = fields.get(key, "").split()
        return int(ids[3]) if len(ids) == 4 else None

    return ProcStatus(
        name=fields.get("Name", ""),
        effective_capabilities=int(fields.get("CapEff", "0"), 16),
        rss_bytes=kib("VmRSS"),
        peak_rss_bytes=kib("VmHWM"),
        fs_uid=fourth("Uid"),
        fs_gid=fourth("Gid"),
        groups=tuple(int(g) for g in fields.get("Groups", "").split()),
        state=fields.get("State", ""),
    )


def missing_capabilities(effective: int, needed: Iterable[int]) -> list[str]:
    """Names of the needed capabilities absent from an effective set."""
    return [CAPABILITY_NAMES.get(c, f"CAP_{c}") for c in needed if not effective >> c & 1]


@dataclass(frozen=True)
class ProcStat:
    comm: str
    state: str
    ppid: int
    start_ticks: int  # clock ticks after boot: with the pid, names one process for good


def parse_stat(text: str) -> ProcStat:
    """The fields of /proc/PID/stat the process scan uses; ValueError when malformed.

    ``comm`` sits in parentheses and may itself hold spaces and ")": the fields
    start after the last ")".
    """
    head, sep, rest = text.rpartition(")")
    _, paren, comm = head.partition("(")
    fields = rest.split()
    if not sep or not paren or len(fields) < 20:
        raise ValueError("not a /proc/PID/stat line")
    # rest starts at field 3 (state); ppid is field 4, starttime field 22.
    return ProcStat(comm, fields[0], int(fields[1]), int(fields[19]))


# Container runtimes' cgroup names: Docker and containerd (cgroupfs or systemd
# drivers), CRI-O, Podman. The id is the 64-hex-digit container id.
_CONTAINER_ID = re.compile(
    r"(?:docker|cri-containerd|containerd|crio|libpod)[-/:]([0-9a-f]{64})(?:\.scope)?(?:/|$)"
    r"|/kubepods[^\n]*?/(?:pod[^/]+/)?([0-9a-f]{64})(?:/|$)")


# A Kubernetes pod's cgroup: kubepods[-QOS]-pod<UID>.slice (systemd driver: the UID's
# dashes as underscores) or kubepods/QOS/pod<UID> (cgroupfs driver).
_POD_UID = re.compile(r"/kubepods[^\n]*?[/-]pod([0-9a-f]{8}(?:[-_][0-9a-f]{4}){3}[-_][0-9a-f]{12})"
                      r"(?:\.slice)?(?:/|$)")


@dataclass(frozen=True)
class ContainerIds:
    """Where a process runs, from its /proc/PID/cgroup: the container runtime's id and
    the Kubernetes pod's UID (None: not in one)."""

    container_id: str | None = None
    pod_uid: str | None = None
    # The pod's cgroup folder, relative to the cgroup mounts (v2: its path; v1: the
    # hierarchy's folder, e.g. "memory/kubepods/besteffort/pod<UID>"). A path is only a
    # name: whoever was delegated a subtree can make a "kubepods-pod<UID>" folder in it,
    # so the pod is believed only where a kubelet (root) owns that folder
    # (perfmon.probes.discovery).
    pod_cgroup: str | None = None


def container_ids(cgroup_text: str) -> ContainerIds:
    """The container id and pod UID of a process from /proc/PID/cgroup (None each where
    no runtime or Kubernetes named it in the cgroup path)."""
    cid = uid = folder = None
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)  # hierarchy id, controllers (v2: none), path
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if cid is None and (match := _CONTAINER_ID.search(path)):
            cid = match.group(1) or match.group(2)
        if uid is None and (found := _POD_UID.search(path)):
            uid = found.group(1).replace("_", "-")
            hierarchy = controllers.removeprefix("name=")
            folder = (f"{hierarchy}/" if hierarchy else "") + path[:found.end(1)].lstrip("/")
            folder += ".slice" if path[found.end(1):].startswith(".slice") else ""
    return ContainerIds(cid, uid, folder)
