"""GPU side of a monitoring session: NVML samples, XID and ECC events, as log records.

Without a driver (CPU jobs, or hosts without NVIDIA GPUs) ``GpuMonitor.start``
returns False with the reason, and the session goes on in CPU mode.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from perfmon.parsers.peak_tflops import peak_tflops_for
from perfmon.probes.nvml import (
    NvmlSampler,
    NvmlUnavailable,
    XidEventWatcher,
    driver_info,
    read_gpu_health,
)
from perfmon.probes.sampler import monotonic_ns

ECC_INTERVAL_NS = 30_000_000_000  # ECC counters move rarely; ~60 NVML calls per read


class GpuMonitor:
    """NVML sampling of every GPU, with the job's pids for per-process memory."""

    def __init__(self, pids: list[int], interval_s: float = 1.0) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.sampler = NvmlSampler(interval_s=interval_s, pids=pids)
        self.xids = XidEventWatcher()
        self.info: dict[str, Any] = {"available": False}
        self._ecc: dict[int, tuple[int | None, int | None]] = {}
        self._next_ecc_ns = 0
        self._started = False

    def start(self) -> bool:
        """Start sampling; False (with ``info['reason']``) when NVML is unavailable."""
        try:
            driver = driver_info()
            self.sampler.start()
            self.xids.start()
        except NvmlUnavailable as err:
            self.info = {"available": False, "reason": str(err)}
            return False
        self._started = True
        self.info = {
            "available": True,
            "driver_version": driver.driver_version,
            "gpu_count": driver.gpu_count,
            "sample_interval_s": self.interval_s,
        }
        return True

    def poll(self) -> list[dict[str, Any]]:
        """Log records (``gpu``, ``xid``, ``ecc``) gathered since the last call."""
        if not self._started:
            return []
        records: list[dict[str, Any]] = []
        samples = self.sampler.poll()
        if samples:
            records.append({
                "type": "gpu",
                "t_mono_ns": min(s.t_mono_ns for s in samples),
                "gpus": [_sample_record(asdict(s)) for s in samples],
            })
        records += [{"type": "xid", "t_mono_ns": e.t_mono_ns, "gpu_index": e.gpu_index,
                     "xid": e.xid} for e in self.xids.poll()]
        now = monotonic_ns()
        if now >= self._next_ecc_ns:
            self._next_ecc_ns = now + ECC_INTERVAL_NS
            records += self._ecc_events(now)
        return records

    def _ecc_events(self, now_ns: int) -> list[dict[str, Any]]:
        """New volatile ECC errors since the previous read (the first read sets the base)."""
        events = []
        for index in self.sampler.gpu_indices:
            readings = read_gpu_health(index)
            current = (readings.ecc_volatile_corrected, readings.ecc_volatile_uncorrected)
            previous = self._ecc.get(index)
            self._ecc[index] = current
            if previous is None:
                continue
            for kind, before, after in zip(("corrected", "uncorrected"), previous, current,
                                           strict=True):
                if before is not None and after is not None and after > before:
                    events.append({"type": "ecc", "t_mono_ns": now_ns, "gpu_index": index,
                                   "kind": kind, "count": after - before})
        return events

    def peak_tflops(self, records: list[dict[str, Any]], dtype: str) -> tuple[float | None, str]:
        """The dense peak of the job's GPU for ``dtype``, from the first samples.

        None for a job on none of the GPUs (a CPU job on a GPU host).
        """
        for record in records:
            if record["type"] != "gpu":
                continue
            indices, _how = job_gpu_indices(record["gpus"])
            for g in record["gpus"]:
                if g["index"] in indices and g.get("name"):
                    return peak_tflops_for(g["name"], dtype), g["name"]
        return None, "unknown"

    def close(self) -> None:
        self.sampler.close()
        self.xids.close()


def job_gpu_indices(gpus: list[dict[str, Any]]) -> tuple[set[int], str]:
    """The GPUs of one ``gpu`` record that are the job's, and how that was decided.

    The sampler lists only the job's processes in ``process_memory_bytes``:
    GPUs showing one are the job's (``processes``). When NVML lists no compute
    process on any GPU (a container with its own PID namespace, or a driver
    that does not say), every GPU counts as the job's (``all_gpus``). Otherwise
    other processes use the GPUs and the job none of them (``none``: a CPU job
    on a GPU host gets no GPU figures and no MFU).
    """
    alive = [g for g in gpus if not g.get("lost")]
    mine = {g["index"] for g in alive if g.get("process_memory_bytes")}
    if mine:
        return mine, "processes"
    if not any(g.get("process_count") for g in gpus):
        return {g["index"] for g in alive}, "all_gpus"
    return set(), "none"


def _sample_record(sample: dict[str, Any]) -> dict[str, Any]:
    """A GpuSample as a log record: tuples to lists, pid keys kept as ints (msgpack)."""
    sample["throttle_reasons"] = list(sample["throttle_reasons"] or [])
    if sample["process_memory_bytes"] is not None:
        sample["process_memory_bytes"] = dict(sample["process_memory_bytes"])
    if sample["gpm"] is not None:
        sample["gpm"] = dict(sample["gpm"])
    return sample
