"""Starting py-spy, and reading a one-off py-spy run's output, bounded.

Every py-spy the agent starts goes through :func:`spawn_pyspy`, which makes it the
process the kernel's OOM killer takes first (py-spy shares the agent's cgroup and can
grow to gigabytes on a hostile job: security issue 36). :func:`run_pyspy` reads at
most a cap of a run's output. :func:`pyspy_failure` tells what a failed run's stderr
means. Needs: py-spy >= 0.4 (``pip install py-spy``); /proc for the OOM score.
"""

from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from perfmon.parsers.pyspy import DUMP_MAX_BYTES
from perfmon.probes.errors import (
    NoSuchProcess,
    PrerequisiteMissing,
    PrivilegeError,
    ProbeError,
    UnsuitableTarget,
    agent_who,
)

_STDERR_MAX_BYTES = 64 << 10
_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
# RUST_BACKTRACE=1 (set in many dev shells) makes py-spy print a backtrace
# after every error; we only want its "Error: ..." line.
_ENV = {**os.environ, "RUST_BACKTRACE": "0"}


def find_pyspy() -> str:
    """Path of the py-spy binary: the one installed next to this Python first, then PATH.

    Raises PrerequisiteMissing.
    """
    # pip installs py-spy's binary into the same bin/ as the interpreter; a venv
    # run without activation has that bin/ off PATH.
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("py-spy")
    if found:
        return found
    raise PrerequisiteMissing(
        f"{agent_who()}: py-spy not found next to {sys.executable} "
        "or on PATH: pip install py-spy"
    )


def _ptrace_hint() -> str:
    try:
        with open(_PTRACE_SCOPE) as f:
            scope = f" (now {f.read().strip()})"
    except OSError:
        scope = " (no Yama here)"
    return (
        "run as root with CAP_SYS_PTRACE (in a container: --cap-add SYS_PTRACE), or as the "
        f"job's user with {_PTRACE_SCOPE} = 0{scope}"
    )


def pyspy_failure(pid: int, stderr: bytes, what: str) -> ProbeError:
    """The error a failed py-spy run stands for, from its stderr."""
    text = stderr.decode("utf-8", "replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    message = next((line for line in lines if line.startswith("Error:")), lines[0] if lines else "")
    lowered = text.lower()
    if "permission denied" in lowered or "operation not permitted" in lowered:
        return PrivilegeError(f"pid {pid}: py-spy may not read this process: {_ptrace_hint()}")
    if "failed to get process executable name" in lowered or "no such process" in lowered:
        return NoSuchProcess(f"pid {pid}: no such process (py-spy {what})")
    if "failed to find python version" in lowered or "python interpreter" in lowered:
        return UnsuitableTarget(f"pid {pid}: py-spy finds no Python interpreter in it")
    return ProbeError(f"pid {pid}: py-spy {what} failed: {message or 'no message'}")


def _make_oom_victim(pid: int) -> None:
    """Make py-spy the process the kernel's OOM killer takes first.

    py-spy is the agent's child, in its cgroup (the node service's MemoryMax), and
    holds a whole record window in memory (2.8 GB for a hostile job: security issue
    36): when the cgroup runs out, losing one py-spy (a window, a dump) is the right
    loss, not the agent. 1000 is the highest score; raising a child's score needs no
    privilege. Best effort: no /proc, or the child already gone.
    """
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def spawn_pyspy(args: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start a py-spy process (every py-spy the agent starts goes through here), with
    stdin closed, no Rust backtraces, and the first place in the OOM killer's line.

    The score is set just after the start: for the first tens of microseconds py-spy
    has the agent's own (and is tiny). Not through a wrapper that sets it and execs
    py-spy (util-linux's choom): its exec would delay py-spy's start by a millisecond
    or more, and a record window's clock origin is the spawn time (perfmon.probes.pyspy).
    """
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, env=_ENV, **popen)
    _make_oom_victim(proc.pid)
    return proc


@dataclass
class PySpyOutput:
    returncode: int
    stdout: bytes
    stderr: bytes
    cut: bool  # stdout passed the cap: py-spy was killed, stdout is its first bytes


def run_pyspy(args: list[str], timeout_s: float, cancel: threading.Event | None,
         max_stdout: int = DUMP_MAX_BYTES) -> PySpyOutput:
    """Run py-spy, keeping at most ``max_stdout`` of its output (it is killed past that)
    and the start of its stderr; TimeoutExpired past ``timeout_s``; killed at once when
    ``cancel`` is set."""
    with spawn_pyspy(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        out, err = bytearray(), bytearray()
        kept = {proc.stdout.fileno(): (out, max_stdout),
                proc.stderr.fileno(): (err, _STDERR_MAX_BYTES)}
        deadline = time.monotonic() + timeout_s
        cut = False
        with selectors.DefaultSelector() as selector:
            for pipe in (proc.stdout, proc.stderr):
                selector.register(pipe, selectors.EVENT_READ)
            while selector.get_map() and not cut:
                left = deadline - time.monotonic()
                if left <= 0 or (cancel is not None and cancel.is_set()):
                    proc.kill()
                    proc.wait()
                    raise subprocess.TimeoutExpired(args, timeout_s)
                for key, _ in selector.select(timeout=min(0.1, left)):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    buf, limit = kept[key.fd]
                    room = max(0, limit - len(buf))
                    buf += chunk[:room]
                    if len(chunk) > room and buf is out:
                        cut = True  # the rest of a stderr past its cap is dropped
        if cut:
            proc.kill()
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return PySpyOutput(proc.returncode, bytes(out), bytes(err), cut)
