"""Each bad input gives one line on stderr naming the problem, and an exit code; no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import _reap


def assert_one_line(run: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == code, run.stderr
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("perfmon-agent: error: ")
    for needle in needles:
        assert needle in lines[0]


@pytest.fixture
def idle_process():
    started = []

    def start(*argv: str) -> int:
        proc = subprocess.Popen(list(argv), start_new_session=True)
        started.append(proc)
        return proc.pid

    yield start
    for proc in started:
        _reap(proc)


def test_no_such_pid(agent, out_dir):
    run = agent.run("attach", "--pid", "999999999", "--output-dir", str(out_dir))
    assert_one_line(run, 3, "pid 999999999", "no such process")


def test_pid_that_is_not_a_python_process(agent, idle_process, out_dir):
    pid = idle_process("sleep", "300")
    run = agent.run("attach", "--pid", str(pid), "--output-dir", str(out_dir))
    assert_one_line(run, 3, f"pid {pid} (sleep)", "not a Python process")


def test_python_process_without_pytorch(agent, idle_process, out_dir):
    pid = idle_process(sys.executable, "-c", "import time; time.sleep(300)")
    run = agent.run("attach", "--pid", str(pid), "--output-dir", str(out_dir))
    assert_one_line(run, 3, f"pid {pid}", "PyTorch is not loaded")


def test_missing_capabilities_are_named(agent, steady_target, out_dir):
    target = steady_target
    # Root, but with an empty bounding set: no capability survives the exec.
    run = agent.run("attach", "--pid", str(target.pid), "--output-dir", str(out_dir),
                    "--iteration-source", "uprobe",
                    prefix=("setpriv", "--bounding-set=-all", "--inh-caps=-all"))
    assert_one_line(run, 4, "CAP_BPF", "CAP_PERFMON", "root")
    assert not list(out_dir.iterdir())  # nothing written before the check


def test_missing_bcc_says_what_to_install(steady_target, out_dir):
    target = steady_target
    # A Python where `import bcc` fails, as on a host without python3-bpfcc.
    code = ("import sys; sys.modules['bcc'] = None; "
            "from perfmon.agent.cli import main; sys.exit(main())")
    run = subprocess.run(
        [sys.executable, "-c", code, "attach", "--pid", str(target.pid),
         "--output-dir", str(out_dir), "--iteration-source", "uprobe", "--probe-backend", "bcc"],
        capture_output=True, text=True, timeout=60, check=False)
    assert_one_line(run, 5, "bcc", "apt-get install python3-bpfcc")


def test_missing_kernel_headers_say_what_to_install(agent, steady_target, out_dir, tmp_path):
    target = steady_target
    run = agent.run("attach", "--pid", str(target.pid), "--output-dir", str(out_dir),
                    "--iteration-source", "uprobe", "--probe-backend", "bcc",
                    env={"BCC_KERNEL_SOURCE": str(tmp_path / "no-headers")})
    assert_one_line(run, 5, "no kernel headers", "linux-headers-")


BAD_MODEL_CONFIGS = {
    "unparsable": ("num_layers: [2\n", ["model.yaml", "line"]),
    "unknown-key": ("num_layer: 2\nhidden_size: 64\n", ["unknown key 'num_layer'", "num_layers"]),
    "impossible-value": (
        "num_layers: 2\nhidden_size: -64\nnum_attention_heads: 4\nseq_length: 8\n"
        "vocab_size: 10\n", ["hidden_size", "-64"]),
}


@pytest.mark.parametrize("case", sorted(BAD_MODEL_CONFIGS))
def test_bad_model_config_file_fails_before_any_process_is_read(agent, out_dir, tmp_path, case):
    text, needles = BAD_MODEL_CONFIGS[case]
    config = tmp_path / "model.yaml"
    config.write_text(text)
    # pid 999999999 does not exist: the file's own faults are reported first.
    run = agent.run("attach", "--pid", "999999999", "--model-config", str(config),
                    "--output-dir", str(out_dir))
    assert_one_line(run, 2, *needles)


def test_missing_model_config_file(agent, out_dir, tmp_path):
    run = agent.run("attach", "--pid", "999999999", "--model-config",
                    str(tmp_path / "model.yaml"), "--output-dir", str(out_dir))
    assert_one_line(run, 2, "model.yaml", "no such file")


def test_model_config_missing_a_required_field_names_it(agent, steady_target, out_dir, tmp_path):
    # Another source (the job's command line) could still supply a field, so
    # completeness is checked once every source is merged, against a real job.
    target = steady_target
    config = tmp_path / "model.yaml"
    config.write_text("num_layers: 2\nnum_attention_heads: 4\nseq_length: 8\nvocab_size: 10\n")
    run = agent.run("attach", "--pid", str(target.pid), "--model-config", str(config),
                    "--output-dir", str(out_dir))
    assert_one_line(run, 2, "hidden_size")
    assert not list(out_dir.iterdir())


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--log-interval", "0"], "--log-interval"),
        (["--duration", "-3"], "--duration"),
        (["--pid", "abc"], "--pid"),
    ],
)
def test_bad_arguments_are_usage_errors(agent, args, needle):
    base = ["attach"] + (["--pid", "1"] if "--pid" not in args else [])
    run = agent.run(*base, *args)
    assert run.returncode == 2
    assert needle in run.stderr and "Traceback" not in run.stderr


def test_summarize_of_a_file_that_is_not_an_event_log(agent, tmp_path):
    bogus = tmp_path / "bogus.msgpack"
    bogus.write_bytes(b"\x00\x01not msgpack")
    run = agent.run("summarize", str(bogus))
    assert_one_line(run, 2, "bogus.msgpack", "not a perfmon event log")
    run = agent.run("summarize", str(tmp_path / "absent.msgpack"))
    assert_one_line(run, 2, "absent.msgpack")


def test_auto_falls_back_to_pyspy_with_one_warning_when_uprobes_cannot_run(
    agent, steady_target, out_dir, tmp_path
):
    target = steady_target
    # bcc is the only backend allowed here, and it lacks headers: iterations from py-spy.
    run = agent.run("attach", "--pid", str(target.pid), "--output-dir", str(out_dir),
                    "--duration", "3", "--probe-backend", "bcc",
                    env={"BCC_KERNEL_SOURCE": str(tmp_path / "no-headers")})
    assert run.returncode == 0, run.stderr
    warnings = [li for li in run.stderr.splitlines() if "uprobes unavailable" in li]
    assert len(warnings) == 1 and "no kernel headers" in warnings[0]
    info = json.loads(next(out_dir.glob("perf_summary_*.json")).read_text())["session_info"]
    assert info["iteration_source"] == "pyspy"
    assert any("uprobes unavailable" in w for w in info["warnings"])


def test_no_ptrace_right_in_pyspy_mode_names_cap_sys_ptrace(agent, steady_target, out_dir):
    target = steady_target
    run = agent.run("attach", "--pid", str(target.pid), "--output-dir", str(out_dir),
                    "--iteration-source", "pyspy",
                    prefix=("setpriv", "--bounding-set=-all", "--inh-caps=-all"))
    assert run.returncode == 4, run.stderr
    assert "CAP_SYS_PTRACE" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (["attach", "--pid", "-5"], "--pid"),
    (["attach", "--pid", "0"], "--pid"),
    (["attach", "--pid", "1", "--iteration-function", "Optimizer.(step"],
     "--iteration-function: not a valid regular expression"),
    (["attach", "--pid", "1", "--duration", "nan"], "--duration"),
    (["stacks", "--pid", "1", "--timeout", "0"], "--timeout"),
    (["stacks", "--pid", "1", "--timeout", "nan"], "--timeout"),
    (["stacks", "--pid", "1", "--timeout", "-1"], "--timeout"),
    (["flops", "--model-preset", "llama2-7b", "--global-batch-size", "0"],
     "--global-batch-size"),
    (["health", "--window", "nan"], "--window"),
    (["health", "--gpus", "-1"], "--gpus"),
])
def test_bad_values_are_one_usage_line(agent, args, needle):
    run = agent.run(*args)
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.splitlines()
    assert needle in line and "error:" in line and "Traceback" not in run.stderr


@pytest.mark.parametrize(("content", "needle"), [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "not UTF-8 text"),
    (b"num_layers: 2\x00\x00binary", "binary data"),
    (b"[" * 5000, "nested deeper than 32 levels"),
    (b"num_layers: 123456789012345678901234567\n", "'num_layers' must be at most 100,000"),
    (b"a: &x [*x, *x]\nb: *x\n", "unknown key"),
])
def test_model_config_files_that_are_not_model_configs_are_one_line(
    agent, out_dir, tmp_path, content, needle
):
    config = tmp_path / "model.yaml"
    config.write_bytes(content)
    run = agent.run("attach", "--pid", "999999999", "--model-config", str(config),
                    "--output-dir", str(out_dir), timeout_s=30)
    assert_one_line(run, 2, "model.yaml", needle)
