"""``perfmon-agent health``: is each GPU fit to run a training job right now?

Watches the GPUs for a window (XID events, temperature, power, clock events),
then reads their error counters once, and judges each check pass / warn / fail;
a check the GPU or driver does not offer is "skipped", never a failure. Thresholds
and the reasons for them are in docs/gpu.md. Exit status: 0 when nothing failed,
1 when a check failed, 3 for a GPU index NVML lacks, 5 when NVML is unavailable
(those two: one line on stderr).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from perfmon.probes.gpu_health import GpuHealthReadings, read_gpu_health
from perfmon.probes.gpu_sampling import GpuSample, NvmlSampler
from perfmon.probes.nvml import driver_info, gpu_indices
from perfmon.probes.sampler import monotonic_ns
from perfmon.probes.xid import XidEvent, XidEventWatcher

Status = Literal["pass", "warn", "fail", "skipped"]
_SEVERITY: dict[str, int] = {"skipped": 0, "pass": 1, "warn": 2, "fail": 3}

SCHEMA_VERSION = 1
# Warn this close below the slowdown threshold: a few degrees more under load and
# the hardware starts cutting clocks.
TEMPERATURE_WARN_MARGIN_C = 5
# Corrected (single-bit) errors are normal in small numbers; a steady stream is what
# precedes XID 92 ("high single-bit ECC error rate"). A heuristic, not an NVIDIA figure.
ECC_VOLATILE_CORRECTED_WARN = 100
# Board power may overshoot the enforced limit briefly; beyond this, capping is failing.
POWER_OVER_LIMIT_RATIO = 1.05
# XIDs that mean the GPU (not the application) is at fault and needs a reset or
# service, per NVIDIA's XID catalogue; every other XID warns (13, 31, 43, 45 are
# usually the application's own fault).
XID_SERIOUS = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
# Hardware-asserted slowdowns: cooling has failed (thermal) or the system's power
# supply asked the GPU to brake; the job runs at a fraction of its speed.
THROTTLE_FAIL = frozenset({"hw_thermal_slowdown", "hw_power_brake_slowdown"})
# The generic hardware slowdown also fires on short power excursions, and the
# software thermal limit is the driver acting before the hardware must.
THROTTLE_WARN = frozenset({"hw_slowdown", "sw_thermal_slowdown"})

CHECK_NAMES = (
    "reachable", "temperature", "power", "ecc", "retired_pages", "row_remap", "xid",
    "throttle", "pcie_link", "nvlink", "foreign_processes",
)


@dataclass(frozen=True)
class CheckResult:
    """One check of one GPU."""

    name: str
    status: Status
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "reason": self.reason}


@dataclass(frozen=True)
class GpuHealth:
    """Every check of one GPU; ``status`` is the worst of them."""

    index: int
    uuid: str | None
    name: str | None
    pci_bus_id: str | None
    checks: tuple[CheckResult, ...]

    @property
    def status(self) -> Status:
        return _worst(check.status for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "uuid": self.uuid, "name": self.name,
            "pci_bus_id": self.pci_bus_id, "status": self.status,
            "checks": [check.to_dict() for check in self.checks],
        }


@dataclass(frozen=True)
class HealthReport:
    """The whole check; ``to_dict()`` follows docs/health_report.schema.json."""

    driver_version: str | None
    nvml_version: str | None
    cuda_driver_version: int | None
    window_s: float
    job_pids: tuple[int, ...]
    gpus: tuple[GpuHealth, ...]
    xid_events: tuple[XidEvent, ...] = ()
    unsupported_fields: dict[str, str] = field(default_factory=dict)

    @property
    def status(self) -> Status:
        return _worst(gpu.status for gpu in self.gpus)

    @property
    def exit_code(self) -> int:
        """1 when any check failed, else 0 (warnings do not fail the command)."""
        return 1 if self.status == "fail" else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "status": self.status,
            "exit_code": self.exit_code,
            "driver": {
                "driver_version": self.driver_version,
                "nvml_version": self.nvml_version,
                "cuda_driver_version": self.cuda_driver_version,
            },
            "window_s": self.window_s,
            "job_pids": list(self.job_pids),
            "gpus": [gpu.to_dict() for gpu in self.gpus],
            "xid_events": [
                {"gpu_index": e.gpu_index, "xid": e.xid, "t_mono_ns": e.t_mono_ns}
                for e in self.xid_events
            ],
            "unsupported_fields": dict(sorted(self.unsupported_fields.items())),
        }


def _worst(statuses: Iterable[Status]) -> Status:
    worst: Status = "pass"
    for status in statuses:
        if _SEVERITY[status] > _SEVERITY[worst]:
            worst = status
    return worst


@dataclass
class _Window:
    """What one GPU showed during the window."""

    temperatures_c: list[int] = field(default_factory=list)
    powers_w: list[float] = field(default_factory=list)
    throttle_reasons: set[str] = field(default_factory=set)
    throttle_seen: bool = False
    busy: bool = False
    pids: set[int] = field(default_factory=set)
    lost_error: str | None = None
    xids: list[int] = field(default_factory=list)
    xid_watched: bool = False

    def add(self, sample: GpuSample) -> None:
        if sample.lost:
            self.lost_error = sample.error
            return
        if sample.temperature_c is not None:
            self.temperatures_c.append(sample.temperature_c)
        if sample.power_w is not None:
            self.powers_w.append(sample.power_w)
        if sample.throttle_reasons is not None:
            self.throttle_seen = True
            self.throttle_reasons.update(sample.throttle_reasons)
        self.busy = self.busy or bool(sample.utilization_gpu_pct)
        self.pids.update(sample.process_memory_bytes or {})


def run_health_check(gpus: list[int] | None, window_s: float, job_pids: set[int]) -> HealthReport:
    """Watch ``gpus`` (NVML indices; None: all) for ``window_s`` seconds, then judge them.

    ``job_pids`` are the job's processes; any other process on a GPU warns.
    Raises NvmlUnavailable (no driver), NoSuchGpu (bad index), ValueError (window < 0).
    """
    if window_s < 0:
        raise ValueError(f"window_s must be >= 0, not {window_s}")
    info = driver_info()
    indices = gpu_indices(gpus)
    windows = {index: _Window() for index in indices}
    events: list[XidEvent] = []
    unsupported: dict[str, str] = {}
    # Several samples per window so short excursions show, at most one a second.
    interval_s = min(1.0, max(window_s / 4, 0.05))
    with XidEventWatcher(indices) as watcher, NvmlSampler(indices, interval_s) as sampler:
        deadline_ns = monotonic_ns() + int(window_s * 1e9)
        while True:
            for sample in sampler.poll():
                windows[sample.index].add(sample)
            events += watcher.poll()
            remaining_ns = deadline_ns - monotonic_ns()
            if remaining_ns <= 0:
                break
            time.sleep(min(remaining_ns / 1e9, 0.05))
        readings = [read_gpu_health(index, unsupported) for index in indices]
        events += watcher.poll()
        for notes in (sampler.unsupported_fields, watcher.unsupported_fields):
            for name, reason in notes.items():
                unsupported.setdefault(name, reason)
        for index in watcher.registered_gpus:
            windows[index].xid_watched = True
    for event in events:
        if event.gpu_index in windows:
            windows[event.gpu_index].xids.append(event.xid)
    return HealthReport(
        driver_version=info.driver_version,
        nvml_version=info.nvml_version,
        cuda_driver_version=info.cuda_driver_version,
        window_s=window_s,
        job_pids=tuple(sorted(job_pids)),
        gpus=tuple(_judge(h, windows[h.index], job_pids, window_s) for h in readings),
        xid_events=tuple(events),
        unsupported_fields=unsupported,
    )


def _judge(h: GpuHealthReadings, w: _Window, job_pids: set[int], window_s: float) -> GpuHealth:
    lost = h.error if h.lost else w.lost_error
    checks: tuple[CheckResult, ...]
    if lost is not None:
        checks = (CheckResult("reachable", "fail", lost),)
    else:
        checks = (
            CheckResult("reachable", "pass", "NVML answers"),
            _temperature(h, w), _power(h, w), _ecc(h), _retired_pages(h), _row_remap(h),
            _xid(w, window_s), _throttle(h, w), _pcie_link(h, w), _nvlink(h),
            _foreign_processes(h, w, job_pids),
        )
    return GpuHealth(h.index, h.uuid, h.name, h.pci_bus_id, checks)


def _unavailable(name: str, h: GpuHealthReadings, fields: Sequence[str]) -> CheckResult:
    errors = [h.errors[f] for f in fields if f in h.errors]
    if errors:  # the GPU offers it but the read failed: worth a look, not a verdict
        return CheckResult(name, "warn", "could not read: " + "; ".join(errors))
    return CheckResult(name, "skipped", "not supported")


def _verdict(name: str, findings: list[tuple[Status, str]], ok: str) -> CheckResult:
    if not findings:
        return CheckResult(name, "pass", ok)
    return CheckResult(name, _worst(s for s, _ in findings), "; ".join(t for _, t in findings))


def _temperature(h: GpuHealthReadings, w: _Window) -> CheckResult:
    temps = w.temperatures_c + ([h.temperature_c] if h.temperature_c is not None else [])
    slowdown, shutdown = h.temperature_slowdown_c, h.temperature_shutdown_c
    if not temps:
        return _unavailable("temperature", h, ["temperature_c"])
    peak = max(temps)
    if slowdown is None and shutdown is None:
        return CheckResult("temperature", "skipped",
                           f"thresholds not supported (peak {peak} °C)")
    limits = f"slowdown {slowdown} °C, shutdown {shutdown} °C"
    # At the slowdown threshold the hardware already cuts clocks (nvml.h,
    # NVML_TEMPERATURE_THRESHOLD_SLOWDOWN): for a training job that is a failure.
    if shutdown is not None and peak >= shutdown:
        return CheckResult("temperature", "fail", f"peak {peak} °C at/over shutdown ({limits})")
    if slowdown is not None and peak >= slowdown:
        return CheckResult("temperature", "fail", f"peak {peak} °C at/over slowdown ({limits})")
    if slowdown is not None and peak >= slowdown - TEMPERATURE_WARN_MARGIN_C:
        return CheckResult("temperature", "warn",
                           f"peak {peak} °C within {TEMPERATURE_WARN_MARGIN_C} °C of slowdown "
                           f"({limits})")
    return CheckResult("temperature", "pass", f"peak {peak} °C ({limits})")


def _power(h: GpuHealthReadings, w: _Window) -> CheckResult:
    powers = w.powers_w + ([h.power_w] if h.power_w is not None else [])
    limit, default = h.power_limit_w, h.power_default_limit_w
    if not powers or limit is None:
        return _unavailable("power", h, ["power_w", "power_limit_w"])
    peak = max(powers)
    findings: list[tuple[Status, str]] = []
    if peak > limit * POWER_OVER_LIMIT_RATIO:
        findings.append(("warn", f"peak {peak:.0f} W over the enforced limit {limit:.0f} W"))
    if default is not None and limit < default:
        findings.append(("warn", f"enforced limit {limit:.0f} W below the default "
                                 f"{default:.0f} W (nvidia-smi -pl or a system power cap)"))
    return _verdict("power", findings, f"peak {peak:.0f} W of {limit:.0f} W limit")


def _ecc(h: GpuHealthReadings) -> CheckResult:
    fields = ["ecc_volatile_corrected", "ecc_volatile_uncorrected",
              "ecc_aggregate_corrected", "ecc_aggregate_uncorrected"]
    if all(getattr(h, f) is None for f in fields):
        return _unavailable("ecc", h, fields)
    findings: list[tuple[Status, str]] = []
    if h.ecc_volatile_uncorrected:
        findings.append(("fail", f"{h.ecc_volatile_uncorrected} uncorrected ECC errors since "
                                 "the driver loaded: reset the GPU, then check row remapping"))
    # Lifetime count: an old error that row remapping dealt with leaves this non-zero
    # on a GPU that is fine now, so it warns; remap pending/failure is judged below.
    if h.ecc_aggregate_uncorrected:
        findings.append(("warn", f"{h.ecc_aggregate_uncorrected} uncorrected ECC errors over "
                                 "the GPU's lifetime"))
    if (h.ecc_volatile_corrected or 0) >= ECC_VOLATILE_CORRECTED_WARN:
        findings.append(("warn", f"{h.ecc_volatile_corrected} corrected ECC errors since the "
                                 f"driver loaded (warn at {ECC_VOLATILE_CORRECTED_WARN})"))
    return _verdict("ecc", findings, f"no uncorrected errors ({h.ecc_volatile_corrected or 0} "
                                     "corrected since the driver loaded)")


def _retired_pages(h: GpuHealthReadings) -> CheckResult:
    # Pre-Ampere GPUs retire pages; Ampere and later remap rows and answer
    # NOT_SUPPORTED here (then see row_remap).
    if h.retired_pages_pending is None:
        return _unavailable("retired_pages", h, ["retired_pages_pending"])
    if h.retired_pages_pending:
        return CheckResult("retired_pages", "warn",
                           "pages pending retirement: reset the GPU to retire them")
    return CheckResult("retired_pages", "pass", "no pages pending retirement")


def _row_remap(h: GpuHealthReadings) -> CheckResult:
    if h.remapped_rows_failure is None:
        return _unavailable("row_remap", h, ["remapped_rows"])
    if h.remapped_rows_failure:
        return CheckResult("row_remap", "fail",
                           "row remapping failed (no spare rows left): the GPU needs service")
    if h.remapped_rows_pending:
        return CheckResult("row_remap", "warn", "row remap pending: reset the GPU to apply it")
    return CheckResult("row_remap", "pass",
                       f"{h.remapped_rows_corrected} rows remapped for corrected and "
                       f"{h.remapped_rows_uncorrected} for uncorrected errors")


def _xid(w: _Window, window_s: float) -> CheckResult:
    if not w.xid_watched:
        return CheckResult("xid", "skipped", "not supported")
    if not w.xids:
        return CheckResult("xid", "pass", f"no XID events in the {window_s:g} s window")
    findings: list[tuple[Status, str]] = [
        ("fail", f"XID {x} ({XID_SERIOUS[x]})") if x in XID_SERIOUS else ("warn", f"XID {x}")
        for x in w.xids
    ]
    return _verdict("xid", findings, "")


def _throttle(h: GpuHealthReadings, w: _Window) -> CheckResult:
    if not w.throttle_seen and h.throttle_reasons is None:
        return _unavailable("throttle", h, ["throttle_reasons"])
    reasons = w.throttle_reasons | set(h.throttle_reasons or ())
    findings: list[tuple[Status, str]] = [
        ("fail", name) for name in sorted(reasons & THROTTLE_FAIL)
    ] + [("warn", name) for name in sorted(reasons & THROTTLE_WARN)]
    rest = sorted(reasons - THROTTLE_FAIL - THROTTLE_WARN)
    if findings:
        return _verdict("throttle", findings, "")
    return CheckResult("throttle", "pass", "clock events: " + (", ".join(rest) or "none"))


def _pcie_link(h: GpuHealthReadings, w: _Window) -> CheckResult:
    width, width_max = h.pcie_link_width, h.pcie_link_width_max
    gen, gen_max = h.pcie_link_gen, h.pcie_link_gen_max
    if None in (width, width_max) and None in (gen, gen_max):
        return _unavailable("pcie_link", h, ["pcie_link_width", "pcie_link_width_max",
                                             "pcie_link_gen", "pcie_link_gen_max"])
    findings: list[tuple[Status, str]] = []
    notes = []
    if width is not None and width_max is not None and width < width_max:
        findings.append(("warn", f"link x{width} of x{width_max}: check seating and risers"))
    if gen is not None and gen_max is not None and gen < gen_max:
        busy = w.busy or bool(h.utilization_gpu_pct)
        if busy:
            findings.append(("warn", f"Gen{gen} of Gen{gen_max} while busy"))
        else:  # the link trains down when idle to save power; only a busy GPU tells
            notes.append(f"Gen{gen} of Gen{gen_max} at idle (power saving)")
    return _verdict("pcie_link", findings,
                    "; ".join([f"x{width} Gen{gen}", *notes]))


def _nvlink(h: GpuHealthReadings) -> CheckResult:
    if h.nvlink_active is None:
        return _unavailable("nvlink", h, ["nvlink_active"])
    inactive = [str(link) for link, active in sorted(h.nvlink_active.items()) if not active]
    total = len(h.nvlink_active)
    if inactive:
        return CheckResult("nvlink", "warn",
                           f"link(s) {', '.join(inactive)} of {total} inactive")
    return CheckResult("nvlink", "pass", f"{total} links active")


def _foreign_processes(h: GpuHealthReadings, w: _Window, job_pids: set[int]) -> CheckResult:
    if h.process_memory_bytes is None and not w.pids:
        return _unavailable("foreign_processes", h, ["process_memory_bytes"])
    memory = dict(h.process_memory_bytes or {})
    # NVML reports pids of the host's pid namespace (none at all in some containers).
    foreign = sorted((w.pids | set(memory)) - job_pids)
    if not foreign:
        return CheckResult("foreign_processes", "pass", "no processes outside the job")
    described = [
        f"pid {pid}" + (f" ({memory[pid] / 2**20:.0f} MiB)" if memory.get(pid) else "")
        for pid in foreign
    ]
    return CheckResult("foreign_processes", "warn",
                       f"{len(foreign)} process(es) outside the job: {', '.join(described)}")
