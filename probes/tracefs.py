"""Training-step markers from the kernel's own uprobe trace events: no bcc, no LLVM, no headers.

Measures: exactly what :class:`perfmon.probes.uprobes.MarkerProbe` measures, as the same
``MarkerEvent`` records: the CLOCK_MONOTONIC time of every ``Optimizer.step``,
``Optimizer.zero_grad`` and DataLoader ``__next__`` entry (the C++ entry point of
PyTorch's ``record_function``, whose name is read in the trap) and of every
``torch::autograd::Engine::execute`` entry and return (``backward_enter`` /
``backward_exit``) and of the c10d collective waits (``wait_enter`` / ``wait_exit``).
The probes are dynamic uprobe events written to tracefs'
``uprobe_events`` and enabled only in a private tracefs instance whose
``trace_clock`` is ``mono``; ``poll()`` reads that instance's ``trace_pipe``
without blocking. Timestamps are the kernel's, taken at the trap (the clock
``bpf_ktime_get_ns`` reads); ``trace_pipe`` prints them to the microsecond, so
``t_mono_ns`` is floored to a whole microsecond.

Cost: one uprobe trap (a few microseconds) per ``record_function`` entry and per
``backward()`` entry and return, i.e. a handful per training step. Unlike bcc's
perf-based uprobes, which the kernel installs only in the pids they name, a uprobe
enabled through tracefs is installed in EVERY process that maps the same library
file (inode): other jobs using the same libtorch_cpu.so take the same traps on these
few, low-rate functions, and the instance's pid filter then drops their events in
the kernel. Names that do not mark a step are dropped by an event filter in the
kernel too. Following the targets' threads (``set_event_pid`` with ``event-fork``)
and recording tgids (``record-tgid``) add a few instructions to every context switch
while a probe runs. Memory: the instance's ring buffer, ``buffer_size_kb()`` KiB per
CPU. Set-up: ~0.1 s, mostly reading libtorch_cpu.so's symbols; close: ~0.25 s of
kernel RCU grace periods. The kernel keeps one uprobe per (file, offset), so another
tool's uprobe on the same function with a different USDT reference counter (bcc
0.26's carry a stray one) makes enabling fail: the two cannot run at once.

Needs: root (CAP_SYS_ADMIN to mount tracefs when it is not mounted, and write
access to tracefs' files; kernel lockdown in confidentiality mode forbids it);
a kernel with CONFIG_UPROBE_EVENTS (Debian's and most distributions' have it) and
the ``ustring`` fetch type (Linux 5.5+; developed on 6.18); x86-64 or arm64; CAP_SYS_PTRACE
to read the target's /proc files. A PyTorch whose libtorch_cpu.so exports
``record_function_enter_new`` (1.13+) or ``record_function_enter``, as for MarkerProbe.

What a SIGKILLed agent leaves in tracefs (its events and instance) is removed by the
next probe's ``start()`` (:func:`remove_stale_probes`).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import itertools
import mmap
import os
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import psutil
from perfmon.parsers.elf_symbols import (
    ElfError,
    ElfSymbol,
    file_offset,
    find_function_symbols,
    load_segments,
)
from perfmon.parsers.events import Record
from perfmon.parsers.procfs import CAP_SYS_ADMIN, CAP_SYS_PTRACE, missing_capabilities
from perfmon.probes.errors import (
    NoSuchProcess,
    PrerequisiteMissing,
    PrivilegeError,
    SymbolNotFound,
)
from perfmon.probes.files import MappedLibrary
from perfmon.probes.procfs import TargetProcess, agent_capabilities
from perfmon.probes.sampler import Source
from perfmon.probes.uprobes import (
    COLLECTIVE_WAIT_SYMBOLS,
    DEFAULT_STEP_KINDS,
    ENGINE_EXECUTE_SYMBOL,
    RECORD_FUNCTION_SYMBOLS,
    STEP_NAME_PREFIXES,
    MarkerEvent,
    open_torch_library,
    step_prefixes,
)

# Where tracefs lives: its own mount point (Linux 4.1+), or under debugfs, where
# the kernel mounts it automatically when debugfs is mounted.
TRACEFS_MOUNT_POINT = "/sys/kernel/tracing"
DEBUGFS_TRACING = "/sys/kernel/debug/tracing"
# Every event group and instance this module makes is named after it, with the
# agent's pid: perfmon_<pid> (group), perfmon_<pid>_<random hex> (instance).
GROUP_PREFIX = "perfmon_"
# The name argument of record_function_enter_new(const std::string& name, ...):
# its class return value takes the first argument register, so the std::string*
# is the second; libstdc++ keeps the char* at offset 0 of std::string, hence two
# dereferences. Per architecture, as the kernel names the registers.
_NAME_FETCH = {
    "x86_64": "+0(+0(%si)):ustring",
    "aarch64": "+0(+0(%x1)):ustring",
}
# Bytes of a name kept, with its terminating NUL: iterations.bpf.c's NAME_LEN,
# so that both backends cut long names at the same byte.
NAME_LEN_BYTES = 64
# Per CPU: a few KiB hold a second of markers; the rest is headroom for polls that
# come late. Bounded in total so that a many-core host does not pay 1 MiB a CPU.
_BUFFER_KB_PER_CPU_MAX = 1024
_BUFFER_KB_PER_CPU_MIN = 64
_BUFFER_KB_TOTAL = 16384
# poll() reads at most this much of the pipe at a time, so it returns promptly
# even when a flood of events is waiting; the rest waits for the next poll.
_MAX_READ_PER_POLL_BYTES = 4 << 20
_READ_CHUNK_BYTES = 1 << 16
_MAX_PARTIAL_LINE_BYTES = 1 << 16
# The ring buffer's loss counters are re-read at most this often (s).
_STATS_INTERVAL_S = 1.0
# A pid whose process started this long (s) after a perfmon instance of that pid
# was made is not the agent that made it (the pid was reused). The margin covers
# the one-second resolution of the boot time psutil adds to a process's start.
_PID_REUSE_MARGIN_S = 2.0
_RECORD_FUNCTION = "record_function"  # an rf_enter event: classified by its name
_LOSS_COUNTERS = ("overrun", "commit overrun", "dropped events")
# Event numbers: unique within the agent, so that several probes in one agent
# (same group) never define the same event name.
_EVENT_NUMBERS = {"rf": itertools.count(), "bw": itertools.count(), "wait": itertools.count()}


def _agent() -> str:
    return f"pid {os.getpid()} (perfmon-agent)"


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
            f"{_agent()}: tracefs is not mounted and mounting it at {TRACEFS_MOUNT_POINT} was "
            "refused: run as root (CAP_SYS_ADMIN), or mount it beforehand "
            f"(mount -t tracefs nodev {TRACEFS_MOUNT_POINT})"
        )
    if err == errno.ENODEV:
        raise PrerequisiteMissing(
            f"{_agent()}: the kernel has no tracefs (CONFIG_TRACING is off): tracefs uprobes "
            "cannot be used"
        )
    raise PrerequisiteMissing(
        f"{_agent()}: cannot mount tracefs at {TRACEFS_MOUNT_POINT}: {os.strerror(err)}"
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
        f"{_agent()}: no tracefs: {TRACEFS_MOUNT_POINT} does not exist (a kernel without "
        "CONFIG_TRACING, or /sys not mounted)"
    )


def check_tracefs_prerequisites() -> str:
    """The tracefs root (mounted here when it was not), once it is known to be usable.

    Raises PrivilegeError when the agent may not mount tracefs or write
    ``uprobe_events``, and PrerequisiteMissing when the kernel lacks uprobe
    events or instances, or the CPU is one this module cannot read arguments on.
    """
    # CAP_SYS_PTRACE: the target's maps and libraries; CAP_SYS_ADMIN: tracefs and its
    # uprobe events (which, unlike tracefs' file modes, root without it cannot use).
    missing = missing_capabilities(agent_capabilities(), (CAP_SYS_PTRACE, CAP_SYS_ADMIN))
    if missing:
        raise PrivilegeError(
            f"{_agent()}: missing capabilities {', '.join(missing)} for tracefs uprobes: run "
            "as root (with full capabilities), or grant CAP_SYS_ADMIN and CAP_SYS_PTRACE")
    machine = os.uname().machine
    if machine not in _NAME_FETCH:
        raise PrerequisiteMissing(
            f"{_agent()}: tracefs uprobes: reading record_function names is only "
            f"implemented on {', '.join(sorted(_NAME_FETCH))}, not {machine}"
        )
    root = _find_tracefs()
    events = os.path.join(root, "uprobe_events")
    try:
        os.stat(events)
    except FileNotFoundError as err:
        raise PrerequisiteMissing(
            f"{_agent()}: {events} does not exist: the kernel has no uprobe events "
            "(CONFIG_UPROBE_EVENTS)"
        ) from err
    except PermissionError as err:  # tracefs' root folder is root's alone (mode 0700)
        raise PrivilegeError(
            f"{_agent()}: cannot reach {events} ({err.strerror}): run as root"
        ) from err
    if not os.path.isdir(os.path.join(root, "instances")):
        raise PrerequisiteMissing(f"{_agent()}: {root} has no instances folder (Linux < 3.19)")
    try:
        # Opening for append checks the right to write without changing anything
        # (O_TRUNC would delete every uprobe event on the host).
        fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except PermissionError as err:
        raise PrivilegeError(
            f"{_agent()}: cannot write {events} ({err.strerror}): run as root; under kernel "
            "lockdown (confidentiality) tracefs cannot be used at all"
        ) from err
    except OSError as err:
        raise PrerequisiteMissing(f"{_agent()}: cannot open {events}: {err.strerror}") from err
    os.close(fd)
    return root


def tracefs_root() -> str:
    """The tracefs root (mounted here when it was not), for instances and static trace events.

    Unlike :func:`check_tracefs_prerequisites` it asks for no uprobe events: a
    tracepoint (e.g. ``oom:mark_victim``) needs only an instance to enable it in.
    Raises PrivilegeError or PrerequisiteMissing, naming the agent's pid.
    """
    root = _find_tracefs()
    instances = os.path.join(root, "instances")
    try:
        os.stat(instances)
    except PermissionError as err:  # tracefs' root folder is root's alone (mode 0700)
        raise PrivilegeError(f"{_agent()}: cannot reach {instances} ({err.strerror}): "
                             "run as root") from err
    except OSError as err:
        raise PrerequisiteMissing(f"{_agent()}: {root} has no instances folder (Linux < 3.19)"
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
            f"{_agent()}: cannot create a tracefs instance in {root}/instances: {err.strerror}"
        ) from err
    try:
        _write(os.path.join(path, "trace_clock"), "mono")
        _write(os.path.join(path, "buffer_size_kb"), str(buffer_kb))
    except OSError as err:
        remove_instance(path)
        raise PrerequisiteMissing(
            f"{_agent()}: cannot configure tracefs instance {path}: {err.strerror}"
        ) from err
    return path


def enable_event(instance: str, system: str, event: str) -> None:
    """Enable trace event ``system:event`` in an instance only (path from make_instance).

    Raises FileNotFoundError when the kernel has no such event, OSError otherwise.
    """
    _write(os.path.join(instance, "events", system, event, "enable"), "1")


def remove_instance(path: str) -> str | None:
    """Remove a tracefs instance (which disables the events enabled in it); a warning when
    it cannot be (None when done or gone)."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as err:  # EBUSY: someone holds its trace_pipe open
        return f"{_agent()}: cannot remove tracefs instance {path}: {err.strerror}"
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


def _write(path: str, text: str, append: bool = False) -> None:
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


def _error_log_tail(root: str) -> str:
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


# --- reading trace_pipe ------------------------------------------------------

@dataclass(frozen=True)
class TraceLine:
    """One uprobe event line of trace_pipe."""

    tid: int
    tgid: int | None  # None when the kernel had not recorded it yet ("(-------)")
    t_mono_ns: int  # floored to the microsecond trace_pipe prints
    event: str
    args: bytes  # what follows the probe address, e.g. b' name="Optimizer.step#SGD.step"'


# The context trace_pipe prints after the task's comm: "-TID (TGID) [CPU] FLAGS
# SECONDS.MICROSECONDS: EVENT: (ADDRESS)" and for a return probe "(ADDRESS <-
# FUNCTION)". The comm is printed "%16s" and is at most 15 bytes, so it fills
# exactly _COMM_WIDTH bytes; it may hold spaces or dashes, hence parsing from a
# fixed column rather than splitting. TGID is there with options/record-tgid,
# FLAGS with options/irq-info.
_COMM_WIDTH = 16
_CONTEXT_PREFIX = rb"-(\d+) +(?:\( *(\d+|-+)\) +)?\[\d+\] +(?:\S+ +)?(\d+)\.(\d{6}): (\w+): "
_CONTEXT = re.compile(_CONTEXT_PREFIX + rb"\(0x[0-9a-f]+(?: <- 0x[0-9a-f]+)?\)(.*)", re.S)
# Any event's line (a tracepoint's fields follow its name: "mark_victim: pid=1973 ...").
_ANY_EVENT = re.compile(_CONTEXT_PREFIX + rb"(.*)", re.S)
_NAME_ARG = re.compile(rb' name="(.*)"', re.S)


def parse_trace_line(line: bytes) -> TraceLine | None:
    """A uprobe event line of trace_pipe (without its newline), or None for any other line."""
    return _trace_line(_CONTEXT.fullmatch(line, _COMM_WIDTH))


def parse_event_line(line: bytes) -> TraceLine | None:
    """Any event line of trace_pipe (a tracepoint's too), or None for another line;
    ``args`` holds what follows the event's name (``b"pid=1973 comm=python ..."``)."""
    return _trace_line(_ANY_EVENT.fullmatch(line, _COMM_WIDTH))


def _trace_line(m: re.Match[bytes] | None) -> TraceLine | None:
    if m is None:
        return None
    tid, tgid, seconds, micros, event, args = m.groups()
    return TraceLine(
        tid=int(tid),
        tgid=int(tgid) if tgid and tgid.isdigit() else None,
        t_mono_ns=int(seconds) * 1_000_000_000 + int(micros) * 1000,
        event=event.decode("ascii"),
        args=args,
    )


def parse_name_arg(args: bytes) -> bytes | None:
    """The ``name`` string of an rf_enter event, or None when the kernel could not read
    it (``name=(fault)``)."""
    m = _NAME_ARG.fullmatch(args)
    return m.group(1) if m else None


def classify_step_name(name: bytes, prefixes: dict[str, str] = STEP_NAME_PREFIXES
                       ) -> str | None:
    """The marker kind a record_function name marks (of ``prefixes``), or None."""
    for prefix, kind in prefixes.items():
        if name.startswith(prefix.encode()):
            return kind
    return None


def _step_name_filter(prefixes: dict[str, str]) -> str | None:
    """A tracefs event filter passing only step names, or None when a prefix holds a
    character the filter's glob would misread."""
    if any(set(p) & set('*?[]"\\') for p in prefixes):
        return None
    return " || ".join(f'name ~ "{prefix}*"' for prefix in prefixes)


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

    Only groups ``perfmon_<pid>`` and instances ``perfmon_<pid>_<hex>`` are
    looked at; those of a live agent are left alone. Returns warnings for what
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
        return [f"{_agent()}: cannot look for stale perfmon uprobes in {root}: {err.strerror}"]
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
                warnings.append(f"{_agent()}: cannot remove stale tracefs instance {name} of "
                                f"dead agent pid {pid}: {err.strerror}")
        for event in events.get(pid, []):
            warning = _remove_event(root, f"{GROUP_PREFIX}{pid}", event)
            if warning:
                warnings.append(f"{warning} (stale: agent pid {pid} is gone)")
    return warnings


def _remove_event(root: str, group: str, event: str) -> str | None:
    """Delete one uprobe event; a warning when it cannot be (None when done or gone)."""
    try:
        _write(os.path.join(root, "uprobe_events"), f"-:{group}/{event}\n", append=True)
    except FileNotFoundError:
        return None  # already removed (the kernel says ENOENT)
    except OSError as err:
        return f"{_agent()}: cannot remove uprobe event {group}/{event}: {err.strerror}"
    return None


# --- the probe ----------------------------------------------------------------

def probe_offsets(target: TargetProcess, library: MappedLibrary
                  ) -> tuple[list[int], list[int], list[int]]:
    """File offsets of (record_function entry points, Engine::execute, collective waits)
    in the target's libtorch_cpu, as uprobe_events wants them.

    Raises SymbolNotFound when the library cannot be read or has no record_function
    entry point; the others may be absent ([]).
    """
    try:
        with mmap.mmap(library.fd, 0, prot=mmap.PROT_READ) as buf:
            found = find_function_symbols(
                buf, (*RECORD_FUNCTION_SYMBOLS, ENGINE_EXECUTE_SYMBOL, *COLLECTIVE_WAIT_SYMBOLS))
            segments = load_segments(buf)
        record: list[ElfSymbol] = next(
            (found[p] for p in RECORD_FUNCTION_SYMBOLS if found[p]), [])
        if not record:
            raise SymbolNotFound(
                f"pid {target.pid} ({target.name}): {target.torch_library} exports no "
                "torch::autograd::profiler::record_function_enter_new or record_function_enter "
                "(a PyTorch older than 1.8, or a build with hidden symbols)"
            )
        return ([file_offset(segments, s.address) for s in record],
                [file_offset(segments, s.address) for s in found[ENGINE_EXECUTE_SYMBOL]],
                [file_offset(segments, s.address)
                 for p in COLLECTIVE_WAIT_SYMBOLS for s in found[p]])
    except (OSError, ValueError, ElfError) as err:
        raise SymbolNotFound(
            f"pid {target.pid} ({target.name}): cannot read symbols of {target.torch_library}: "
            f"{err}"
        ) from err


def _threads(pid: int) -> list[int]:
    """The thread ids of a process ([] when it is gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit()]
    except OSError:
        return []


class TracefsMarkerProbe(Source):
    """Tracefs uprobe events on the step markers of one or more PyTorch processes.

    ``poll()`` returns the markers delivered since the last call without
    blocking; ``dropped`` counts events the kernel overwrote or could not store
    because the instance's ring buffer was full. ``warnings`` lists degraded
    features (e.g. no backward probe) and clean-up that failed.
    """

    name = "tracefs"

    def __init__(self, targets: list[TargetProcess],
                 step_kinds: tuple[str, ...] = DEFAULT_STEP_KINDS) -> None:
        super().__init__()
        self._prefixes = step_prefixes(step_kinds)
        self.targets = targets
        self.dropped = 0
        self.events = 0
        self.group = f"{GROUP_PREFIX}{os.getpid()}"
        self.instance_name: str | None = None
        self._root = ""
        self._kinds: dict[str, str] = {}  # our event name -> marker kind or _RECORD_FUNCTION
        self._defined: list[str] = []
        self._enabled: list[str] = []
        self._pipe = -1
        self._partial = b""
        self._libraries: list[MappedLibrary] = []
        self._pids = {t.pid for t in targets}
        self._tgids: dict[int, int | None] = {}
        self._stats_read_at = 0.0
        self._owner_pid = os.getpid()

    @property
    def _instance(self) -> str:
        return os.path.join(self._root, "instances", self.instance_name or "")

    def _start(self) -> None:
        self._owner_pid = os.getpid()
        self.group = f"{GROUP_PREFIX}{self._owner_pid}"
        self._root = check_tracefs_prerequisites()
        self.warnings.extend(remove_stale_probes(self._root))
        atexit.register(self.close)  # an agent that raises still removes its probes
        try:
            points = self._open_libraries()
            self._make_instance()
            self._follow_targets()
            for library, target, record, engine, wait in points:
                self._define(library, target, record, engine, wait)
            self._enable()
            self._pipe = os.open(os.path.join(self._instance, "trace_pipe"),
                                 os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            self._close()
            raise

    def _open_libraries(self) -> list[tuple[MappedLibrary, TargetProcess, list[int],
                                            list[int], list[int]]]:
        """Each target's libtorch_cpu held open, and the probe offsets of each distinct
        file: targets that mapped the same inode share its events (a tracefs uprobe
        fires in every process mapping it, so one event per file, not per target)."""
        points: dict[tuple[int, int],
                     tuple[MappedLibrary, TargetProcess, list[int], list[int], list[int]]]
        points = {}
        for target in self.targets:
            library = open_torch_library(target)
            self._libraries.append(library)
            st = os.fstat(library.fd)
            key = (st.st_dev, st.st_ino)
            if key not in points:
                points[key] = (library, target, *probe_offsets(target, library))
            if not points[key][3]:
                self.warnings.append(
                    f"pid {target.pid} ({target.name}): {target.torch_library} exports no "
                    "torch::autograd::Engine::execute: micro-batches per step are not counted"
                )
        return list(points.values())

    def _make_instance(self) -> None:
        path = make_instance(self._root, self.group, buffer_size_kb())
        self.instance_name = os.path.basename(path)
        try:
            # Threads a target starts later inherit its place in set_event_pid.
            _write(os.path.join(self._instance, "options", "event-fork"), "1")
        except OSError as err:
            raise PrerequisiteMissing(
                f"{_agent()}: cannot configure tracefs instance {self._instance}: {err.strerror}"
            ) from err
        for option, value in (("record-tgid", "1"), ("irq-info", "0")):
            try:
                # record-tgid prints each event's tgid; without it (or before the kernel
                # has recorded a thread's tgid) it is read from /proc/TID/status.
                # irq-info only adds a column of flags.
                _write(os.path.join(self._instance, "options", option), value)
            except OSError:
                pass

    def _follow_targets(self) -> None:
        """Let only the targets' threads' events into the instance.

        set_event_pid, not a ``common_pid`` event filter: common_pid is a thread
        id, and a filter holds only the threads that exist when it is written,
        whereas set_event_pid with options/event-fork also admits every thread a
        listed thread starts later (autograd's device threads, which run
        Engine::execute for reentrant backward passes, start at the first
        backward). Children a target forks (DataLoader workers) are admitted too
        and dropped in poll() by their tgid. Threads are listed twice, so one
        started while the first list was written is not missed.
        """
        path = os.path.join(self._instance, "set_event_pid")
        written: set[int] = set()
        for _ in range(2):
            tids = set()
            for target in self.targets:
                threads = _threads(target.pid)
                if not threads:
                    raise NoSuchProcess(f"pid {target.pid} ({target.name}): exited before "
                                        "the uprobes were attached")
                tids.update(threads)
            new = sorted(tids - written)
            for i in range(0, len(new), 256):
                try:
                    _write(path, " ".join(map(str, new[i:i + 256])))
                except OSError as err:
                    raise PrerequisiteMissing(
                        f"{_agent()}: cannot set the pid filter {path}: {err.strerror}"
                    ) from err
            written |= tids

    def _define(self, library: MappedLibrary, target: TargetProcess,
                record: list[int], engine: list[int], wait: list[int]) -> None:
        # /proc/self/fd/N names the very inode the job mapped: the kernel resolves
        # the path during our write, in the agent's context, and keeps the inode.
        path = library.probe_path
        fetch = _NAME_FETCH[os.uname().machine]
        for offset in record:
            name = f"rf_enter_{next(_EVENT_NUMBERS['rf'])}"
            self._add_event(target, name, _RECORD_FUNCTION,
                            f"p:{self.group}/{name} {path}:{offset:#x} name={fetch}")
        for offset in engine:
            n = next(_EVENT_NUMBERS["bw"])
            self._add_event(target, f"bw_enter_{n}", "backward_enter",
                            f"p:{self.group}/bw_enter_{n} {path}:{offset:#x}")
            self._add_event(target, f"bw_exit_{n}", "backward_exit",
                            f"r:{self.group}/bw_exit_{n} {path}:{offset:#x}")
        for offset in wait:
            n = next(_EVENT_NUMBERS["wait"])
            self._add_event(target, f"wait_enter_{n}", "wait_enter",
                            f"p:{self.group}/wait_enter_{n} {path}:{offset:#x}")
            self._add_event(target, f"wait_exit_{n}", "wait_exit",
                            f"r:{self.group}/wait_exit_{n} {path}:{offset:#x}")

    def _add_event(self, target: TargetProcess, name: str, kind: str, definition: str) -> None:
        try:
            _write(os.path.join(self._root, "uprobe_events"), definition + "\n", append=True)
        except OSError as err:
            why = _error_log_tail(self._root)
            raise PrerequisiteMissing(
                f"pid {target.pid} ({target.name}): the kernel refused uprobe event "
                f"{definition!r}: {err.strerror}{'; ' + why if why else ''}"
            ) from err
        self._defined.append(name)
        self._kinds[name] = kind

    def _enable(self) -> None:
        name_filter = _step_name_filter(self._prefixes)
        for name, kind in self._kinds.items():
            folder = os.path.join(self._instance, "events", self.group, name)
            if kind == _RECORD_FUNCTION and name_filter:
                try:
                    _write(os.path.join(folder, "filter"), name_filter)
                except OSError:
                    pass  # an older filter syntax: poll() classifies the names anyway
            try:
                _write(os.path.join(folder, "enable"), "1")
            except OSError as err:
                # EINVAL here is, in practice, another uprobe on the same function
                # with a different USDT reference counter: the kernel shares one
                # uprobe per (file, offset) and refuses the mismatch (dmesg says
                # "ref_ctr_offset mismatch"). bcc 0.26's Python passes a stray one.
                hint = ("; another tool (e.g. bcc 0.26, whose uprobes carry a stray "
                        "reference counter) probes the same function: see dmesg"
                        if err.errno == errno.EINVAL else "")
                raise PrerequisiteMissing(
                    f"{_agent()}: cannot enable uprobe event {self.group}/{name}: "
                    f"{err.strerror}{hint}"
                ) from err
            self._enabled.append(name)

    # -- polling --

    def quality(self) -> dict[str, Any]:
        return {"events": self.events, "events_dropped": self.dropped}

    def _poll(self) -> list[Record]:
        if self._pipe < 0:
            return []
        try:
            lines, self._partial = read_trace_pipe(self._pipe, self._partial)
        except OSError as err:
            self.warnings.append(f"{_agent()}: reading {self._instance}/trace_pipe failed: "
                                 f"{err.strerror}; no more markers")
            os.close(self._pipe)
            self._pipe = -1
            return []
        events = []
        lost = False
        for line in lines:
            event = self._event(line)
            if event is not None:
                events.append(event)
            elif b"[LOST " in line:
                lost = True
        now = time.monotonic()
        if lost or now - self._stats_read_at >= _STATS_INTERVAL_S:
            self._stats_read_at = now
            self._read_dropped()
        self.events += len(events)
        return list(events)

    def _event(self, line: bytes) -> MarkerEvent | None:
        parsed = parse_trace_line(line)
        if parsed is None:
            return None
        kind = self._kinds.get(parsed.event)
        if kind is None:
            return None
        tgid = parsed.tgid if parsed.tgid is not None else self._tgid(parsed.tid)
        if tgid not in self._pids:
            return None  # a child the target forked, admitted by event-fork
        name = ""
        if kind == _RECORD_FUNCTION:
            raw = parse_name_arg(parsed.args)
            if raw is None:
                return None  # the kernel could not read the name
            raw = raw[: NAME_LEN_BYTES - 1]
            step_kind = classify_step_name(raw, self._prefixes)
            if step_kind is None:
                return None
            kind, name = step_kind, raw.decode("utf-8", "replace")
        return MarkerEvent(t_mono_ns=parsed.t_mono_ns, pid=tgid, tid=parsed.tid, kind=kind,
                           name=name)

    def _tgid(self, tid: int) -> int | None:
        """The process of thread ``tid``, from /proc (cached); None when it is gone."""
        if tid not in self._tgids:
            tgid = None
            try:
                with open(f"/proc/{tid}/status") as f:
                    for line in f:
                        if line.startswith("Tgid:"):
                            tgid = int(line.split()[1])
                            break
            except (OSError, ValueError):
                pass
            self._tgids[tid] = tgid
        return self._tgids[tid]

    def _read_dropped(self) -> None:
        """Events the instance's ring buffer lost, summed over its CPUs."""
        total = ring_buffer_losses(self._instance)
        if total is not None:
            self.dropped = total

    # -- clean-up --

    def _close(self) -> None:
        """Disable, remove the instance, remove exactly our events, close the libraries.

        Never raises: what fails becomes a warning (and is removed by the next
        agent's start if it was left behind).
        """
        atexit.unregister(self.close)
        if os.getpid() != self._owner_pid:
            return  # a forked child: the probes are its parent's to remove
        if self.instance_name is not None:
            self._read_dropped()
            for name in self._enabled:
                try:
                    _write(os.path.join(self._instance, "events", self.group, name, "enable"), "0")
                except OSError as err:
                    self.warnings.append(f"{_agent()}: cannot disable uprobe event "
                                         f"{self.group}/{name}: {err.strerror}")
        self._enabled = []
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1
        if self.instance_name is not None:
            warning = remove_instance(self._instance)
            if warning:
                self.warnings.append(warning)
            self.instance_name = None
        for name in self._defined:
            warning = _remove_event(self._root, self.group, name)
            if warning:
                self.warnings.append(warning)
        self._defined = []
        for library in self._libraries:
            library.close()
        self._libraries = []
