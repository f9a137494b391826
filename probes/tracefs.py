"""Training-step markers from the kernel's own uprobe trace events: no bcc, no LLVM, no headers.

Measures: exactly what :class:`perfmon.probes.uprobes.MarkerProbe` measures, as the same
``Marker`` records: the CLOCK_MONOTONIC time of every ``Optimizer.step``,
``Optimizer.zero_grad`` and DataLoader ``__next__`` entry (the C++ entry point of
PyTorch's ``record_function``, whose name is read in the trap) and of every
``torch::autograd::Engine::execute`` entry and return (``backward_enter`` /
``backward_exit``) and the time blocked in c10d collective waits (a ``waits`` record
a step, from probes.waits; ``wait_enter`` / ``wait_exit`` only with ``set_raw_waits``).
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
next probe's ``start()`` (:func:`perfmon.probes.ftrace.remove_stale_probes`). Finding
tracefs and handling the instance are perfmon.probes.ftrace's, reading trace_pipe's
lines perfmon.parsers.trace_pipe's.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import os
import time
from typing import Any

from perfmon.parsers.events import WAIT_MARKERS, Marker, Record
from perfmon.parsers.procfs import CAP_SYS_ADMIN, CAP_SYS_PTRACE, missing_capabilities
from perfmon.parsers.trace_pipe import (
    classify_step_name,
    parse_name_arg,
    parse_trace_line,
    step_name_filter,
)
from perfmon.parsers.wait_symbols import WaitPoint
from perfmon.probes.errors import (
    NoSuchProcess,
    PrerequisiteMissing,
    PrivilegeError,
    agent_who,
)
from perfmon.probes.files import MappedLibrary
from perfmon.probes.ftrace import (
    GROUP_PREFIX,
    TraceInstance,
    buffer_size_kb,
    error_log_tail,
    remove_stale_probes,
    remove_uprobe_event,
    tracefs_write,
    uprobe_events_root,
)
from perfmon.probes.procfs import TargetProcess, agent_capabilities, thread_group, thread_ids
from perfmon.probes.sampler import Source, monotonic_ns
from perfmon.probes.torch_symbols import find_torch_offsets, open_torch_library
from perfmon.probes.uprobes import (
    DEFAULT_STEP_KINDS,
    NAME_LEN_BYTES,
    UpdateAccount,
    step_prefixes,
)
from perfmon.probes.waits import WaitAccount

# The name argument of record_function_enter_new(const std::string& name, ...):
# its class return value takes the first argument register, so the std::string*
# is the second; libstdc++ keeps the char* at offset 0 of std::string, hence two
# dereferences. Per architecture, as the kernel names the registers.
_NAME_FETCH = {
    "x86_64": "+0(+0(%si)):ustring",
    "aarch64": "+0(+0(%x1)):ustring",
}
# The ring buffer's loss counters are re-read at most this often (s).
_STATS_INTERVAL_S = 1.0
_RECORD_FUNCTION = "record_function"  # an rf_enter event: classified by its name
# Event numbers: unique within the agent, so that several probes in one agent
# (same group) never define the same event name.
_EVENT_NUMBERS = {"rf": itertools.count(), "bw": itertools.count(), "wait": itertools.count()}


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
            f"{agent_who()}: missing capabilities {', '.join(missing)} for tracefs uprobes: run "
            "as root (with full capabilities), or grant CAP_SYS_ADMIN and CAP_SYS_PTRACE")
    machine = os.uname().machine
    if machine not in _NAME_FETCH:
        raise PrerequisiteMissing(
            f"{agent_who()}: tracefs uprobes: reading record_function names is only "
            f"implemented on {', '.join(sorted(_NAME_FETCH))}, not {machine}"
        )
    return uprobe_events_root()


# --- the probe ----------------------------------------------------------------

class TracefsMarkerProbe(Source):
    """Tracefs uprobe events on the step markers of one or more PyTorch processes.

    ``poll()`` returns the markers delivered since the last call without
    blocking; ``dropped`` counts events the kernel overwrote or could not store
    because the instance's ring buffer was full. ``warnings`` lists degraded
    features (e.g. no backward probe) and clean-up that failed.
    """

    name = "tracefs"

    def __init__(self, targets: list[TargetProcess],
                 step_kinds: tuple[str, ...] = DEFAULT_STEP_KINDS, *,
                 microbatches: int | None = None) -> None:
        super().__init__()
        self._prefixes = step_prefixes(step_kinds)
        self.targets = targets
        self.dropped = 0
        self.updates = UpdateAccount(microbatches)
        self.events = 0
        self.group = f"{GROUP_PREFIX}{os.getpid()}"
        self._root = ""
        self._trace: TraceInstance | None = None  # the private instance, while started
        self._kinds: dict[str, str] = {}  # our event name -> marker kind or _RECORD_FUNCTION
        self._defined: list[str] = []
        self._enabled: list[str] = []
        self._libraries: list[MappedLibrary] = []
        self._pids = {t.pid for t in targets}
        self._tgids: dict[int, int | None] = {}
        self._stats_read_at = 0.0
        self._owner_pid = os.getpid()
        self._waits = WaitAccount()  # collective waits, one record a step (probes.waits)
        self._waits_probed: set[int] = set()
        self.wait_points: dict[int, list[WaitPoint]] = {}  # pid -> its wait points probed
        self.waits_on = True
        self.raw_waits = False  # (set_raw_waits)

    @property
    def instance_name(self) -> str | None:
        """The tracefs instance's name while the probe is started (None before and after)."""
        return self._trace.name if self._trace is not None else None

    def _start(self) -> None:
        self._owner_pid = os.getpid()
        self.group = f"{GROUP_PREFIX}{self._owner_pid}"
        self._root = check_tracefs_prerequisites()
        self.warnings.extend(remove_stale_probes(self._root))
        atexit.register(self.close)  # an agent that raises still removes its probes
        try:
            points = self._open_libraries()
            self._trace = trace = TraceInstance(self._root, self.group, buffer_size_kb())
            self._configure(trace)
            self._follow_targets(trace)
            for library, target, record, engine, wait in points:
                self._define(library, target, record, engine, wait)
            self._enable(trace)
            trace.open_pipe()
        except BaseException:
            self._close()
            raise

    def _open_libraries(self) -> list[tuple[MappedLibrary, TargetProcess, list[int],
                                            list[int], list[tuple[int, WaitPoint]]]]:
        """Each target's libtorch_cpu held open, and the probe offsets of each distinct
        file: targets that mapped the same inode share its events (a tracefs uprobe
        fires in every process mapping it, so one event per file, not per target)."""
        points: dict[tuple[int, int], tuple[MappedLibrary, TargetProcess, list[int],
                                            list[int], list[tuple[int, WaitPoint]]]]
        points = {}
        for target in self.targets:
            library = open_torch_library(target)
            self._libraries.append(library)
            st = os.fstat(library.fd)
            key = (st.st_dev, st.st_ino)
            if key not in points:
                points[key] = (library, target, *find_torch_offsets(target, library))
            if points[key][4]:
                self._waits_probed.add(target.pid)
            if not points[key][3]:
                self.warnings.append(
                    f"pid {target.pid} ({target.name}): {target.torch_library} exports no "
                    "torch::autograd::Engine::execute: micro-batches per step are not counted"
                )
        return list(points.values())

    def _configure(self, trace: TraceInstance) -> None:
        try:
            # Threads a target starts later inherit its place in set_event_pid.
            tracefs_write(os.path.join(trace.path, "options", "event-fork"), "1")
        except OSError as err:
            raise PrerequisiteMissing(
                f"{agent_who()}: cannot configure tracefs instance {trace.path}: {err.strerror}"
            ) from err
        for option, value in (("record-tgid", "1"), ("irq-info", "0")):
            try:
                # record-tgid prints each event's tgid; without it (or before the kernel
                # has recorded a thread's tgid) it is read from /proc/TID/status.
                # irq-info only adds a column of flags.
                tracefs_write(os.path.join(trace.path, "options", option), value)
            except OSError:
                pass

    def _follow_targets(self, trace: TraceInstance) -> None:
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
        path = os.path.join(trace.path, "set_event_pid")
        written: set[int] = set()
        for _ in range(2):
            tids = set()
            for target in self.targets:
                threads = thread_ids(target.pid)
                if not threads:
                    raise NoSuchProcess(f"pid {target.pid} ({target.name}): exited before "
                                        "the uprobes were attached")
                tids.update(threads)
            new = sorted(tids - written)
            for i in range(0, len(new), 256):
                try:
                    tracefs_write(path, " ".join(map(str, new[i:i + 256])))
                except OSError as err:
                    raise PrerequisiteMissing(
                        f"{agent_who()}: cannot set the pid filter {path}: {err.strerror}"
                    ) from err
            written |= tids

    def _define(self, library: MappedLibrary, target: TargetProcess,
                record: list[int], engine: list[int], wait: list[tuple[int, WaitPoint]]
                ) -> None:
        # /proc/self/fd/N names the very inode the job mapped: the kernel resolves
        # the path during our write, in the agent's context, and keeps the inode.
        path = library.probe_path
        fetch = _NAME_FETCH[os.uname().machine]
        for offset in record:
            name = f"rf_enter_{next(_EVENT_NUMBERS['rf'])}"
            self._add_event(target, name, _RECORD_FUNCTION,
                            f"p:{self.group}/{name} {path}:{offset:#x} name={fetch}")
        for offset in engine:
            self._add_entry_and_return(target, f"{path}:{offset:#x}", "bw", "backward")
        for offset, point in wait:
            self._add_entry_and_return(target, f"{path}:{offset:#x}", "wait",
                                       "p2p_wait" if point.kind == "p2p" else "wait")
        self.wait_points[target.pid] = [point for _, point in wait]

    def _add_entry_and_return(self, target: TargetProcess, place: str, stem: str,
                              kind: str) -> None:
        """An entry event (``<stem>_enter_<n>``, kind ``<kind>_enter``) and a return
        event (``<stem>_exit_<n>``, ``<kind>_exit``) on the function at ``place``."""
        n = next(_EVENT_NUMBERS[stem])
        for probe, end in (("p", "enter"), ("r", "exit")):
            name = f"{stem}_{end}_{n}"
            self._add_event(target, name, f"{kind}_{end}", f"{probe}:{self.group}/{name} {place}")

    def _add_event(self, target: TargetProcess, name: str, kind: str, definition: str) -> None:
        try:
            tracefs_write(os.path.join(self._root, "uprobe_events"), definition + "\n",
                          append=True)
        except OSError as err:
            why = error_log_tail(self._root)
            raise PrerequisiteMissing(
                f"pid {target.pid} ({target.name}): the kernel refused uprobe event "
                f"{definition!r}: {err.strerror}{'; ' + why if why else ''}"
            ) from err
        self._defined.append(name)
        self._kinds[name] = kind

    def _enable(self, trace: TraceInstance) -> None:
        name_filter = step_name_filter(self._prefixes)
        for name, kind in self._kinds.items():
            if kind == _RECORD_FUNCTION and name_filter:
                try:
                    tracefs_write(os.path.join(trace.path, "events", self.group, name, "filter"),
                                  name_filter)
                except OSError:
                    pass  # an older filter syntax: poll() classifies the names anyway
            try:
                trace.enable(self.group, name)
            except OSError as err:
                # EINVAL here is, in practice, another uprobe on the same function
                # with a different USDT reference counter: the kernel shares one
                # uprobe per (file, offset) and refuses the mismatch (dmesg says
                # "ref_ctr_offset mismatch"). bcc 0.26's Python passes a stray one.
                hint = ("; another tool (e.g. bcc 0.26, whose uprobes carry a stray "
                        "reference counter) probes the same function: see dmesg"
                        if err.errno == errno.EINVAL else "")
                raise PrerequisiteMissing(
                    f"{agent_who()}: cannot enable uprobe event {self.group}/{name}: "
                    f"{err.strerror}{hint}"
                ) from err
            self._enabled.append(name)

    # -- polling --

    def quality(self) -> dict[str, Any]:
        return {"events": self.events, "events_dropped": self.dropped,
                **self.updates.quality(),
                # (ranks of a distributed job: a lone process has no process group)
                "ranks_without_wait_probes": sum(
                    1 for t in self.targets
                    if t.rank is not None and self.wait_points.get(t.pid) == [])}

    def _poll(self) -> list[Record]:
        if self._trace is None or not self._trace.reading:
            return []
        try:
            lines = self._trace.read_lines()
        except OSError as err:  # the pipe is closed: nothing more will come
            self.warnings.append(f"{agent_who()}: reading {self._trace.path}/trace_pipe failed: "
                                 f"{err.strerror}; no more markers")
            return []
        events: list[Record] = []
        lost = False
        for line in lines:
            event = self._event(line)
            if event is not None:
                events += self._account(event)
            elif b"[LOST " in line:
                lost = True
        now = time.monotonic()
        if lost or now - self._stats_read_at >= _STATS_INTERVAL_S:
            self._stats_read_at = now
            self._read_dropped()
        self.events += len(events)
        return list(events)

    def _event(self, line: bytes) -> Marker | None:
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
        return Marker(t_mono_ns=parsed.t_mono_ns, pid=tgid, tid=parsed.tid, kind=kind,
                           name=name)

    def _account(self, event: Marker) -> list[Record]:
        """What of a marker is logged (probes.waits.WaitAccount.account). (No gradient
        reads here: a tracefs uprobe traps in every process that maps the library, and
        they are frequent; a job without torch.optim's step shows as unmeasured.)"""
        self.updates.on_marker(event)
        return self._waits.account(event, event.pid in self._waits_probed, self.raw_waits)

    @property
    def waits_probed_pids(self) -> set[int]:
        return set(self._waits_probed)

    def set_raw_waits(self, on: bool) -> None:
        """Every wait's entry and return as a ``wait_*`` marker too, or only the totals."""
        self.raw_waits = on

    def set_waits_on(self, on: bool) -> None:
        """Enable or disable the collective-wait events (sampled waits: a uprobe enabled
        nowhere costs the job nothing). Waits open when they were disabled are forgotten
        at the first event after they are on again (the pipe may still hold older ones)."""
        if self._trace is None or on == self.waits_on:
            return
        for name, kind in self._kinds.items():
            if kind in WAIT_MARKERS:
                try:
                    self._trace.enable(self.group, name, on)
                except OSError as err:
                    self.warnings.append(f"{agent_who()}: cannot {'en' if on else 'dis'}able "
                                         f"{self.group}/{name}: {err.strerror}")
        self.waits_on = on
        if on:
            self._waits.forget_open_from(monotonic_ns())

    def _tgid(self, tid: int) -> int | None:
        """The process of thread ``tid`` (cached); None when it is gone."""
        if tid not in self._tgids:
            self._tgids[tid] = thread_group(tid)
        return self._tgids[tid]

    def _read_dropped(self) -> None:
        """Events the instance's ring buffer lost, summed over its CPUs."""
        total = self._trace.losses() if self._trace is not None else None
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
        if self._trace is not None:
            self._read_dropped()
            for name in self._enabled:
                try:
                    self._trace.enable(self.group, name, on=False)
                except OSError as err:
                    self.warnings.append(f"{agent_who()}: cannot disable uprobe event "
                                         f"{self.group}/{name}: {err.strerror}")
        self._enabled = []
        if self._trace is not None:
            warning = self._trace.close()  # closes trace_pipe first
            if warning:
                self.warnings.append(warning)
            self._trace = None
        for name in self._defined:
            warning = remove_uprobe_event(self._root, self.group, name)
            if warning:
                self.warnings.append(warning)
        self._defined = []
        for library in self._libraries:
            library.close()
        self._libraries = []
