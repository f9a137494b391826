"""What this host lets the agent do, each capability checked for real (``perfmon-agent
doctor``; the node service runs the host checks once at start and exports them).

Measures: whether the kernel loads a BPF program (the bpf() syscall, a tracing-type
"r0 = 0; exit"), has BTF and uprobes, where tracefs is mounted and whether its
``uprobe_events`` can be written, perf_event_paranoid, the lockdown mode, the
agent's capabilities, whether bcc compiles, loads and attaches a program (a uprobe on
the agent's own ``getpid``), whether the tracefs backend's prerequisites hold,
NVML's driver and py-spy's version. The job's checks are perfmon.agent.tools.doctor's,
made of the probes' own functions.

Changes nothing on the host: where tracefs or securityfs is not mounted, the mount
the agent would make is tried in a child process with a mount namespace of its own
(:func:`in_private_mounts`), which vanishes with it. The uprobe on ``getpid`` is
filtered to the agent's pid and detached at once.

Cost: ~1 s, mostly bcc's compile. Needs: root for a complete answer (without it the
checks say what is refused).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from perfmon.parsers.errors import PerfmonError
from perfmon.parsers.host_facts import (
    ABSENT,
    DEGRADED,
    FAILED,
    OK,
    Check,
    has_filesystem,
    kernel_version,
    lockdown_mode,
    pyspy_version,
    tracefs_mount_points,
)
from perfmon.parsers.procfs import (
    CAP_BPF,
    CAP_PERFMON,
    CAP_SYS_ADMIN,
    CAP_SYS_PTRACE,
    mapped_file,
    parse_maps,
)
from perfmon.probes.files import MappedLibrary
from perfmon.probes.ftrace import TRACEFS_MOUNT_POINT, uprobe_events_root
from perfmon.probes.procfs import agent_capabilities, read_proc
from perfmon.probes.pyspy import find_pyspy
from perfmon.probes.tracefs import check_tracefs_prerequisites
from perfmon.probes.uprobes import (
    check_ebpf_prerequisites,
    close_bpf,
    kernel_headers_dir,
    pass_zero_ref_ctr_offset,
)

# The host checks, in the table's order: also the ``check`` label values of the
# perfmon_capability gauge, so this fixed set bounds that label.
HOST_CHECK_NAMES = ("bpf", "btf", "uprobes", "tracefs", "perf_event_paranoid", "lockdown",
                    "capabilities", "bcc", "tracefs_backend", "nvml", "pyspy")

MOUNT_TRACEFS = f"mount -t tracefs nodev {TRACEFS_MOUNT_POINT}"
NO_UPROBES = "iterations from py-spy stack samples (--iteration-source auto)"
_BTF = "/sys/kernel/btf/vmlinux"
_UPROBE_PMU = "/sys/bus/event_source/devices/uprobe/type"
_PARANOID = "/proc/sys/kernel/perf_event_paranoid"
_SECURITYFS = "/sys/kernel/security"
_LOCKDOWN = f"{_SECURITYFS}/lockdown"
_SMALL_READ_BYTES = 64 << 10  # any /proc or /sys file read here is far smaller
_CHILD_TIMEOUT_S = 5.0
_PYSPY_TIMEOUT_S = 5.0

# bpf(2): BPF_PROG_LOAD of "r0 = 0 (BPF_ALU64|BPF_MOV|BPF_K); exit (BPF_JMP|BPF_EXIT)",
# two struct bpf_insn, in a zeroed union bpf_attr. Syscall numbers per architecture.
_BPF_SYSCALL = {"x86_64": 321, "aarch64": 280}
_BPF_PROG_LOAD = 5
PROG_TYPE_SOCKET_FILTER, PROG_TYPE_KPROBE = 1, 2  # a uprobe program is of the kprobe type
_RETURN_ZERO = struct.pack("<BBhiBBhi", 0xB7, 0, 0, 0, 0x95, 0, 0, 0)
_BPF_ATTR_BYTES = 128
# unshare(2)/mount(2) flags (linux/sched.h, linux/mount.h).
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000

# Capabilities beyond those of bcc and tracefs (see docs/requirements.md): what each
# gives, what is lost without it, and the kernel from which it is no longer needed.
_CAP_NET_ADMIN, _CAP_SETGID, _CAP_SETUID, _CAP_SYS_CHROOT = 12, 6, 7, 18
_OTHER_CAPABILITIES = (
    ((_CAP_SETUID, _CAP_SETGID, _CAP_SYS_CHROOT), "CAP_SETUID, CAP_SETGID, CAP_SYS_CHROOT",
     "files the job names (its config.json) and its outputs are not read", None),
    ((_CAP_NET_ADMIN,), "CAP_NET_ADMIN",
     "no exit statuses from the kernel's process-events connector", (6, 6)),
)


def _read_small(path: str) -> str:
    """The start of a small kernel file; OSError when it cannot be read."""
    with open(path, "rb") as f:
        return f.read(_SMALL_READ_BYTES).decode("utf-8", "replace")


def _has(caps: int, cap: int) -> bool:
    return bool(caps >> cap & 1)


def _libc_call(name: str, *args: Any) -> None:
    """A libc call returning -1 on failure; OSError with its errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str) -> None:
    """mount(2) with no flags; OSError."""
    _libc_call("mount", source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(0),
               None)


def in_private_mounts(action: Callable[[], str]) -> tuple[bool, str]:
    """Run ``action`` in a forked child with a mount namespace of its own, a throwaway
    copy of the agent's mounts: what it mounts there vanishes with it and the host
    never sees it. (True, what it returned) or (False, why it failed).

    Call it before any thread is started (a forked child has only the caller's).
    Needs CAP_SYS_ADMIN.
    """
    try:
        read_fd, write_fd = os.pipe()
    except OSError as err:
        return False, f"pipe: {err.strerror}"
    try:
        pid = os.fork()
    except OSError as err:
        os.close(read_fd)
        os.close(write_fd)
        return False, f"fork: {err.strerror}"
    if pid == 0:  # the child: ends in os._exit, whatever happens
        ok, text = False, ""
        try:
            os.close(read_fd)
            _libc_call("unshare", _CLONE_NEWNS)
            # Private before anything is mounted: the copy's mounts still propagate to
            # their peers on the host until they are made private.
            _libc_call("mount", b"none", b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None)
            text, ok = action(), True
        except BaseException as err:
            text = str(err) or type(err).__name__
        try:
            os.write(write_fd, text.encode("utf-8", "replace")[:4096])
        finally:
            os._exit(0 if ok else 1)
    os.close(write_fd)
    try:
        answer = _read_child(read_fd, time.monotonic() + _CHILD_TIMEOUT_S)
    finally:
        os.close(read_fd)
    if answer is None:
        _reap_child(pid)
        return False, f"no answer within {_CHILD_TIMEOUT_S:g} s"
    return _reap_child(pid) == 0, answer


def _read_child(fd: int, deadline: float) -> str | None:
    """All the child writes before it closes the pipe; None past the deadline."""
    chunks: list[bytes] = []
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return b"".join(chunks).decode("utf-8", "replace")
        chunks.append(chunk)
    return None


def _reap_child(pid: int) -> int:
    """The child's exit status (killed first when it is still running)."""
    done, status = os.waitpid(pid, os.WNOHANG)
    if done == 0:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def load_trivial_program(prog_type: int) -> int:
    """Load "r0 = 0; exit" as a BPF program of ``prog_type`` through the bpf() syscall,
    and close it; 0 when the kernel took it, else its errno."""
    number = _BPF_SYSCALL.get(os.uname().machine)
    if number is None:
        return errno.ENOSYS
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    insns = ctypes.create_string_buffer(_RETURN_ZERO, len(_RETURN_ZERO))
    license_ = ctypes.create_string_buffer(b"GPL")
    attr = ctypes.create_string_buffer(_BPF_ATTR_BYTES)
    # union bpf_attr for BPF_PROG_LOAD: u32 prog_type, u32 insn_cnt, u64 insns, u64 license.
    struct.pack_into("<IIQQ", attr, 0, prog_type, 2, ctypes.addressof(insns),
                     ctypes.addressof(license_))
    fd = libc.syscall(ctypes.c_long(number), ctypes.c_long(_BPF_PROG_LOAD), attr,
                      ctypes.c_ulong(_BPF_ATTR_BYTES))
    if fd < 0:
        return ctypes.get_errno() or errno.EINVAL
    os.close(fd)
    return 0


def bpf_check() -> Check:
    err = load_trivial_program(PROG_TYPE_KPROBE)
    if err == 0:
        return Check("bpf", OK, "the bpf() syscall loads a tracing program (kprobe/uprobe type)")
    base = load_trivial_program(PROG_TYPE_SOCKET_FILTER)
    why = (f"refused a tracing program ({errno.errorcode.get(err, err)}: {os.strerror(err)})"
           + ("; a socket filter loads" if base == 0 else ""))
    if err == errno.ENOSYS:
        why = f"no bpf() syscall here (CONFIG_BPF_SYSCALL off, or {os.uname().machine})"
    return Check("bpf", FAILED, f"the kernel {why}",
                 fix="run as root, or grant CAP_BPF and CAP_PERFMON (Linux >= 5.8)",
                 fallback="no eBPF: the tracefs backend for iterations, no CUDA/NCCL counters")


def btf_check() -> Check:
    if os.path.exists(_BTF):
        return Check("btf", OK, f"{_BTF} present")
    return Check("btf", ABSENT, f"no {_BTF}: not needed (bcc compiles the agent's programs "
                                "against kernel headers)")


def uprobes_check(tracefs_roots: list[str]) -> Check:
    try:
        pmu = _read_small(_UPROBE_PMU).strip()
        return Check("uprobes", OK, f"the kernel's uprobe PMU (perf type {pmu})")
    except OSError:
        pass
    events = [r for r in tracefs_roots if os.path.exists(os.path.join(r, "uprobe_events"))]
    if events:
        return Check("uprobes", OK, f"no uprobe PMU (Linux < 4.17); {events[0]}/uprobe_events")
    return Check("uprobes", FAILED, f"no {_UPROBE_PMU} and no uprobe_events in tracefs",
                 fix="a kernel with CONFIG_UPROBES and CONFIG_UPROBE_EVENTS", fallback=NO_UPROBES)


def tracefs_checks(caps: int, roots: list[str]) -> tuple[Check, Check]:
    """(tracefs mounted and ``uprobe_events`` writable, the tracefs backend usable).

    Unmounted, the agent mounts tracefs itself when it starts: that is tried here in
    a throwaway mount namespace, so the host is left as it is.
    """
    lost = "OOM kills are not attributed (oom_killed null); no tracefs uprobe backend"
    if not roots and not _has(caps, CAP_SYS_ADMIN):
        fail = "not mounted, and mounting it needs CAP_SYS_ADMIN, which the agent lacks"
        return (Check("tracefs", FAILED, fail, fix=MOUNT_TRACEFS, fallback=lost),
                Check("tracefs_backend", FAILED, fail, fix=MOUNT_TRACEFS,
                      fallback="the bcc backend only"))
    if roots:
        tracefs = _run_check(uprobe_events_root)
        backend = _run_check(check_tracefs_prerequisites)
        where = f"mounted at {roots[0]}"
    else:
        tracefs = in_private_mounts(uprobe_events_root)
        backend = in_private_mounts(check_tracefs_prerequisites)
        where = (f"not mounted; the agent mounts it at {TRACEFS_MOUNT_POINT} when it starts "
                 "(tried in a private mount namespace)")
    first = (Check("tracefs", OK, f"{where}; uprobe_events writable") if tracefs[0] else
             Check("tracefs", FAILED, f"{where}: {tracefs[1]}", fix=MOUNT_TRACEFS, fallback=lost))
    second = (Check("tracefs_backend", OK, "tracefs uprobes usable (uprobe_events, instances)")
              if backend[0] else
              Check("tracefs_backend", FAILED, backend[1], fix="run as root (CAP_SYS_ADMIN)",
                    fallback="the bcc backend only; without it, " + NO_UPROBES))
    return first, second


def _run_check(check: Callable[[], str]) -> tuple[bool, str]:
    try:
        return True, check()
    except PerfmonError as err:
        return False, str(err)


def paranoid_check(caps: int) -> Check:
    try:
        value = _read_small(_PARANOID).strip()
    except OSError as err:
        return Check("perf_event_paranoid", ABSENT, f"cannot read {_PARANOID}: {err.strerror}")
    if _has(caps, CAP_PERFMON) or _has(caps, CAP_SYS_ADMIN):
        return Check("perf_event_paranoid", OK,
                     f"{value} (no limit for the agent: it has CAP_PERFMON or CAP_SYS_ADMIN)")
    return Check("perf_event_paranoid", FAILED,
                 f"{value}, and the agent lacks CAP_PERFMON: perf events (uprobes) on other "
                 "processes are refused", fix="run as root, or grant CAP_PERFMON",
                 fallback=NO_UPROBES)


def lockdown_check(caps: int) -> Check:
    text: str | None = None
    try:
        text = _read_small(_LOCKDOWN)
    except OSError:
        try:
            filesystems = _read_small("/proc/filesystems")
        except OSError:
            filesystems = ""
        if not has_filesystem(filesystems, "securityfs"):
            return Check("lockdown", OK, "none (the kernel has no securityfs, so no lockdown)")
        if _has(caps, CAP_SYS_ADMIN):
            ok, answer = in_private_mounts(_read_lockdown)
            text = answer if ok else None
        if text is None:
            return Check("lockdown", OK, f"unknown ({_SECURITYFS} not mounted); the tracefs "
                                         "and bcc lines show its effects")
    mode = lockdown_mode(text) if text else "none"
    if mode in ("none", "integrity", None):
        # integrity forbids bpf_probe_write_user and debugfs writes: nothing the agent uses.
        return Check("lockdown", OK, f"{mode or 'none (no lockdown LSM)'}")
    return Check("lockdown", DEGRADED,
                 f"{mode}: tracefs and BPF reads of kernel memory are forbidden",
                 fix="boot with lockdown=integrity or none (or without Secure Boot's lockdown)",
                 fallback="no tracefs backend, no OOM-kill attribution")


def _read_lockdown() -> str:
    """In a private mount namespace: securityfs mounted, its lockdown file read."""
    mount("securityfs", _SECURITYFS, "securityfs")
    try:
        return _read_small(_LOCKDOWN)
    except FileNotFoundError:
        return ""  # securityfs without the lockdown LSM


def capabilities_check(caps: int) -> Check:
    lost = []
    if not _has(caps, CAP_SYS_PTRACE):
        lost.append("CAP_SYS_PTRACE: other users' jobs cannot be read (maps, py-spy)")
    if not (_has(caps, CAP_SYS_ADMIN) or (_has(caps, CAP_BPF) and _has(caps, CAP_PERFMON))):
        lost.append("CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN): no eBPF (bcc)")
    if not _has(caps, CAP_SYS_ADMIN):
        lost.append("CAP_SYS_ADMIN: no tracefs backend, libraries opened by path "
                    "(inode checked) rather than /proc/PID/map_files, and on Linux 6.16+ "
                    "(and stable kernels since mid-2025) bcc's uprobes only through tracefs "
                    "uprobe_events (the kernel's uprobe PMU wants CAP_SYS_ADMIN)")
    kernel = kernel_version(os.uname().release) or (0, 0)
    for numbers, names, what, until in _OTHER_CAPABILITIES:
        if (until is None or kernel < until) and not all(_has(caps, c) for c in numbers):
            lost.append(f"{names}: {what}")
    if not lost:
        return Check("capabilities", OK, "every capability the agent uses (root)")
    return Check("capabilities", FAILED if not _has(caps, CAP_SYS_PTRACE) else DEGRADED,
                 "missing " + "; ".join(lost), fix="run as root with full capabilities",
                 fallback="what each missing capability gives is lost (above)")


def bcc_check() -> Check:
    fallback = "the tracefs backend for iterations; no CUDA/NCCL counters"
    try:
        import bcc
    except ImportError as err:
        return Check("bcc", FAILED, f"import bcc: {err}", fallback=fallback,
                     fix="apt-get install python3-bpfcc (and a virtualenv made with "
                         "--system-site-packages)")
    version = getattr(bcc, "__version__", "?")
    said: list[str] = []
    try:
        check_ebpf_prerequisites()  # capabilities and kernel headers, as attach checks them
        with _stderr_captured(said):
            compiled_and_attached()
    except Exception as err:  # PerfmonError, or bcc's bare Exception on compile/attach
        told = f" (libbcc: {'; '.join(said[-2:])})" if not isinstance(err, PerfmonError) else ""
        return Check("bcc", FAILED, f"bcc {version}: {str(err).strip()}{told}",
                     fallback=fallback, facts={"version": version},
                     fix="run as root with full capabilities, with kernel headers for this "
                         f"kernel (apt-get install linux-headers-{os.uname().release})")
    return Check("bcc", OK, f"bcc {version}: compiled a program (headers at "
                            f"{kernel_headers_dir()}), loaded it and attached a uprobe",
                 facts={"version": version})


@contextmanager
def _stderr_captured(lines: list[str]) -> Iterator[None]:
    """fd 2 goes to a temporary file meanwhile (libbcc and clang print there, not to
    Python's stderr); its non-empty lines are added to ``lines`` afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read(_SMALL_READ_BYTES).decode("utf-8", "replace")
            lines += [line.strip() for line in text.splitlines() if line.strip()]


def compiled_and_attached() -> None:
    """Compile a trivial program with bcc, attach it as a uprobe on this process's own
    getpid (filtered to this pid) and detach it; bcc's exception when it cannot.

    libc is named as the agent names a job's library, ``/proc/self/fd/N``: where the
    kernel refuses the uprobe PMU (uprobes._attach_hint), bcc's tracefs fallback names
    its event after the path, and bcc's own ``/proc/PID/root/usr/lib/...`` for "c"
    exceeds the kernel's 64-character event name, failing where attach works.
    """
    from bcc import BPF

    libc = mapped_file(parse_maps(read_proc(os.getpid(), "maps")), "libc.so")  # type: ignore[arg-type]
    if libc is None:
        raise PerfmonError("the agent's own libc is not mapped (a static Python?)")
    library = MappedLibrary(os.getpid(), libc)
    try:
        pass_zero_ref_ctr_offset()  # as the agent attaches: never a stray USDT counter offset
        bpf = BPF(text=b"int perfmon_doctor(void *ctx) { return 0; }")
        try:
            bpf.attach_uprobe(name=library.probe_path.encode(), sym=b"getpid",
                              fn_name=b"perfmon_doctor", pid=os.getpid())
        finally:
            close_bpf(bpf, [library])
    finally:
        library.close()


def nvml_check(needed: bool) -> Check:
    """NVML and the driver. Missing is ``absent`` (nothing to measure) unless the host
    has NVIDIA devices or ``needed`` (the job uses CUDA)."""
    devices = glob.glob("/dev/nvidia[0-9]*")
    try:
        from perfmon.probes.nvml import driver_info

        info = driver_info()
    except (ImportError, PerfmonError) as err:
        if not devices and not needed:
            return Check("nvml", ABSENT, f"no NVIDIA GPU (no /dev/nvidia*): nothing to measure "
                                         f"({err})")
        return Check("nvml", FAILED, str(err), fallback="no GPU figures (measured as a CPU job)",
                     fix="install and load the NVIDIA driver (libnvidia-ml.so.1); pip install "
                         "nvidia-ml-py")
    return Check("nvml", OK, f"driver {info.driver_version}, NVML {info.nvml_version}, "
                             f"{info.gpu_count} GPU(s)",
                 facts={"driver_version": info.driver_version, "gpus": info.gpu_count})


def pyspy_check() -> Check:
    fallback = "no stack sampling (phases, hang stacks); without uprobes no iterations"
    try:
        path = find_pyspy()
        done = subprocess.run([path, "--version"], capture_output=True, timeout=_PYSPY_TIMEOUT_S,
                              check=False, stdin=subprocess.DEVNULL)
    except (PerfmonError, OSError, subprocess.TimeoutExpired) as err:
        return Check("pyspy", FAILED, str(err), fix="pip install py-spy", fallback=fallback)
    version = pyspy_version(done.stdout[:4096].decode("utf-8", "replace"))
    if done.returncode != 0 or version is None:
        return Check("pyspy", FAILED, f"{path} --version failed (exit {done.returncode})",
                     fix="pip install --force-reinstall py-spy", fallback=fallback)
    return Check("pyspy", OK, f"py-spy {version} ({path})",
                 facts={"version": version, "path": path})


def host_checks(job_uses_cuda: bool = False) -> list[Check]:
    """Every host check, in HOST_CHECK_NAMES' order. Forks (the tracefs and lockdown
    checks): call it before starting threads."""
    caps = agent_capabilities()
    try:
        roots = tracefs_mount_points(_read_small("/proc/self/mounts"))
    except OSError:
        roots = []
    tracefs, backend = tracefs_checks(caps, roots)
    lockdown = lockdown_check(caps)
    bcc = bcc_check()
    if not bcc.works and not backend.works:  # neither uprobe backend: py-spy finds iterations
        bcc = replace(bcc, fallback=f"{NO_UPROBES}; no CUDA/NCCL counters")
        backend = replace(backend, fallback=NO_UPROBES)
    return [bpf_check(), btf_check(), uprobes_check(roots), tracefs, paranoid_check(caps),
            lockdown, capabilities_check(caps), bcc, backend, nvml_check(job_uses_cuda),
            pyspy_check()]
