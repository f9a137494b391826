"""`perfmon-agent run [options] -- COMMAND`: the real agent starts a real job, watches its
ranks from their first iterations, writes their summaries, and exits with the job's status."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TRAIN_GPT, Target, load_summary, wait_for
from tests.e2e.test_fail_slow import own_change_pct
from tests.e2e.test_security import job_user  # noqa: F401  (the unprivileged job user)

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


@pytest.mark.long(reason=("400 iterations of a job slow from its first: the fail-slow warm-up and "
                          "baseline"))
def test_a_job_slow_from_its_first_iteration_gets_no_fail_slow_event_from_its_warm_up(
        agent, out_dir: Path, tmp_path: Path) -> None:
    """Watched from its first iteration, a job's warm-up (its first, slower steps) is no
    baseline, and a job slow all along (40 ms more a step, waited as for a slow device) is
    measured at its own pace."""
    stamps = tmp_path / "stamps.txt"
    done = run_agent(agent, out_dir, sys.executable, str(TRAIN_GPT), "--train-iters", "400",
                     "--slow-ranks", "all", "--slow-ms", "40", "--slow-wait",
                     "--timestamps", str(stamps))
    assert done.returncode == 0, done.stderr
    summary = load_summary(out_dir)
    assert summary["session_info"]["total_iterations"] == 400
    # Any event is the job's own clock moving (the shared VM slows a job by itself at
    # times), never the warm-up or the detector alone.
    job = Target(None, stamps)  # type: ignore[arg-type]  (only its timestamps are read)
    for event in summary["final_statistics"]["fail_slow"]:
        own = own_change_pct(job, event)
        assert own * event["change_pct"] > 0 and abs(own) >= 0.6 * abs(event["change_pct"]), (
            own, event)


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


# -- COMMAND's environment: its user's, never root's --------------------------------------

ROOT_ONLY = {"ROOT_SECRET": "root-secret-4f1c", "PYENV_ROOT": "/root/.pyenv",
             "PATH": f"/root/.pyenv/shims:{os.environ['PATH']}", "HOME": "/root",
             "USER": "root", "LOGNAME": "root", "MAIL": "/var/mail/root",
             "PYTHONPATH": "/root/lib", "KRB5CCNAME": "FILE:/tmp/krb5cc_0"}
PRINT_ENV = ("import json, os; print(json.dumps({'env': dict(os.environ), 'uid': os.getuid(), "
             "'gid': os.getgid(), 'groups': os.getgroups()}))")
# What a login gives the user, and what is the terminal's or locale's.
LOGIN_NAMES = {"HOME", "USER", "LOGNAME", "SHELL", "PATH"}
SESSION_NAMES = {"TERM", "COLORTERM", "LANG", "LANGUAGE", "TZ"}


def _printed(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_users_environment(env: dict[str, str], user: pwd.struct_passwd,
                             allowed: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """Nothing of root's environment but what is the user's too, the session's or named."""
    extra = {n for n in env if n not in LOGIN_NAMES | SESSION_NAMES | allowed
             and not n.startswith("LC_")}
    assert not extra, extra
    assert env["HOME"] == user.pw_dir and env["USER"] == env["LOGNAME"] == user.pw_name
    assert env["SHELL"] == user.pw_shell
    assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
    text = json.dumps(env)
    assert ROOT_ONLY["ROOT_SECRET"] not in text and "/root" not in text, text


def test_run_as_another_user_gives_a_login_environment_and_only_what_is_named(
        agent, out_dir: Path, job_user: pwd.struct_passwd) -> None:  # noqa: F811
    done = agent.run("run", "--output-dir", str(out_dir), "--metrics-address", "off",
                     "--user", job_user.pw_name, "--env", "OMP_NUM_THREADS=3",
                     "--preserve-env", "NCCL_DEBUG,LANG", "--", sys.executable, "-c", PRINT_ENV,
                     env={**ROOT_ONLY, "NCCL_DEBUG": "INFO", "LANG": "C.UTF-8"})
    printed = _printed(done)
    env = printed["env"]
    assert_users_environment(env, job_user, {"OMP_NUM_THREADS", "NCCL_DEBUG"})
    assert env["OMP_NUM_THREADS"] == "3" and env["NCCL_DEBUG"] == "INFO"
    assert env["LANG"] == "C.UTF-8"
    assert (printed["uid"], printed["gid"]) == (job_user.pw_uid, job_user.pw_gid)


def test_a_root_shell_that_carries_sudo_uid_passes_nothing_of_roots_and_no_foreign_group(
        agent, out_dir: Path, job_user: pwd.struct_passwd) -> None:  # noqa: F811
    # As after `sudo -i`: root's own environment, with SUDO_UID/SUDO_GID left in it.
    done = agent.run("run", "--output-dir", str(out_dir), "--metrics-address", "off", "--",
                     sys.executable, "-c", PRINT_ENV,
                     env={**ROOT_ONLY, "SUDO_UID": str(job_user.pw_uid), "SUDO_GID": "0",
                          "SUDO_USER": job_user.pw_name})
    printed = _printed(done)
    # KRB5CCNAME is one of the variables sudo keeps of its invoker's; here it is root's
    # and points into nothing the user can read (a file of root's, 0600): allowed.
    env = {k: v for k, v in printed["env"].items() if k != "KRB5CCNAME"}
    assert_users_environment(env, job_user)
    # SUDO_GID 0 is no group of the user's: the user's own primary group instead.
    assert (printed["uid"], printed["gid"]) == (job_user.pw_uid, job_user.pw_gid)
    assert 0 not in printed["groups"]


@pytest.fixture
def sudoers(job_user: pwd.struct_passwd) -> Iterator[None]:  # noqa: F811
    """The job user may start the agent with sudo (as a site would allow it)."""
    path = Path(f"/etc/sudoers.d/perfmon-test-{os.getpid()}")
    path.write_text(f"{job_user.pw_name} ALL=(root) NOPASSWD: {sys.executable}\n")
    path.chmod(0o440)
    try:
        subprocess.run(["visudo", "-cq", "-f", str(path)], check=True)
        yield
    finally:
        path.unlink()


@pytest.mark.usefixtures("sudoers")
def test_run_under_real_sudo_gives_the_invoking_users_environment_and_groups(
        agent, out_dir: Path, job_user: pwd.struct_passwd) -> None:  # noqa: F811
    users_own = {"HOME": job_user.pw_dir, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
                 "TERM": "xterm", "USERS_OWN_SECRET": "not-for-the-job"}
    done = agent.run("run", "--output-dir", str(out_dir), "--metrics-address", "off", "--",
                     sys.executable, "-c", PRINT_ENV,
                     prefix=("setpriv", f"--reuid={job_user.pw_uid}",
                             f"--regid={job_user.pw_gid}", "--init-groups", "env", "-i",
                             *(f"{k}={v}" for k, v in users_own.items()), "sudo", "-n"))
    printed = _printed(done)
    env = printed["env"]
    # sudo sets HOME, USER, LOGNAME, SHELL, MAIL and PATH (secure_path) to root's and adds
    # SUDO_*: none of that reaches the job; the terminal's TERM and LANG do.
    assert_users_environment(env, job_user)
    assert env["TERM"] == "xterm" and env["LANG"] == "C.UTF-8"
    assert (printed["uid"], printed["gid"]) == (job_user.pw_uid, job_user.pw_gid)


def test_bad_environment_options_are_one_usage_line(agent, out_dir: Path) -> None:
    for option, value in (("--env", "NOEQUALS"), ("--env", "1BAD=x"),
                          ("--preserve-env", "A,B-C")):
        done = agent.run("run", "--output-dir", str(out_dir), option, value, "--", "true")
        assert done.returncode == 2
        assert done.stderr.strip().splitlines()[-1].startswith("perfmon-agent run: error:"), (
            done.stderr)
