"""XID critical-error events from NVML (:class:`XidEventWatcher`, :class:`XidEvent`).

Cost: one non-blocking nvmlEventSetWait_v2 per pending event and one more that
finds none, per poll. No thread. Only events raised after ``start()`` are seen.
NVML access, its errors and GPU enumeration are in :mod:`perfmon.probes.nvml`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pynvml
from perfmon.probes.errors import ProbeError
from perfmon.probes.nvml import GpuLost, NvmlCallError, gpu_indices, nvml_query
from perfmon.probes.sampler import Sampler, monotonic_ns

# Bounds one poll, so a GPU spewing events cannot hold the caller's loop forever.
_MAX_EVENTS_PER_POLL = 1024


@dataclass(frozen=True)
class XidEvent:
    """An XID (driver-reported GPU error) seen by :class:`XidEventWatcher`."""

    gpu_index: int | None  # None: the event named a device we did not register
    xid: int
    # When poll() received it: NVML events carry no timestamp (nvmlEventData_t).
    t_mono_ns: int


class XidEventWatcher(Sampler[XidEvent]):
    """XID critical-error events from NVML, polled without blocking (timeout 0).

    Only events raised after ``start()`` are seen. GPUs whose driver refuses the
    registration are left out of ``registered_gpus`` (reason in
    ``unsupported_fields``).
    """

    def __init__(self, gpus: Sequence[int] | None = None) -> None:
        super().__init__()
        self._requested = None if gpus is None else list(gpus)
        self._event_set: Any = None
        self._index_by_handle: dict[int | None, int] = {}
        self.registered_gpus: frozenset[int] = frozenset()
        self.unsupported_fields: dict[str, str] = {}
        self.errors: list[str] = []

    def _start(self) -> None:
        indices = gpu_indices(self._requested)
        self._event_set = nvml_query(pynvml.nvmlEventSetCreate, field="xid_events",
                                     unsupported=self.unsupported_fields)
        if self._event_set is None:
            return
        for index in indices:
            local: dict[str, str] = {}
            try:
                handle = nvml_query(pynvml.nvmlDeviceGetHandleByIndex, index,
                                    field="handle", gpu=index)
                nvml_query(pynvml.nvmlDeviceRegisterEvents, handle,
                           pynvml.nvmlEventTypeXidCriticalError, self._event_set,
                           field="xid_events", unsupported=local, gpu=index)
            except (GpuLost, NvmlCallError) as err:
                self.errors.append(str(err))
                continue
            if local:
                self.unsupported_fields.setdefault("xid_events",
                                                   f"{local['xid_events']} (GPU {index})")
                continue
            self._index_by_handle[ctypes.cast(handle, ctypes.c_void_p).value] = index
        self.registered_gpus = frozenset(self._index_by_handle.values())

    def _poll(self) -> list[XidEvent]:
        if self._event_set is None:
            return []
        events: list[XidEvent] = []
        for _ in range(_MAX_EVENTS_PER_POLL):
            try:
                data = nvml_query(pynvml.nvmlEventSetWait_v2, self._event_set, 0,
                                  field="xid_events", none_on={pynvml.NVML_ERROR_TIMEOUT})
            except (GpuLost, NvmlCallError) as err:
                self.errors.append(str(err))
                break
            if data is None:  # TIMEOUT: nothing pending
                break
            if data.eventType != pynvml.nvmlEventTypeXidCriticalError:
                continue
            handle = ctypes.cast(data.device, ctypes.c_void_p).value
            events.append(XidEvent(self._index_by_handle.get(handle), int(data.eventData),
                                   monotonic_ns()))
        return events

    def _close(self) -> None:
        if self._event_set is not None:
            try:
                nvml_query(pynvml.nvmlEventSetFree, self._event_set, field="xid_events")
            except ProbeError:
                pass  # the set dies with the process anyway
            self._event_set = None
