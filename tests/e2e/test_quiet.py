"""What a new user sees: `attach` on a CPU job says nothing it cannot act on (its output
to /dev/null, or to a terminal), while a GPU job that lacks a library it should have
is still warned about; --verbose prints the notes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import TRAIN_GPT, load_summary, wait_for
from tests.e2e.test_attach_gpu import TRAIN_FAKE_CUDA

pytestmark = pytest.mark.usefixtures("ebpf")

# Every dimension on the command line: no model warning either (`make demo`'s job, tens
# of ms a step: a job of a few ms races py-spy's reads of it more often than 5% of them).
MODEL = ("--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "128", "--vocab-size", "1024", "--micro-batch-size", "4")
CUDA_NOTES = ("libcudart.so* is not loaded", "libcuda.so* is not loaded",
              "libnccl.so* is not loaded")


def _lines(stderr: str, kind: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"perfmon-agent: {kind}: ")]


def test_a_cpu_job_writing_to_dev_null_gets_no_warning_and_its_notes_with_verbose(
        start_target, agent, tmp_path: Path) -> None:
    target = start_target(*MODEL)  # (stdout and stderr: /dev/null)
    runs = {}
    for verbose in (False, True):
        out = tmp_path / f"verbose_{verbose}"
        out.mkdir()
        runs[verbose] = agent.run("attach", "--pid", str(target.pid), "--duration", "5",
                                  "--output-dir", str(out), *(["--verbose"] * verbose))
        assert runs[verbose].returncode == 0, runs[verbose].stderr
    assert _lines(runs[False].stderr, "warning") == []
    assert _lines(runs[False].stderr, "note") == []
    # The summary keeps what was left unsaid; --verbose prints it.
    notes = load_summary(tmp_path / "verbose_False")["session_info"]["notes"]
    for told in (notes, _lines(runs[True].stderr, "note")):
        text = " | ".join(told)
        assert all(f"pid {target.pid} (python): {lib}" in text for lib in CUDA_NOTES), told
        assert ("not read for exit causes (a device, not a regular file): "
                f"pid {target.pid} stdout and stderr") in text, told
    assert _lines(runs[True].stderr, "warning") == []


def test_a_cpu_job_on_a_terminal_gets_no_warning(agent, tmp_path: Path) -> None:
    tmux = shutil.which("tmux")
    assert tmux, "tmux is installed by the test set-up (make setup-test-system)"
    session, stamps = f"perfmon-{uuid.uuid4().hex[:8]}", tmp_path / "stamps.txt"
    tmux_cmd = [tmux, "-S", str(tmp_path / "tmux.sock")]
    subprocess.run([*tmux_cmd, "new-session", "-d", "-s", session, "-x", "120", "-y", "40",
                    f"exec {sys.executable} {TRAIN_GPT} --timestamps {stamps} "
                    + " ".join(MODEL)], check=True, timeout=30)
    pid = None
    try:
        pid = int(subprocess.run([*tmux_cmd, "list-panes", "-t", session, "-F",
                                  "#{pane_pid}"], capture_output=True, text=True,
                                 check=True, timeout=30).stdout)
        wait_for(lambda: stamps.exists() and len(stamps.read_text().splitlines()) >= 2, 60,
                 "the job's first iterations")
        assert os.readlink(f"/proc/{pid}/fd/1").startswith("/dev/pts/")
        out = tmp_path / "out"
        out.mkdir()
        run = agent.run("attach", "--pid", str(pid), "--duration", "5",
                        "--output-dir", str(out))
        assert run.returncode == 0, run.stderr
        assert _lines(run.stderr, "warning") == [], run.stderr
        notes = " | ".join(load_summary(out)["session_info"]["notes"])
        assert ("not read for exit causes (a device, not a regular file): "
                f"pid {pid} stdout and stderr") in notes, notes
    finally:
        subprocess.run([*tmux_cmd, "kill-server"], check=False, timeout=30)
        if pid is not None:  # (the server's end hangs up the job's terminal)
            wait_for(lambda: not psutil.pid_exists(pid), 30, "the job in tmux to end")


def test_a_gpu_job_without_nccl_is_still_warned_about(start_target, agent, fake_cuda,
                                                        out_dir: Path) -> None:
    # A job that loaded the CUDA runtime and driver uses the GPU: the library it lacks
    # leaves a figure uncounted, which is a warning.
    target = start_target("--cuda-lib-dir", str(fake_cuda.lib_dir), "--no-nccl",
                          script=TRAIN_FAKE_CUDA, warm_iterations=3)
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "4",
                    "--no-stack-sampling", "--output-dir", str(out_dir))
    assert run.returncode == 0, run.stderr
    warned = _lines(run.stderr, "warning")
    assert any(f"pid {target.pid}" in w and "libnccl.so* is not loaded: NCCL collectives "
               "not counted" in w for w in warned), run.stderr
    assert not any("libcudart" in w or "libcuda.so" in w for w in warned), warned
