"""NVML access (libnvidia-ml.so.1, through nvidia-ml-py's ``pynvml``) for every GPU probe.

Initialisation, the one call wrapper :func:`nvml_query` and its errors, opening a
GPU (:func:`open_gpu`) and reading its fields (:class:`GpuReader`), driver
information and GPU enumeration. The probes built on it: the sampler in
:mod:`perfmon.probes.gpu_sampling`, XID events in :mod:`perfmon.probes.xid`, the
counters a health check reads once in :mod:`perfmon.probes.gpu_health`.

Privileges: none beyond opening /dev/nvidia*. Where the driver withholds a value
(NO_PERMISSION, NVML_VALUE_NOT_AVAILABLE for other users' processes in some
set-ups) the field is None and listed as unsupported, never an error.

Versions: nvidia-ml-py >= 12.535 and a driver whose NVML has
nvmlDeviceGetComputeRunningProcesses_v3 (R510+). Clock *event* reasons are the
R535 name of throttle reasons; older drivers get the old call. Row remapping needs
Ampere or later, GPM Hopper or later.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import pynvml
from perfmon.probes.errors import PrerequisiteMissing, ProbeError

log = logging.getLogger(__name__)


class NvmlUnavailable(PrerequisiteMissing):
    """NVML cannot be used: no libnvidia-ml.so.1, no driver, or library and driver differ."""


class GpuLost(ProbeError):
    """The GPU fell off the bus (NVML_ERROR_GPU_IS_LOST) or needs a reset."""


class NvmlCallError(ProbeError):
    """An NVML call failed for a reason other than 'not supported' or 'GPU lost'."""


class NoSuchGpu(ProbeError):
    """A GPU index outside what NVML enumerates was asked for."""


_CODE_NAMES = {
    value: name
    for name, value in vars(pynvml).items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}
# Answers that mean "this GPU or driver does not offer the value": the field is
# None and listed, as nvitop's libnvml does, rather than a failed sample.
_UNSUPPORTED = {
    pynvml.NVML_ERROR_NOT_SUPPORTED: "not supported",
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: "not in this driver",  # pynvml: no such symbol
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission",
}
# nvml.h: after GPU_IS_LOST every call on the device fails until it is reset.
_NOT_IN_DRIVER = _UNSUPPORTED[pynvml.NVML_ERROR_FUNCTION_NOT_FOUND]
_LOST = {
    pynvml.NVML_ERROR_GPU_IS_LOST: "fallen off the bus",
    pynvml.NVML_ERROR_RESET_REQUIRED: "needs a reset",
}
_UNAVAILABLE = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "libnvidia-ml.so.1 not found; is the NVIDIA driver installed?"
    ),
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "libnvidia-ml.so.1 does not match the loaded kernel driver (reload the driver or reboot)"
    ),
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission to open /dev/nvidia*",
}
_THROTTLE_REASON_NAMES = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

_init_lock = threading.Lock()
_initialised = False
_logged_unsupported: set[str] = set()


def _code_name(code: int) -> str:
    return _CODE_NAMES.get(code, f"NVML error {code}")


def _ensure_initialised() -> None:
    global _initialised
    with _init_lock:
        if _initialised:
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            reason = _UNAVAILABLE.get(err.value, str(err))
            raise NvmlUnavailable(f"NVML unavailable ({_code_name(err.value)}): {reason}") from err
        _initialised = True
        atexit.register(_shutdown)


def _shutdown() -> None:
    global _initialised
    with _init_lock:
        if _initialised:
            _initialised = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass


def nvml_query(
    func: Callable[..., Any],
    *args: Any,
    field: str,
    unsupported: dict[str, str] | None = None,
    gpu: int | None = None,
    none_on: Collection[int] = (),
) -> Any:
    """Call one pynvml function; every NVML call of perfmon goes through here.

    Initialises NVML on first use. Returns the function's result, or None when the
    GPU or driver does not offer it (NOT_SUPPORTED, FUNCTION_NOT_FOUND,
    NO_PERMISSION): ``field`` is then recorded in ``unsupported`` with the reason
    and the function is logged once per process. Codes in ``none_on`` give None
    silently (TIMEOUT from an event wait, INVALID_ARGUMENT for a missing link).

    Raises NvmlUnavailable (no library or driver), GpuLost (GPU_IS_LOST,
    RESET_REQUIRED) and NvmlCallError (any other NVML error).
    """
    _ensure_initialised()
    try:
        return func(*args)
    except pynvml.NVMLError as err:
        code = err.value
        name = getattr(func, "__name__", repr(func))
        where = f"GPU {gpu}: " if gpu is not None else ""
        if code in none_on:
            return None
        if code in _UNSUPPORTED:
            if unsupported is not None:
                unsupported.setdefault(field, _UNSUPPORTED[code])
            if name not in _logged_unsupported:
                _logged_unsupported.add(name)
                log.info("%s%s: %s; %s is None", where, name, _UNSUPPORTED[code], field)
            return None
        if code in _LOST:
            raise GpuLost(f"{where}{_LOST[code]} ({_code_name(code)} from {name})") from err
        raise NvmlCallError(f"{where}{name} failed: {err} ({_code_name(code)})") from err


def throttle_reason_names(mask: int) -> tuple[str, ...]:
    """Names of the bits set in an nvmlClocksEventReason* mask (unknown bits as hex)."""
    names = [name for bit, name in _THROTTLE_REASON_NAMES.items() if mask & bit]
    rest = mask & ~sum(_THROTTLE_REASON_NAMES)
    for bit in range(64):
        if rest & (1 << bit):
            names.append(f"unknown_0x{1 << bit:x}")
    return tuple(names)


@dataclass(frozen=True)
class DriverInfo:
    """What the driver reports about itself."""

    driver_version: str | None
    nvml_version: str | None
    cuda_driver_version: int | None  # e.g. 12040 for CUDA 12.4
    gpu_count: int


def driver_info() -> DriverInfo:
    """Driver and NVML versions and the GPU count. Raises NvmlUnavailable."""
    count = nvml_query(pynvml.nvmlDeviceGetCount, field="gpu_count")
    return DriverInfo(
        driver_version=nvml_query(pynvml.nvmlSystemGetDriverVersion, field="driver_version"),
        nvml_version=nvml_query(pynvml.nvmlSystemGetNVMLVersion, field="nvml_version"),
        cuda_driver_version=nvml_query(
            pynvml.nvmlSystemGetCudaDriverVersion, field="cuda_driver_version"
        ),
        gpu_count=count or 0,
    )


def gpu_indices(gpus: Iterable[int] | None) -> list[int]:
    """``gpus`` checked against NVML's enumeration (all GPUs when None).

    NVML indices follow PCI bus order and ignore CUDA_VISIBLE_DEVICES. Raises
    NoSuchGpu for an index NVML does not have, NvmlUnavailable without a driver.
    """
    count = driver_info().gpu_count
    if gpus is None:
        return list(range(count))
    indices = sorted(set(gpus))
    for index in indices:
        if not 0 <= index < count:
            raise NoSuchGpu(f"GPU {index} not found: NVML sees {count} GPU(s)")
    return indices


class GpuReader:
    """Reads one GPU's fields: per-field failures become None plus a note.

    Shared by :mod:`perfmon.probes.gpu_sampling` and :mod:`perfmon.probes.gpu_health`.
    """

    def __init__(self, index: int, handle: Any, unsupported: dict[str, str]) -> None:
        self.index = index
        self.handle = handle
        self.unsupported = unsupported  # shared by the caller, across GPUs
        self.missing: set[str] = set()  # fields this GPU does not offer
        self.errors: dict[str, str] = {}

    def get(self, field: str, func: Callable[..., Any], *args: Any,
            none_on: Collection[int] = (), fallback: Callable[..., Any] | None = None) -> Any:
        """One read; ``fallback`` is tried when ``func`` is not in this driver."""
        local: dict[str, str] = {}
        try:
            value = nvml_query(func, *args, field=field, unsupported=local,
                               gpu=self.index, none_on=none_on)
            if fallback is not None and local.get(field) == _NOT_IN_DRIVER:
                local.clear()
                value = nvml_query(fallback, *args, field=field, unsupported=local,
                                   gpu=self.index, none_on=none_on)
        except NvmlCallError as err:
            self.errors[field] = str(err)
            return None
        if local:
            self.missing.add(field)
            self.unsupported.setdefault(field, f"{local[field]} (GPU {self.index})")
        return value

    def dev(self, field: str, func: Callable[..., Any], *args: Any,
            fallback: Callable[..., Any] | None = None) -> Any:
        """``get`` for a call that takes the device handle first."""
        return self.get(field, func, self.handle, *args, fallback=fallback)

    def identity(self) -> tuple[str | None, str | None]:
        return (self.dev("uuid", pynvml.nvmlDeviceGetUUID),
                self.dev("name", pynvml.nvmlDeviceGetName))

    def watts(self, field: str, func: Callable[..., Any]) -> float | None:
        milliwatts = self.dev(field, func)  # nvml.h: all power values are in mW
        return None if milliwatts is None else milliwatts / 1000.0

    def temperature_c(self) -> int | None:
        # nvml.h deprecates nvmlDeviceGetTemperature (removal planned for CUDA 14) in
        # favour of nvmlDeviceGetTemperatureV, which older drivers lack.
        return self.dev("temperature_c", pynvml.nvmlDeviceGetTemperature,
                        pynvml.NVML_TEMPERATURE_GPU, fallback=_temperature_v)

    def throttle_reasons(self) -> tuple[str, ...] | None:
        # R535 renamed "clocks throttle reasons" to "clocks event reasons" (same bits);
        # older drivers only export the old symbol.
        mask = self.dev("throttle_reasons", pynvml.nvmlDeviceGetCurrentClocksEventReasons,
                        fallback=pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        return None if mask is None else throttle_reason_names(mask)

    def processes(self, pids: Collection[int] | None
                  ) -> tuple[dict[int, int | None] | None, int | None]:
        """(memory per pid of ``pids`` (None: all), count of every compute process listed)."""
        procs = self.dev("process_memory_bytes", pynvml.nvmlDeviceGetComputeRunningProcesses_v3)
        if procs is None:
            return None, None
        memory: dict[int, int | None] = {}
        for proc in procs:
            if pids is not None and proc.pid not in pids:
                continue
            # pynvml turns NVML_VALUE_NOT_AVAILABLE (hidden from us) into None. A
            # process appears once per MIG instance it uses: add up, unknown if any is.
            used = proc.usedGpuMemory
            if proc.pid in memory:
                before = memory[proc.pid]
                used = None if before is None or used is None else before + used
            memory[proc.pid] = used
        return memory, len({proc.pid for proc in procs})

    def utilization(self) -> tuple[int | None, int | None]:
        util = self.dev("utilization_gpu_pct", pynvml.nvmlDeviceGetUtilizationRates)
        return (None, None) if util is None else (util.gpu, util.memory)


def _temperature_v(handle: Any, sensor: int) -> int:
    return int(pynvml.nvmlDeviceGetTemperatureV(handle, sensor))


def open_gpu(index: int, unsupported: dict[str, str]) -> GpuReader:
    """A reader of GPU ``index`` (its handle got by index), noting in ``unsupported``.

    Raises GpuLost and NvmlCallError (the GPU cannot be had), NvmlUnavailable.
    """
    handle = nvml_query(pynvml.nvmlDeviceGetHandleByIndex, index, field="handle", gpu=index)
    return GpuReader(index, handle, unsupported)

