"""The GPU counters a health check reads once (:func:`read_gpu_health`).

Temperature and its thresholds, power and its limits, ECC, retired pages, row
remapping (Ampere or later), PCIe link and NVLink state, and the compute
processes, as :class:`GpuHealthReadings`. Reads go through the per-field reader
of :mod:`perfmon.probes.nvml`, so a value the GPU or driver does not offer is
None and listed, never an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pynvml
from perfmon.probes.nvml import GpuLost, GpuReader, NvmlCallError, open_gpu


@dataclass(frozen=True)
class GpuHealthReadings:
    """One reading of everything a health check judges. None: not offered or failed."""

    index: int
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    temperature_c: int | None = None
    temperature_slowdown_c: int | None = None
    temperature_shutdown_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    power_default_limit_w: float | None = None
    utilization_gpu_pct: int | None = None
    throttle_reasons: tuple[str, ...] | None = None
    ecc_volatile_corrected: int | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    pcie_link_width: int | None = None
    pcie_link_width_max: int | None = None
    pcie_link_gen: int | None = None
    pcie_link_gen_max: int | None = None
    nvlink_active: Mapping[int, bool] | None = None  # link number -> active
    process_memory_bytes: Mapping[int, int | None] | None = None  # every compute process
    unsupported: frozenset[str] = frozenset()  # fields this GPU or driver does not offer
    errors: Mapping[str, str] = field(default_factory=dict)  # field -> failed read
    lost: bool = False
    error: str | None = None


def read_gpu_health(index: int, unsupported: dict[str, str] | None = None) -> GpuHealthReadings:
    """Read GPU ``index`` once for a health check (about 60 NVML calls).

    A lost GPU gives ``lost=True``; other per-field failures are in ``errors``.
    Raises NvmlUnavailable without a driver.
    """
    notes: dict[str, str] = {} if unsupported is None else unsupported
    try:
        r = open_gpu(index, notes)
        uuid, name = r.identity()
    except (GpuLost, NvmlCallError) as err:
        return GpuHealthReadings(index, lost=True, error=str(err))
    try:
        return _read_health(r, uuid, name)
    except GpuLost as err:
        return GpuHealthReadings(index, uuid, name, lost=True, error=str(err))


def _read_health(r: GpuReader, uuid: str | None, name: str | None) -> GpuHealthReadings:
    def threshold(field_name: str, kind: int) -> int | None:
        return r.dev(field_name, pynvml.nvmlDeviceGetTemperatureThreshold, kind)

    def ecc(field_name: str, error_type: int, counter: int) -> int | None:
        return r.dev(field_name, pynvml.nvmlDeviceGetTotalEccErrors, error_type, counter)

    pci = r.dev("pci_bus_id", pynvml.nvmlDeviceGetPciInfo_v3)
    pending = r.dev("retired_pages_pending", pynvml.nvmlDeviceGetRetiredPagesPendingStatus)
    remap = r.dev("remapped_rows", pynvml.nvmlDeviceGetRemappedRows)
    corrected, uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, \
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    volatile, aggregate = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
    return GpuHealthReadings(
        r.index, uuid, name,
        pci_bus_id=None if pci is None else _text(pci.busId),
        temperature_c=r.temperature_c(),
        temperature_slowdown_c=threshold("temperature_slowdown_c",
                                         pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
        temperature_shutdown_c=threshold("temperature_shutdown_c",
                                         pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
        power_w=r.watts("power_w", pynvml.nvmlDeviceGetPowerUsage),
        power_limit_w=r.watts("power_limit_w", pynvml.nvmlDeviceGetEnforcedPowerLimit),
        power_default_limit_w=r.watts("power_default_limit_w",
                                      pynvml.nvmlDeviceGetPowerManagementDefaultLimit),
        utilization_gpu_pct=r.utilization()[0],
        throttle_reasons=r.throttle_reasons(),
        ecc_volatile_corrected=ecc("ecc_volatile_corrected", corrected, volatile),
        ecc_volatile_uncorrected=ecc("ecc_volatile_uncorrected", uncorrected, volatile),
        ecc_aggregate_corrected=ecc("ecc_aggregate_corrected", corrected, aggregate),
        ecc_aggregate_uncorrected=ecc("ecc_aggregate_uncorrected", uncorrected, aggregate),
        retired_pages_pending=None if pending is None else bool(pending),
        remapped_rows_corrected=None if remap is None else remap[0],
        remapped_rows_uncorrected=None if remap is None else remap[1],
        remapped_rows_pending=None if remap is None else bool(remap[2]),
        remapped_rows_failure=None if remap is None else bool(remap[3]),
        pcie_link_width=r.dev("pcie_link_width", pynvml.nvmlDeviceGetCurrPcieLinkWidth),
        pcie_link_width_max=r.dev("pcie_link_width_max", pynvml.nvmlDeviceGetMaxPcieLinkWidth),
        pcie_link_gen=r.dev("pcie_link_gen", pynvml.nvmlDeviceGetCurrPcieLinkGeneration),
        # The maximum this GPU *and this slot* allow, not the GPU's alone.
        pcie_link_gen_max=r.dev("pcie_link_gen_max", pynvml.nvmlDeviceGetMaxPcieLinkGeneration),
        nvlink_active=_nvlink_active(r),
        process_memory_bytes=r.processes(None)[0],
        unsupported=frozenset(r.missing),
        errors=dict(r.errors),
    )


def _nvlink_active(r: GpuReader) -> dict[int, bool] | None:
    # Links may be sparse (boards wire a subset), and a link number the GPU lacks
    # answers INVALID_ARGUMENT or NOT_SUPPORTED: try all NVML_NVLINK_MAX_LINKS.
    absent = {pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_NOT_SUPPORTED}
    states: dict[int, bool] = {}
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        state = r.get("nvlink_active", pynvml.nvmlDeviceGetNvLinkState, r.handle, link,
                      none_on=absent)
        if state is not None:
            states[link] = bool(state)
    if not states and "nvlink_active" not in r.errors:
        r.missing.add("nvlink_active")
        r.unsupported.setdefault("nvlink_active", f"not supported (GPU {r.index})")
        return None
    return states or None


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
