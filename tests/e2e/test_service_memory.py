"""The node service in a 512 MiB memory cgroup (its unit says 2 GiB) against an ordinary
user's hostile processes: a "libtorch" whose symbol tables claim 2 GiB (a sparse file,
a few KB on disk), and a job 65 threads deep in 950 frames of long names. The service
must live, keep its memory, and say what it refused (issue 36: it was OOM-killed by
each, at 4.37 GB and 1.93 GB)."""

from __future__ import annotations

import os
import re
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.e2e.test_security import other_user  # noqa: F401  (an ordinary user)
from tests.e2e.test_service import Service, summaries
from tests.e2e.test_service_users import UserJobs
from tests.unit.parsers.test_elf_symbols_hostile import sparse_elf

pytestmark = pytest.mark.usefixtures("ebpf")

DEEP_STACKS = Path(__file__).resolve().parents[1] / "targets" / "deep_stacks.py"
LIMIT_BYTES = 512 << 20
# What of py-spy's output is left out to keep the agent's memory bounded (docs/metrics.md).
CUT_COUNTERS = ("windows_cut", "dumps_cut", "threads_cut", "stacks_cut", "names_cut",
                "samples_cut")
MARK = f"perfmon-fake-libtorch-{uuid.uuid4().hex[:8]}"
# A sleeping Python process that maps a file named libtorch_cpu.so: the agent takes it
# for a PyTorch job and reads the library's symbols.
MAP_AND_SLEEP = ("import mmap, sys, time; f = open(sys.argv[1], 'rb'); "
                 "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); time.sleep(600)")


class MemoryCgroup:
    """A memory cgroup with a hard limit (v2's memory.max, or v1's limit_in_bytes on a
    hybrid host), removed after; what it holds is moved back to the root first."""

    def __init__(self, limit_bytes: int) -> None:
        name = f"perfmon-test-mem-{uuid.uuid4().hex[:6]}"
        v2 = Path("/sys/fs/cgroup")
        if (v2 / "cgroup.controllers").exists() and "memory" in (
                v2 / "cgroup.subtree_control").read_text().split():
            self.root, self.v2 = v2, True
        elif Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
            self.root, self.v2 = Path("/sys/fs/cgroup/memory"), False
        else:
            pytest.fail("no memory cgroup controller: cannot hold the service to a limit")
        self.path = self.root / name
        self.path.mkdir()
        if self.v2:
            (self.path / "memory.max").write_text(str(limit_bytes))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            if (self.path / "memory.memsw.limit_in_bytes").exists():
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        if self.v2:
            events = (self.path / "memory.events").read_text()
        else:
            events = (self.path / "memory.oom_control").read_text()
        found = re.search(r"^oom_kill (\d+)$", events, re.M)
        return int(found[1]) if found else 0

    def peak_bytes(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return int((self.path / name).read_text()) if (self.path / name).exists() else -1

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.root / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # exited meanwhile
        self.path.rmdir()


@pytest.fixture
def memory_cgroup() -> Iterator[MemoryCgroup]:
    cgroup = MemoryCgroup(LIMIT_BYTES)
    try:
        yield cgroup
    finally:
        cgroup.close()


@pytest.fixture
def bob(other_user) -> Iterator[UserJobs]:  # noqa: F811
    jobs = UserJobs(other_user)
    yield jobs
    jobs.close()


@pytest.mark.long(reason=("a job of 950-frame stacks read by py-spy under the service's "
                          "memory cap until its summary says what was cut: minutes when busy"))
def test_the_service_lives_under_512_mib_beside_a_sparse_libtorch_and_deep_stacks(
        memory_cgroup: MemoryCgroup, bob: UserJobs, tmp_path: Path) -> None:
    library = sparse_elf(bob.home / "libtorch_cpu.so", ".dynstr")
    os.chown(library, bob.user.pw_uid, bob.user.pw_gid)
    svc = Service(tmp_path, include={"commands": [re.escape(MARK), r"deep_stacks\.py"]},
                  attach={"log_interval": 5, "iteration_source": "uprobe",
                          "stack_sampling": True})
    try:
        memory_cgroup.add(svc.proc.pid)  # at once: it is still importing
        wait_for(lambda: "READY=1" in svc.received() or svc.proc.poll() is not None, 60,
                 "READY=1")
        assert svc.proc.poll() is None, svc.log()
        fake = bob.start([sys.executable, "-c", MAP_AND_SLEEP, str(library), MARK])
        deep = bob.start([sys.executable, str(DEEP_STACKS), "--flip-s", "2"])
        wait_for(lambda: "over the cap" in svc.log(), 60,
                 "the sparse library's symbol table to be refused")
        folder = svc.job_folder(deep.pid, timeout_s=120)
        # py-spy's windows of the deep job are read, cut and said in its summary.
        def cut() -> dict | None:
            for summary in summaries(folder):
                quality = summary["final_statistics"]["data_quality"]
                pyspy = (quality.get("sources") or {}).get("pyspy") or {}
                if any(pyspy.get(k) for k in CUT_COUNTERS) and any(
                        "cut" in line for line in quality.get("losses") or []):
                    return pyspy
            return None
        quality = wait_for(cut, 240, "the deep job's summary to say what was cut")
        time.sleep(10)
        assert svc.proc.poll() is None, svc.log()
        rss = int(re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{svc.proc.pid}/status")
                            .read_text(), re.M)[1]) << 10
        print(f"service RSS {rss >> 20} MiB; cgroup peak {memory_cgroup.peak_bytes() >> 20} "
              f"MiB; OOM kills in it {memory_cgroup.oom_kills()}; {quality}")
        assert rss < LIMIT_BYTES // 2
        assert fake.poll() is None and deep.poll() is None
    finally:
        svc.close()
    assert "Traceback" not in svc.log()
