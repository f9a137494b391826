"""Why each rank ended: its exit status from the kernel, the OOM killer, and its last lines.

Measures, once per target when it exits, a ``RankExit`` record:

- its exit status, from the kernel's process-events connector (netlink,
  ``CONFIG_PROC_EVENTS``): on every task exit ``do_exit`` sends
  ``PROC_EVENT_EXIT`` with the task's ``exit_code``, which ``do_exit`` has just
  set to the code it was called with (wait(2)'s format: ``exit_group(n)`` gives
  ``n << 8``, a fatal signal its number, 0x80 when a core was dumped), and a
  CLOCK_MONOTONIC timestamp (``ktime_get_ns``). Every thread exits through
  ``do_exit``; ``do_group_exit`` passes the group's status to each of them, so
  the thread-group leader's (pid == tgid) is the process's. This is the very
  value a kprobe on ``do_exit`` would fetch as ``$arg1``, without needing
  ``CONFIG_KPROBES`` (which kernels built without kprobes lack, e.g. the one
  this was developed on) and without leaving kernel state behind if the agent
  is killed (the subscription ends with the socket);
- whether the kernel's OOM killer chose it: the ``oom:mark_victim`` tracepoint
  (Linux 4.8+; pid of the victim), enabled in a private tracefs instance of its
  own (perfmon.probes.ftrace), read from that instance's ``trace_pipe``;
- the known cause in the last lines it printed (perfmon.parsers.exit_causes),
  when its stdout/stderr is a regular file its user may read: opened at start,
  as the job's user, through ``/proc/PID/fd/1`` and ``/2``
  (perfmon.probes.job_files.open_job_outputs) and held, so the last 64 KiB can be
  read after the process is gone.

When the connector cannot be used (no privilege, a kernel without it, an agent
outside the initial pid or network namespace), an exit is still recorded when
the target is seen gone: with the status the kernel keeps for a zombie
(``/proc/PID/stat`` field 52, ``source`` proc_stat) while its parent has not
reaped it, else with no status (``source`` unobserved) — never a guess.

Cost: one netlink message per task exiting on the host (filtered to exits by
the kernel since Linux 6.6; by ``poll()`` before), read without blocking; a
read of /proc/PID/stat for each unfinished target per poll; ~20 ms at start per target
(a child process that opens its outputs as its user) and ~10 ms per poll that
sees exits (a child that reads the tails, killed after 1 s). Memory: the
instance's ring buffer (64 KiB per CPU) and a 4 MiB socket buffer.

Needs: CAP_NET_ADMIN for the connector before Linux 6.6 (root); root for tracefs
(CAP_SYS_ADMIN to mount it; lockdown in confidentiality mode forbids it) and to
open a job's outputs as its user (CAP_SETUID, CAP_SETGID); the agent in the
initial pid, user and network namespaces (the connector and tracefs report
global pids, and the connector exists in the initial network namespace only).
"""

from __future__ import annotations

import atexit
import errno
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from perfmon.parsers.errors import PerfmonError
from perfmon.parsers.events import RankExit, Record
from perfmon.parsers.exit_causes import CAUSES, classify_log_tail, describe_status
from perfmon.parsers.proc_connector import (
    CN_IDX_PROC,
    parse_connector_exits,
    subscribe_messages,
    unsubscribe_message,
)
from perfmon.parsers.trace_pipe import oom_victim, parse_event_line
from perfmon.probes.errors import agent_who
from perfmon.probes.ftrace import GROUP_PREFIX, TraceInstance, remove_stale_probes, tracefs_root
from perfmon.probes.job_files import (
    NOT_A_FILE,
    OUTPUT_TAIL_BYTES,
    FileTail,
    JobFileError,
    open_job_outputs,
    read_file_tails,
)
from perfmon.probes.procfs import TargetProcess, process_state
from perfmon.probes.sampler import Source, monotonic_ns

NETLINK_CONNECTOR = 11  # linux/netlink.h: the connector's netlink protocol
_SOCKET_BUFFER_BYTES = 4 << 20
_SO_RCVBUFFORCE = 33  # asm-generic/socket.h; Python's socket module does not name it
# The subscription is checked by watching a child of the agent exit: without the
# connector (a kernel without CONFIG_PROC_EVENTS, another network namespace) no
# event ever comes, and nothing else says so.
_SELF_TEST_TIMEOUT_S = 1.0
# A target found gone whose exit event has not arrived yet: do_exit sends the event
# just after the task becomes a zombie, so it is at most a few microseconds late.
_LATE_EVENT_WAIT_S = 0.05
# A timestamp further than this from the agent's clock is not CLOCK_MONOTONIC.
_CLOCK_TOLERANCE_NS = 10_000_000_000
_OOM_BUFFER_KB_PER_CPU = 64
# /proc/PID/stat: field 52 (Linux 3.5+) is the exit status of a zombie, in wait(2)'s
# format. Counted after the ")" that ends the comm (which may hold spaces).
_STAT_EXIT_CODE = 52 - 3
_STREAMS = {1: "stdout", 2: "stderr"}


def _who(target: TargetProcess) -> str:
    return f"pid {target.pid} ({target.name})"


def _zombie_status(pid: int) -> int | None:
    """The exit status the kernel keeps for zombie ``pid`` (/proc/PID/stat field 52)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    if len(fields) <= _STAT_EXIT_CODE or fields[0] != b"Z":
        return None
    value = fields[_STAT_EXIT_CODE]
    return int(value) if value.isdigit() else None


def _state(target: TargetProcess) -> str:
    """"alive", "zombie" (exited, not reaped) or "gone" (reaped, or its pid reused)."""
    state = process_state(target)
    return "alive" if state == "unknown" else state  # cannot tell: look again at the next poll


@dataclass
class _Output:
    """A target's stdout and/or stderr, held open by the agent until the target exits."""

    fd: int
    stream: str  # "stdout", "stderr", or "stdout+stderr" when both are one file
    identity: tuple[int, int]  # (st_dev, st_ino)


class ExitSource(Source):
    """How each target ends: a ``RankExit`` record per target, when it exits.

    ``hook`` says where exit statuses come from: ``proc_connector`` or, when that
    could not be set up, ``unobserved`` (with a warning saying why); ``oom_watched``
    whether OOM kills are seen. ``warnings`` also names the outputs that will not be
    read because the job's user may not read them, ``notes`` those that are no file
    (a terminal, a pipe, /dev/null: where a job's output often goes).
    """

    name = "exits"

    def __init__(self, targets: list[TargetProcess],
                 tail_bytes: int = OUTPUT_TAIL_BYTES) -> None:
        super().__init__()
        self.targets = targets
        self.tail_bytes = tail_bytes
        self.hook = "unobserved"
        self.oom_watched = False
        self.exits = 0
        self.unobserved = 0
        self.dropped = 0
        self.tails_read = 0
        self.tails_unread = 0
        self._oom: TraceInstance | None = None  # where oom:mark_victim is enabled
        self._pending = {t.pid: t for t in targets}
        self._seen: dict[int, tuple[int, int]] = {}  # pid -> (t_mono_ns, wait status)
        self._oom_victims: set[int] = set()
        self._outputs: dict[int, list[_Output]] = {}
        self._connector: socket.socket | None = None
        self._connector_drops = 0
        self._self_test_pid: int | None = None
        self._kernel_clock = True  # the connector's stamps are CLOCK_MONOTONIC
        self._ring_losses = 0
        self._owner_pid = os.getpid()

    def _start(self) -> None:
        self._owner_pid = os.getpid()
        if not self.targets:
            self.available, self.reason = False, "no target processes"
            return
        atexit.register(self.close)  # an agent that raises still removes its instance
        try:
            self._open_outputs()
            self._open_connector()
            self._watch_oom_kills()
        except BaseException:
            self._close()
            raise

    # -- set-up --

    def _open_outputs(self) -> None:
        """Hold each target's stdout/stderr open when it is a regular file its user may read;
        one warning per reason for those that are not."""
        refused: dict[str, dict[int, list[str]]] = {}  # reason -> pid -> streams
        for target in self.targets:
            try:
                opened = open_job_outputs(target.pid, tuple(_STREAMS))
            except JobFileError as err:
                reason = str(err).split(": ", 1)[-1]
                refused.setdefault(reason, {})[target.pid] = ["stdout", "stderr"]
                continue
            outputs: list[_Output] = []
            for number, value in sorted(opened.items()):
                stream = _STREAMS[number]
                if isinstance(value, str):
                    refused.setdefault(value, {}).setdefault(target.pid, []).append(stream)
                    continue
                st = os.fstat(value)
                same = next((o for o in outputs if o.identity == (st.st_dev, st.st_ino)), None)
                if same is not None:  # 2>&1: one file, read once
                    os.close(value)
                    same.stream = "stdout+stderr"
                    continue
                outputs.append(_Output(value, stream, (st.st_dev, st.st_ino)))
            self._outputs[target.pid] = outputs
        for reason, pids in refused.items():  # one line per reason, not per rank
            whose = [f"pid {pid} {' and '.join(streams)}" for pid, streams in pids.items()]
            shown = ", ".join(whose[:8]) + (f" and {len(whose) - 8} more" if len(whose) > 8
                                            else "")
            told = self.notes if reason.endswith(NOT_A_FILE) else self.warnings
            told.append(f"not read for exit causes ({reason}): {shown}")

    def _open_connector(self) -> None:
        """Subscribe to the kernel's exit events and check that they come; a warning when not."""
        why = None
        try:
            sock = socket.socket(socket.AF_NETLINK,
                                 socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                                 NETLINK_CONNECTOR)
        except OSError as err:
            self.warnings.append(f"{agent_who()}: exit statuses are not observed: no netlink "
                                 f"connector socket ({err.strerror}); exits are recorded "
                                 "when seen, with the status only while unreaped")
            return
        self._connector = sock
        try:
            # A burst of exits on a busy host must not overflow it: root may force a size
            # above net.core.rmem_max (the option's number is asm-generic's: x86-64, arm64).
            try:
                if os.uname().machine not in ("x86_64", "aarch64"):
                    raise OSError(errno.ENOPROTOOPT, "SO_RCVBUFFORCE")
                sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, _SOCKET_BUFFER_BYTES)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER_BYTES)
            sock.bind((0, CN_IDX_PROC))
            for message in subscribe_messages(os.getpid()):  # poll() filters on older kernels
                sock.send(message)
            why = self._self_test()
        except OSError as err:
            why = (f"{err.strerror} (the connector exists only in the initial network "
                   "namespace)" if err.errno == errno.ECONNREFUSED else err.strerror)
        if why is None:
            self.hook = "proc_connector"
            return
        self._close_connector()
        self.warnings.append(f"{agent_who()}: exit statuses are not observed: the kernel's process "
                             f"events connector: {why}; exits are recorded when seen, with the "
                             "status only while unreaped")

    def _self_test(self) -> str | None:
        """Why the connector delivers no exit events (a child's exit is watched), or None."""
        child = subprocess.Popen([sys.executable, "-I", "-S", "-c", ""],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, env={}, cwd="/")
        self._self_test_pid = child.pid
        child.wait()
        deadline = time.monotonic() + _SELF_TEST_TIMEOUT_S
        while self._self_test_pid not in self._seen:
            left = deadline - time.monotonic()
            if left <= 0 or self._connector is None:
                self._self_test_pid = None
                return (f"no exit event for a test process within {_SELF_TEST_TIMEOUT_S:g} s "
                        "(a kernel without CONFIG_PROC_EVENTS, or an agent outside the "
                        "initial pid namespace)")
            select.select([self._connector], [], [], left)
            self._drain_connector()
        t_ns, _ = self._seen.pop(self._self_test_pid)
        self._self_test_pid = None
        if abs(monotonic_ns() - t_ns) > _CLOCK_TOLERANCE_NS:
            # Not CLOCK_MONOTONIC (very old kernels): exits are stamped when read.
            self._kernel_clock = False
        return None

    def _watch_oom_kills(self) -> None:
        """Enable oom:mark_victim in an instance of our own; a warning when it cannot be."""
        try:
            root = tracefs_root()
            self.warnings.extend(remove_stale_probes(root))
            self._oom = oom = TraceInstance(root, f"{GROUP_PREFIX}{self._owner_pid}",
                                            _OOM_BUFFER_KB_PER_CPU)
            try:
                oom.enable("oom", "mark_victim")
            except FileNotFoundError:
                raise OSError(errno.ENOENT, "the kernel has no oom:mark_victim tracepoint "
                                            "(Linux < 4.8)") from None
            oom.open_pipe()
        except (PerfmonError, OSError) as err:
            self._close_instance()
            reason = err.strerror if isinstance(err, OSError) else str(err)
            self.warnings.append(f"{agent_who()}: OOM kills are not watched (oom_killed is null): "
                                 f"{reason}")
            return
        self.oom_watched = True

    # -- polling --

    def quality(self) -> dict[str, Any]:
        return {"exits": self.exits, "exits_unobserved": self.unobserved,
                "events_dropped": self.dropped, "log_tails_read": self.tails_read,
                "log_tails_unread": self.tails_unread}

    def _poll(self) -> list[Record]:
        self._drain_connector()
        self._drain_oom()
        ended: list[tuple[TargetProcess, int, int | None, str]] = []
        waited = False
        for pid, target in list(self._pending.items()):
            seen = self._seen.pop(pid, None)
            state = "gone"
            if seen is None:
                state = _state(target)
                if state == "alive":
                    continue
                if self._connector is not None and not waited:
                    waited = True
                    select.select([self._connector], [], [], _LATE_EVENT_WAIT_S)
                    self._drain_connector()
                    self._drain_oom()
                    seen = self._seen.pop(pid, None)
            if seen is not None:
                ended.append((target, seen[0], seen[1], "proc_connector"))
            else:
                status = _zombie_status(pid) if state == "zombie" else None
                ended.append((target, monotonic_ns(), status,
                              "unobserved" if status is None else "proc_stat"))
            del self._pending[pid]
        if not ended:
            return []
        causes = self._log_causes([target for target, *_ in ended])
        records: list[Record] = []
        for target, t_ns, status, source in ended:
            fields: dict[str, Any] = (describe_status(status) if status is not None else
                                      {"exit_code": None, "signal": None, "core_dumped": None})
            records.append(RankExit(
                t_mono_ns=t_ns, pid=target.pid, **fields,
                oom_killed=(target.pid in self._oom_victims) if self.oom_watched else None,
                log_tail_cause=causes.get(target.pid), source=source, rank=target.rank))
            self.exits += 1
            self.unobserved += source == "unobserved"
        return records

    def _drain_connector(self) -> None:
        sock = self._connector
        while sock is not None:
            try:
                datagram = sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno == errno.ENOBUFS:
                    # The socket buffer overflowed: some exits on the host were lost. A
                    # target's among them is recorded when it is seen gone.
                    self._connector_drops += 1
                    self.dropped = self._connector_drops + self._ring_losses
                    continue
                self.warnings.append(f"{agent_who()}: reading exit events failed: {err.strerror}; "
                                     "exits are recorded when seen from now on")
                self._close_connector()
                self.hook = "unobserved"
                return
            now = monotonic_ns()
            for event in parse_connector_exits(datagram):
                # The leader's exit is the process's (do_group_exit gives every thread
                # the group's status); other threads' and other processes' are dropped.
                if event.pid != event.tgid:
                    continue
                if event.pid in self._pending or event.pid == self._self_test_pid:
                    t_ns = event.t_mono_ns if self._kernel_clock else now
                    self._seen.setdefault(event.pid, (t_ns, event.wait_status))

    def _drain_oom(self) -> None:
        oom = self._oom
        if oom is None or not oom.reading:
            return
        try:
            lines = oom.read_lines()
        except OSError as err:  # the pipe is closed: nothing more will come
            self.warnings.append(f"{agent_who()}: reading {oom.path}/trace_pipe failed: "
                                 f"{err.strerror}; OOM kills are no longer watched")
            return
        lost = False
        for line in lines:
            parsed = parse_event_line(line)
            if parsed is None:
                lost = lost or b"[LOST " in line
                continue
            victim = oom_victim(parsed)
            if victim is None:
                continue
            # The victim is a task: its process's leader, in practice, or a thread of it.
            tgid = victim if victim in self._pending else _tgid(victim)
            if tgid is not None:
                self._oom_victims.add(tgid)
        if lost:
            # OOM kills are rare: the per-CPU statistics are read only when the pipe says
            # events were lost, and at close.
            self._ring_losses = max(self._ring_losses, oom.losses() or 0)
            self.dropped = self._connector_drops + self._ring_losses

    def _log_causes(self, targets: list[TargetProcess]) -> dict[int, dict[str, Any]]:
        """The known cause in the tails of these targets' outputs (pid -> cause), read by one
        child process; the outputs are closed afterwards."""
        outputs = {t.pid: self._outputs.pop(t.pid, []) for t in targets}
        fds = [o.fd for held in outputs.values() for o in held]
        try:
            tails = read_file_tails(fds, self.tail_bytes)
        finally:
            for fd in fds:
                os.close(fd)
        causes = {}
        names = {t.pid: _who(t) for t in targets}
        for pid, held in outputs.items():
            found = []
            for output in held:
                tail = tails.get(output.fd)
                if not isinstance(tail, FileTail):
                    self.tails_unread += 1
                    self.warnings.append(f"{names[pid]}: its {output.stream} was not read for "
                                         f"the exit's cause: {tail}")
                    continue
                self.tails_read += 1
                cause = classify_log_tail(_tail_text(tail))
                if cause is not None:
                    found.append({**cause, "stream": output.stream})
            if found:
                causes[pid] = min(found, key=lambda c: CAUSES.index(c["cause"]))
        return causes

    # -- clean-up --

    def _close_connector(self) -> None:
        if self._connector is None:
            return
        try:
            self._connector.send(unsubscribe_message(os.getpid()))
        except OSError:
            pass  # closing the socket ends the subscription anyway
        self._connector.close()
        self._connector = None

    def _close_instance(self) -> None:
        if self._oom is not None:
            warning = self._oom.close()  # disables mark_victim with it
            if warning:
                self.warnings.append(warning)
            self._oom = None

    def _close(self) -> None:
        """Unsubscribe, remove the instance, close the held outputs; never raises."""
        atexit.unregister(self.close)
        if os.getpid() != self._owner_pid:
            return  # a forked child: the instance and the fds' owner is its parent
        self._close_connector()
        if self._oom is not None:
            losses = self._oom.losses()
            if losses is not None:
                self._ring_losses = losses
                self.dropped = self._connector_drops + losses
        self._close_instance()
        for held in self._outputs.values():
            for output in held:
                os.close(output.fd)
        self._outputs = {}


def _tail_text(tail: FileTail) -> str:
    """A tail as text; a first line cut by the tail's start is dropped."""
    text = tail.data.decode("utf-8", "replace")
    if tail.offset > 0:
        text = text.partition("\n")[2]
    return text


def _tgid(tid: int) -> int | None:
    """The process of thread ``tid``, from /proc; None when it is gone."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f.read(64 << 10).splitlines():
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None

