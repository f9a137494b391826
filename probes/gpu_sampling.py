"""GPU state sampled on a schedule: :class:`NvmlSampler` and its :class:`GpuSample`.

Measures, per GPU: utilisation, memory, power and its limit, SM and memory clocks,
temperature, clock-event (throttle) reasons, driver-side memory per process and, on
Hopper and later, GPM metrics. Every read goes through NVML access of
:mod:`perfmon.probes.nvml` (its per-field reader: a value the GPU or driver does not
offer is None and listed, never an error).

Cost: about a dozen NVML calls per GPU per sample, each an ioctl into the driver
(tens of microseconds to about a millisecond; power and the process list are the
slow ones). No thread: :meth:`NvmlSampler.poll` samples when a slot is due.

Versions: GPM needs Hopper or later (and nvidia-ml-py's GPM calls).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pynvml
from perfmon.probes.errors import ProbeError
from perfmon.probes.nvml import GpuLost, GpuReader, NvmlCallError, gpu_indices, nvml_query, open_gpu
from perfmon.probes.sampler import Sampler, monotonic_ns

GPM_METRIC_IDS = {
    "graphics_util_pct": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    "sm_util_pct": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy_pct": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "any_tensor_util_pct": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "dram_bw_util_pct": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
}


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one instant. None: not offered by this GPU/driver, or the read failed."""

    index: int
    t_mono_ns: int
    late_ns: int = 0  # t_mono_ns minus its slot (start + k*interval): lateness as data
    uuid: str | None = None
    name: str | None = None
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    temperature_c: int | None = None
    throttle_reasons: tuple[str, ...] | None = None
    # Driver-side memory per pid (CUDA context + caching allocator reserve); None
    # values: the driver does not show that process's memory to us.
    process_memory_bytes: Mapping[int, int | None] | None = None
    # How many compute processes (anyone's) NVML lists on this GPU; 0 inside a
    # container with its own PID namespace, where NVML shows none.
    process_count: int | None = None
    gpm: Mapping[str, float] | None = None  # GPM_METRIC_IDS names; Hopper+, from 2nd sample
    lost: bool = False
    error: str | None = None  # lost reason or failed reads ("field: message; ...")


@dataclass
class _Gpu:
    index: int
    handle: Any = None
    uuid: str | None = None
    name: str | None = None
    lost_error: str | None = None
    gpm_samples: list[Any] | None = None  # [previous, current] nvmlGpmSample_t
    gpm_primed: bool = False
    gpm_request: Any = None  # a reused c_nvmlGpmMetricsGet_t (about 19 KiB)


class NvmlSampler(Sampler[GpuSample]):
    """Samples GPUs every ``interval_s`` on a drift-free schedule (start + k*interval).

    No thread: ``poll()`` takes one sample of every GPU when a slot is due, so call
    it at least once per interval; slots that passed unsampled are counted in
    ``missed_slots``. A lost GPU yields ``lost=True`` samples and the others go on.
    Raises NvmlUnavailable from ``start()`` when there is no driver.
    """

    def __init__(self, gpus: Sequence[int] | None = None, interval_s: float = 1.0,
                 pids: Iterable[int] | None = None) -> None:
        super().__init__()
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, not {interval_s}")
        self._requested = None if gpus is None else list(gpus)
        self._interval_ns = int(interval_s * 1e9)
        self._pids: frozenset[int] | None = None if pids is None else frozenset(pids)
        self._gpus: list[_Gpu] = []
        self._t0_ns = 0
        self._next_slot = 0
        self.missed_slots = 0
        self.unsupported_fields: dict[str, str] = {}  # field -> reason, over all GPUs

    def set_pids(self, pids: Iterable[int] | None) -> None:
        """Report process memory for these pids from the next sample on (None: all)."""
        self._pids = None if pids is None else frozenset(pids)

    @property
    def gpu_indices(self) -> list[int]:
        return [gpu.index for gpu in self._gpus]

    def _start(self) -> None:
        self._gpus = [_Gpu(index) for index in gpu_indices(self._requested)]
        for gpu in self._gpus:
            try:
                reader = open_gpu(gpu.index, self.unsupported_fields)
                gpu.handle = reader.handle
                gpu.uuid, gpu.name = reader.identity()
                self._start_gpm(gpu, reader)
            except (GpuLost, NvmlCallError) as err:
                gpu.lost_error = str(err)  # reported in every sample of this GPU
        self._t0_ns = monotonic_ns()
        self._next_slot = 0

    def _start_gpm(self, gpu: _Gpu, reader: GpuReader) -> None:
        support = reader.dev("gpm", pynvml.nvmlGpmQueryDeviceSupport)
        if support is None or not support.isSupportedDevice:
            self.unsupported_fields.setdefault("gpm", f"not supported (GPU {gpu.index})")
            return
        samples = [reader.get("gpm", pynvml.nvmlGpmSampleAlloc) for _ in range(2)]
        if None in samples:
            self._free_gpm(samples)
            return
        gpu.gpm_samples = samples
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRIC_IDS)
        for i, metric_id in enumerate(GPM_METRIC_IDS.values()):
            request.metrics[i].metricId = metric_id
        gpu.gpm_request = request

    def _poll(self) -> list[GpuSample]:
        now_ns = monotonic_ns()
        due_slot = (now_ns - self._t0_ns) // self._interval_ns
        if due_slot < self._next_slot:
            return []
        self.missed_slots += due_slot - self._next_slot
        self._next_slot = due_slot + 1
        slot_ns = self._t0_ns + due_slot * self._interval_ns
        return [self._sample(gpu, slot_ns) for gpu in self._gpus]

    def _sample(self, gpu: _Gpu, slot_ns: int) -> GpuSample:
        t_ns = monotonic_ns()
        late_ns = t_ns - slot_ns
        if gpu.lost_error is not None:
            return GpuSample(gpu.index, t_ns, late_ns, gpu.uuid, gpu.name, lost=True,
                             error=gpu.lost_error)
        r = GpuReader(gpu.index, gpu.handle, self.unsupported_fields)
        try:
            util_gpu, util_mem = r.utilization()
            process_memory, process_count = r.processes(self._pids)
            memory = r.dev("memory_used_bytes", pynvml.nvmlDeviceGetMemoryInfo)
            sample = GpuSample(
                gpu.index, t_ns, late_ns, gpu.uuid, gpu.name,
                utilization_gpu_pct=util_gpu,
                utilization_memory_pct=util_mem,
                memory_used_bytes=None if memory is None else memory.used,
                memory_total_bytes=None if memory is None else memory.total,
                power_w=r.watts("power_w", pynvml.nvmlDeviceGetPowerUsage),
                power_limit_w=r.watts("power_limit_w", pynvml.nvmlDeviceGetEnforcedPowerLimit),
                sm_clock_mhz=r.dev("sm_clock_mhz", pynvml.nvmlDeviceGetClockInfo,
                                   pynvml.NVML_CLOCK_SM),
                mem_clock_mhz=r.dev("mem_clock_mhz", pynvml.nvmlDeviceGetClockInfo,
                                    pynvml.NVML_CLOCK_MEM),
                temperature_c=r.temperature_c(),
                throttle_reasons=r.throttle_reasons(),
                process_memory_bytes=process_memory,
                process_count=process_count,
                gpm=self._read_gpm(gpu, r),
                error="; ".join(r.errors.values()) or None,
            )
        except GpuLost as err:
            # nvml.h: a lost GPU stays lost until reset; later samples say so cheaply.
            gpu.lost_error = str(err)
            return GpuSample(gpu.index, t_ns, late_ns, gpu.uuid, gpu.name, lost=True,
                             error=gpu.lost_error)
        return sample

    def _read_gpm(self, gpu: _Gpu, r: GpuReader) -> dict[str, float] | None:
        if gpu.gpm_samples is None:
            return None
        previous, current = gpu.gpm_samples
        if r.dev("gpm", pynvml.nvmlGpmSampleGet, current) is None:
            return None
        gpu.gpm_samples = [current, previous]
        if not gpu.gpm_primed:  # GPM metrics are rates between two samples
            gpu.gpm_primed = True
            return None
        request = gpu.gpm_request
        request.sample1, request.sample2 = previous, current
        if r.get("gpm", pynvml.nvmlGpmMetricsGet, request) is None:
            return None
        return {
            name: float(request.metrics[i].value)
            for i, name in enumerate(GPM_METRIC_IDS)
            if request.metrics[i].nvmlReturn == pynvml.NVML_SUCCESS
        }

    @staticmethod
    def _free_gpm(samples: Iterable[Any]) -> None:
        for sample in samples:
            if sample is not None:
                try:
                    nvml_query(pynvml.nvmlGpmSampleFree, sample, field="gpm")
                except ProbeError:
                    pass  # freeing on a lost GPU may fail; nothing else to do

    def _close(self) -> None:
        for gpu in self._gpus:
            if gpu.gpm_samples is not None:
                self._free_gpm(gpu.gpm_samples)
                gpu.gpm_samples = None
