"""CUDA kernel launches, time blocked on the GPU, and NCCL traffic, from eBPF uprobes (bcc).

Measures, per target process, as CUMULATIVE counters kept in BPF maps (the
caller differences them, e.g. at iteration boundaries):

- kernel launches: entries of the runtime's ``cudaLaunchKernel``,
  ``cudaLaunchKernelExC`` and ``cudaLaunchCooperativeKernel`` (libcudart) and
  of the driver's ``cuLaunchKernel``, ``cuLaunchKernelEx`` and
  ``cuLaunchCooperativeKernel`` (libcuda; cuBLAS, Triton and NCCL launch
  here), each with its per-thread-default-stream twin (``_ptsz``). The runtime
  forwards every launch to the driver; a launch entry point entered from
  inside libcudart or libcuda (its return address lies in their code) is
  counted apart as *forwarded*, so each launch is counted once.
  ``cudaGraphLaunch``/``cuGraphLaunch`` are counted apart (a graph holds many
  kernels that are not launched one by one).
- time blocked: wall time spent inside ``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaEventSynchronize`` and ``cudaMemcpy`` (and
  their ``_ptsz``/``_ptds`` twins), per thread from entry to return, summed; a
  blocking call made inside another counts once. Attributed when it returns.
- NCCL: calls and bytes of ``ncclAllReduce``, ``ncclReduceScatter``,
  ``ncclAllGather``, ``ncclBroadcast``, ``ncclReduce``, ``ncclSend``,
  ``ncclRecv`` and (NCCL 2.28+) ``ncclAlltoAll``, ``ncclGather``,
  ``ncclScatter``, with their ``*Config`` twins (2.32+); bytes = the call's
  count argument x the size of its ncclDataType_t. That count is per rank: the
  whole buffer for all-reduce, broadcast, reduce, send and recv, but one
  rank's slice for all-gather (sendcount), reduce-scatter (recvcount),
  all-to-all, gather and scatter. See docs/cuda-nccl.md.
- at every ``Optimizer.step`` entry (PyTorch's ``record_function``, found in
  libtorch_cpu as :mod:`perfmon.probes.torch_symbols` finds it), a copy of the
  process's counters taken in the kernel at that instant, so that the
  differences between two steps are exactly one iteration's calls, however
  late ``poll()`` runs.

Only exact exported names are probed (``.dynsym``); aliases at one address
(NCCL's ``pncclX`` profiling names) are probed once. Libraries are found in
/proc/PID/maps (basenames ``libcudart.so*``, ``libcuda.so*``, ``libnccl.so*``,
wherever they live) and reached through /proc/PID/root, so containers work. A
library the target has not loaded is not probed (``warnings`` says so); with
none loaded the probe is ``available = False`` and ``reason`` says why.
Libraries loaded after ``start()`` are not probed.

Cost: one uprobe trap per probed call on the calling thread, and a second at
the return of the blocking calls; a PyTorch ``cudaLaunchKernel`` takes two
(the runtime entry and the driver entry it forwards to). The BPF work per call
(one hash lookup, an 8-byte user read, a few compares) is lost in the trap's
cost; nothing is copied out per call and ``poll()`` is one map lookup per
target. Measured on the project's test VM (kernel 6.18): about 10 us per trap,
i.e. ~20 us per PyTorch launch, so 10,000 launches a second would cost ~20% of
the launching thread there; uprobe traps are usually several times cheaper on
bare metal (not measured here). The step snapshot adds one trap per
``record_function`` entry in the target (a handful per step; shared with the
iteration probe's trap at the same address when both run) and one ~250-byte
ring buffer record per step. Set-up: ~0.5 s of BPF compilation plus one perf
event per probed function per target (up to ~50).

Needs: the capabilities, bcc's Python module and kernel headers of
:mod:`perfmon.probes.uprobes`. x86-64 only (argument registers and the
return-address read at function entry). CUDA 11.x/12.x (``cuLaunchKernelEx``
and ``cudaLaunchKernelExC`` from 11.8 are probed where present); NCCL 2.x
(fp8 datatypes 10 and 11 from NCCL 2.24).

Holds the probe (:class:`CudaActivityProbe`) and its log source
(:class:`CudaSource`); the libraries and symbols probed are in
:mod:`perfmon.probes.cuda_libraries`, the counter record in
:mod:`perfmon.probes.cuda_counters`, the launch sampling in
:mod:`perfmon.probes.cuda_sampling`.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

from perfmon.parsers.elf_symbols import ElfSymbol
from perfmon.parsers.events import CudaSnapshot, Record
from perfmon.probes.cuda_counters import COUNTERS, CudaCounters, counters_from_kernel
from perfmon.probes.cuda_libraries import (
    ENTRY_AND_RETURN,
    LIBRARIES,
    NCCL_DTYPE_BYTES,
    TargetLibraries,
    exact_symbols,
    find_libraries,
)
from perfmon.probes.cuda_sampling import LaunchSampling
from perfmon.probes.errors import PrerequisiteMissing, SymbolNotFound, agent_who
from perfmon.probes.files import MappedLibrary, PathRefused
from perfmon.probes.procfs import TargetProcess
from perfmon.probes.sampler import Sampler, Source, monotonic_ns
from perfmon.probes.torch_symbols import find_torch_symbols, open_torch_library
from perfmon.probes.uprobes import check_ebpf_prerequisites, close_bpf, compile_step_program

# Kernel launches: "always" probed (a trap per launch: ~11 us here), "sampled"
# (probed for one iteration in every N), or "off".
LAUNCH_MODES = ("sampled", "always", "off")
_LAUNCH_PROGRAMS = ("on_runtime_launch", "on_driver_launch")


class _Planned(NamedTuple):
    """One probe to attach to one target: where, on what, and with which program."""

    path: str  # the library as the target sees it
    library: MappedLibrary  # held open
    symbol: str
    address: int  # attached by address: bcc never reads the library's symbol tables
    program: str
    kind: str

# Sizes of the BPF program's tables, passed to it as -D cflags.
_MAX_TEXT_RANGES = 4
_NCCL_DTYPES = 16
_MAX_SYNC_THREADS = 16384
_STEP_EVENT_PAGES = 64  # 256 KiB: ~1,000 step snapshots between two polls


class CudaActivityProbe(Sampler[CudaCounters]):
    """In-kernel counters of CUDA launches, blocking waits and NCCL calls of some processes.

    After ``start()``: ``available`` says whether anything was probed (with
    ``reason`` when not), ``attached`` maps each probed library path (as the
    targets see it) to the functions probed in it, and ``warnings`` lists what
    is not measured and why (a library not loaded, a function not exported).
    ``poll()`` returns, without blocking and in time order, one
    :class:`CudaCounters` per probed target read now, plus one ``at_step``
    snapshot per ``Optimizer.step`` entered since the last call (for targets
    whose libtorch_cpu exports ``record_function_enter_new``; its path and
    symbol are then in ``attached``). ``dropped`` counts step snapshots lost to
    a full ring buffer. Raises PrerequisiteMissing or PrivilegeError from
    ``start()`` when libraries are loaded but eBPF cannot be used,
    NoSuchProcess when a target has exited.
    """

    def __init__(self, targets: list[TargetProcess], launches: str = "always") -> None:
        super().__init__()
        if launches not in LAUNCH_MODES:
            raise ValueError(f"launches must be one of {LAUNCH_MODES}, not {launches!r}")
        self.targets = targets
        self.launches = launches
        self.available = False
        self.reason: str | None = None
        self.attached: dict[str, list[str]] = {}
        self.warnings: list[str] = []
        self.notes: list[str] = []  # the libraries a CPU job does not load
        self.dropped = 0
        self._bpf: Any = None
        self._pids: list[int] = []
        self._pending_steps: list[CudaCounters] = []
        self._libraries: list[MappedLibrary] = []  # held open while probed
        # The launch entry points, attached with the rest ("always"), never ("off"),
        # or by attach_launches()/detach_launches() ("sampled").
        self._launch_plan: dict[int, list[_Planned]] = {}
        self._launch_fds: list[bytes] = []  # bcc event names of the attached launch probes

    def _start(self) -> None:
        loaded = [find_libraries(t) for t in self.targets]
        for found in loaded:
            t = found.target
            # A rank that loaded none of them is a CPU job (a note); one that loaded some
            # uses CUDA, and a figure of it goes uncounted (a warning).
            told = self.warnings if found.paths else self.notes
            for lib in LIBRARIES:
                if lib.name not in found.paths:
                    told.append(f"pid {t.pid} ({t.name}): {lib.basename_prefix}* is not "
                                f"loaded: {lib.measures} not counted")
        probed = [f for f in loaded if f.paths]
        if not probed:
            pids = ", ".join(str(t.pid) for t in self.targets)
            self.reason = (
                f"no CUDA runtime, driver or NCCL library (libcudart.so*, libcuda.so*, "
                f"libnccl.so*) in /proc/PID/maps of pid {pids}: a CPU-only job, or CUDA "
                "not initialised yet"
            )
            return
        # Also before reading symbols, which may need bcc's resolver.
        check_ebpf_prerequisites()
        plans = {f.target.pid: self._plan(f) for f in probed}
        if not any(plans.values()):
            self.reason = (
                "the loaded CUDA/NCCL libraries export none of the probed functions: "
                + "; ".join(self.warnings))
            return
        steps = {f.target.pid: self._step_symbols(f.target) for f in probed}
        self._compile()
        try:
            self._fill_tables(probed)
            for found in probed:
                plan = plans[found.target.pid]
                launch = [e for e in plan if e.program in _LAUNCH_PROGRAMS]
                if self.launches != "always":
                    plans[found.target.pid] = [e for e in plan if e not in launch]
                    sampled = self.launches == "sampled"
                    self._launch_plan[found.target.pid] = launch if sampled else []
            failures = [err for f in probed for err in self._attach(f.target, plans[f.target.pid])]
            if not self.attached and not any(self._launch_plan.values()):
                raise PrerequisiteMissing(
                    f"{agent_who()}: no CUDA/NCCL uprobe could be attached: "
                    + "; ".join(failures))
            self._pids = [f.target.pid for f in probed
                          if plans[f.target.pid] or self._launch_plan.get(f.target.pid)]
            for found in probed:
                if found.target.pid in self._pids:
                    self._attach_steps(found.target, *steps[found.target.pid])
            self._bpf[b"step_events"].open_ring_buffer(self._on_step)
        except Exception:
            self._close()
            raise
        self.available = True

    def _step_symbols(self, target: TargetProcess
                      ) -> tuple[MappedLibrary | None, list[ElfSymbol]]:
        """A target's libtorch_cpu and its record_function entry points ([] with a warning)."""
        try:
            library = open_torch_library(target)
        except SymbolNotFound as err:
            self.warnings.append(f"{err}: no counter snapshots at Optimizer.step")
            return None, []
        self._libraries.append(library)
        try:
            record, *_ = find_torch_symbols(target, library)
        except SymbolNotFound as err:
            self.warnings.append(f"{err}: no counter snapshots at Optimizer.step")
            return None, []
        return library, record

    def _attach_steps(self, target: TargetProcess, library: MappedLibrary | None,
                      symbols: list[ElfSymbol]) -> None:
        """Snapshot a target's counters at each Optimizer.step entry (warns when it cannot).
        By address, as MarkerProbe attaches (bcc never reads the library's tables)."""
        for sym in symbols:
            assert library is not None
            try:
                self._bpf.attach_uprobe(
                    name=library.probe_path.encode(), addr=sym.address,
                    fn_name=b"on_record_function_enter", pid=target.pid)
            except Exception as err:  # bcc raises bare Exception on attach failure
                self.warnings.append(
                    f"pid {target.pid} ({target.name}): cannot attach uprobe to {sym.name} in "
                    f"{target.torch_library}: {err}: no counter snapshots at Optimizer.step")
                continue
            names = self.attached.setdefault(target.torch_library, [])
            if sym.name not in names:
                names.append(sym.name)

    def _plan(self, found: TargetLibraries) -> list[_Planned]:
        """The probes to attach for one target."""
        t = found.target
        plan = []
        for lib in LIBRARIES:
            for mapping in found.paths.get(lib.name, []):
                path = mapping.path
                wanted = {sym: (prog, kind) for sym, prog, kind in lib.probes}
                try:
                    library = MappedLibrary(t.pid, mapping)
                except (OSError, PathRefused) as err:
                    self.warnings.append(f"pid {t.pid} ({t.name}): cannot open {path}: {err}: "
                                         "not probed")
                    continue
                self._libraries.append(library)
                try:
                    symbols = exact_symbols(library, wanted)
                except Exception as err:  # OSError, ElfError, or bcc's bare Exception
                    self.warnings.append(
                        f"pid {t.pid} ({t.name}): cannot read symbols of {path}: {err}")
                    continue
                if not symbols:
                    self.warnings.append(
                        f"pid {t.pid} ({t.name}): {path} exports none of "
                        f"{', '.join(wanted)}: {lib.measures} not counted")
                for sym, address in symbols.items():
                    plan.append(_Planned(path, library, sym, address, *wanted[sym]))
        return plan

    def _compile(self) -> None:
        self._bpf = compile_step_program("cuda.bpf.c", [
            f"-DN_COUNTERS={len(COUNTERS)}",
            *(f"-DCTR_{name.upper()}={i}" for i, name in enumerate(COUNTERS)),
            f"-DMAX_TEXT_RANGES={_MAX_TEXT_RANGES}",
            f"-DMAX_TARGETS={max(1, len(self.targets))}",
            f"-DMAX_SYNC_THREADS={_MAX_SYNC_THREADS}",
            f"-DNCCL_DTYPES={_NCCL_DTYPES}",
            f"-DSTEP_EVENT_PAGES={_STEP_EVENT_PAGES}",
        ])

    def _fill_tables(self, probed: list[TargetLibraries]) -> None:
        sizes = self._bpf[b"nccl_dtype_bytes"]
        for dtype, size in NCCL_DTYPE_BYTES.items():
            sizes[ctypes.c_int(dtype)] = ctypes.c_uint(size)
        pids = self._bpf[b"pids"]
        for found in probed:
            t = found.target
            state = pids.Leaf()  # zeroed counters
            ranges = found.forwarding_text
            if len(ranges) > _MAX_TEXT_RANGES:
                self.warnings.append(
                    f"pid {t.pid} ({t.name}): {len(ranges)} copies of libcudart/libcuda loaded; "
                    f"only {_MAX_TEXT_RANGES} are recognised as callers, so launches forwarded "
                    "by the others are counted twice")
            for i, (lo, hi) in enumerate(ranges[:_MAX_TEXT_RANGES]):
                state.text_lo[i], state.text_hi[i] = lo, hi
            pids[ctypes.c_uint(t.pid)] = state

    def _attach(self, target: TargetProcess,
                plan: list[_Planned]) -> list[str]:
        """Attach one target's probes; returns why some could not be (also in ``warnings``).

        One refused function (the kernel rejects a uprobe on some first
        instructions, e.g. LOCK-prefixed ones) leaves the others measuring.
        """
        failures = []
        for path, library, sym, address, prog, kind in plan:
            host = library.probe_path.encode()
            try:
                # The return probe first: a call entered between the two attaches
                # then has no entry recorded (ignored) rather than an entry whose
                # return is never seen (which the program must heal).
                if kind == ENTRY_AND_RETURN:
                    self._bpf.attach_uretprobe(
                        name=host, addr=address, fn_name=b"on_sync_exit", pid=target.pid)
                self._bpf.attach_uprobe(
                    name=host, addr=address, fn_name=prog.encode(), pid=target.pid)
            except Exception as err:  # bcc raises bare Exception on attach failure
                failures.append(f"pid {target.pid} ({target.name}): cannot attach uprobe to "
                                f"{sym} in {path}: {err}")
                self.warnings.append(failures[-1] + ": not counted")
                continue
            names = self.attached.setdefault(path, [])
            if sym not in names:
                names.append(sym)
        return failures

    def attach_launches(self) -> None:
        """Attach the launch probes (mode "sampled"); a failure is a warning."""
        if self._bpf is None or self._launch_fds:
            return
        before = set(self._bpf.uprobe_fds)
        for target in self.targets:
            plan = self._launch_plan.get(target.pid, [])
            if plan:
                self._attach(target, plan)
        self._launch_fds = [name for name in self._bpf.uprobe_fds if name not in before]

    def detach_launches(self) -> None:
        """Detach them again: closing a uprobe's perf event fd removes it (see close_bpf)."""
        from bcc import lib

        for name in self._launch_fds:
            fd = self._bpf.uprobe_fds.get(name)
            if fd is not None:
                lib.bpf_close_perf_event_fd(fd)
                self._bpf._del_uprobe_fd(name)
        self._launch_fds = []

    def _poll(self) -> list[CudaCounters]:
        if self._bpf is None:
            return []
        table = self._bpf[b"pids"]
        snapshots = []
        for pid in self._pids:
            t = monotonic_ns()
            try:
                state = table[ctypes.c_uint(pid)]
            except KeyError:  # only if the entry was removed: never by this module
                continue
            snapshots.append(counters_from_kernel(t, pid, state.counter, at_step=False))
        # After the map read: every step entered before it is delivered now, so
        # records come in time order across polls too (to within the few
        # microseconds between a step program's start and its submit).
        self._bpf.ring_buffer_consume()
        self.dropped = int(self._bpf[b"step_events_dropped"][ctypes.c_int(0)].value)
        snapshots += self._pending_steps
        self._pending_steps = []
        return sorted(snapshots, key=lambda c: c.t_mono_ns)

    def _on_step(self, _ctx: Any, data: Any, _size: int) -> None:
        ev = self._bpf[b"step_events"].event(data)
        self._pending_steps.append(
            counters_from_kernel(ev.t_mono_ns, ev.tgid, ev.counter, at_step=True))

    def _close(self) -> None:
        if self._bpf is not None:
            close_bpf(self._bpf, self._libraries)
            self._bpf = None
        for library in self._libraries:
            library.close()
        self._libraries = []


class CudaSource(Source):
    """The CUDA/NCCL counters as log records: one ``cuda`` snapshot per Optimizer.step
    entry of every probed rank (the periodic reads add nothing per iteration).

    Kernel launches come at a price: every launch traps into the kernel (~11 us
    each measured here; a GPU step can make tens of thousands). With
    ``launches="sampled"`` (the default) the launch probes are attached for one
    iteration in every N and detached between (at the next poll: a sample covers
    the iterations of up to one poll interval), N adapted so that the sampled
    iterations' extra time, spread over all, stays under LAUNCH_BUDGET
    (:mod:`perfmon.probes.cuda_sampling`) of the step time. A snapshot says
    whether the launch probes were attached since the previous one
    (``launches_probed``): those iterations' launch counts are exact.
    """

    name = "cuda"

    def __init__(self, targets: list[TargetProcess], launches: str = "sampled") -> None:
        super().__init__()
        self.probe = CudaActivityProbe(targets, launches)
        self.launches = launches
        self.snapshots = 0
        self._last: dict[int, CudaCounters] = {}
        self._sampling = LaunchSampling(
            targets[0].pid, self.probe.attach_launches, self.probe.detach_launches)

    def _start(self) -> None:
        self.probe.start()
        self.available, self.reason = self.probe.available, self.probe.reason
        self.warnings, self.notes = self.probe.warnings, self.probe.notes

    @property
    def attached(self) -> dict[str, list[str]]:
        return self.probe.attached

    @property
    def samples(self) -> int:
        """Times the launch probes were attached (mode "sampled")."""
        return self._sampling.samples

    @property
    def sample_every(self) -> int:
        """Steps of the primary rank between two launch samples, as adapted so far."""
        return self._sampling.sample_every

    def _poll(self) -> list[Record]:
        records: list[Record] = []
        for c in self.probe.poll():
            self._last[c.pid] = c
            if c.at_step:
                records.append(CudaSnapshot(
                    c.t_mono_ns, c.pid, True, c.kernel_launches, c.sync_wait_ns,
                    c.graph_launches, c.nccl_calls, c.nccl_bytes, c.runtime_launches,
                    c.driver_launches, c.forwarded_launches, c.sync_calls, c.sync_untracked,
                    c.nccl_unknown_dtype_calls, self._probed(c)))
        self.snapshots += len(records)
        if self.launches == "sampled":
            self._sampling.schedule()
        return records

    def _probed(self, c: CudaCounters) -> bool:
        """Whether the launch probes were attached since this rank's previous snapshot."""
        if self.launches != "sampled":
            return self.launches == "always"
        return self._sampling.on_step(c.pid, c.t_mono_ns)

    def quality(self) -> dict[str, Any]:
        q: dict[str, Any] = {
            "snapshots": self.snapshots, "snapshots_dropped": self.probe.dropped,
            "sync_untracked": sum(c.sync_untracked for c in self._last.values()),
            "nccl_unknown_dtype_calls": sum(c.nccl_unknown_dtype_calls
                                            for c in self._last.values()),
            "launches": self.launches}
        if self.launches == "sampled":
            q.update(launch_samples=self.samples, launch_sample_every=self.sample_every)
        return q

    def _close(self) -> None:
        self.probe.close()
