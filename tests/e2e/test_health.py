"""``perfmon-agent health`` against the fake libnvidia-ml.so.1 (real pynvml).

Every check passes on a healthy GPU and warns or fails on its scripted fault, with
the matching exit status; unsupported checks are skipped; no driver is one line on
stderr and exit 5; the JSON validates against docs/health_report.schema.json.
"""

from __future__ import annotations

import ctypes.util
import json
import textwrap
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.fakes.build import FakeNvml, write_scenario

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "health_report.schema.json").read_text())
WINDOW = "0.1"


def health(fake: FakeNvml, tmp_path: Path, scenario: str, *args: str,
           json_out: bool = True) -> tuple[int, Any, str]:
    """(exit status, parsed JSON or stdout text, stderr) of one health run."""
    path = write_scenario(tmp_path / "scenario", textwrap.dedent(scenario))
    argv = ["-m", "perfmon.agent.cli", "health", "--window", WINDOW,
            *(["--json"] if json_out else []), *args]
    done = fake.run(argv, path)
    out = json.loads(done.stdout) if json_out else done.stdout
    if isinstance(out, dict):
        jsonschema.validate(out, SCHEMA)
    return done.returncode, out, done.stderr


def checks_of(report: dict, gpu: int = 0) -> dict[str, dict]:
    return {c["name"]: c for c in report["gpus"][gpu]["checks"]}


def test_a_healthy_gpu_passes_every_check(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    code, report, stderr = health(fake_nvml, tmp_path, """
        gpu0.proc.4242.used_bytes=1073741824
        """, "--pids", "4242")
    assert (code, stderr) == (0, "")
    assert report["status"] == "pass" and report["exit_code"] == 0
    checks = checks_of(report)
    assert list(checks) == ["reachable", "temperature", "power", "ecc", "retired_pages",
                            "row_remap", "xid", "throttle", "pcie_link", "nvlink",
                            "foreign_processes"]
    assert {c["status"] for c in checks.values()} == {"pass"}
    assert report["driver"] == {"driver_version": "550.54.15", "nvml_version": "12.550.54.15",
                                "cuda_driver_version": 12040}


# (scenario lines for GPU 0, check, expected status, words in the reason)
FAULTS = [
    ("temperature_c=86", "temperature", "warn", "within 5 °C of slowdown"),
    ("temperature_c=90", "temperature", "fail", "at/over slowdown"),
    ("temperature_c=93", "temperature", "fail", "at/over shutdown"),
    ("power_mw=760000", "power", "warn", "peak 760 W over the enforced limit 700 W"),
    ("power_limit_mw=400000", "power", "warn", "400 W below the default 700 W"),
    ("ecc.volatile.uncorrected=3", "ecc", "fail", "3 uncorrected ECC errors since"),
    ("ecc.aggregate.uncorrected=1", "ecc", "warn", "over the GPU's lifetime"),
    ("ecc.volatile.corrected=150", "ecc", "warn", "150 corrected ECC errors"),
    ("retired_pages_pending=1", "retired_pages", "warn", "pending retirement"),
    ("remap.failure=1", "row_remap", "fail", "row remapping failed"),
    ("remap.pending=1", "row_remap", "warn", "row remap pending"),
    ("xid=79", "xid", "fail", "XID 79 (GPU has fallen off the bus)"),
    ("xid=48,13", "xid", "fail", "XID 48 (double-bit ECC error); XID 13"),
    ("xid=13", "xid", "warn", "XID 13"),
    ("clocks_event_reasons=0x40", "throttle", "fail", "hw_thermal_slowdown"),
    ("clocks_event_reasons=0x80", "throttle", "fail", "hw_power_brake_slowdown"),
    ("clocks_event_reasons=0x8", "throttle", "warn", "hw_slowdown"),
    ("clocks_event_reasons=0x20", "throttle", "warn", "sw_thermal_slowdown"),
    ("pcie.width=8", "pcie_link", "warn", "link x8 of x16"),
    ("pcie.gen=3\ngpu0.utilization_gpu_pct=95", "pcie_link", "warn", "Gen3 of Gen5 while busy"),
    ("nvlink.inactive=3,7", "nvlink", "warn", "link(s) 3, 7 of 18 inactive"),
    ("proc.777.used_bytes=2147483648", "foreign_processes", "warn", "pid 777 (2048 MiB)"),
]


@pytest.mark.parametrize("case", FAULTS, ids=[f"{c}-{s}-{f.splitlines()[0]}"
                                               for f, c, s, _ in FAULTS])
def test_each_check_flags_its_scripted_fault(fake_nvml: FakeNvml, tmp_path: Path,
                                             case: tuple[str, str, str, str]) -> None:
    fault, check, status, words = case
    code, report, stderr = health(fake_nvml, tmp_path, f"gpu0.{fault}\n")
    assert code == (1 if status == "fail" else 0), stderr
    checks = checks_of(report)
    assert checks[check]["status"] == status
    assert words in checks[check]["reason"]
    others = {c["status"] for name, c in checks.items() if name != check}
    assert others == {"pass"}  # the fault shows in its own check only
    assert report["gpus"][0]["status"] == report["status"] == status


@pytest.mark.parametrize(("fault", "check", "words"), [
    ("clocks_event_reasons=0x5", "throttle", "clock events: gpu_idle, sw_power_cap"),
    ("pcie.gen=1", "pcie_link", "Gen1 of Gen5 at idle (power saving)"),
])
def test_normal_conditions_that_look_like_faults_pass(
        fake_nvml: FakeNvml, tmp_path: Path, fault: str, check: str, words: str) -> None:
    code, report, _ = health(fake_nvml, tmp_path, f"gpu0.{fault}\n")
    assert code == 0 and checks_of(report)[check] == {
        "name": check, "status": "pass", "reason": checks_of(report)[check]["reason"]}
    assert words in checks_of(report)[check]["reason"]


def test_job_processes_are_not_foreign(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    scenario = "gpu0.proc.777.used_bytes=1\ngpu0.proc.778.used_bytes=536870912\n"
    code, report, _ = health(fake_nvml, tmp_path, scenario, "--pids", "777")
    assert code == 0
    assert checks_of(report)["foreign_processes"]["reason"].endswith(": pid 778 (512 MiB)")
    code, report, _ = health(fake_nvml, tmp_path, scenario, "--pids", "777,778")
    assert checks_of(report)["foreign_processes"]["status"] == "pass"


def test_unsupported_checks_are_skipped_not_failed(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    code, report, stderr = health(fake_nvml, tmp_path, """
        func.nvmlDeviceGetTotalEccErrors=NOT_SUPPORTED
        func.nvmlDeviceGetRetiredPagesPendingStatus=NOT_SUPPORTED
        func.nvmlDeviceGetRemappedRows=FUNCTION_NOT_FOUND
        func.nvmlDeviceRegisterEvents=NOT_SUPPORTED
        func.nvmlDeviceGetPowerUsage=NO_PERMISSION
        func.nvmlDeviceGetTemperatureThreshold=NOT_SUPPORTED
        func.nvmlDeviceGetComputeRunningProcesses_v3=NOT_SUPPORTED
        gpu0.nvlink.count=0
        """)
    assert (code, stderr) == (0, "")
    checks = checks_of(report)
    for name in ("ecc", "retired_pages", "row_remap", "xid", "power", "nvlink",
                 "foreign_processes"):
        assert checks[name] == {"name": name, "status": "skipped", "reason": "not supported"}
    assert checks["temperature"]["status"] == "skipped"
    assert checks["temperature"]["reason"] == "thresholds not supported (peak 41 °C)"
    assert report["status"] == "pass"  # skipped never fails the GPU
    assert set(report["unsupported_fields"]) >= {
        "ecc_volatile_uncorrected", "retired_pages_pending", "remapped_rows", "xid_events",
        "power_w", "nvlink_active", "process_memory_bytes", "temperature_slowdown_c"}
    assert report["unsupported_fields"]["remapped_rows"] == "not in this driver (GPU 0)"


def test_a_read_that_errors_warns_instead_of_passing(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    code, report, _ = health(fake_nvml, tmp_path, "func.nvmlDeviceGetRemappedRows=UNKNOWN\n")
    assert code == 0
    row_remap = checks_of(report)["row_remap"]
    assert row_remap["status"] == "warn"
    assert row_remap["reason"].startswith("could not read: GPU 0: nvmlDeviceGetRemappedRows")
    assert "NVML_ERROR_UNKNOWN" in row_remap["reason"]


def test_a_lost_gpu_fails_and_the_other_gpu_is_still_checked(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    code, report, _ = health(fake_nvml, tmp_path, "count=2\ngpu0.lost_after_calls=40\n")
    assert code == 1 and report["status"] == "fail"
    [reachable] = report["gpus"][0]["checks"]
    assert reachable["name"] == "reachable" and reachable["status"] == "fail"
    assert "fallen off the bus (NVML_ERROR_GPU_IS_LOST" in reachable["reason"]
    assert report["gpus"][1]["status"] == "pass" and len(report["gpus"][1]["checks"]) == 11


def test_temperature_is_judged_on_the_peak_during_the_window(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    # The GPU runs hot from 0.2 s to 1.0 s of a 1.6 s window and is cool again at the
    # end; samples every 0.4 s must catch it. Run in one process to control timing.
    path = write_scenario(tmp_path / "scenario", "gpu0.temperature_c=41\n")
    code = textwrap.dedent(f"""
        import json, threading, time
        from pathlib import Path
        from perfmon.agent.measure.health import run_health_check

        def rewrite(text):
            tmp = Path({str(path)!r} + ".tmp"); tmp.write_text(text); tmp.replace({str(path)!r})

        def heat():
            time.sleep(0.2); rewrite("gpu0.temperature_c=91\\n")
            time.sleep(0.8); rewrite("gpu0.temperature_c=41\\n")

        threading.Thread(target=heat).start()
        print(json.dumps(run_health_check(None, 1.6, set()).to_dict()))
        """)
    report = fake_nvml.run_json(code, path)
    temperature = checks_of(report)["temperature"]
    assert temperature["status"] == "fail" and temperature["reason"].startswith("peak 91 °C")


def test_table_output_names_every_check(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    code, out, _ = health(fake_nvml, tmp_path, "gpu0.xid=79\n", json_out=False)
    assert code == 1
    assert "GPU health: FAIL" in out
    for name in ("reachable", "temperature", "row_remap", "foreign_processes"):
        assert name in out


@pytest.mark.parametrize(("scenario", "words"), [
    ("func.nvmlInitWithFlags=DRIVER_NOT_LOADED\n",
     "NVML unavailable (NVML_ERROR_DRIVER_NOT_LOADED): the NVIDIA kernel driver is not loaded"),
    ("func.nvmlInitWithFlags=LIB_RM_VERSION_MISMATCH\n",
     "libnvidia-ml.so.1 does not match the loaded kernel driver"),
])
def test_no_driver_is_one_line_and_exit_5(fake_nvml: FakeNvml, tmp_path: Path,
                                          scenario: str, words: str) -> None:
    code, out, stderr = health(fake_nvml, tmp_path, scenario)  # the JSON validates
    assert code == 5
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert stderr.startswith("perfmon-agent: error: ") and words in stderr
    # --json: stdout is still one JSON document, saying why there is no report.
    assert out["status"] == "error" and out["exit_code"] == 5 and words in out["error"]
    code, text, _ = health(fake_nvml, tmp_path, scenario, json_out=False)
    assert (code, text) == (5, "")


def test_no_nvml_library_is_one_line_and_exit_5(tmp_path: Path) -> None:
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("a real libnvidia-ml is installed, so 'no library' cannot be staged here")
    empty = FakeNvml(tmp_path)  # a directory without the library
    done = empty.run(["-m", "perfmon.agent.cli", "health", "--json"], None)
    message = ("NVML unavailable (NVML_ERROR_LIBRARY_NOT_FOUND): libnvidia-ml.so.1 not found; "
               "is the NVIDIA driver installed?")
    assert done.returncode == 5
    assert done.stderr == f"perfmon-agent: error: {message}\n"
    report = json.loads(done.stdout)
    jsonschema.validate(report, SCHEMA)
    assert report == {"schema_version": 1, "status": "error", "exit_code": 5, "error": message}


def test_a_gpu_index_nvml_lacks_is_one_line_and_exit_3(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    code, out, stderr = health(fake_nvml, tmp_path, "count=2\n", "--gpus", "0,5")
    assert (code, out["status"], out["exit_code"]) == (3, "error", 3)
    assert stderr == "perfmon-agent: error: GPU 5 not found: NVML sees 2 GPU(s)\n"


def test_json_of_a_troubled_machine_validates_against_the_schema(
        fake_nvml: FakeNvml, tmp_path: Path) -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    code, report, _ = health(fake_nvml, tmp_path, """
        count=3
        gpu0.xid=79,13
        gpu0.proc.5.used_bytes=NA
        gpu1.lost=1
        gpu2.func.nvmlDeviceGetRemappedRows=NOT_SUPPORTED
        gpu2.gpm=1
        """, "--gpus", "0,1,2")  # health() validated it; check the parts the schema allows
    assert code == 1
    assert [e["xid"] for e in report["xid_events"]] == [79, 13]
    assert [g["status"] for g in report["gpus"]] == ["fail", "fail", "pass"]
    assert report["gpus"][1]["uuid"] is None  # lost before we could read it
