"""Ranks are the processes that train, whatever launched them: find_jobs
(perfmon.agent.daemon.jobs) on synthetic scans, for the shapes that need another launcher
or PyTorch (real jobs of each shape: tests/e2e/test_spawn_ranks.py)."""

from __future__ import annotations

import pytest
from perfmon.agent.daemon.jobs import FoundJob, find_jobs
from perfmon.parsers.procfs import ContainerIds
from perfmon.probes.discovery import DATA_WORKER, ProcessInfo, Snapshot, _Known

SPAWN_CHILD = ["python", "-c", "from multiprocessing.spawn import spawn_main; "
               "spawn_main(tracker_fd=5, pipe_handle=7)", "--multiprocessing-fork"]


class Scan(Snapshot):
    """A scan of made-up processes (pids beyond pid_max: nothing of /proc is theirs)
    whose main threads' business is said, not measured (``busy``)."""

    def __init__(self) -> None:
        super().__init__({})
        self.cpu_busy: dict[int, bool | None] = {}

    def add(self, pid: int, ppid: int, argv: list[str], *, env: dict[str, str] | None = None,
            torch: bool = True, trains: str | None = None, comm: str = "python",
            busy: bool | None = None) -> None:
        info = ProcessInfo(pid, ppid, pid, comm, 1000)  # (started in pid order)
        self.processes[pid] = info
        self.children.setdefault(ppid, []).append(pid)
        self._known[info.key] = _Known(python=True, torch=torch, environ=env or {},
                                       cmdline=argv, container=(ContainerIds(), None),
                                       trains=trains)
        self.cpu_busy[pid] = busy

    def busy(self, pid: int, since_s: float) -> bool | None:
        return self.cpu_busy.get(pid)

    def jobs(self) -> list[FoundJob]:
        return find_jobs(self, lambda _cmd, _uid: True,
                         lambda pid, err: (_ for _ in ()).throw(AssertionError((pid, err))))


P = 5_000_000  # pids no process has (pid_max is at most 4194304)
LAUNCHED = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "3",
            "NODE_RANK": "0"}


def test_lightning_ddp_rank_0_starts_the_others_and_all_three_are_ranks() -> None:
    """Lightning's ``ddp`` strategy: the script is rank 0 and starts ranks 1 and 2 as
    ``python train.py`` with LOCAL_RANK (no RANK); all three join one process group.
    Rank 0's DataLoader worker is no rank."""
    scan = Scan()
    scan.add(P, 1, ["python", "train.py"], trains="threads")
    for i in (1, 2):
        scan.add(P + i, P, ["python", "train.py"], env={**LAUNCHED, "LOCAL_RANK": str(i)},
                 trains="threads")
    scan.add(P + 3, P, ["python", "train.py"], comm=DATA_WORKER)
    [job] = scan.jobs()
    assert job.ranks == [P, P + 1, P + 2] and job.launchers == []
    assert job.numbered and job.rank_of == {P: 0, P + 1: 1, P + 2: 2}
    assert job.ready and job.id_from == "MASTER_ADDR:MASTER_PORT"
    assert job.name == "10.0.0.1-29500"


@pytest.mark.parametrize("parent_busy", [True, False])
def test_without_thread_names_a_busy_parent_trains_and_an_idle_one_launches(
        parent_busy: bool) -> None:
    """PyTorch before 2.2 names no threads: two children with PyTorch say nothing. A
    parent busy while they are there trains (they work for it); an idle one waits in
    join, and its children are the ranks, attached after rank_wait_s (not ready)."""
    scan = Scan()
    scan.add(P, 1, ["python", "train.py"], busy=parent_busy)
    scan.add(P + 1, P, SPAWN_CHILD)
    scan.add(P + 2, P, SPAWN_CHILD)
    [job] = scan.jobs()
    if parent_busy:
        assert job.ranks == [P] and job.launchers == [] and job.ready
    else:
        assert job.ranks == [P + 1, P + 2] and job.launchers == [P]
        assert job.rank_of == {P + 1: 0, P + 2: 1} and not job.ready
        assert job.expected == 3


def test_a_parent_not_yet_measured_waits_and_is_no_rank_meanwhile() -> None:
    """The first scan that sees the children cannot say yet how busy the parent is
    while they are there: the job is not ready (nothing attached on a guess)."""
    scan = Scan()
    scan.add(P, 1, ["python", "train.py"], busy=None)
    scan.add(P + 1, P, SPAWN_CHILD, torch=False)  # (still importing PyTorch)
    [job] = scan.jobs()
    assert not job.ready


def test_a_launcher_whose_ranks_exited_is_no_rank_unless_it_trains_since() -> None:
    scan = Scan()
    scan.add(P, 1, ["python", "train.py"], busy=False)
    scan.add(P + 1, P, SPAWN_CHILD, trains="threads")
    [job] = scan.jobs()
    assert job.ranks == [P + 1] and job.launchers == [P]
    # Its child exits: the parent, returning from join, is alone.
    del scan.processes[P + 1]
    scan.children[P] = []
    [job] = scan.jobs()
    assert job.ranks == [] and job.launchers == [P] and not job.ready
    scan.cpu_busy[P] = True  # it trains itself now
    [job] = scan.jobs()
    assert job.ranks == [P] and job.launchers == [] and job.ready


def test_torchrun_and_srun_keep_their_rules() -> None:
    """torchrun (its ranks carry RANK; a rank's DataLoader workers inherit it and are
    no ranks) and a task srun started with DataLoader workers (SLURM_PROCID, the step's
    tasks on this node)."""
    scan = Scan()
    run = {"TORCHELASTIC_RUN_ID": "r42", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    scan.add(P, 1, ["python", "-m", "torch.distributed.run", "train.py"], comm="pt_elastic")
    scan.add(P + 1, P, ["python", "train.py"], env={**run, "RANK": "1"})
    scan.add(P + 2, P, ["python", "train.py"], env={**run, "RANK": "0"})
    scan.add(P + 3, P + 2, ["python", "train.py"], env={**run, "RANK": "0"}, comm=DATA_WORKER)
    srun = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3",
            "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    scan.add(P + 10, 1, ["python", "train.py"], env=srun)
    scan.add(P + 11, P + 10, ["python", "train.py"], env=srun, comm=DATA_WORKER)
    torchrun, slurm = sorted(scan.jobs(), key=lambda j: j.name)
    assert torchrun.name == "r42" and torchrun.launchers == [P]
    assert torchrun.ranks == [P + 2, P + 1] and torchrun.rank_of == {P + 1: 1, P + 2: 0}
    assert not torchrun.numbered and torchrun.ready
    assert slurm.name == "slurm-77.0" and slurm.ranks == [P + 10]
    assert slurm.rank_of == {P + 10: 3} and slurm.expected == 2 and not slurm.ready
