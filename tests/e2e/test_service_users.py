"""The node service on a node shared by two ordinary users: a job belongs to its user.

User A trains; user B, who can set any environment variable in processes of their
own, copies A's rendezvous id or master address into Python processes that map
the real libtorch, makes them fail, restarts them, and starts twenty of them. The
real `perfmon-agent serve` (as root) must keep A's job A's: its ranks, its one
session, its exit cause, its Prometheus series, and a slot for A's next job.

One service runs for the module (its config reloaded between tests with SIGHUP).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TRAIN_GPT, _reap, wait_for
from tests.e2e.test_security import job_user, other_user  # noqa: F401  (the two users)
from tests.e2e.test_service import SCAN_S, TAG, Service, ended, rank_pids, record, summaries
from tests.prom import free_port

pytestmark = [pytest.mark.usefixtures("ebpf"),
              pytest.mark.long(reason=("two users' jobs under the node service: 200 short-lived "
                                       "processes, 20 fake jobs and real ranks"))]

_TORCH = importlib.util.find_spec("torch")
assert _TORCH is not None and _TORCH.submodule_search_locations
LIBTORCH = Path(_TORCH.submodule_search_locations[0]) / "lib" / "libtorch_cpu.so"
# A Python process that maps the real libtorch (every symbol the probes need) and never
# trains: what a user can start in a second, as often as they like.
FAKE = ("import ctypes, sys, time; ctypes.CDLL(sys.argv[1]); time.sleep(float(sys.argv[2])); "
        "sys.exit(int(sys.argv[3]))")


class UserJobs:
    """Processes started as one ordinary user, in a folder of theirs; always reaped."""

    def __init__(self, user: pwd.struct_passwd) -> None:
        self.user = user
        self.home = Path(tempfile.mkdtemp(prefix=f"perfmon-{user.pw_name}-", dir="/tmp"))
        os.chown(self.home, user.pw_uid, user.pw_gid)
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(
            ["setpriv", f"--reuid={self.user.pw_uid}", f"--regid={self.user.pw_gid}",
             "--init-groups", *argv],
            env={"PATH": os.environ["PATH"], "HOME": str(self.home), **(env or {})},
            cwd=self.home, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        self.procs.append(proc)
        return proc

    def fake(self, seconds: float, exit_code: int = 0, **env: str) -> subprocess.Popen:
        return self.start([sys.executable, "-c", FAKE, str(LIBTORCH), str(seconds),
                           str(exit_code), TAG], env)

    def torchrun(self, run_id: str, *args: str) -> subprocess.Popen:
        return self.start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                           "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id,
                           str(TRAIN_GPT), "--ddp", "--tag", TAG, *args])

    def python(self, *args: str, env: dict[str, str]) -> subprocess.Popen:
        return self.start([sys.executable, str(TRAIN_GPT), "--tag", TAG, *args], env)

    def close(self) -> None:
        for proc in self.procs:
            _reap(proc)
        shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service(tmp_path_factory.mktemp("serve-users"))
    try:
        wait_for(lambda: "READY=1" in svc.received() or svc.proc.poll() is not None, 30,
                 "READY=1")
        assert svc.proc.poll() is None, svc.log()
        yield svc
    finally:
        svc.close()


@pytest.fixture
def alice(job_user: pwd.struct_passwd) -> Iterator[UserJobs]:  # noqa: F811
    jobs = UserJobs(job_user)
    yield jobs
    jobs.close()


@pytest.fixture
def bob(other_user: pwd.struct_passwd) -> Iterator[UserJobs]:  # noqa: F811
    jobs = UserJobs(other_user)
    yield jobs
    jobs.close()


def reconfigure(service: Service, **config: Any) -> None:
    """Reload the module's service with ``config`` over its base config."""
    marker = "configuration reloaded"
    before = service.log().count(marker)
    service.write_config({**service.config, **config})
    service.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: service.log().count(marker) > before, 10, "the reload")


def job_series(text: str, name: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample with job label ``name``: (metric, labels, value)."""
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.labels.get("job") == name]


def folders_of(service: Service, user: pwd.struct_passwd) -> list[Path]:
    found = []
    for path in service.jobs_root.glob("*/*/job.json"):
        try:
            if json.loads(path.read_text()).get("uid") == user.pw_uid:
                found.append(path.parent)
        except ValueError:
            continue  # being replaced
    return found


def assert_only_alices(folder: Path, pids: list[int], alice_user: pwd.struct_passwd) -> None:
    job = record(folder)
    assert job["uid"] == alice_user.pw_uid and job["user"] == alice_user.pw_name
    assert sorted(r["pid"] for r in job["ranks"]) == sorted(pids)
    for segment in job["segments"]:
        assert sorted(segment["pids"]) == sorted(pids), segment


def test_another_users_process_with_the_run_id_never_joins_ends_or_fails_the_job(
        service: Service, alice: UserJobs, bob: UserJobs) -> None:
    run_id = f"shared-run-{uuid.uuid4().hex[:6]}"
    launcher = alice.torchrun(run_id, "--train-iters", "500")
    pids = rank_pids(launcher, 2)
    folder = service.job_folder(pids[0])
    name = record(folder)["name"]
    wait_for(lambda: list(folder.glob("perf_summary_*.json")), 60, "A's first summary")

    # B: rank 0 with A's run id that stays; rank 1 that fails with exit code 1; and a
    # process that comes and goes four times.
    squatter = bob.fake(600, TORCHELASTIC_RUN_ID=run_id, RANK="0", WORLD_SIZE="2")
    failing = bob.fake(3, 1, TORCHELASTIC_RUN_ID=run_id, RANK="1", WORLD_SIZE="2")
    for _ in range(4):
        flapping = bob.fake(2 * SCAN_S, TORCHELASTIC_RUN_ID=run_id, RANK="1")
        assert flapping.wait(timeout=30) == 0
    assert failing.wait(timeout=30) == 1
    # B's processes make a job of B's own, in a folder of its own, with B's label set.
    bob_folder = service.job_folder(squatter.pid)
    assert bob_folder != folder and record(bob_folder)["user"] == bob.user.pw_name
    assert record(bob_folder)["job_id"] == record(folder)["job_id"]

    # A's series are A's: two processes, A's user label, A's rank 0 with A's memory.
    def alices_memory() -> float | None:
        series = job_series(service.metrics(), name)
        assert {labels["user"] for _, labels, _ in series} <= {alice.user.pw_name,
                                                               bob.user.pw_name}
        info = [labels for metric, labels, _ in series if metric == "perfmon_job_info"
                and labels["user"] == alice.user.pw_name]
        assert [i["processes"] for i in info] in ([], ["2"]), info
        return next((v for metric, labels, v in series if metric == "perfmon_memory_bytes"
                     and labels["user"] == alice.user.pw_name and labels["rank"] == "0"
                     and labels["kind"] == "rss"), None)
    # (the figures come with each summary the session writes: every 15 s, or 200 x the
    # time a write takes when that is longer, as it is on a busy 2-core machine)
    assert wait_for(alices_memory, 60, "A's rank 0 memory") > 100 * 2**20
    squatter.kill()
    squatter.wait()

    job = wait_for(lambda: ended(folder), 180, "A's job to end")
    assert_only_alices(folder, pids, alice.user)
    [segment] = job["segments"]  # never restarted, never ranks_changed
    assert segment["end_reason"] == "target_exited" and segment["cause"] is None
    [summary] = summaries(folder)
    info = summary["session_info"]
    assert sorted(info["pids"]) == sorted(pids) and info["exit"]["cause"] is None
    assert info["job"]["user"] == alice.user.pw_name
    assert info["total_iterations"] > 100
    assert "rank 1" not in service.log().split(f"job {name} ({alice.user.pw_name})")[-1]


def test_another_users_process_with_the_master_address_never_joins_or_fails_the_job(
        service: Service, alice: UserJobs, bob: UserJobs) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [alice.python("--train-iters", "600", env={**env, "RANK": str(r)})
             for r in (0, 1)]
    folder = wait_for(lambda: next((f for f in folders_of(service, alice.user)
                                    if sorted(r["pid"] for r in record(f).get("ranks") or [])
                                    == sorted(p.pid for p in ranks)), None), 60, "A's job")
    failing = bob.fake(4, 1, **env, RANK="1")
    # And A's own strays: a second rank 1, a rank 7 of a world of 2. Neither fits the
    # job (a live rank holds 1; 7 is beyond its world): no new session.
    strays = [alice.fake(3 * SCAN_S, **env, RANK=rank) for rank in ("1", "7")]
    assert failing.wait(timeout=30) == 1
    assert [p.wait(timeout=30) for p in strays] == [0, 0]
    time.sleep(2 * SCAN_S)
    assert record(folder)["status"] == "running"
    job = wait_for(lambda: ended(folder), 180, "A's job to end")
    assert_only_alices(folder, [p.pid for p in ranks], alice.user)
    [segment] = job["segments"]
    assert segment["cause"] is None and job["id_from"] == "MASTER_ADDR:MASTER_PORT"
    [summary] = summaries(folder)
    assert summary["session_info"]["exit"]["cause"] is None


def attach_line(service: Service, pid: int) -> bool:
    return re.search(rf"attaching to \d+ rank\(s\) \(ranks [-\d,]+; pids ([\d,]*,)?{pid}[,)]",
                     service.log()) is not None


def test_twenty_fake_jobs_of_one_user_leave_slots_for_another_users_job(
        service: Service, alice: UserJobs, bob: UserJobs) -> None:
    fakes = [bob.fake(600) for _ in range(20)]
    # B gets max_jobs_per_user (8) of the 16 slots; the rest of B's wait, said once each.
    wait_for(lambda: sum(attach_line(service, p.pid) for p in fakes) >= 8, 120,
             "eight of B's fakes to be attached")
    wait_for(lambda: service.log().count("(max_jobs_per_user)") >= 12, 3 * SCAN_S + 5,
             "the other twelve to wait")
    time.sleep(2 * SCAN_S)
    assert sum(attach_line(service, p.pid) for p in fakes) == 8
    # Sessions start their probes one at a time (bcc's compiler: ~2 s each here, and
    # the summary is published once they run): A's job starts once B's eight measure,
    # or its own measure begins behind theirs (83 of 400 iterations once in CI).
    attached = [p for p in fakes if attach_line(service, p.pid)]
    wait_for(lambda: all(any(service.job_folder(p.pid).glob("perf_summary_*.json"))
                         for p in attached), 120, "B's eight sessions to be measuring")
    job = alice.python("--train-iters", "400", env={})
    wait_for(lambda: "libtorch_cpu" in open(f"/proc/{job.pid}/maps").read(), 60,
             "A's job to load PyTorch", interval_s=0.05)
    loaded_s = time.monotonic()
    wait_for(lambda: attach_line(service, job.pid), SCAN_S + 3, "A's job to be attached",
             interval_s=0.05)
    assert time.monotonic() - loaded_s <= SCAN_S + 1.0
    folder = service.job_folder(job.pid)
    done = wait_for(lambda: ended(folder), 180, "A's job to end")
    assert done["segments"][0]["iterations"] > 100
    for fake in fakes:
        fake.kill()


def test_a_job_without_iterations_yields_its_slot_to_a_waiting_job(
        service: Service, alice: UserJobs, bob: UserJobs) -> None:
    reconfigure(service, max_jobs=2, max_jobs_per_user=2, idle_yield_s=10)
    try:
        fakes = [bob.fake(600) for _ in range(2)]
        wait_for(lambda: all(attach_line(service, p.pid) for p in fakes), 60,
                 "B's two fakes to take both slots")
        job = alice.python(env={})  # trains until it is ended
        wait_for(lambda: "not watched: 2 jobs are (max_jobs)" in service.log(), 30,
                 "A's job to wait")
        waited_s = time.monotonic()
        wait_for(lambda: attach_line(service, job.pid), 40, "A's job to get a slot")
        # The fakes had trained for no iteration in 10 s: one of them yields.
        assert time.monotonic() - waited_s <= 10 + 3 * SCAN_S + 5
        wait_for(lambda: [f for f in folders_of(service, bob.user)
                          if any(s.get("end_reason") == "yielded"
                                 for s in record(f)["segments"])], 30,
                 "a segment of B's that ended as yielded")
        assert "its slot goes to a waiting job" in service.log()
        folder = service.job_folder(job.pid)
        wait_for(lambda: [s for s in summaries(folder)
                          if s["session_info"]["total_iterations"] > 20], 60,
                 "A's job to be measured")
        for proc in (job, *fakes):
            proc.kill()
    finally:
        reconfigure(service)


# Values a user can give any job variable: a Unicode digit ('²'.isdigit() is true and
# int('²') raises), another script's digit, signs, 10^30, empty, 100 KB.
HOSTILE_NUMBERS = ("²", "٣", "-1", "+3", " 1", str(10**30), "", "9" * 100_000)
# Read with RANK set (torchrun's) and without (srun's: SLURM_PROCID, SLURM_NTASKS).
TORCH_NUMBER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_JOB_ID",
                     "SLURM_STEP_ID", "SLURM_NODEID")
SLURM_NUMBER_KEYS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS",
                     "SLURM_NODEID")


def test_job_variables_of_any_value_never_end_the_service_or_another_users_job(
        service: Service, alice: UserJobs, bob: UserJobs, agent, tmp_path: Path) -> None:
    stamps = alice.home / "stamps"
    job = alice.python("--train-iters", "400", "--timestamps", str(stamps), env={})
    folder = service.job_folder(job.pid)
    fakes = [bob.fake(600, **{key: value for key in keys})
             for value in HOSTILE_NUMBERS for keys in (TORCH_NUMBER_KEYS, SLURM_NUMBER_KEYS)]
    wait_for(lambda: sum(attach_line(service, p.pid) for p in fakes) >= 8, 120,
             "B's processes to be scanned and attached (max_jobs_per_user)")
    # attach and doctor of such a process: no traceback, no crash.
    for command in (("doctor", "--pid"), ("attach", "--duration", "2", "--output-dir",
                                          str(tmp_path), "--pid")):
        done = agent.run(*command, str(fakes[0].pid))
        assert "Traceback" not in done.stderr and done.returncode in (0, 1, 3), done.stderr
    done = wait_for(lambda: ended(folder), 180, "A's job to end")
    assert service.proc.poll() is None, service.log()
    assert "Traceback" not in service.log() and "scan failed" not in service.log()
    [segment] = done["segments"]
    assert segment["end_reason"] == "target_exited"
    [summary] = summaries(folder)
    info = summary["session_info"]
    lo, hi = info["attach_monotonic_ns"], info["detach_monotonic_ns"]
    truth = [t for line in stamps.read_text().splitlines()
             if lo <= (t := int(line.split()[1])) <= hi]
    assert len(truth) > 100 and abs(info["total_iterations"] - len(truth)) <= 1
    for fake in fakes:
        fake.kill()


def uprobe_events(pid: int) -> list[str]:
    """The uprobe events process ``pid`` made (libbcc names them ..._bcc_PID, the tracefs
    backend puts them in its group perfmon_PID): the agents of tests running beside
    this one make their own."""
    mine = re.compile(rf"(_bcc_{pid}\b|^[pr]\w*:perfmon_{pid}/)")
    return [line for root in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
            if os.path.exists(f"{root}/uprobe_events")
            for line in Path(f"{root}/uprobe_events").read_text().splitlines()
            if mine.search(line)]


def test_short_lived_processes_leave_no_uprobe_event_behind(
        bob: UserJobs, tmp_path: Path) -> None:
    """100 processes of an ordinary user that map libtorch and exit 0.3-5 s later, many of
    them while the service attaches (libbcc then makes a tracefs event it never removes):
    once the service stops, no uprobe event of its own is left (ten waves of ten, each
    wave's exits meeting the attaches of the wave before)."""
    svc = Service(tmp_path, scan_interval_s=0.5, max_jobs=32, max_jobs_per_user=32)
    try:
        wait_for(lambda: "READY=1" in svc.received() or svc.proc.poll() is not None, 30,
                 "READY=1")
        assert svc.proc.poll() is None, svc.log()
        started_s, cpu = time.monotonic(), psutil.Process(svc.proc.pid).cpu_times()
        lifetimes = [0.3 + 4.7 * ((i * 37) % 100) / 100 for i in range(100)]
        for wave in range(0, 100, 10):
            for seconds in lifetimes[wave:wave + 10]:
                bob.fake(seconds)
            time.sleep(1.5)
            assert svc.proc.poll() is None, svc.log()
        for proc in bob.procs:
            proc.wait(timeout=60)
        time.sleep(3)
        now = psutil.Process(svc.proc.pid).cpu_times()
        used_s = sum(now[:4]) - sum(cpu[:4])  # user, system, and reaped children's
        print(f"churn: {used_s / (time.monotonic() - started_s):.0%} of a core; "
              f"{svc.log().count('attaching to')} attaches, "
              f"{svc.log().count('No such process')} refused by the kernel mid-attach")
        assert svc.log().count("attaching to") > 20, svc.log()  # it did attach to many
    finally:
        svc.close()
    assert uprobe_events(svc.proc.pid) == []
