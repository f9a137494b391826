"""A tracefs toolkit: instances, events, trace_pipe, stale probes.

Finds tracefs (mounting it at /sys/kernel/tracing when it is mounted nowhere),
makes private instances whose ``trace_clock`` is ``mono`` and enables trace
events in them alone (:class:`TraceInstance`, the handle that
perfmon.probes.tracefs and perfmon.probes.exits hold), reads an instance's
``trace_pipe`` without blocking and its ring buffer's losses, and removes what a
SIGKILLed agent left behind (:func:`remove_stale_probes`). What trace_pipe's
lines say is read by perfmon.parsers.trace_pipe.

Needs: root (CAP_SYS_ADMIN to mount tracefs when it is not mounted, and write
access to tracefs' files; kernel lockdown in confidentiality mode forbids it).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets

import psutil
from perfmon.probes.errors import PrerequisiteMissing, PrivilegeError, agent_who

# Where tracefs lives: its own mount point (Linux 4.1+), or under debugfs, where
# the kernel mounts it automatically when debugfs is mounted.
TRACEFS_MOUNT_POINT = "/sys/kernel/tracing"
DEBUGFS_TRACING = "/sys/kernel/debug/tracing"
# Every event group and instance perfmon makes is named after it, with the
# agent's pid: perfmon_<pid> (group), perfmon_<pid>_<random hex> (instance).
GROUP_PREFIX = "perfmon_"
# Per CPU: a few KiB hold a second of markers; the rest is headroom for polls that
# come late. Bounded in total so that a many-core host does not pay 1 MiB a CPU.
_BUFFER_KB_PER_CPU_MAX = 1024
_BUFFER_KB_PER_CPU_MIN = 64
_BUFFER_KB_TOTAL = 16384
# read_trace_pipe() reads at most this much of the pipe at a time, so a poll returns
# promptly even when a flood of events is waiting; the rest waits for the next poll.
_MAX_READ_PER_POLL_BYTES = 4 << 20
_READ_CHUNK_BYTES = 1 << 16
_MAX_PARTIAL_LINE_BYTES = 1 << 16
# A pid whose process started this long (s) after a perfmon instance of that pid
# was made is not the agent that made it (the pid was reused). The margin covers
# the one-second resolution of the boot time psutil adds to a process's start.
_PID_REUSE_MARGIN_S = 2.0
_LOSS_COUNTERS = ("overrun", "commit overrun", "dropped events")


def _unescape_mount_path(field: str) -> str:
    """A mount point as /proc/self/mounts writes it (space, tab, newline, \\ octal-escaped)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _tracefs_mounts() -> list[str]:
    """Mount points of tracefs in the agent's mount namespace, the usual one first."""
    found = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3 and fields[2] == "tracefs":
                    found.append(_unescape_mount_path(fields[1]))
    except OSError:
        return []
    return sorted(found, key=lambda p: (p != TRACEFS_MOUNT_POINT, p != DEBUGFS_TRACING, p))


def _mount_tracefs() -> None:
    """Mount tracefs at TRACEFS_MOUNT_POINT; PrivilegeError or PrerequisiteMissing."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"nodev", TRACEFS_MOUNT_POINT.encode(), b"tracefs", 0, None) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EBUSY:  # mounted meanwhile by someone else
        return
    if err == errno.EPERM:
        raise PrivilegeError(
            f"{agent_who()}: tracefs is not mounted and mounting it at {TRACEFS_MOUNT_POINT} was "
            "refused: run as root (CAP_SYS_ADMIN), or mount it beforehand "
            f"(mount -t tracefs nodev {TRACEFS_MOUNT_POINT})"
        )
    if err == errno.ENODEV:
        raise PrerequisiteMissing(
            f"{agent_who()}: the kernel has no tracefs (CONFIG_TRACING is off): tracefs uprobes "
            "cannot be used"
        )
    raise PrerequisiteMissing(
        f"{agent_who()}: cannot mount tracefs at {TRACEFS_MOUNT_POINT}: {os.strerror(err)}"
    )


def _find_tracefs() -> str:
    """The tracefs root to use, mounting tracefs when it is mounted nowhere."""
    for root in _tracefs_mounts():
        if os.path.exists(os.path.join(root, "uprobe_events")):
            return root
    mounts = _tracefs_mounts()
    if mounts:
        return mounts[0]
    if os.path.isdir(TRACEFS_MOUNT_POINT):
        try:
            _mount_tracefs()
        except PrivilegeError:
            # debugfs, when mounted, mounts tracefs under it on first access.
            if os.path.exists(os.path.join(DEBUGFS_TRACING, "uprobe_events")):
                return DEBUGFS_TRACING
            raise
        return TRACEFS_MOUNT_POINT
    if os.path.exists(os.path.join(DEBUGFS_TRACING, "uprobe_events")):
        return DEBUGFS_TRACING
    raise PrerequisiteMissing(
        f"{agent_who()}: no tracefs: {TRACEFS_MOUNT_POINT} does not exist (a kernel without "
        "CONFIG_TRACING, or /sys not mounted)"
    )


def uprobe_events_root() -> str:
    """The tracefs root (mounted here when it was not), once the agent may define uprobe
    events in it (``uprobe_events``) and enable them in instances.

    Raises PrivilegeError when the agent may not mount tracefs or write
    ``uprobe_events``, and PrerequisiteMissing when the kernel lacks uprobe
    events or instances.
    """
    root = _find_tracefs()
    events = os.path.join(root, "uprobe_events")
    try:
        os.stat(events)
    except FileNotFoundError as err:
        raise PrerequisiteMissing(
            f"{agent_who()}: {events} does not exist: the kernel has no uprobe events "
            "(CONFIG_UPROBE_EVENTS)"
        ) from err
    except PermissionError as err:  # tracefs' root folder is root's alone (mode 0700)
        raise PrivilegeError(
            f"{agent_who()}: cannot reach {events} ({err.strerror}): run as root"
        ) from err
    if not os.path.isdir(os.path.join(root, "instances")):
        raise PrerequisiteMissing(f"{agent_who()}: {root} has no instances folder (Linux < 3.19)")
    try:
        # Opening for append checks the right to write without changing anything
        # (O_TRUNC would delete every uprobe event on the host).
        fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except PermissionError as err:
        raise PrivilegeError(
            f"{agent_who()}: cannot write {events} ({err.strerror}): run as root; under kernel "
            "lockdown (confidentiality) tracefs cannot be used at all"
        ) from err
    except OSError as err:
        raise PrerequisiteMissing(f"{agent_who()}: cannot open {events}: {err.strerror}") from err
    os.close(fd)
    return root


def tracefs_root() -> str:
    """The tracefs root (mounted here when it was not), for instances and static trace events.

    Unlike :func:`uprobe_events_root` it asks for no uprobe events: a
    tracepoint (e.g. ``oom:mark_victim``) needs only an instance to enable it in.
    Raises PrivilegeError or PrerequisiteMissing, naming the agent's pid.
    """
    root = _find_tracefs()
    instances = os.path.join(root, "instances")
    try:
        os.stat(instances)
    except PermissionError as err:  # tracefs' root folder is root's alone (mode 0700)
        raise PrivilegeError(f"{agent_who()}: cannot reach {instances} ({err.strerror}): "
                             "run as root") from err
    except OSError as err:
        raise PrerequisiteMissing(f"{agent_who()}: {root} has no instances folder (Linux < 3.19)"
                                  ) from err
    return root


def make_instance(root: str, group: str, buffer_kb: int) -> str:
    """A new private instance ``<group>_<8 hex>`` of tracefs ``root``; its path.

    Its ``trace_clock`` is ``mono`` (CLOCK_MONOTONIC, the clock of every record)
    and its ring buffer ``buffer_kb`` KiB per CPU; only the instance's settings
    change, the global buffer keeps its own. Raises PrerequisiteMissing; an
    instance whose settings failed is removed again.
    """
    path = os.path.join(root, "instances", f"{group}_{secrets.token_hex(4)}")
    try:
        os.mkdir(path)
    except OSError as err:
        raise PrerequisiteMissing(
            f"{agent_who()}: cannot create a tracefs instance in {root}/instances: {err.strerror}"
        ) from err
    try:
        tracefs_write(os.path.join(path, "trace_clock"), "mono")
        tracefs_write(os.path.join(path, "buffer_size_kb"), str(buffer_kb))
    except OSError as err:
        remove_instance(path)
        raise PrerequisiteMissing(
            f"{agent_who()}: cannot configure tracefs instance {path}: {err.strerror}"
        ) from err
    return path


def enable_event(instance: str, system: str, event: str, on: bool = True) -> None:
    """Enable (``on=False``: disable) trace event ``system:event`` in an instance only
    (path from make_instance).

    Raises FileNotFoundError when the kernel has no such event, OSError otherwise.
    """
    tracefs_write(os.path.join(instance, "events", system, event, "enable"),
                  "1" if on else "0")


def remove_instance(path: str) -> str | None:
    """Remove a tracefs instance (which disables the events enabled in it); a warning when
    it cannot be (None when done or gone)."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as err:  # EBUSY: someone holds its trace_pipe open
        return f"{agent_who()}: cannot remove tracefs instance {path}: {err.strerror}"
    return None


def ring_buffer_losses(instance: str) -> int | None:
    """Events an instance's ring buffer lost (overwritten or not stored), summed over its
    CPUs; None when its statistics cannot be read."""
    per_cpu = os.path.join(instance, "per_cpu")
    total = 0
    try:
        for cpu in os.listdir(per_cpu):
            for line in _read_text(os.path.join(per_cpu, cpu, "stats")).splitlines():
                key, _, value = line.partition(":")
                if key.strip() in _LOSS_COUNTERS and value.strip().isdigit():
                    total += int(value)
    except OSError:
        return None
    return total


def read_trace_pipe(fd: int, partial: bytes,
                    max_bytes: int = _MAX_READ_PER_POLL_BYTES) -> tuple[list[bytes], bytes]:
    """The complete lines waiting in a trace_pipe opened ``O_NONBLOCK`` (about ``max_bytes``
    at most, so a flood waits for the next call), and the partial last line to pass back
    as ``partial`` next time. Never blocks; OSError from the read propagates.
    """
    chunks, total = [partial], 0
    while total < max_bytes:
        try:
            chunk = os.read(fd, _READ_CHUNK_BYTES)
        except BlockingIOError:
            break  # nothing more now
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    lines = b"".join(chunks).split(b"\n")
    partial = lines.pop()
    if len(partial) > _MAX_PARTIAL_LINE_BYTES:
        partial = b""  # no event line is this long: not ours
    return lines, partial


def tracefs_write(path: str, text: str, append: bool = False) -> None:
    """One write() of ``text`` to a tracefs file. Never opens with O_TRUNC: on
    uprobe_events and set_event_pid that would clear what others defined."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | (os.O_APPEND if append else 0))
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def error_log_tail(root: str) -> str:
    """The kernel's reason for the last refused definition, e.g. "trace_uprobe: error:
    Invalid register name" ('' if none). error_log repeats the command after it."""
    try:
        lines = _read_text(os.path.join(root, "error_log")).splitlines()
    except OSError:
        return ""
    reasons = [li for li in lines if li.startswith("[")]
    return reasons[-1].partition("]")[2].strip() if reasons else ""


def buffer_size_kb(cpus: int | None = None) -> int:
    """The instance's ring buffer size per CPU (KiB): 1024 on small hosts, less on big ones."""
    per_cpu = _BUFFER_KB_TOTAL // max(1, cpus or os.cpu_count() or 1)
    return max(_BUFFER_KB_PER_CPU_MIN, min(_BUFFER_KB_PER_CPU_MAX, per_cpu))


class TraceInstance:
    """A private tracefs instance (:func:`make_instance`) and its trace_pipe, as one source
    holds it: events enabled in it alone, its lines read without blocking.

    Made in tracefs ``root`` as ``<group>_<8 hex>`` with a ring buffer of
    ``buffer_kb`` KiB per CPU; raises PrerequisiteMissing as make_instance does.
    ``close()`` removes it once, and never raises.
    """

    def __init__(self, root: str, group: str, buffer_kb: int) -> None:
        self.path = make_instance(root, group, buffer_kb)
        self.name = os.path.basename(self.path)
        self._pipe = -1
        self._partial = b""
        self._removed = False

    def enable(self, system: str, event: str, on: bool = True) -> None:
        """Enable (``on=False``: disable) ``system:event`` in this instance; OSError
        (FileNotFoundError when the kernel has no such event)."""
        enable_event(self.path, system, event, on)

    def open_pipe(self) -> None:
        """Open trace_pipe for :meth:`read_lines` (non-blocking); OSError."""
        self._pipe = os.open(os.path.join(self.path, "trace_pipe"),
                             os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def reading(self) -> bool:
        """Whether trace_pipe is open: opened, and neither failed nor closed since."""
        return self._pipe >= 0

    def read_lines(self) -> list[bytes]:
        """The complete lines waiting in trace_pipe (:func:`read_trace_pipe`); [] when it is
        not open. OSError from the read closes the pipe (no more lines) and propagates."""
        if self._pipe < 0:
            return []
        try:
            lines, self._partial = read_trace_pipe(self._pipe, self._partial)
        except OSError:
            self._close_pipe()
            raise
        return lines

    def losses(self) -> int | None:
        """Events its ring buffer lost (:func:`ring_buffer_losses`); None when unknown."""
        return ring_buffer_losses(self.path)

    def close(self) -> str | None:
        """Close trace_pipe and remove the instance (which disables the events enabled in
        it), once; a warning when it cannot be removed. Never raises."""
        self._close_pipe()
        if self._removed:
            return None
        self._removed = True
        return remove_instance(self.path)

    def _close_pipe(self) -> None:
        if self._pipe >= 0:
            try:
                os.close(self._pipe)
            except OSError:
                pass  # nothing to release: the fd is gone either way
            self._pipe = -1


# --- clean-up of agents that died -------------------------------------------

_EVENT_LINE = re.compile(rf"^[pr]\w*:{GROUP_PREFIX}(\d+)/(\w+)\s")
_INSTANCE_NAME = re.compile(rf"^{GROUP_PREFIX}(\d+)_[0-9a-f]+$")


def _agent_alive(pid: int, instance_ctimes: list[float]) -> bool:
    """Whether ``pid`` may still be the agent that made these events and instances."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        created = proc.create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell: leave them
    # A process younger than every instance of its pid did not make them.
    return not instance_ctimes or created <= max(instance_ctimes) + _PID_REUSE_MARGIN_S


def remove_stale_probes(root: str) -> list[str]:
    """Remove the uprobe events and instances of perfmon agents that no longer run.

    Only groups ``perfmon_<pid>``, instances ``perfmon_<pid>_<hex>`` and libbcc's
    events on the agent's ``/proc/self/fd/N`` paths are looked at; those of a live
    process are left alone. Returns warnings for what
    could not be removed (e.g. an event someone enabled in another instance).
    """
    warnings: list[str] = []
    events: dict[int, list[str]] = {}
    try:
        try:
            uprobe_events = _read_text(os.path.join(root, "uprobe_events")).splitlines()
        except FileNotFoundError:
            uprobe_events = []  # no CONFIG_UPROBE_EVENTS: instances only (perfmon.probes.exits)
        for line in uprobe_events:
            m = _EVENT_LINE.match(line)
            if m:
                events.setdefault(int(m.group(1)), []).append(m.group(2))
        instance_dir = os.path.join(root, "instances")
        instances: dict[int, list[str]] = {}
        for entry in os.listdir(instance_dir):
            m = _INSTANCE_NAME.match(entry)
            if m:
                instances.setdefault(int(m.group(1)), []).append(entry)
    except OSError as err:
        return [f"{agent_who()}: cannot look for stale perfmon uprobes in {root}: {err.strerror}"]
    for pid in sorted(set(events) | set(instances)):
        ctimes = []
        for name in instances.get(pid, []):
            try:
                ctimes.append(os.stat(os.path.join(instance_dir, name)).st_ctime)
            except FileNotFoundError:
                pass  # removed meanwhile (by that agent, or another agent cleaning up)
        if _agent_alive(pid, ctimes):
            continue
        # Instances first: removing one disables the events enabled in it, and an
        # enabled event cannot be removed.
        for name in instances.get(pid, []):
            try:
                os.rmdir(os.path.join(instance_dir, name))
            except FileNotFoundError:
                pass
            except OSError as err:
                warnings.append(f"{agent_who()}: cannot remove stale tracefs instance {name} of "
                                f"dead agent pid {pid}: {err.strerror}")
        for event in events.get(pid, []):
            warning = remove_uprobe_event(root, f"{GROUP_PREFIX}{pid}", event)
            if warning:
                warnings.append(f"{warning} (stale: agent pid {pid} is gone)")
    for event, path, pid in bcc_uprobe_events(root):
        if AGENT_PROBE_PATH.fullmatch(path) and not _agent_alive(pid, []):
            warning = remove_uprobe_event(root, "uprobes", event)
            if warning:
                warnings.append(f"{warning} (stale: agent pid {pid} is gone)")
    return warnings


# libbcc's names for the uprobe events it makes in tracefs where the perf uprobe PMU
# refuses an attach (a target that exited: ESRCH): <p|r>_<path, each character but
# [A-Za-z0-9_] made "_">_0x<offset>_<target pid>_bcc_<attaching pid>. When opening the
# event then fails too, libbcc leaves it behind (issue 36: 36 after 200 short-lived
# processes, outliving the agent). The agent attaches through /proc/self/fd/N alone
# (perfmon.probes.files.MappedLibrary): a path no bcc tool is given by hand.
_BCC_EVENT_LINE = re.compile(r"^[pr]:uprobes/([pr]_(\w+?)_0x[0-9a-f]+_\d+_bcc_(\d+))\s")
AGENT_PROBE_PATH = re.compile(r"_proc_self_fd_\d+")


def bcc_probe_path(path: str) -> str:
    """``path`` as it stands in libbcc's event names."""
    return re.sub(r"[^A-Za-z0-9_]", "_", path)


def bcc_event_roots() -> list[str]:
    """The tracefs roots with uprobe events, where libbcc may have made some."""
    roots = [*_tracefs_mounts(), TRACEFS_MOUNT_POINT, DEBUGFS_TRACING]
    return [r for i, r in enumerate(roots) if r not in roots[:i]
            and os.path.exists(os.path.join(r, "uprobe_events"))]


def bcc_uprobe_events(root: str) -> list[tuple[str, str, int]]:
    """(event, probed path as named, the attaching pid) of every uprobe event of libbcc's
    in tracefs ``root`` ([] where it cannot be read)."""
    try:
        lines = _read_text(os.path.join(root, "uprobe_events")).splitlines()
    except OSError:
        return []
    return [(m[1], m[2], int(m[3])) for line in lines if (m := _BCC_EVENT_LINE.match(line))]


def remove_bcc_uprobe_events(paths: set[str], pid: int) -> list[str]:
    """Remove libbcc's uprobe events that process ``pid`` made on ``paths`` (probe paths,
    as given to bcc); warnings for those that cannot be (e.g. still in use)."""
    named = {bcc_probe_path(p) for p in paths}
    warnings = []
    for root in bcc_event_roots():
        for event, path, made_by in bcc_uprobe_events(root):
            if made_by == pid and path in named:
                warning = remove_uprobe_event(root, "uprobes", event)
                if warning:
                    warnings.append(warning)
    return warnings


def remove_uprobe_event(root: str, group: str, event: str) -> str | None:
    """Delete one uprobe event; a warning when it cannot be (None when done or gone)."""
    try:
        tracefs_write(os.path.join(root, "uprobe_events"), f"-:{group}/{event}\n", append=True)
    except FileNotFoundError:
        return None  # already removed (the kernel says ENOENT)
    except OSError as err:
        return f"{agent_who()}: cannot remove uprobe event {group}/{event}: {err.strerror}"
    return None


