"""GPU side of a monitoring session: NVML samples, XID and ECC events, as log records.

Without a driver (CPU jobs, or hosts without NVIDIA GPUs) ``GpuSource`` is not
``available`` (``reason`` says why) and the session goes on in CPU mode.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from perfmon.parsers.events import Ecc, GpuSamples, Record, Xid
from perfmon.parsers.gpu_samples import job_gpu_indices
from perfmon.parsers.peak_tflops import peak_tflops_for
from perfmon.probes.gpu_health import read_gpu_health
from perfmon.probes.gpu_sampling import NvmlSampler
from perfmon.probes.nvml import NvmlUnavailable, driver_info
from perfmon.probes.sampler import Source, monotonic_ns
from perfmon.probes.xid import XidEventWatcher

ECC_INTERVAL_NS = 30_000_000_000  # ECC counters move rarely; ~60 NVML calls per read


class GpuSource(Source):
    """NVML sampling of every GPU, with the job's pids for per-process memory.

    Records: ``gpu`` (every GPU, once per interval), ``xid``, and ``ecc`` (new
    volatile ECC errors, read every 30 s).
    """

    name = "nvml"

    def __init__(self, pids: list[int], interval_s: float = 1.0) -> None:
        super().__init__()
        self.pids = pids
        self.interval_s = interval_s
        self.sampler = NvmlSampler(interval_s=interval_s, pids=pids)
        self.xids = XidEventWatcher()
        self.info: dict[str, Any] = {"available": False}
        self._ecc: dict[int, tuple[int | None, int | None]] = {}
        self._next_ecc_ns = 0
        self.samples = 0
        self.xid_events = 0

    def _start(self) -> None:
        """Start sampling; not ``available`` (with ``info['reason']``) without NVML."""
        try:
            driver = driver_info()
            self.sampler.start()
            self.xids.start()
        except NvmlUnavailable as err:
            self.available, self.reason = False, str(err)
            self.info = {"available": False, "reason": str(err)}
            return
        self.info = {
            "available": True,
            "driver_version": driver.driver_version,
            "gpu_count": driver.gpu_count,
            "sample_interval_s": self.interval_s,
        }

    def _poll(self) -> list[Record]:
        """Records (``gpu``, ``xid``, ``ecc``) gathered since the last call."""
        if not self.available:
            return []
        records: list[Record] = []
        samples = self.sampler.poll()
        if samples:
            self.samples += 1
            records.append(GpuSamples(min(s.t_mono_ns for s in samples),
                                      [_sample_record(asdict(s)) for s in samples]))
        xids = self.xids.poll()
        self.xid_events += len(xids)
        records += [Xid(e.t_mono_ns, e.gpu_index, e.xid) for e in xids]
        now = monotonic_ns()
        if now >= self._next_ecc_ns:
            self._next_ecc_ns = now + ECC_INTERVAL_NS
            records += self._ecc_events(now)
        return records

    def _ecc_events(self, now_ns: int) -> list[Record]:
        """New volatile ECC errors since the previous read (the first read sets the base)."""
        events: list[Record] = []
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
                    events.append(Ecc(now_ns, index, kind, after - before))
        return events

    def quality(self) -> dict[str, Any]:
        return {"samples": self.samples, "missed_slots": self.sampler.missed_slots,
                "unsupported_fields": len(self.sampler.unsupported_fields),
                "xid_events": self.xid_events}

    def peak_tflops(self, records: list[Record], dtype: str) -> tuple[float | None, str]:
        """The dense peak of the job's GPU for ``dtype``, from the first samples.

        None for a job on none of the GPUs (a CPU job on a GPU host).
        """
        for record in records:
            if not isinstance(record, GpuSamples):
                continue
            indices, _how = job_gpu_indices(record.gpus)
            for g in record.gpus:
                if g["index"] in indices and g.get("name"):
                    return peak_tflops_for(g["name"], dtype), g["name"]
        return None, "unknown"

    def _close(self) -> None:
        self.sampler.close()
        self.xids.close()


def _sample_record(sample: dict[str, Any]) -> dict[str, Any]:
    """A GpuSample as a log record: tuples to lists, pid keys kept as ints (msgpack)."""
    sample["throttle_reasons"] = list(sample["throttle_reasons"] or [])
    if sample["process_memory_bytes"] is not None:
        sample["process_memory_bytes"] = dict(sample["process_memory_bytes"])
    if sample["gpm"] is not None:
        sample["gpm"] = dict(sample["gpm"])
    return sample
