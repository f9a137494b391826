"""NvmlSampler and XidEventWatcher against the fake libnvidia-ml.so.1 (real pynvml).

Each test runs the sampler in a child process (the loader reads LD_LIBRARY_PATH
only at start-up) and gets its records back as JSON.
"""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

from tests.fakes.build import FakeNvml, write_scenario

# Imported by every child: samples become JSON with dataclasses.asdict.
PRELUDE = """\
import dataclasses, json, os, time
from pathlib import Path
from perfmon.probes.gpu_sampling import NvmlSampler
from perfmon.probes.nvml import NoSuchGpu, NvmlUnavailable
from perfmon.probes.xid import XidEventWatcher

def dump(obj):
    print(json.dumps(obj, default=lambda o: dataclasses.asdict(o)))

def rewrite(text):  # atomically, as the fake expects
    path = Path(os.environ["FAKE_NVML_SCENARIO"])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
"""


def run(fake: FakeNvml, tmp_path: Path, scenario: str, code: str) -> dict:
    path = write_scenario(tmp_path / "scenario", textwrap.dedent(scenario))
    return fake.run_json(PRELUDE + textwrap.dedent(code), path)


def test_a_sample_carries_every_field_in_our_units(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    out = run(fake_nvml, tmp_path, """
        gpu0.name=NVIDIA H200
        gpu0.uuid=GPU-1234
        gpu0.utilization_gpu_pct=97
        gpu0.utilization_memory_pct=41
        gpu0.memory_total_bytes=150754820096
        gpu0.memory_used_bytes=80000000000
        gpu0.power_mw=612345
        gpu0.power_limit_mw=700000
        gpu0.sm_clock_mhz=1755
        gpu0.mem_clock_mhz=3201
        gpu0.temperature_c=63
        gpu0.clocks_event_reasons=0x24
        """, """
        with NvmlSampler(interval_s=1.0) as sampler:
            t_before = time.monotonic_ns()
            samples = sampler.poll()
            dump({"samples": samples, "again": sampler.poll(), "t_before": t_before})
        """)
    [sample] = out["samples"]
    assert out["again"] == []  # the next slot is a second away
    assert sample["t_mono_ns"] >= out["t_before"]
    assert {k: v for k, v in sample.items() if k not in ("t_mono_ns", "late_ns")} == {
        "index": 0, "uuid": "GPU-1234", "name": "NVIDIA H200",
        "utilization_gpu_pct": 97, "utilization_memory_pct": 41,
        "memory_used_bytes": 80000000000, "memory_total_bytes": 150754820096,
        "power_w": 612.345, "power_limit_w": 700.0,
        "sm_clock_mhz": 1755, "mem_clock_mhz": 3201, "temperature_c": 63,
        "throttle_reasons": ["sw_power_cap", "sw_thermal_slowdown"],
        "process_memory_bytes": {}, "process_count": 0, "gpm": None, "lost": False,
        "error": None,
    }


def test_slots_follow_start_plus_k_intervals_without_drift(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    out = run(fake_nvml, tmp_path, "count=1\n", """
        samples = []
        with NvmlSampler(interval_s=0.05) as sampler:
            end = time.monotonic() + 0.6
            while time.monotonic() < end:
                samples += sampler.poll()
                time.sleep(0.013)  # polls that do not line up with the slots
            dump({"samples": samples, "missed": sampler.missed_slots})
        """)
    slots = [s["t_mono_ns"] - s["late_ns"] for s in out["samples"]]
    assert len(slots) >= 5
    assert all(s["late_ns"] >= 0 for s in out["samples"])
    steps = [(b - a) / 50_000_000 for a, b in itertools.pairwise(slots)]
    assert all(step == int(step) and step >= 1 for step in steps), steps  # on the grid
    assert sum(int(step) - 1 for step in steps) == out["missed"]


def test_a_gpu_lost_mid_sampling_is_recorded_and_the_other_gpu_goes_on(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    out = run(fake_nvml, tmp_path, "count=2\n", """
        samples = []
        with NvmlSampler(interval_s=0.05) as sampler:
            for i in range(12):
                if i == 5:
                    rewrite("count=2\\ngpu0.lost=1\\n")  # GPU 0 falls off the bus
                samples += sampler.poll()
                time.sleep(0.05)
        dump(samples)
        """)
    gpu0 = [s for s in out if s["index"] == 0]
    gpu1 = [s for s in out if s["index"] == 1]
    assert len(gpu0) == len(gpu1) >= 8
    assert not gpu0[0]["lost"] and gpu0[0]["temperature_c"] == 41
    assert gpu0[-1]["lost"] and gpu0[-1]["temperature_c"] is None
    assert "NVML_ERROR_GPU_IS_LOST" in gpu0[-1]["error"]
    assert gpu0[-1]["uuid"] == gpu0[0]["uuid"]  # still says which GPU it was
    lost_at = next(i for i, s in enumerate(gpu0) if s["lost"])
    assert all(s["lost"] for s in gpu0[lost_at:])  # lost stays lost
    assert not any(s["lost"] for s in gpu1) and all(s["temperature_c"] == 41 for s in gpu1)


def test_process_memory_is_reported_for_the_pids_of_interest(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    out = run(fake_nvml, tmp_path, """
        gpu0.proc.4242.used_bytes=21474836480
        gpu0.proc.4243.used_bytes=NA
        gpu0.proc.777.used_bytes=1048576
        """, """
        with NvmlSampler(interval_s=0.05, pids=[4242, 4243, 99999]) as sampler:
            first = sampler.poll()
            sampler.set_pids(None)
            time.sleep(0.06)
            everyone = sampler.poll()
        dump({"first": first, "everyone": everyone})
        """)
    # NA: NVML_VALUE_NOT_AVAILABLE, the driver hides that process's memory from us.
    assert out["first"][0]["process_memory_bytes"] == {"4242": 21474836480, "4243": None}
    assert out["everyone"][0]["process_memory_bytes"] == {
        "4242": 21474836480, "4243": None, "777": 1048576}


def test_unsupported_functions_are_listed_and_sampling_goes_on(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    out = run(fake_nvml, tmp_path, """
        func.nvmlDeviceGetPowerUsage=NOT_SUPPORTED
        func.nvmlDeviceGetComputeRunningProcesses_v3=NO_PERMISSION
        gpu0.func.nvmlDeviceGetTemperature=NOT_SUPPORTED
        # a failure that is not "unsupported": the field is None, the error says why
        func.nvmlDeviceGetClockInfo=UNKNOWN
        """, """
        with NvmlSampler() as sampler:
            dump({"samples": sampler.poll(), "unsupported": sampler.unsupported_fields})
        """)
    [sample] = out["samples"]
    assert sample["power_w"] is None and sample["temperature_c"] is None
    assert sample["process_memory_bytes"] is None and sample["sm_clock_mhz"] is None
    assert sample["power_limit_w"] == 700.0 and not sample["lost"]
    assert "NVML_ERROR_UNKNOWN" in sample["error"] and "sm_clock_mhz" not in out["unsupported"]
    assert out["unsupported"] == {
        "power_w": "not supported (GPU 0)",
        "process_memory_bytes": "no permission (GPU 0)",
        "temperature_c": "not supported (GPU 0)",
        "gpm": "not supported (GPU 0)",
    }


def test_calls_a_driver_lacks_fall_back_to_their_other_name(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    out = run(fake_nvml, tmp_path, """
        # before R535 only the "throttle reasons" name exists
        func.nvmlDeviceGetCurrentClocksEventReasons=FUNCTION_NOT_FOUND
        gpu0.clocks_event_reasons=0x4
        # after CUDA 14 only nvmlDeviceGetTemperatureV will
        func.nvmlDeviceGetTemperature=FUNCTION_NOT_FOUND
        gpu0.temperature_c=77
        """, """
        with NvmlSampler() as sampler:
            dump({"samples": sampler.poll(), "unsupported": sampler.unsupported_fields})
        """)
    [sample] = out["samples"]
    assert sample["throttle_reasons"] == ["sw_power_cap"] and sample["temperature_c"] == 77
    assert "throttle_reasons" not in out["unsupported"]
    assert "temperature_c" not in out["unsupported"]


def test_gpm_metrics_appear_from_the_second_sample_where_supported(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    out = run(fake_nvml, tmp_path, """
        count=2
        gpu0.gpm=1
        gpu0.gpm.2=61.5
        gpu0.gpm.5=33.0
        """, """
        with NvmlSampler(interval_s=0.05) as sampler:
            first = sampler.poll()
            time.sleep(0.06)
            second = sampler.poll()
        dump([first, second])
        """)
    first, second = out
    assert first[0]["gpm"] is None  # GPM metrics are rates between two samples
    assert second[0]["gpm"] == {"graphics_util_pct": 0.0, "sm_util_pct": 61.5,
                                "sm_occupancy_pct": 0.0, "any_tensor_util_pct": 33.0,
                                "dram_bw_util_pct": 0.0}
    assert second[1]["gpm"] is None  # GPU 1 has no GPM


def test_xid_events_are_polled_without_blocking(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    out = run(fake_nvml, tmp_path, "count=2\ngpu1.xid=79,13\n", """
        with XidEventWatcher() as watcher:
            t0 = time.monotonic_ns()
            events = watcher.poll()
            empty = watcher.poll()
            took_ns = time.monotonic_ns() - t0
            dump({"events": events, "empty": empty, "took_ns": took_ns, "t0": t0,
                  "registered": sorted(watcher.registered_gpus)})
        """)
    assert [(e["gpu_index"], e["xid"]) for e in out["events"]] == [(1, 79), (1, 13)]
    assert all(e["t_mono_ns"] >= out["t0"] for e in out["events"])
    assert out["empty"] == [] and out["took_ns"] < 100_000_000
    assert out["registered"] == [0, 1]


def test_without_a_driver_start_raises_nvml_unavailable(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    out = run(fake_nvml, tmp_path, "func.nvmlInitWithFlags=DRIVER_NOT_LOADED\n", """
        try:
            NvmlSampler().start()
        except NvmlUnavailable as err:
            dump({"message": str(err), "exit_code": err.exit_code})
        """)
    assert out == {"exit_code": 5, "message": "NVML unavailable (NVML_ERROR_DRIVER_NOT_LOADED):"
                                              " the NVIDIA kernel driver is not loaded"}


def test_asking_for_a_gpu_nvml_lacks_raises_no_such_gpu(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    out = run(fake_nvml, tmp_path, "count=2\n", """
        try:
            NvmlSampler(gpus=[0, 2]).start()
        except NoSuchGpu as err:
            dump(str(err))
        """)
    assert out == "GPU 2 not found: NVML sees 2 GPU(s)"


def test_close_is_idempotent_and_poll_after_close_is_empty(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    out = run(fake_nvml, tmp_path, "gpu0.gpm=1\n", """
        sampler, watcher = NvmlSampler(interval_s=0.01), XidEventWatcher()
        sampler.start(); watcher.start()
        n = len(sampler.poll())
        for _ in range(2):
            sampler.close(); watcher.close()
        time.sleep(0.02)
        dump([n, sampler.poll(), watcher.poll()])
        """)
    assert out == [1, [], []]
