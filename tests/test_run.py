"""`perfmon-agent run [options] -- COMMAND`: the real agent starts a real job, watches its
ranks from their first iterations, writes their summaries, and exits with the job's status."""

from __future__ import annotations

import json
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TRAIN_GPT, load_summary, wait_for
from tests.test_security import job_user  # noqa: F401  (the unprivileged job user)

pytestmark = pytest.mark.usefixtures("ebpf")


def run_agent(agent, out_dir: Path, *command: str, timeout_s: float = 180
              ) -> subprocess.CompletedProcess:
    return agent.run("run", "--output-dir", str(out_dir), "--metrics-address", "off",
                     "--no-stack-sampling", "--", *command, timeout_s=timeout_s)


def test_torchrun_job_exits_0_and_both_ranks_are_watched_from_their_first_iteration(
        agent, out_dir: Path, tmp_path: Path) -> None:
    stamps = tmp_path / "stamps.txt"
    done = run_agent(agent, out_dir, sys.executable, "-m", "torch.distributed.run",
                     "--standalone", "--nproc-per-node", "2", str(TRAIN_GPT), "--ddp",
                     "--train-iters", "120", "--timestamps", str(stamps))
    assert done.returncode == 0, done.stderr
    summary = load_summary(out_dir)
    info = summary["session_info"]
    assert info["ranks"] == [0, 1]
    assert info["end_reason"] in ("target_exited", "command_exited")
    # Attached before the job's first iteration: every iteration of rank 0 is counted.
    assert info["total_iterations"] == 120
    assert "perf summary" in done.stderr and done.stdout.count("iteration 50") == 2


def test_the_job_exit_code_is_passed_through_and_the_summary_written(
        agent, out_dir: Path) -> None:
    done = run_agent(agent, out_dir, sys.executable, str(TRAIN_GPT), "--train-iters", "40",
                     "--exit-code", "3")
    assert done.returncode == 3, done.stderr
    info = load_summary(out_dir)["session_info"]
    assert info["total_iterations"] == 40
    # How it ended, from the kernel: the job's cause is its one rank's exit code.
    [(pid, rank_exit)] = info["exit"]["ranks"].items()
    assert int(pid) == info["primary_pid"] and rank_exit["exit_code"] == 3
    assert info["exit"]["cause"]["what"] == "exit code 3"


def test_sigterm_is_forwarded_and_the_signal_is_the_exit_status(agent, out_dir: Path) -> None:
    proc = agent.start("run", "--output-dir", str(out_dir), "--metrics-address", "off",
                       "--no-stack-sampling", "--", sys.executable, str(TRAIN_GPT))
    wait_for(lambda: list(out_dir.glob("perf_summary_*.json")), 60, "the session to start")
    wait_for(lambda: load_summary(out_dir)["session_info"]["total_iterations"] > 0
             or time.sleep(1), 60, "iterations")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    info = load_summary(out_dir)["session_info"]
    assert info["end_time"] is not None and info["total_iterations"] > 0


def test_command_runs_as_the_user_named_and_the_agent_stays_root(
        agent, out_dir: Path, tmp_path: Path, job_user: pwd.struct_passwd) -> None:  # noqa: F811
    done = agent.run(
        "run", "--output-dir", str(out_dir), "--metrics-address", "off",
        "--user", job_user.pw_name, "--", sys.executable, "-c",
        "import os, json; print(json.dumps([os.getuid(), os.getgid(), os.environ['HOME']]))")
    assert done.returncode == 0, done.stderr
    uid, gid, home = json.loads(done.stdout)
    assert (uid, gid, home) == (job_user.pw_uid, job_user.pw_gid, job_user.pw_dir)


@pytest.mark.parametrize(("command", "code", "says"), [
    (["no-such-command-here"], 127, "command not found"),
    ([], 2, "no COMMAND given"),
    (["--user", "no-such-user-here", "--", "true"], 2, "no such user"),
])
def test_bad_commands_are_one_line(agent, out_dir: Path, command: list[str], code: int,
                                   says: str) -> None:
    args = command if command[:1] == ["--user"] else ["--", *command] if command else []
    done = agent.run("run", "--output-dir", str(out_dir), "--metrics-address", "off", *args)
    assert done.returncode == code
    [line] = done.stderr.strip().splitlines()
    assert says in line and line.startswith("perfmon-agent: error: ")
