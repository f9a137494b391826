"""Why a rank ended, against real PyTorch processes and the real kernel hooks.

The ranks are tests/targets/rank_exit.py: they train a few steps, say they are
ready, and end when the test says so (exit code 3; a CUDA out-of-memory
traceback into the log file their stdout and stderr go to, then exit 1; killed
by SIGKILL; killed by the kernel's OOM killer in a small memory cgroup).
``ExitSource`` runs in the test process (root) with the process-events
connector and the oom:mark_victim tracepoint; without them the exits are still
recorded, with no status unless the kernel still holds it. Under
PERFMON_REQUIRE_EBPF=1 a missing hook fails the tests instead of skipping them.
(The parsers on bytes as the kernel writes them: tests/unit/parsers/test_proc_connector.py;
the reducer on exact records: tests/unit/agent/reducers/test_exits.py.)
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from perfmon.agent.reducers.exits import Exits
from perfmon.probes.exits import ExitSource
from perfmon.probes.procfs import inspect_process

from tests.conftest import _reap, wait_for
from tests.e2e.test_security import as_job_user, job_home, job_user  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[2]
RANK_EXIT = ROOT / "tests" / "targets" / "rank_exit.py"
SECRET = "ROOTSECRET-7f3a9c"
TIMEOUT_S = 30


class Rank:
    """A rank_exit.py process started by a test (reaped by the fixture)."""

    def __init__(self, proc: subprocess.Popen, ready: Path) -> None:
        self.proc, self.ready = proc, ready

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"rank pid {self.pid} exited early: {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise AssertionError(f"rank pid {self.pid} not ready in 120 s")
            time.sleep(0.05)

    def go(self) -> None:
        """Let it end as its --end says."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()


@pytest.fixture
def start_rank(tmp_path: Path) -> Iterator:
    started: list[subprocess.Popen] = []

    def start(end: str, rank: int, *, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
              folder: Path = tmp_path, prefix: tuple[str, ...] = ()) -> Rank:
        ready = folder / f"ready_{len(started)}"
        env = {"PATH": os.environ["PATH"], "HOME": str(folder), "RANK": str(rank),
               "WORLD_SIZE": "3"}
        proc = subprocess.Popen(
            [*prefix, sys.executable, str(RANK_EXIT), "--ready", str(ready), "--end", end],
            stdin=subprocess.PIPE, stdout=stdout, stderr=stderr, cwd=folder, env=env,
            start_new_session=True)
        started.append(proc)
        return Rank(proc, ready)

    yield start
    for proc in started:
        _reap(proc)


def require_kernel_hooks(source: ExitSource) -> None:
    """A failure under PERFMON_REQUIRE_EBPF=1, else a skip, when a kernel hook is missing."""
    if source.hook == "proc_connector" and source.oom_watched:
        return
    reason = "; ".join(w for w in source.warnings if "not observed" in w or "not watched" in w)
    source.close()
    if os.environ.get("PERFMON_REQUIRE_EBPF") == "1":
        pytest.fail(f"PERFMON_REQUIRE_EBPF=1 but the exit hooks cannot be set up: {reason}")
    pytest.skip(f"the exit hooks cannot be set up: {reason}")


def collect(source: ExitSource, count: int, timeout_s: float = TIMEOUT_S) -> list:
    """Poll as the session does (every 0.1 s) until ``count`` records came."""
    records: list = []
    deadline = time.monotonic() + timeout_s
    while len(records) < count:
        assert time.monotonic() < deadline, f"only {len(records)} exits in {timeout_s} s"
        records += source.poll()
        time.sleep(0.1)
    return records


def started_source(ranks: list[Rank]) -> ExitSource:
    for r in ranks:
        r.wait_ready()
    source = ExitSource([inspect_process(r.pid) for r in ranks])
    source.start()
    require_kernel_hooks(source)
    return source


def summarize(records: list) -> dict:
    """The reducer fed as the session feeds it: records as logged maps, in time order."""
    exits = Exits()
    for record in sorted(records, key=lambda r: r.t_mono_ns):
        exits.on_exit(record.to_record())
    return json.loads(json.dumps(exits.summary()))  # as session_info holds it


@pytest.mark.parametrize("first", ["exit_code_3", "cuda_oom"])
def test_exit_code_sigkill_and_a_cuda_oom_traceback_are_recorded_and_the_first_failure_is_the_cause(
        start_rank, tmp_path, first):
    # Ranks 0 and 1 write stdout and stderr into a log file each (2>&1); rank 2 into /dev/null.
    with open(tmp_path / "rank0.log", "wb") as log0, open(tmp_path / "rank1.log", "wb") as log1:
        exit3 = start_rank("exit:3", 0, stdout=log0, stderr=subprocess.STDOUT)
        oom = start_rank("cuda-oom", 1, stdout=log1, stderr=subprocess.STDOUT)
    killed = start_rank("wait", 2)
    source = started_source([exit3, oom, killed])
    try:
        # /dev/null is no file to read: a note, not a warning.
        assert source.warnings == []
        assert source.notes == ["not read for exit causes (a device, not a regular file): "
                                f"pid {killed.pid} stdout and stderr"]
        before_ns = time.monotonic_ns()
        order = [exit3, oom] if first == "exit_code_3" else [oom, exit3]
        records = []
        for rank in order:  # one after the other, as a failure and its aftermath
            rank.go()
            records += collect(source, 1)
        killed.proc.send_signal(signal.SIGKILL)  # as a launcher stops the rest
        records += collect(source, 1)
        after_ns = time.monotonic_ns()
        assert source.poll() == []  # once per rank
        quality = source.quality()
    finally:
        source.close()
    by_pid = {r.pid: r for r in records}
    assert set(by_pid) == {exit3.pid, oom.pid, killed.pid}
    for record in records:  # the kernel's time of the exit, on the agent's clock
        assert before_ns <= record.t_mono_ns <= after_ns
        assert record.source == "proc_connector" and record.oom_killed is False
    assert [r.pid for r in records] == [r.pid for r in order] + [killed.pid]

    r = by_pid[exit3.pid]
    # Its log holds three iteration lines and no failure.
    assert (r.exit_code, r.signal, r.core_dumped, r.log_tail_cause, r.rank) == (
        3, None, False, None, 0)
    r = by_pid[killed.pid]
    assert (r.exit_code, r.signal, r.core_dumped, r.log_tail_cause, r.rank) == (
        None, "SIGKILL", False, None, 2)
    r = by_pid[oom.pid]
    assert (r.exit_code, r.signal, r.rank) == (1, None, 1)
    assert r.log_tail_cause is not None
    assert r.log_tail_cause["cause"] == "cuda_out_of_memory"
    assert r.log_tail_cause["exception_type"] == "torch.OutOfMemoryError"
    assert r.log_tail_cause["message"].startswith(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB")
    assert r.log_tail_cause["stream"] == "stdout+stderr"
    assert quality["exits"] == 3 and quality["exits_unobserved"] == 0
    assert quality["events_dropped"] == 0

    summary = summarize(records)
    assert summary["ranks"][str(exit3.pid)]["what"] == "exit code 3"
    assert summary["ranks"][str(killed.pid)]["what"] == "killed by SIGKILL"
    assert summary["ranks"][str(oom.pid)]["what"].startswith(
        "CUDA out of memory. Tried to allocate 20.00 GiB.")
    assert summary["ranks"][str(oom.pid)]["what"].endswith("(exit code 1)")
    cause_rank = exit3 if first == "exit_code_3" else oom
    assert summary["cause"] == {"pid": cause_rank.pid, "rank": 0 if cause_rank is exit3 else 1,
                                "what": summary["ranks"][str(cause_rank.pid)]["what"]}


def memory_cgroup(limit_bytes: int) -> Path | None:
    """A new memory cgroup (v2, else v1) limited to ``limit_bytes`` without swap, or None."""
    name = f"perfmon-test-{secrets.token_hex(4)}"
    v2 = Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.subtree_control"  # v2: what its children may limit
    if controllers.exists() and "memory" in controllers.read_text().split():
        path = v2 / name
        path.mkdir()
        (path / "memory.max").write_text(str(limit_bytes))
        if (path / "memory.swap.max").exists():
            (path / "memory.swap.max").write_text("0")
        return path
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        path = v1 / name
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        (path / "memory.swappiness").write_text("0")
        return path
    return None


def test_a_rank_the_kernel_oom_killer_chose_is_named(start_rank):
    victim = start_rank("allocate", 0)
    source = started_source([victim])
    cgroup = memory_cgroup(64 << 20)
    try:
        if cgroup is None:
            if os.environ.get("PERFMON_REQUIRE_EBPF") == "1":
                pytest.fail("no memory cgroup controller to run a real OOM kill in")
            pytest.skip("no memory cgroup controller to run a real OOM kill in")
        # What it allocates from now on is charged to the small cgroup.
        (cgroup / "cgroup.procs").write_text(str(victim.pid))
        victim.go()
        (record,) = collect(source, 1)
    finally:
        source.close()
        _reap(victim.proc)
        if cgroup is not None:
            wait_for(lambda: _rmdir(cgroup), 10, "the test cgroup to be removed")
    assert (record.pid, record.signal, record.exit_code, record.oom_killed) == (
        victim.pid, "SIGKILL", None, True)
    summary = summarize([record])
    assert summary["cause"] == {"pid": victim.pid, "rank": 0,
                                "what": "killed by SIGKILL (the kernel's OOM killer)"}


def _rmdir(path: Path) -> bool:
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def test_outputs_that_are_a_fifo_or_a_link_to_a_root_only_file_are_never_read(
        start_rank, job_user, job_home, tmp_path):  # noqa: F811
    # A root-only log holding a failure and a secret; the job's user links to it from
    # its folder, and a root launcher redirects the job's stdout through that link.
    private = tmp_path / "root-only.log"
    planted = (f"{SECRET}\nTraceback (most recent call last):\n  File \"x\"\n"
               f"torch.OutOfMemoryError: CUDA out of memory. {SECRET}\n")
    private.write_text(planted)
    private.chmod(0o600)
    link = job_home / "train.log"
    link.symlink_to(private)
    os.lchown(link, job_user.pw_uid, job_user.pw_gid)
    # Its stderr is a FIFO the job's user made; someone reads it (or the job would block).
    fifo = job_home / "stderr.fifo"
    os.mkfifo(fifo)
    os.chown(fifo, job_user.pw_uid, job_user.pw_gid)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with open(link, "ab") as stdout, open(fifo, "wb") as stderr:
            rank = start_rank("cuda-oom", 0, stdout=stdout, stderr=stderr, folder=job_home,
                              prefix=tuple(as_job_user(job_user)))
        rank.wait_ready()  # (its start-up, importing PyTorch, is not the source's)
        began = time.monotonic()
        source = started_source([rank])
        try:
            # Neither output blocked the start: the job writes nothing to either until
            # go(), so a read or open that blocked would block for good.
            assert time.monotonic() - began < 10
            # A file the job's user may not read is a warning; a pipe, a note.
            assert f"not read for exit causes (Permission denied): pid {rank.pid} stdout" \
                in " | ".join(source.warnings)
            assert source.notes == ["not read for exit causes (a FIFO, not a regular file): "
                                    f"pid {rank.pid} stderr"]
            rank.go()
            (record,) = collect(source, 1)
        finally:
            source.close()
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
        assert os.read(reader, 1 << 16).count(b"torch.OutOfMemoryError") == 1  # all left for us
    finally:
        os.close(reader)
    assert (record.exit_code, record.log_tail_cause, record.source) == (1, None, "proc_connector")
    assert SECRET not in repr(record) + " ".join(source.warnings + source.notes)
    # The job appended its iteration lines through the fd root gave it; nothing else changed.
    assert private.read_text().startswith(planted)


# Runs ExitSource in a network namespace of its own, where the process-events
# connector does not exist: starts, prints "started", polls when told (a line on
# stdin) until it has N records, prints them.
PROBE = r"""
import json, sys, time
from dataclasses import asdict
from perfmon.probes.exits import ExitSource
from perfmon.probes.procfs import inspect_process

pids = [int(p) for p in sys.argv[1:]]
source = ExitSource([inspect_process(p) for p in pids])
source.start()
print(json.dumps({"hook": source.hook, "warnings": source.warnings}), flush=True)
sys.stdin.readline()
records, deadline = [], time.monotonic() + 20
while len(records) < len(pids) and time.monotonic() < deadline:
    records += source.poll()
    time.sleep(0.1)
source.close()
print(json.dumps([asdict(r) for r in records]), flush=True)
"""


def test_without_the_kernel_hook_an_exit_is_recorded_with_no_status_never_a_guess(start_rank):
    reaped = start_rank("exit:3", 0)
    zombie = start_rank("exit:5", 1)
    for r in (reaped, zombie):
        r.wait_ready()
    probe = subprocess.Popen(
        ["unshare", "--net", sys.executable, "-c", PROBE, str(reaped.pid), str(zombie.pid)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=ROOT, start_new_session=True)
    try:
        assert probe.stdout is not None and probe.stdin is not None
        started = json.loads(probe.stdout.readline() or "null")
        assert started is not None, probe.stderr.read() if probe.stderr else ""
        assert started["hook"] == "unobserved"
        assert any("exit statuses are not observed" in w and "network namespace" in w
                   for w in started["warnings"]), started["warnings"]
        reaped.go()
        assert reaped.proc.wait(timeout=TIMEOUT_S) == 3  # reaped: the kernel keeps nothing
        zombie.go()
        wait_for(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE, TIMEOUT_S,
                 "the rank to be a zombie")
        probe.stdin.write("poll\n")
        probe.stdin.flush()
        out, _ = probe.communicate(timeout=TIMEOUT_S)
    finally:
        _reap(probe)
    records = {r["pid"]: r for r in json.loads(out)}
    assert records[reaped.pid] | {"t_mono_ns": 0} == {
        "t_mono_ns": 0, "pid": reaped.pid, "exit_code": None, "signal": None,
        "core_dumped": None, "oom_killed": False, "log_tail_cause": None,
        "source": "unobserved", "rank": 0}
    # Unreaped, the kernel still holds its status (/proc/PID/stat): that is not a guess.
    assert (records[zombie.pid]["exit_code"], records[zombie.pid]["source"]) == (5, "proc_stat")


# -- the parsers, on bytes as the kernel writes them --------------------------------


# -- the reducer, on records as the source gives them -------------------------------
