"""Jobs started by Slurm, found and named by the node service: real slurmctld, slurmd and
munged (Debian's packages, installed by `make test`), started here with a
configuration written for this machine (one node), and jobs submitted as an ordinary
user: an `srun -n 2` job whose ranks come from SLURM_PROCID (no torchrun) and an
`sbatch --wrap "torchrun ..."` job.

The service names each job by its Slurm id (its folder and `job` label) and records
the few Slurm variables it reads, nothing else of the environment.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests import eventlogs
from tests.conftest import SUMMARY_SCHEMA, TRAIN_GPT, _reap, wait_for
from tests.e2e.test_security import job_user  # noqa: F401  (the unprivileged job user)
from tests.e2e.test_service import Service
from tests.prom import free_port

pytestmark = [pytest.mark.usefixtures("ebpf"),
              pytest.mark.long(reason=("real slurmctld, slurmd and munged started, and jobs run "
                                       "through them"))]

TAG = f"slurm-test-{uuid.uuid4().hex[:8]}"
CLUSTER = f"perfmon{uuid.uuid4().hex[:6]}"  # a variable the agent must not store
JOB_NAME = "pretrain llama"
MODEL = ("--num-layers", "1", "--hidden-size", "64", "--seq-length", "32", "--device-ms",
         "40", "--train-iters", "400", "--tag", TAG)
DAEMONS = ("munged", "slurmctld", "slurmd")


def _binary(name: str) -> str:
    for folder in ("/usr/sbin", "/usr/bin"):
        if os.access(f"{folder}/{name}", os.X_OK):
            return f"{folder}/{name}"
    pytest.fail(f"{name} is missing: `make test` installs Debian's slurmctld, slurmd, "
                "slurm-client and munge (TEST_DEB_PACKAGES in the Makefile)")


class SlurmCluster:
    """munged, slurmctld and slurmd of our own, on a configuration of our own."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.host = socket.gethostname()
        self.conf = folder / "slurm.conf"
        self.munge_socket = folder / "munge" / "munge.socket"
        self.procs: list[subprocess.Popen] = []
        for sub in ("state", "spool", "munge", "log"):
            (folder / sub).mkdir(mode=0o755)
        self.conf.write_text("\n".join([
            f"ClusterName={CLUSTER}", f"SlurmctldHost={self.host}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin", "MpiDefault=none", "ReturnToService=2",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            # (the node's 2 CPUs would run one job at a time; these ranks mostly wait)
            "SlurmdParameters=config_overrides",
            f"NodeName={self.host} CPUs=8 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            ""]))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        munge_key = Path("/etc/munge/munge.key")
        if not munge_key.exists():
            pytest.fail("/etc/munge/munge.key is missing: Debian's munge package makes it")
        # munged as root, on a socket of ours (never the system's munged).
        self._spawn([_binary("munged"), "--foreground", "--force",
                     f"--socket={self.munge_socket}", f"--key-file={munge_key}",
                     f"--pid-file={self.folder / 'munge' / 'munged.pid'}",
                     f"--log-file={self.folder / 'log' / 'munged.log'}",
                     f"--seed-file={self.folder / 'munge' / 'munged.seed'}"])
        wait_for(self.munge_socket.exists, 20, "munged's socket")
        os.chmod(self.munge_socket.parent, 0o755)
        self._spawn([_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn([_binary("slurmd"), "-D", "-f", str(self.conf)])
        wait_for(lambda: "idle" in self.run("sinfo", "-h", "-o", "%t").stdout, 60,
                 "the Slurm node to be idle", interval_s=0.5)

    def _spawn(self, argv: list[str]) -> None:
        log = (self.folder / "log" / f"{Path(argv[0]).name}.out").open("wb")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                           env=self.env, start_new_session=True))

    def run(self, *argv: str, user: str | None = None) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", user, "--"] if user else []
        return subprocess.run([*prefix, _binary(argv[0]), *argv[1:]], env=self.env,
                              capture_output=True, text=True, timeout=60, check=False,
                              cwd=self.folder)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted((self.folder / "log").iterdir()))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            _reap(proc)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    folder = Path(tempfile_dir(tmp_path_factory))
    cluster = SlurmCluster(folder)
    try:
        cluster.start()
        yield cluster
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()


def tempfile_dir(factory: pytest.TempPathFactory) -> Path:
    """A folder every user may read (the job's user reads the config and writes its
    output there)."""
    folder = factory.mktemp("slurm")
    folder.chmod(0o755)
    for parent in folder.parents:
        if parent == Path("/tmp"):
            break
        parent.chmod(parent.stat().st_mode | 0o005)
    return folder


def _summary(folder: Path) -> dict[str, Any]:
    (path,) = folder.glob("perf_summary_*.json")
    summary: dict[str, Any] = json.loads(path.read_text())
    jsonschema.validate(summary, SUMMARY_SCHEMA)
    return summary


def test_srun_and_sbatch_jobs_are_found_named_by_their_slurm_id_with_its_fields(
        slurm: SlurmCluster, job_user: pwd.struct_passwd, tmp_path: Path) -> None:  # noqa: F811
    service_folder = tmp_path / "serve"
    service_folder.mkdir()
    service = Service(service_folder, include={"commands": [re.escape(TAG)]},
                      attach={"log_interval": 10, "iteration_source": "uprobe",
                              "stack_sampling": False})
    work = slurm.folder / "work"  # the job's user's working folder
    work.mkdir()
    os.chown(work, job_user.pw_uid, job_user.pw_gid)
    srun = None
    try:
        service.wait_ready()
        # srun: two tasks, their ranks from SLURM_PROCID (train_gpt sets RANK from it).
        srun = subprocess.Popen(
            ["runuser", "-u", job_user.pw_name, "--", _binary("srun"), "-n", "2",
             "--job-name", JOB_NAME, f"--export=ALL,MASTER_ADDR=127.0.0.1,"
             f"MASTER_PORT={free_port()}", sys.executable, str(TRAIN_GPT), "--ddp", *MODEL],
            env=slurm.env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        # sbatch: torchrun inside a batch script.
        submitted = slurm.run(
            "sbatch", "--job-name", JOB_NAME, "-n", "1", "-c", "2", "-o", str(work / "%j.out"),
            "--wrap", f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 "
            f"{TRAIN_GPT} --ddp {' '.join(MODEL)}", user=job_user.pw_name)
        assert submitted.returncode == 0, submitted.stderr + slurm.logs()
        batch_id = int(re.search(r"Submitted batch job (\d+)", submitted.stdout)[1])
        # While it runs, its metrics carry its Slurm id.
        info = rf'perfmon_job_info{{[^}}\n]*job="slurm-{batch_id}"[^}}\n]*slurm_job_id="{batch_id}"'
        wait_for(lambda: re.search(info, service.metrics()), 90, "the batch job's metrics")
        try:
            # (until both jobs ended: their summaries and logs are final then)
            jobs = wait_for(lambda: _slurm_jobs(service, 2), 180, "both Slurm jobs to end")
        except BaseException:
            print(slurm.logs())
            raise
        names = sorted(jobs)
        srun_name = next(n for n in names if "." in n)
        srun_id = int(srun_name.split("-")[1].split(".")[0])
        assert names == sorted([f"slurm-{batch_id}", f"slurm-{srun_id}.0"]), names
        for name, (folder, record) in jobs.items():
            step = 0 if name == srun_name else None
            job_id = srun_id if name == srun_name else batch_id
            # jobs_root/<host>/<name>.<user>.<start>/
            assert folder.name.startswith(f"{name}.{job_user.pw_name}."), folder
            assert record["id_from"] == "SLURM_JOB_ID" and record["user"] == job_user.pw_name
            assert record["slurm"] == {"job_id": job_id, "step_id": step,
                                       "user": job_user.pw_name, "job_name": JOB_NAME,
                                       "partition": "debug"}, record
            summary = _summary(folder)
            assert summary["session_info"]["job"]["slurm"] == record["slurm"]
            assert summary["session_info"]["ranks"] == [0, 1]
            # Nothing of Slurm's environment beyond the allowlist: not the cluster's
            # name, not the submit folder, in any file the service wrote.
            texts = [p.read_bytes().decode("utf-8", "replace") for p in folder.glob("*.json")]
            for log in folder.glob("perf_events_*"):
                texts.append(json.dumps(eventlogs.read_records(log), default=str))
            for text in texts:
                assert CLUSTER not in text and str(work) not in text

    finally:
        if srun is not None:
            _reap(srun)
        slurm.run("scancel", "--user", job_user.pw_name)
        service.close()
        shutil.rmtree(work, ignore_errors=True)


def _slurm_jobs(service: Service, count: int) -> dict[str, tuple[Path, dict[str, Any]]] | None:
    found = {}
    for path in service.jobs_root.glob("*/*/job.json"):
        try:
            record = json.loads(path.read_text())
        except ValueError:
            return None
        if record.get("id_from") == "SLURM_JOB_ID" and record.get("status") == "ended":
            found[record["job_id"]] = (path.parent, record)
    time.sleep(0.5)
    return found if len(found) >= count else None
