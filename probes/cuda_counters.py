"""The CUDA/NCCL counters of one process: their numbering in cuda.bpf.c's counter array,
and the record :class:`~perfmon.probes.cuda.CudaActivityProbe` reads them into.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from perfmon.probes.cuda_libraries import NCCL_COLLECTIVES

# Counter ids, shared with cuda.bpf.c through -D cflags (CTR_<NAME>=index).
COUNTERS = (
    "runtime_launches",
    "driver_launches",
    "forwarded_launches",
    "graph_launches",
    "forwarded_graph_launches",
    "sync_calls",
    "sync_wait_ns",
    "sync_untracked",
    "nccl_unknown_dtype_calls",
    *(f"nccl_calls_{key}" for key in NCCL_COLLECTIVES),
    *(f"nccl_bytes_{key}" for key in NCCL_COLLECTIVES),
)


@dataclass(frozen=True)
class CudaCounters:
    """Cumulative counts for one process since the probes were attached.

    ``t_mono_ns`` is CLOCK_MONOTONIC: for a periodic snapshot, taken just
    before the kernel map is read; for an ``at_step`` one, the kernel's time at
    the entry of ``Optimizer.step``, when the kernel copied the counters.
    """

    t_mono_ns: int
    pid: int
    kernel_launches: int  # runtime_launches + driver_launches; excludes graph launches
    sync_wait_ns: int  # wall time inside blocking calls that have returned
    nccl_calls: dict[str, int]  # keys: NCCL_COLLECTIVES, always all present
    nccl_bytes: dict[str, int]  # count argument x datatype size, summed (see perfmon.probes.cuda)
    runtime_launches: int = 0  # made through libcudart
    driver_launches: int = 0  # made through libcuda by anything but libcudart/libcuda
    forwarded_launches: int = 0  # driver (or _ptsz) entries made by the CUDA libraries
    graph_launches: int = 0  # cudaGraphLaunch / cuGraphLaunch, not forwarded
    sync_calls: int = 0  # blocking calls that have returned (outermost only)
    sync_untracked: int = 0  # blocking calls not timed (return unseen, or table full)
    nccl_unknown_dtype_calls: int = 0  # calls with a datatype not in NCCL_DTYPE_BYTES
    at_step: bool = False  # taken in the kernel at an Optimizer.step entry, not by poll()


def counters_from_kernel(t_mono_ns: int, pid: int, raw: Iterable[int],
                         at_step: bool) -> CudaCounters:
    """CudaCounters from the kernel's counter array (numbered as COUNTERS)."""
    c = dict(zip(COUNTERS, (int(v) for v in raw), strict=True))
    return CudaCounters(
        t_mono_ns=t_mono_ns,
        pid=pid,
        kernel_launches=c["runtime_launches"] + c["driver_launches"],
        sync_wait_ns=c["sync_wait_ns"],
        nccl_calls={k: c[f"nccl_calls_{k}"] for k in NCCL_COLLECTIVES},
        nccl_bytes={k: c[f"nccl_bytes_{k}"] for k in NCCL_COLLECTIVES},
        runtime_launches=c["runtime_launches"],
        driver_launches=c["driver_launches"],
        forwarded_launches=c["forwarded_launches"],
        graph_launches=c["graph_launches"],
        sync_calls=c["sync_calls"],
        sync_untracked=c["sync_untracked"],
        nccl_unknown_dtype_calls=c["nccl_unknown_dtype_calls"],
        at_step=at_step,
    )
