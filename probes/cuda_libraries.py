"""The CUDA runtime, driver and NCCL libraries a job maps, and where their probed symbols are.

Holds the tables :mod:`perfmon.probes.cuda` probes from: the NCCL collectives
and the bytes of each ncclDataType_t, the exact entry points per library
(runtime and driver launches, graph launches, blocking calls, NCCL
collectives and their ``*Config`` twins), each library's basename in
/proc/PID/maps; and finding them in one target: the libraries it has mapped
(with the address spans of those that forward launches) and the exported
addresses of the wanted names in one of them (``.dynsym``, one name per
address).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from perfmon.parsers import procfs
from perfmon.parsers.elf_symbols import find_function_symbols
from perfmon.probes.files import MappedLibrary
from perfmon.probes.procfs import TargetProcess, read_proc

# Collectives: the key used in CudaCounters.nccl_calls/nccl_bytes (and in the
# names of the BPF program, on_nccl_<key>, and counters) -> its NCCL entry point.
NCCL_COLLECTIVES = {
    "all_reduce": "ncclAllReduce",
    "reduce_scatter": "ncclReduceScatter",
    "all_gather": "ncclAllGather",
    "broadcast": "ncclBroadcast",  # ncclBcast (in place) calls it: counted here once
    "reduce": "ncclReduce",
    "send": "ncclSend",
    "recv": "ncclRecv",
    "all_to_all": "ncclAlltoAll",  # NCCL 2.28+
    "gather": "ncclGather",  # NCCL 2.28+
    "scatter": "ncclScatter",  # NCCL 2.28+
}
# NCCL 2.32 adds a twin of every collective taking a trailing ncclCollConfig_t*
# (count and datatype where they are in the plain one); it is separate code,
# not a wrapper of the plain call, so both are probed and counted under one key.
NCCL_CONFIG_SUFFIX = "Config"

# ncclDataType_t (nccl.h) -> bytes per element. 10 and 11 are ncclFloat8e4m3
# and ncclFloat8e5m2 (NCCL 2.24+); older NCCL rejects them, so listing them is safe.
NCCL_DTYPE_BYTES = {
    0: 1,  # ncclInt8 / ncclChar
    1: 1,  # ncclUint8
    2: 4,  # ncclInt32 / ncclInt
    3: 4,  # ncclUint32
    4: 8,  # ncclInt64
    5: 8,  # ncclUint64
    6: 2,  # ncclFloat16 / ncclHalf
    7: 4,  # ncclFloat32 / ncclFloat
    8: 8,  # ncclFloat64 / ncclDouble
    9: 2,  # ncclBfloat16
    10: 1,  # ncclFloat8e4m3
    11: 1,  # ncclFloat8e5m2
}

# Entry points per library: symbol -> BPF program. The _ptsz/_ptds names are
# what code built with --default-stream per-thread calls instead of the legacy
# name; both are probed, and a call between them inside the library is told
# apart by the caller check (launches) or the stack pointer (blocking calls).
RUNTIME_LAUNCH_SYMBOLS = (
    "cudaLaunchKernel", "cudaLaunchKernel_ptsz",
    "cudaLaunchKernelExC", "cudaLaunchKernelExC_ptsz",
    "cudaLaunchCooperativeKernel", "cudaLaunchCooperativeKernel_ptsz",
)
DRIVER_LAUNCH_SYMBOLS = (
    "cuLaunchKernel", "cuLaunchKernel_ptsz",
    "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz",
    "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel_ptsz",
)
RUNTIME_GRAPH_SYMBOLS = ("cudaGraphLaunch", "cudaGraphLaunch_ptsz")
DRIVER_GRAPH_SYMBOLS = ("cuGraphLaunch", "cuGraphLaunch_ptsz")
SYNC_SYMBOLS = (
    "cudaStreamSynchronize", "cudaStreamSynchronize_ptsz",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy", "cudaMemcpy_ptds",
)

# How a symbol is probed: at its entry only, or also at its return (to time the call).
ENTRY, ENTRY_AND_RETURN = "entry", "entry+return"


@dataclass(frozen=True)
class CudaLibrary:
    name: str  # as reported: "libcudart", "libcuda", "libnccl"
    basename_prefix: str  # in /proc/PID/maps; "libcuda.so" does not match libcudart
    probes: tuple[tuple[str, str, str], ...]  # (symbol, BPF program, ENTRY or ENTRY_AND_RETURN)
    forwards_launches: bool  # its code calls launch entry points on the caller's behalf
    measures: str  # what is lost when it is not loaded (for warnings)


LIBRARIES = (
    CudaLibrary(
        "libcudart", "libcudart.so",
        (
            *((s, "on_runtime_launch", ENTRY) for s in RUNTIME_LAUNCH_SYMBOLS),
            *((s, "on_graph_launch", ENTRY) for s in RUNTIME_GRAPH_SYMBOLS),
            *((s, "on_sync_enter", ENTRY_AND_RETURN) for s in SYNC_SYMBOLS),
        ),
        forwards_launches=True,
        measures="runtime launches and time blocked in synchronising calls",
    ),
    CudaLibrary(
        "libcuda", "libcuda.so",
        (
            *((s, "on_driver_launch", ENTRY) for s in DRIVER_LAUNCH_SYMBOLS),
            *((s, "on_graph_launch", ENTRY) for s in DRIVER_GRAPH_SYMBOLS),
        ),
        forwards_launches=True,
        measures="driver-API launches (cuBLAS, Triton, NCCL kernels)",
    ),
    CudaLibrary(
        "libnccl", "libnccl.so",
        tuple(
            (sym + suffix, f"on_nccl_{key}", ENTRY)
            for key, sym in NCCL_COLLECTIVES.items()
            # ncclSend/ncclRecv have no Config twin
            for suffix in (("",) if key in ("send", "recv") else ("", NCCL_CONFIG_SUFFIX))
        ),
        forwards_launches=False,  # NCCL's own kernels are real launches: counted
        measures="NCCL collectives",
    ),
)


@dataclass
class TargetLibraries:
    """What one target has loaded: library name -> paths as the target sees them."""

    target: TargetProcess
    paths: dict[str, list[procfs.MappedFile]] = field(default_factory=dict)  # first mappings
    # Executable address ranges of the libraries that forward launches.
    forwarding_text: list[tuple[int, int]] = field(default_factory=list)


def find_libraries(target: TargetProcess) -> TargetLibraries:
    """The CUDA/NCCL libraries one target has mapped, from its /proc/PID/maps."""
    mappings = procfs.parse_maps(read_proc(target.pid, "maps"))  # type: ignore[arg-type]
    found = TargetLibraries(target)
    for mapping in mappings:
        basename = mapping.path.rsplit("/", 1)[-1]
        for lib in LIBRARIES:
            if not basename.startswith(lib.basename_prefix):
                continue
            paths = found.paths.setdefault(lib.name, [])
            if any(m.path == mapping.path for m in paths):
                continue
            paths.append(mapping)
            span = procfs.address_span(mappings, mapping.path)
            if lib.forwards_launches and span is not None:
                # The whole span of the library: its non-code parts hold no return addresses.
                found.forwarding_text.append(span)
    return found


def exact_symbols(library: MappedLibrary, names: Iterable[str]) -> dict[str, int]:
    """Exported function name -> address, for the names present; one name per address.

    Raises ElfError when the file is not an ELF64 library the agent reads (a job's
    crafted, truncated or oversized file: the parser's caps), OSError or ValueError
    when it cannot be mapped (an empty file); callers make it that library's warning.
    """
    names = list(names)
    found = find_function_symbols(library, names)
    addresses = {n: s.address for n in names for s in found[n] if s.name == n}
    by_name: dict[str, int] = {}
    seen: set[int] = set()
    for name in names:  # table order: the legacy name before its _ptsz twin
        address = addresses.get(name)
        if address is not None and address not in seen:
            by_name[name] = address
            seen.add(address)
    return by_name
