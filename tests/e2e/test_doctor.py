"""`perfmon-agent doctor`: each line is a real check of this host (and of a real job), a
missing piece says what falls back and makes the exit status 1, and the node service
exports the host's checks as `perfmon_capability`. Nothing is mocked: bcc is hidden by
a module that fails to import, tracefs is unmounted in a mount namespace of the test's
own, and a libtorch without the probed symbols is a real shared library."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from perfmon.probes.capabilities import HOST_CHECK_NAMES
from perfmon.probes.torch_symbols import ENGINE_EXECUTE_SYMBOL
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, _reap, load_summary, wait_for
from tests.prom import free_port, get

pytestmark = pytest.mark.usefixtures("ebpf")

SCHEMA = json.loads((ROOT / "parsers" / "data" / "doctor.schema.json").read_text())
NO_GPU = not any(Path("/dev").glob("nvidia[0-9]*"))
# tracefs and debugfs unmounted, then the command: in a mount namespace of its own.
UNMOUNT_TRACEFS = ("umount -l /sys/kernel/tracing 2>/dev/null; "
                   "umount -l /sys/kernel/debug/tracing 2>/dev/null; "
                   "umount -l /sys/kernel/debug 2>/dev/null; exec \"$@\"")
PRIVATE_MOUNTS = ("unshare", "--mount", "--propagation", "private", "sh", "-c", UNMOUNT_TRACEFS,
                  "sh")


def doctor(agent, *args: str, **kw: Any) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """Run `doctor --json`; its document, checked against the schema."""
    run = agent.run("doctor", "--json", *args, timeout_s=60, **kw)
    document = json.loads(run.stdout)
    jsonschema.validate(document, SCHEMA)
    return run, document


def checks(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in document["checks"]}


@pytest.fixture
def idle_python():
    """Start a Python process (argv after the interpreter) that sleeps; reaped after."""
    started: list[subprocess.Popen] = []

    def start(*code: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, *code], start_new_session=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        _reap(proc)


def test_this_host_has_every_capability_and_exits_0(agent) -> None:
    run, document = doctor(agent)
    assert run.returncode == 0, document
    found = checks(document)
    assert list(found) == list(HOST_CHECK_NAMES)
    assert document["status"] == "ok" and document["job"] is None
    for name, check in found.items():
        if name in ("nvml", "btf"):
            continue
        assert check["status"] == "ok", check
    # No NVIDIA device here: NVML is not needed, so its absence degrades nothing.
    if NO_GPU:
        assert found["nvml"]["status"] == "absent"
        assert "libnvidia-ml.so.1" in found["nvml"]["detail"]
    assert re.match(r"bcc \d", found["bcc"]["detail"])
    assert found["bcc"]["facts"]["version"]
    assert re.match(r"py-spy \d+\.\d+", found["pyspy"]["detail"])
    # The table says the same.
    table = agent.run("doctor", timeout_s=60)
    assert table.returncode == 0, table.stderr
    assert "perfmon-agent doctor: OK" in table.stdout and "tracefs_backend" in table.stdout


def test_a_training_job_has_its_python_symbols_ranks_and_model(agent, start_target) -> None:
    target = start_target("--num-layers", "3", "--hidden-size=96", "--num-attention-heads",
                          "4", "--seq-length", "32", "--vocab-size", "256")
    run, document = doctor(agent, "--pid", str(target.pid))
    assert run.returncode == 0, document
    found = checks(document)
    assert [c["scope"] for c in document["checks"]].count("job") == 6
    assert document["job"]["pid"] == target.pid
    assert [(r["pid"], r["rank"]) for r in document["job"]["ranks"]] == [(target.pid, None)]
    python = found["python"]
    assert python["status"] == "ok"
    assert python["facts"]["version"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert found["pyspy_job"]["status"] == "ok"
    torch = found["libtorch"]
    assert torch["status"] == "ok", torch
    assert all(torch["facts"]["symbols"].values()) and len(torch["facts"]["symbols"]) == 2
    # The wait probes by process group kind, found in the library's own symbols: the
    # base class's, gloo's work objects' (point-to-point ones among them), DDP's reducer.
    waits = torch["facts"]["wait_probes"]
    assert waits["any"] == ["Work::wait"] and waits["ddp"] == ["Reducer::finalize_backward"]
    assert {"ProcessGroupGloo::SendWork::wait", "ProcessGroupGloo::RecvWork::wait"} <= set(
        waits["gloo"]), waits
    assert "wait probes by process group kind: any: Work::wait" in torch["detail"]
    assert torch["facts"]["path"].endswith("/torch/lib/libtorch_cpu.so")
    assert torch["facts"]["torch_version"] == _torch_version()
    assert found["ranks"]["facts"]["pids"] == [target.pid]
    assert found["model"]["status"] == "ok"
    assert found["model"]["facts"]["source"] == "cmdline"
    assert found["cuda"]["status"] == "absent"  # a CPU job: nothing to count


def _torch_version() -> str:
    """The test's own torch's version, read as the doctor reads the job's."""
    from importlib.metadata import version

    return version("torch")


def test_without_bcc_the_tracefs_backend_is_used_and_the_exit_is_1(agent, tmp_path) -> None:
    # A bcc module first on the path that fails to import, as on a host without python3-bpfcc.
    (tmp_path / "bcc").mkdir()
    (tmp_path / "bcc" / "__init__.py").write_text("raise ImportError('no bcc here')\n")
    run, document = doctor(agent, env={"PYTHONPATH": str(tmp_path)})
    assert run.returncode == 1
    assert document["status"] == "degraded"
    found = checks(document)
    assert found["bcc"]["status"] == "failed"
    assert "no bcc here" in found["bcc"]["detail"]
    assert "python3-bpfcc" in found["bcc"]["fix"]
    assert "tracefs backend" in found["bcc"]["fallback"]
    assert found["tracefs_backend"]["status"] == "ok"
    assert [n for n, c in found.items() if c["status"] not in ("ok", "absent")] == ["bcc"]


def test_unmounted_tracefs_is_mounted_by_the_agent_itself(agent) -> None:
    # Root may mount tracefs: the agent does at start, and the doctor tries it in a
    # throwaway mount namespace, so nothing is lost and nothing is left mounted.
    run, document = doctor(agent, prefix=PRIVATE_MOUNTS)
    assert run.returncode == 0, document
    tracefs = checks(document)["tracefs"]
    assert tracefs["status"] == "ok"
    assert "not mounted; the agent mounts it at /sys/kernel/tracing" in tracefs["detail"]
    assert checks(document)["tracefs_backend"]["status"] == "ok"


def test_unmounted_tracefs_that_cannot_be_mounted_fails_with_the_fix(agent) -> None:
    # The same, with CAP_SYS_ADMIN dropped after the unmount: tracefs cannot be mounted.
    drop = ("setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin")
    run, document = doctor(agent, prefix=(*PRIVATE_MOUNTS, *drop))
    assert run.returncode == 1
    found = checks(document)
    tracefs = found["tracefs"]
    assert tracefs["status"] == "failed"
    assert "CAP_SYS_ADMIN" in tracefs["detail"]
    assert tracefs["fix"] == "mount -t tracefs nodev /sys/kernel/tracing"
    assert "OOM kills are not attributed" in tracefs["fallback"]
    assert found["tracefs_backend"]["status"] == "failed"
    assert found["capabilities"]["status"] == "degraded"


def test_without_cap_sys_admin_bcc_attaches_through_tracefs_as_attach_does(
        agent, start_target, out_dir) -> None:
    # Linux 6.16+ refuses the uprobe PMU to CAP_PERFMON without CAP_SYS_ADMIN; bcc then
    # writes tracefs uprobe_events, named after the library path. The doctor's test
    # uprobe must go the way attach's do (/proc/self/fd/N), or it fails where they work.
    drop = ("setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin")
    run, document = doctor(agent, prefix=drop)
    found = checks(document)
    assert found["bcc"]["status"] == "ok", found["bcc"]
    assert found["capabilities"]["status"] == "degraded"
    assert "uprobe PMU wants CAP_SYS_ADMIN" in found["capabilities"]["detail"]
    assert run.returncode == 1
    target = start_target()
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "4",
                    "--iteration-source", "uprobe", "--output-dir", str(out_dir), prefix=drop)
    assert run.returncode == 0, run.stderr
    info = load_summary(out_dir)["session_info"]
    assert (info["probe_backend"], info["iteration_source"]) == ("bcc", "uprobe")
    assert info["total_iterations"] > 0


def test_a_python_process_without_pytorch_is_refused_as_attach_refuses_it(
        agent, idle_python) -> None:
    proc = idle_python("-c", "import time; time.sleep(60)")
    run = agent.run("doctor", "--pid", str(proc.pid), timeout_s=60)
    assert run.returncode == 3  # as attach (tests/e2e/test_bad_input.py)
    [line] = run.stderr.strip().splitlines()
    assert line.startswith("perfmon-agent: error: ")
    assert f"pid {proc.pid}" in line and "PyTorch is not loaded" in line
    assert "attach refuses it too" in line
    assert run.stdout == ""
    run, document = doctor(agent, "--pid", str(proc.pid))
    assert run.returncode == 3 and document["status"] == "error"
    assert document["exit_code"] == 3 and "PyTorch is not loaded" in document["error"]


def test_no_such_pid_is_one_line(agent) -> None:
    run = agent.run("doctor", "--pid", "999999999", timeout_s=60)
    assert run.returncode == 3
    assert run.stderr.strip() == ("perfmon-agent: error: pid 999999999: no such process "
                                  "(or it exited)")


def test_a_libtorch_without_the_step_symbol_names_it_and_the_py_spy_fallback(
        agent, idle_python, tmp_path) -> None:
    # A stand-in libtorch_cpu.so (found by its file name, as the agent finds libtorch)
    # exporting Engine::execute, c10d::Work::wait and gloo's RecvWork::wait under their
    # real mangled names, but no record_function entry point and no
    # Reducer::finalize_backward.
    timeout = "NSt6chrono8durationIlSt5ratioILl1ELl1000EEEE"
    exported = [ENGINE_EXECUTE_SYMBOL + "ERKSt6vectorINS0_4EdgeESaIS3_EERKS2_IN2at6TensorESaIS9_"
                "EEbbbS7_", "_ZN4c10d4Work4waitE" + timeout,
                "_ZN4c10d16ProcessGroupGloo8RecvWork4waitE" + timeout]
    source = tmp_path / "stand_in.c"
    source.write_text("".join(f"void {name}(void) {{}}\n" for name in exported))
    library = tmp_path / "libtorch_cpu.so"
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc is not None, "a C compiler is needed to build the stand-in libtorch"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(source)], check=True,
                   timeout=60)
    proc = idle_python("-c", f"import ctypes, time; ctypes.CDLL({str(library)!r}); "
                             "time.sleep(60)")
    wait_for(lambda: str(library) in Path(f"/proc/{proc.pid}/maps").read_text(), 20,
             "the stand-in library to be loaded")
    run, document = doctor(agent, "--pid", str(proc.pid))
    assert run.returncode == 1
    torch = checks(document)["libtorch"]
    assert torch["status"] == "failed"
    assert torch["facts"]["path"] == str(library)
    assert "record_function_enter_new" in torch["detail"]
    assert "torch::autograd::Engine::execute" not in torch["detail"]
    assert "py-spy" in torch["fallback"]
    assert torch["facts"]["symbols"]["torch::autograd::Engine::execute"]
    # The wait probes it would attach, by process group kind (the reducer's absent).
    assert torch["facts"]["wait_probes"] == {"any": ["Work::wait"],
                                            "gloo": ["ProcessGroupGloo::RecvWork::wait"]}
    assert ("wait probes by process group kind: any: Work::wait; gloo: "
            "ProcessGroupGloo::RecvWork::wait") in torch["detail"]


def test_the_service_exports_its_host_checks(agent, tmp_path) -> None:
    port = free_port()
    config = tmp_path / "config.yaml"
    # Watches only a command line no process has: no job on this machine is attached.
    config.write_text(json.dumps({"include": {"commands": [f"doctor-test-{os.getpid()}-none"]},
                                  "scan_interval_s": 5}))
    service = agent.start("serve", "--config", str(config), "--jobs-root", str(tmp_path / "jobs"),
                          "--metrics-address", f"127.0.0.1:{port}", "--host", "doctor-node")
    try:
        def scraped() -> dict[str, float] | None:
            assert service.poll() is None, service.communicate()
            try:
                text = get(f"http://127.0.0.1:{port}/metrics")
            except OSError:
                return None  # not listening yet
            return {s.labels["check"]: s.value
                    for family in text_string_to_metric_families(text)
                    if family.name == "perfmon_capability"
                    for s in family.samples if s.labels["host"] == "doctor-node"} or None

        values = wait_for(scraped, 30, "perfmon_capability in /metrics")
        assert set(values) == set(HOST_CHECK_NAMES)
        assert values["bcc"] == 1.0 and values["tracefs"] == 1.0 and values["pyspy"] == 1.0
        if NO_GPU:
            assert values["nvml"] == 1.0  # no GPU here: nothing is lost without NVML
    finally:
        _reap(service)
