"""Training-step markers from eBPF uprobes (bcc) in a process's libtorch_cpu.so.

Measures: the exact CLOCK_MONOTONIC time of every ``Optimizer.step``,
``Optimizer.zero_grad`` and DataLoader ``__next__`` entry (PyTorch wraps each
in a ``record_function`` block, whose C++ entry point we probe) and of every
``torch::autograd::Engine::execute`` entry and exit (one per ``backward()``); of the
first gradient read after a backward pass (``c10::TensorImpl::grad`` in libc10,
``grad_read``: the update of a job without torch.optim's marker, probed only until
the process shows that marker), and
the time blocked in the c10d calls that wait on the process group (every work
object's wait the library exports, perfmon.parsers.wait_symbols; point-to-point sends'
and receives' apart): accounted in the kernel and carried by each step's event (a
``waits`` record), with each entry and return as ``wait_enter`` / ``wait_exit``
(``p2p_wait_*``) markers only while ``set_raw_waits`` asks for them.

Cost: one uprobe trap per ``record_function`` entry, per ``backward()`` and per
collective wait in the target (a few microseconds each); what leaves the kernel is
a handful of events per training step, however many collectives it makes. Names
that do not mark a step are rejected in the kernel after one 24-byte read.
Set-up: ~0.5 s of BPF compilation.

Needs: root, or CAP_SYS_PTRACE plus CAP_BPF + CAP_PERFMON (Linux >= 5.8) or
CAP_SYS_ADMIN (on newer kernels, see :func:`_attach_hint`); bcc's
Python module (Debian ``python3-bpfcc``); kernel headers for the running
kernel (``/lib/modules/$(uname -r)/build``, ``$BCC_KERNEL_SOURCE`` or
``/sys/kernel/kheaders.tar.xz``); a PyTorch whose libtorch_cpu.so exports
``record_function_enter_new`` (1.13+) or ``record_function_enter``.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Iterable
from importlib import resources
from typing import Any

from perfmon.parsers.elf_symbols import ElfSymbol
from perfmon.parsers.events import MARKER_KINDS, Marker, Record, WaitTotals
from perfmon.parsers.procfs import (
    CAP_BPF,
    CAP_PERFMON,
    CAP_SYS_ADMIN,
    CAP_SYS_PTRACE,
    missing_capabilities,
)
from perfmon.parsers.wait_symbols import WaitPoint
from perfmon.probes.errors import (
    PrerequisiteMissing,
    PrivilegeError,
    SymbolNotFound,
    agent_who,
)
from perfmon.probes.files import MappedLibrary
from perfmon.probes.ftrace import remove_bcc_uprobe_events
from perfmon.probes.procfs import TargetProcess, agent_capabilities
from perfmon.probes.sampler import Source
from perfmon.probes.torch_symbols import (
    GRAD_READ_SYMBOL,
    WaitSymbol,
    find_grad_read,
    find_torch_symbols,
    open_torch_library,
)

# record_function names that mark a step, and the BPF event kind of each
# (kind numbers index MARKER_KINDS from 1, as in iterations.bpf.c).
STEP_NAME_PREFIXES = {
    "Optimizer.step#": "optimizer_step",
    "Optimizer.zero_grad#": "zero_grad",
    "enumerate(DataLoader)#": "dataloader_next",
}
# What the probes report by default: the iteration ends (plus backward entries and
# exits, from Engine::execute). zero_grad and the data loader's next batch are a
# marker each per step or micro-batch that nothing reduces: each costs the agent
# ~15 us of CPU, so they are reported only when asked for (step_kinds).
DEFAULT_STEP_KINDS = ("optimizer_step",)
# Bytes of a name kept, with its terminating NUL: iterations.bpf.c's NAME_LEN (given
# as a -D cflag), and where the tracefs backend cuts it, so both cut at the same byte.
NAME_LEN_BYTES = 64
# struct event_t of iterations.bpf.c, field by field up to its name (which follows:
# NAME_LEN_BYTES). tests/unit/probes/test_ring_record_layout.py holds it to the C.
EVENT_HEAD_FIELDS = (("t_mono_ns", "Q"), ("pid", "I"), ("tid", "I"), ("kind", "I"),
                     ("_pad", "4x"), ("wait_ns", "Q"), ("waits", "Q"),
                     ("p2p_wait_ns", "Q"), ("p2p_waits", "Q"))
EVENT_HEAD = struct.Struct("<" + "".join(code for _, code in EVENT_HEAD_FIELDS))
_OPTIMIZER_STEP = MARKER_KINDS.index("optimizer_step") + 1
_UPDATE_ENDS = (_OPTIMIZER_STEP, MARKER_KINDS.index("grad_read") + 1)
# 1 MiB: ~9,200 markers between two polls. A loaded node starves the agent of CPU for
# seconds (the suite's load of 8 on 2 cores: 1,032 markers of a 24-step/s job lost to
# a 256 KiB ring, ~3.5 s unpolled); a real job makes ~10 markers a step.
DEFAULT_RING_PAGES = 256
_PREFIX_WORDS = 3
_MAX_PREFIXES = 4
_BPF_DIR = "bpf"  # in this package: the *.bpf.c programs and step_names.bpf.h


def kernel_headers_dir() -> str | None:
    """Where bcc will find kernel headers, or None when it will find none.

    bcc takes $BCC_KERNEL_SOURCE alone when it is set; otherwise the running
    kernel's build folder, else the in-kernel /sys/kernel/kheaders.tar.xz.
    """
    override = os.environ.get("BCC_KERNEL_SOURCE")
    if override is not None:
        return override if os.path.isdir(os.path.join(override, "include")) else None
    build = f"/lib/modules/{os.uname().release}/build"
    if os.path.isdir(os.path.join(build, "include")):
        return build
    return "/sys/kernel/kheaders.tar.xz" if os.path.exists("/sys/kernel/kheaders.tar.xz") else None


def _attach_hint() -> str:
    """Why a uprobe attach may fail with the capabilities check passed: Linux 6.16 (and
    stable kernels since mid-2025, upstream ba677dbe77af) want CAP_SYS_ADMIN for the
    uprobe PMU, CAP_PERFMON no longer suffices; bcc then writes tracefs
    ``uprobe_events``, which needs tracefs mounted and writable by the agent's uid."""
    if agent_capabilities() >> CAP_SYS_ADMIN & 1:
        return ""
    return (" (without CAP_SYS_ADMIN newer kernels refuse the uprobe PMU and bcc must "
            "write tracefs uprobe_events: run as root with CAP_SYS_ADMIN)")


def check_ebpf_prerequisites() -> None:
    """Raise PrivilegeError or PrerequisiteMissing naming what the host lacks."""
    caps = agent_capabilities()
    # CAP_SYS_PTRACE: reading another process's maps and environ; CAP_BPF and
    # CAP_PERFMON (both implied by CAP_SYS_ADMIN): loading BPF and attaching uprobes
    # (through tracefs without CAP_SYS_ADMIN on newer kernels: see _attach_hint).
    needed = [CAP_SYS_PTRACE] + ([] if caps >> CAP_SYS_ADMIN & 1 else [CAP_BPF, CAP_PERFMON])
    missing = missing_capabilities(caps, needed)
    if missing:
        raise PrivilegeError(
            f"{agent_who()}: missing capabilities {', '.join(missing)} "
            "for eBPF uprobes: run as root (with full capabilities), or grant "
            "CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE"
        )
    try:
        import bcc  # noqa: F401
    except ImportError as err:
        raise PrerequisiteMissing(
            f"{agent_who()}: the bcc Python module is missing: "
            "apt-get install python3-bpfcc (and use a virtualenv made with "
            "--system-site-packages)"
        ) from err
    if kernel_headers_dir() is None:
        release = os.uname().release
        raise PrerequisiteMissing(
            f"{agent_who()}: no kernel headers for {release}: "
            f"apt-get install linux-headers-{release} (or point BCC_KERNEL_SOURCE at a "
            "headers tree; `make setup` links Debian's linux-headers-amd64 when the "
            "running kernel has no package)"
        )


def step_prefixes(kinds: tuple[str, ...]) -> dict[str, str]:
    """The record_function name prefixes that mark these kinds (of STEP_NAME_PREFIXES)."""
    return {p: kind for p, kind in STEP_NAME_PREFIXES.items() if kind in kinds}


def compile_step_program(file_name: str, cflags: list[str],
                         kinds: tuple[str, ...] = DEFAULT_STEP_KINDS) -> Any:
    """Compile ``probes/bpf/<file_name>`` (which includes step_names.bpf.h) with bcc,
    and fill its step-name prefix table; returns the ``BPF`` object.

    Raises PrerequisiteMissing when the program does not compile.
    """
    from bcc import BPF

    pass_zero_ref_ctr_offset()
    source = resources.files("perfmon.probes").joinpath(f"{_BPF_DIR}/{file_name}").read_bytes()
    try:
        bpf = BPF(text=source, cflags=[*cflags, *_step_name_cflags()])
    except Exception as err:  # bcc raises bare Exception on compile failure
        raise PrerequisiteMissing(
            f"{agent_who()}: BPF program {file_name} failed to compile "
            f"(kernel headers at {kernel_headers_dir()}): {err}"
        ) from err
    _fill_step_prefixes(bpf, step_prefixes(kinds))
    return bpf


def pass_zero_ref_ctr_offset() -> None:
    """Make bcc's Python attach uprobes with a reference-counter offset of 0.

    libbcc's ``bpf_attach_uprobe`` takes a 7th argument, ``ref_ctr_offset`` (the
    file offset of a USDT semaphore the kernel increments in every traced
    process), but bcc 0.26's Python declares and passes only six, so the C side
    reads whatever the stack holds. A non-zero value makes the kernel write into
    the target's memory at that offset of the probed library (seen: 0x6, the
    ELF header), and makes every later uprobe on that function fail with
    "ref_ctr_offset mismatch". The agent must never write into a job, so the
    call is wrapped to pass 0 explicitly. Idempotent; a bcc that declares the
    argument already is left alone.
    """
    import ctypes as ct

    from bcc import libbcc

    attach = libbcc.lib.bpf_attach_uprobe
    if getattr(attach, "perfmon_zero_ref_ctr", False) or len(attach.argtypes or ()) != 6:
        return
    attach.argtypes = [*attach.argtypes, ct.c_uint32]

    def with_zero_ref_ctr(*args: Any) -> int:  # bcc passes the first six
        return int(attach(*args, 0))

    with_zero_ref_ctr.perfmon_zero_ref_ctr = True  # type: ignore[attr-defined]
    libbcc.lib.bpf_attach_uprobe = with_zero_ref_ctr


def _step_name_cflags() -> list[str]:
    """cflags for a BPF program that includes step_names.bpf.h.

    Puts the header's folder on the include path, so the package must be
    installed as files (bcc's compiler reads the header from disk).
    """
    bpf_dir = resources.files("perfmon.probes").joinpath(_BPF_DIR)
    return [
        f"-I{bpf_dir}",
        f"-DPREFIX_WORDS={_PREFIX_WORDS}",
        f"-DMAX_PREFIXES={_MAX_PREFIXES}",
        f"-DSTEP_KIND_OPTIMIZER_STEP={MARKER_KINDS.index('optimizer_step') + 1}",
    ]


def _fill_step_prefixes(bpf: Any, prefixes: dict[str, str]) -> None:
    """Fill the ``prefixes`` table of step_names.bpf.h (prefix -> kind).

    ``bpf`` is a compiled bcc ``BPF`` object. Kinds number MARKER_KINDS from 1.
    """
    table = bpf[b"prefixes"]
    leaf = table.Leaf()  # zeroed: unused slots have kind 0
    for index, (prefix, kind) in enumerate(prefixes.items()):
        raw = prefix.encode().ljust(_PREFIX_WORDS * 8, b"\0")
        entry = leaf.entry[index]
        for w in range(_PREFIX_WORDS):
            chunk = raw[w * 8 : w * 8 + 8]
            significant = max(0, min(8, len(prefix) - w * 8))
            entry.word[w] = int.from_bytes(chunk, "little")
            entry.mask[w] = (1 << (8 * significant)) - 1
        entry.kind = MARKER_KINDS.index(kind) + 1
    table[ctypes.c_int(0)] = leaf


class UpdateAccount:
    """Backward passes and update ends (Optimizer.step, grad_read) per process, from the
    markers: a rank whose backward passes run but none of whose updates any probe saw
    is one whose iterations are not measured at all (a loss, never "nothing missed"),
    unless the user declared its backward passes per update (``declared``, --microbatches:
    then every K of them end one)."""

    def __init__(self, declared: int | None = None) -> None:
        self.declared = declared
        self.backward_passes: dict[int, int] = {}
        self.update_ends: dict[int, int] = {}

    def on_marker(self, marker: Marker) -> None:
        if marker.kind == "backward_exit":
            self.backward_passes[marker.pid] = self.backward_passes.get(marker.pid, 0) + 1
        elif marker.kind in ("optimizer_step", "grad_read"):
            self.update_ends[marker.pid] = self.update_ends.get(marker.pid, 0) + 1

    def quality(self) -> dict[str, int]:
        return {"backward_passes": sum(self.backward_passes.values()),
                "update_ends": sum(self.update_ends.values()),
                "backward_passes_unmeasured": 0 if self.declared else sum(
                    n for pid, n in self.backward_passes.items()
                    if not self.update_ends.get(pid))}


class MarkerProbe(Source):
    """Uprobes on the step markers of one or more PyTorch processes.

    ``poll()`` returns the markers delivered since the last call without
    blocking; ``dropped`` counts events the kernel could not deliver because
    the ring buffer was full. ``warnings`` lists degraded features (e.g. no
    backward probe, hence no micro-batch count).
    """

    name = "uprobes"

    def __init__(self, targets: list[TargetProcess], ring_pages: int = DEFAULT_RING_PAGES,
                 step_kinds: tuple[str, ...] = DEFAULT_STEP_KINDS, *,
                 microbatches: int | None = None) -> None:
        super().__init__()
        self.step_kinds = step_kinds
        if ring_pages < 1 or ring_pages & (ring_pages - 1):
            raise ValueError(f"ring_pages must be a power of two, not {ring_pages}")
        self.ring_pages = ring_pages
        self.targets = targets
        self.dropped = 0
        self.events = 0
        self._bpf: Any = None
        self._raw: list[bytes] = []  # events as the ring buffer delivered them
        self._libraries: dict[int, MappedLibrary] = {}
        self._c10_libraries: dict[int, MappedLibrary] = {}
        self._waits_probed: set[int] = set()  # pids whose collective waits are accounted
        # (library, address, pid, p2p) of each wait point attached
        self._wait_points: list[tuple[bytes, int, int, bool]] = []
        self.wait_points: dict[int, list[WaitPoint]] = {}  # pid -> its wait points probed
        self._wait_events: set[bytes] = set()  # bcc's names of the attached wait probes
        # pid -> bcc's names of its gradient-read probe, while it has shown no
        # Optimizer.step (the exact marker: then it is detached, costing nothing more)
        self._grad_events: dict[int, set[bytes]] = {}
        self._grad_points: dict[int, tuple[bytes, int]] = {}  # pid -> (library, address)
        self.updates = UpdateAccount(microbatches)
        self.waits_on = True
        self.raw_waits = False  # (set_raw_waits)

    def _start(self) -> None:
        check_ebpf_prerequisites()
        try:
            symbols = {}
            for t in self.targets:
                self._libraries[t.pid] = open_torch_library(t)
                symbols[t.pid] = find_torch_symbols(t, self._libraries[t.pid])
            self._bpf = compile_step_program(
                "iterations.bpf.c",
                [f"-DNAME_LEN={NAME_LEN_BYTES}", f"-DRING_PAGES={self.ring_pages}"],
                self.step_kinds)
            self._bpf[b"raw_waits"][ctypes.c_int(0)] = ctypes.c_uint32(int(self.raw_waits))
            for target in self.targets:
                self._attach(target, *symbols[target.pid])
        except Exception:
            self._close()
            raise
        self._bpf[b"events"].open_ring_buffer(self._on_event)

    def _attach(self, target: TargetProcess, record: list[ElfSymbol], engine: list[ElfSymbol],
                wait: list[WaitSymbol]) -> None:
        # By the addresses read here (perfmon.parsers.elf_symbols, bounded), never by
        # name: bcc would resolve a name by reading the library's symbol tables whole,
        # .symtab included, which a job's crafted library can make gigabytes.
        lib = self._libraries[target.pid].probe_path.encode()
        for sym in record:
            try:
                self._bpf.attach_uprobe(name=lib, addr=sym.address,
                                        fn_name=b"on_record_function_enter", pid=target.pid)
            except Exception as err:  # bcc raises bare Exception on attach failure
                raise PrerequisiteMissing(
                    f"pid {target.pid} ({target.name}): cannot attach uprobe to {sym.name}: "
                    f"{err}{_attach_hint()}"
                ) from err
        for sym in engine:
            # Return first: a backward pass entered between the two attaches then shows
            # only its exit (ignored), never an entry without an exit, which would leave
            # the process "inside backward()" for good and hide its gradient reads.
            self._bpf.attach_uretprobe(name=lib, addr=sym.address, fn_name=b"on_backward_exit",
                                       pid=target.pid)
            self._bpf.attach_uprobe(name=lib, addr=sym.address, fn_name=b"on_backward_enter",
                                    pid=target.pid)
        if not engine:
            self.warnings.append(
                f"pid {target.pid} ({target.name}): {target.torch_library} exports no "
                "torch::autograd::Engine::execute: micro-batches per step are not counted"
            )
        else:
            self._attach_grad_read(target)
        if wait:
            self._waits_probed.add(target.pid)
        self.wait_points[target.pid] = [w.point for w in wait]
        points = [(lib, w.symbol.address, target.pid, w.point.kind == "p2p") for w in wait]
        self._wait_points += points
        self._attach_waits(points)

    def _attach_grad_read(self, target: TargetProcess) -> None:
        """The update probe of a job without torch.optim's marker (iterations.bpf.c's
        on_grad_read); a target where it cannot be had is a warning: its iterations
        then come from Optimizer.step alone."""
        try:
            library, symbol = find_grad_read(target)
        except SymbolNotFound as err:
            self.warnings.append(f"{err}: a job that steps without torch.optim (a compiled "
                                 "or hand-written update) is not measured")
            return
        self._c10_libraries[target.pid] = library
        self._grad_points[target.pid] = (library.probe_path.encode(), symbol.address)
        self.set_grad_reads(target.pid, True)

    def set_grad_reads(self, pid: int, on: bool) -> None:
        """Attach or detach the gradient-read probe of ``pid`` (the session detaches it
        while the rank's updates are counted, perfmon.agent.measure.update_sampling);
        never again once the rank showed an Optimizer.step."""
        if self._bpf is None or pid not in self._grad_points or on == (pid in self._grad_events):
            return
        if not on:
            self._detach(self._grad_events.pop(pid))
            return
        before = set(self._bpf.uprobe_fds)
        lib, address = self._grad_points[pid]
        try:
            self._bpf.attach_uprobe(name=lib, addr=address, fn_name=b"on_grad_read", pid=pid)
        except Exception as err:  # bcc raises bare Exception on attach failure
            del self._grad_points[pid]  # (never tried again)
            if _alive(pid):  # (one that exited has nothing more to probe)
                self.warnings.append(
                    f"pid {pid}: cannot attach uprobe to {GRAD_READ_SYMBOL}: {err}: its "
                    "updates, without torch.optim's step, are no longer found (a count "
                    "already learnt goes on unchecked)")
            return
        self._grad_events[pid] = set(self._bpf.uprobe_fds) - before

    @property
    def grad_read_pids(self) -> set[int]:
        """The targets whose gradient reads can be probed (no Optimizer.step seen)."""
        return set(self._grad_points)

    @property
    def grad_reads_on(self) -> set[int]:
        """... and those whose probe is attached now."""
        return set(self._grad_events)

    def _detach(self, ev_names: Iterable[bytes]) -> None:
        """Detach these probes (bcc's event names), entry probes before return probes,
        the fds closed as close_bpf does."""
        from bcc import lib as bcc_lib

        for ev_name in sorted(ev_names, key=lambda e: not e.startswith(b"p_")):
            bcc_lib.bpf_close_perf_event_fd(self._bpf.uprobe_fds[ev_name])
            self._bpf._del_uprobe_fd(ev_name)

    def _attach_waits(self, points: list[tuple[bytes, int, int, bool]],
                      again: bool = False) -> None:
        """``again``: attached once already (sampled waits); a rank that exited since
        is passed over (and forgotten), not an error of the session."""
        before = set(self._bpf.uprobe_fds)
        gone = set()
        for lib, addr, pid, p2p in points:
            stem = b"on_p2p_wait" if p2p else b"on_wait"
            try:
                # Return first: a call entered between the two attaches then shows only
                # its exit (ignored), never an entry without an exit.
                self._bpf.attach_uretprobe(name=lib, addr=addr, fn_name=stem + b"_exit",
                                           pid=pid)
                self._bpf.attach_uprobe(name=lib, addr=addr, fn_name=stem + b"_enter",
                                        pid=pid)
            except Exception:  # bcc raises bare Exception on attach failure
                if not again or _alive(pid):
                    raise
                gone.add(pid)
        self._wait_events |= set(self._bpf.uprobe_fds) - before
        self._wait_points = [p for p in self._wait_points if p[2] not in gone]

    def set_waits_on(self, on: bool) -> None:
        """Attach or detach the collective-wait probes (sampled waits: a detached probe
        costs the job nothing). Off, the threads' open waits are forgotten: their
        returns go unseen, and the totals stay as they were."""
        if self._bpf is None or on == self.waits_on:
            return
        if on:
            self._attach_waits(self._wait_points, again=True)
        else:
            # Entry probes first, so no wait is entered whose return goes unseen.
            self._detach(self._wait_events)
            self._wait_events = set()
            self._bpf[b"wait_threads"].clear()
        self.waits_on = on

    def _on_event(self, _ctx: Any, data: Any, size: int) -> None:
        # Called by bcc once per event: only copy the bytes here; they are decoded
        # in bulk by _poll (this runs for every marker of a busy job).
        self._raw.append(ctypes.string_at(data, size))

    def _poll(self) -> list[Record]:
        self._bpf.ring_buffer_consume()
        dropped = self._bpf[b"dropped"][ctypes.c_int(0)].value
        self.dropped = int(dropped)
        raw, self._raw = self._raw, []
        events: list[Record] = []
        stepped = set()
        for data in raw:
            t, pid, tid, kind, wait_ns, waits, p2p_ns, p2p_waits = EVENT_HEAD.unpack_from(data)
            name = data[EVENT_HEAD.size:].split(b"\0", 1)[0].decode("utf-8", "replace")
            if kind in _UPDATE_ENDS:
                if kind == _OPTIMIZER_STEP:
                    stepped.add(pid)
                if pid in self._waits_probed:
                    events.append(WaitTotals(t, pid, wait_ns, waits, p2p_ns, p2p_waits))
            marker = Marker(t, pid, tid, MARKER_KINDS[kind - 1], name)
            self.updates.on_marker(marker)
            events.append(marker)
        for pid in stepped & self._grad_points.keys():
            self.set_grad_reads(pid, False)
            del self._grad_points[pid]
        self.events += len(events)
        return events

    @property
    def waits_probed_pids(self) -> set[int]:
        """The targets whose collective waits are probed."""
        return set(self._waits_probed)

    def set_raw_waits(self, on: bool) -> None:
        """Every wait's entry and return as a ``wait_*`` marker too (a hang, a fail-slow
        window, ``--raw-markers``), or only the totals at each step (the default)."""
        if self._bpf is not None and on != self.raw_waits:
            self._bpf[b"raw_waits"][ctypes.c_int(0)] = ctypes.c_uint32(int(on))
        self.raw_waits = on

    def quality(self) -> dict[str, Any]:
        return {"events": self.events, "events_dropped": self.dropped,
                **self.updates.quality(),
                # ranks whose updates gradient reads find (no Optimizer.step seen), and
                # those whose reads are probed now (not while their updates are counted)
                "grad_read_ranks": len(self._grad_points),
                "grad_read_probes": len(self._grad_events),
                # (ranks of a distributed job: a lone process has no process group)
                "ranks_without_wait_probes": sum(
                    1 for t in self.targets
                    if t.rank is not None and self.wait_points.get(t.pid) == [])}

    def _close(self) -> None:
        libraries = [*self._libraries.values(), *self._c10_libraries.values()]
        if self._bpf is not None:
            close_bpf(self._bpf, libraries)
            self._bpf = None
        for library in libraries:
            library.close()
        self._libraries, self._c10_libraries = {}, {}


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def close_bpf(bpf: Any, libraries: Iterable[MappedLibrary] = ()) -> None:
    """Detach every probe of a bcc ``BPF`` object and free it; ``libraries``: those
    it probed (still open), whose tracefs events libbcc may have left.

    Closing a uprobe's perf event fd detaches it. bcc 0.26's own clean-up then
    also writes to tracefs' ``uprobe_events``, which fails (and raises) where
    probes were attached through the perf uprobe PMU and tracefs is not
    mounted, so the fds are closed here first, and the events that libbcc made
    in tracefs (where the PMU refused an attach: the target had exited) removed
    here, those of attaches that failed included (perfmon.probes.ftrace).
    """
    from bcc import lib

    for ev_name, fd in list(bpf.uprobe_fds.items()):
        lib.bpf_close_perf_event_fd(fd)
        bpf._del_uprobe_fd(ev_name)
    bpf.cleanup()
    remove_bcc_uprobe_events({library.probe_path for library in libraries}, os.getpid())
