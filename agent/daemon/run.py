"""``perfmon-agent run -- COMMAND``: a job launched and watched, around
perfmon.agent.daemon.tracker.JobTracker.

Starts COMMAND in a process group of its own (the terminal's foreground group, so
Ctrl-C reaches the job, not the agent), as the invoking user in that user's
environment, and watches every training rank among its descendants from when it
loads PyTorch; SIGINT/SIGTERM/SIGHUP sent to the agent go to COMMAND's group first.
When COMMAND exits the sessions end, their summaries are written, and the agent
exits with COMMAND's status (128+N for signal N).
"""

from __future__ import annotations

import argparse
import os
import pwd
import re
import signal
import subprocess
import time
from typing import Any

from perfmon.agent.argtypes import Command
from perfmon.agent.console import Output, print_summary_table, warn
from perfmon.agent.daemon.config import ServiceConfig
from perfmon.agent.daemon.tracker import JobTracker, agent_figures, log
from perfmon.agent.measure.heap import limit_malloc_arenas
from perfmon.agent.measure.metrics import start_metrics
from perfmon.agent.options import add_attach_arguments, add_metrics_argument, attach_options
from perfmon.agent.record.outputs import OutputDir
from perfmon.parsers.errors import PerfmonError

RUN_SCAN_INTERVAL_S = 0.5  # a rank is attached within this of loading PyTorch
RUN_STOP_TIMEOUT_S = 60.0


class RunCommandError(PerfmonError):
    """COMMAND could not be started (exit 127 when not found, 126 when not executable, as
    shells do), or ``run`` was called without one (2)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


RUN_EPILOG = """examples:
  sudo perfmon-agent run -- bash outputs/llama/logs/scripts/host_0_localhost_run.sh
  sudo perfmon-agent run --model-config llama7b.yaml -- torchrun --nproc-per-node 8 train.py
  sudo perfmon-agent run --user alice -- python train.py
  sudo perfmon-agent run --preserve-env PYTHONPATH,NCCL_DEBUG --env OMP_NUM_THREADS=8 -- ./train.sh

COMMAND runs as the invoking user (sudo's SUDO_UID), or --user, never as root
unless root started it, in a login's environment for that user (HOME, USER,
LOGNAME, SHELL, a default PATH, the terminal's and locale's variables; under sudo
what sudo kept) plus --env and --preserve-env: nothing else of root's. The
agent's lines go to stderr, COMMAND's output is its own. The exit status is
COMMAND's (128+N when signal N ended it).
"""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    add_attach_arguments(parser)
    add_metrics_argument(parser)
    parser.add_argument("--user", metavar="USER",
                        help="run COMMAND as this user (root only; default: the invoking "
                        "user, from sudo's SUDO_UID/SUDO_GID, else this user)")
    parser.add_argument("--env", action="append", default=[], type=_assignment,
                        metavar="NAME=VALUE", help="set this variable in COMMAND's "
                        "environment (repeatable)")
    parser.add_argument("--preserve-env", action="append", default=[], type=_names,
                        metavar="NAME[,NAME...]", help="pass these variables of the agent's "
                        "environment on to COMMAND when it runs as another user (repeatable)")
    parser.add_argument("job_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the job's command line")


_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
# What a login gives a user (Debian's /etc/login.defs ENV_PATH).
LOGIN_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
# The terminal's and the locale's, never an identity: carried to COMMAND's user.
SESSION_VARIABLES = ("TERM", "COLORTERM", "LANG", "LANGUAGE", "TZ")
# What sudo's env_reset keeps of the invoking user's environment beyond those (its
# default env_keep): the user's own, so carried when sudo started the agent.
SUDO_KEPT_VARIABLES = ("DISPLAY", "XAUTHORITY", "XAUTHORIZATION", "KRB5CCNAME", "COLORS",
                       "LS_COLORS", "XDG_CURRENT_DESKTOP")


def _assignment(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not _VARIABLE.match(name):
        raise argparse.ArgumentTypeError(f"not NAME=VALUE: {text!r}")
    return name, value


def _names(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if not _VARIABLE.match(n)]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"not a variable name: {(bad or [text])[0]!r}")
    return names


def job_environment(entry: pwd.struct_passwd, parent: dict[str, str], *, sudo: bool,
                    preserve: list[str], extra: dict[str, str]) -> dict[str, str]:
    """COMMAND's environment when it runs as ``entry``'s user: a login's (HOME, USER,
    LOGNAME, SHELL, a default PATH), the terminal's and locale's variables, under sudo
    what sudo kept of the invoking user's, then ``preserve`` (names taken from
    ``parent``) and ``extra``. Nothing else of ``parent``, the agent's (root's)
    environment, reaches the job."""
    env = {"HOME": entry.pw_dir, "USER": entry.pw_name, "LOGNAME": entry.pw_name,
           "SHELL": entry.pw_shell or "/bin/sh", "PATH": LOGIN_PATH}
    carried = SESSION_VARIABLES + (SUDO_KEPT_VARIABLES if sudo else ())
    for name, value in parent.items():
        if name in carried or name.startswith("LC_") or name in preserve:
            env[name] = value
    env.update(extra)
    return env


def _credentials(args: argparse.Namespace) -> dict[str, Any]:
    """Popen's user/group/extra_groups/env for COMMAND's user ({}: COMMAND runs as the
    agent does, in its environment)."""
    user: str | None = args.user
    sudo = user is None and os.geteuid() == 0 and os.environ.get("SUDO_UID", "").isdigit()
    if sudo:
        user = os.environ["SUDO_UID"]
    if user is None:
        return {"env": {**os.environ, **dict(args.env)}} if args.env else {}
    if os.geteuid() != 0:
        raise RunCommandError(f"--user {user}: only root can run COMMAND as another user")
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, OverflowError):
        raise RunCommandError(f"--user {user}: no such user") from None
    groups = os.getgrouplist(entry.pw_name, entry.pw_gid)
    # sudo's SUDO_GID is the invoking user's group at the time (after newgrp, say);
    # taken when it is one of the user's groups, never to gain another.
    sudo_gid = os.environ.get("SUDO_GID", "")
    gid = int(sudo_gid) if sudo and sudo_gid.isdigit() and int(sudo_gid) in groups else (
        entry.pw_gid)
    preserve = [name for names in args.preserve_env for name in names]
    return {"user": entry.pw_uid, "group": gid, "extra_groups": groups,
            "env": job_environment(entry, dict(os.environ), sudo=sudo, preserve=preserve,
                                   extra=dict(args.env))}


class _Foreground:
    """Make COMMAND's process group the terminal's foreground (as a shell does), so that
    Ctrl-C reaches the job; restored at the end."""

    def __init__(self) -> None:
        self.fd: int | None = None
        try:
            if os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp():
                self.fd = 0
        except OSError:
            self.fd = None

    def _set(self, pgid: int) -> None:
        if self.fd is None:
            return
        previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        try:
            os.tcsetpgrp(self.fd, pgid)
        except OSError:
            pass
        finally:
            signal.signal(signal.SIGTTOU, previous)

    def give(self, pgid: int) -> None:
        self._set(pgid)

    def take_back(self) -> None:
        self._set(os.getpgrp())


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run_main(args: argparse.Namespace) -> int:
    command = args.job_command[1:] if args.job_command[:1] == ["--"] else args.job_command
    if not command:
        raise RunCommandError("run: no COMMAND given (perfmon-agent run [options] -- COMMAND)")
    limit_malloc_arenas()
    options = attach_options(args, 0)
    # Checked before COMMAND starts: an unfit output dir is an error, not a lost run.
    OutputDir.open(options.output_dir, allow_shared=options.allow_shared_output_dir).close()
    credentials = _credentials(args)
    metrics = start_metrics(args.metrics_address, warn)
    foreground = _Foreground()
    try:
        child = subprocess.Popen(command, process_group=0, **credentials)
    except FileNotFoundError:
        raise RunCommandError(f"run: {command[0]}: command not found", 127) from None
    except PermissionError:
        raise RunCommandError(f"run: {command[0]}: permission denied", 126) from None
    except OSError as err:
        raise RunCommandError(f"run: {command[0]}: {err.strerror}", 126) from None
    foreground.give(child.pid)

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    handlers = {s: signal.signal(s, forward)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    config = ServiceConfig(scan_interval_s=RUN_SCAN_INTERVAL_S, rank_wait_s=5.0,
                           max_jobs=64, max_jobs_per_user=64, cpu_budget_pct=1e4,
                           cpu_budget_per_rank_pct=options.cpu_budget_pct or 1e4,
                           retry_initial_s=5.0, retry_max_s=60.0)
    tracker = JobTracker(options=options, config=config, log=log, metrics=metrics,
                         scope_pid=child.pid)
    try:
        while child.poll() is None:
            tracker.tick(time.monotonic())
            agent_figures(metrics, tracker.running)
            time.sleep(RUN_SCAN_INTERVAL_S)
        tracker.stop("command_exited", RUN_STOP_TIMEOUT_S)
    finally:
        foreground.take_back()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        if child.poll() is None:  # the agent itself failed: COMMAND is not left behind
            forward(signal.SIGTERM, None)
            child.wait()
        if metrics is not None:
            metrics.close()
    if not tracker.results:
        warn("no training process was watched: none with PyTorch loaded among COMMAND's "
             "processes, or none could be attached (see above)")
    # stdout belongs to COMMAND: the agent's tables go to stderr.
    out = Output(stderr=True)
    for result in tracker.results:
        out.table(lambda r=result: print_summary_table(
            out.console, r.statistics, r.summary["session_info"], r.summary_path))
    return _exit_status(child.returncode)


COMMAND = Command(
    "run", "start a command and watch every training rank it starts", add_run_arguments,
    run_main, description="Start COMMAND, watch every training process among its "
    "descendants, write their summaries when it exits, and exit with its status.",
    epilog=RUN_EPILOG)
