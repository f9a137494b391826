"""Which found jobs the node service tracks (perfmon.agent.daemon.tracker): a watched job's
launcher, found alone by a scan that read it before its children, is no job of its own;
nobody else's process is hidden that way (real services: tests/e2e/test_spawn_ranks.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from perfmon.agent.daemon.jobs import FoundJob
from perfmon.agent.daemon.tracker import JobTracker, TrackedJob

PARENT, CHILDREN, TICKS = 100, (101, 102), 5000


def _watched(uid: int = 1000) -> TrackedJob:
    """An mp.spawn job: its two children are the ranks, the parent its launcher."""
    found = FoundJob(("127.0.0.1", 29500), "127.0.0.1-29500", "MASTER_ADDR:MASTER_PORT", uid,
                     ranks=list(CHILDREN), launchers=[PARENT],
                     started={PARENT: TICKS, CHILDREN[0]: TICKS + 1, CHILDREN[1]: TICKS + 2})
    return TrackedJob(found, "job", "alice", 0.0)


def _alone(pid: int = PARENT, uid: int = 1000, ticks: int = TICKS) -> FoundJob:
    return FoundJob(("python", pid), f"python-{pid}", "launcher", uid, ranks=[pid],
                    started={pid: ticks})


@pytest.mark.parametrize(("found", "hidden"), [
    (_alone(), True),  # the launcher itself, found alone
    (_alone(uid=1001), False),  # another user's process with that pid: never hidden
    (_alone(ticks=TICKS + 99), False),  # the pid reused by a new process
    (_alone(pid=CHILDREN[0]), False),  # a rank is no launcher
    (_alone(pid=999), False),  # an unrelated process
])
def test_only_a_watched_jobs_own_launcher_found_alone_is_no_job_of_its_own(
        found: FoundJob, hidden: bool) -> None:
    tracker = SimpleNamespace(jobs={"alice/job": _watched()})
    assert JobTracker._launches_a_watched_job(tracker, found) is hidden  # type: ignore[arg-type]
