"""A rank in a Kubernetes pod, as the node service sees it: the test makes the cgroup v2
hierarchy a kubelet makes (systemd driver, burstable QoS, containerd), moves a real
training process into it, sets the downward API's POD_NAME and POD_NAMESPACE as a pod
spec would, and reads the job's record, summary and metrics. (The DaemonSet that runs
the agent: docs/deploy, tests/unit/test_deploy.py.)"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from perfmon.probes.discovery import ProcessScan
from perfmon.probes.procfs import TargetProcess, container_of, target_job

from tests.conftest import SUMMARY_SCHEMA, TRAIN_GPT, Target, _reap, wait_for
from tests.e2e.test_security import other_user  # noqa: F401  (an ordinary user)
from tests.e2e.test_service import Service

pytestmark = pytest.mark.usefixtures("ebpf")

TAG = f"k8s-test-{uuid.uuid4().hex[:8]}"


def cgroup2_mount() -> Path:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or .../unified on a
    hybrid host); a failure, not a skip, where there is none."""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return Path(fields[1])
    pytest.fail("no cgroup v2 hierarchy is mounted: mount -t cgroup2 none /sys/fs/cgroup")


@pytest.fixture
def pod_cgroup() -> Iterator[tuple[str, str, Path]]:
    """(pod UID, container id, the container's cgroup), made as a kubelet and containerd
    name them, and removed after (the folders this test made only)."""
    pod_uid, container_id = str(uuid.uuid4()), secrets.token_hex(32)
    root = cgroup2_mount()
    parts = ["kubepods.slice", "kubepods-burstable.slice",
             f"kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice",
             f"cri-containerd-{container_id}.scope"]
    made = []
    path = root
    for part in parts:
        path = path / part
        if not path.exists():
            path.mkdir()
            made.append(path)
    try:
        yield pod_uid, container_id, path
    finally:
        for folder in reversed(made):
            for pid in (folder / "cgroup.procs").read_text().split():
                try:  # (anything left: back to the root, so the folder can go)
                    (root / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            folder.rmdir()


def test_a_rank_in_a_pod_has_its_pod_uid_container_id_and_names_in_its_record(
        pod_cgroup: tuple[str, str, Path], tmp_path: Path) -> None:
    pod_uid, container_id, cgroup = pod_cgroup
    (tmp_path / "serve").mkdir()
    service = Service(tmp_path / "serve", include={"commands": [re.escape(TAG)]},
                      attach={"log_interval": 10, "iteration_source": "uprobe",
                              "stack_sampling": False})
    stamps = tmp_path / "stamps.txt"
    job = None
    try:
        service.wait_ready()
        # The pod's container process: the downward API's variables in its environment.
        # It is moved into the container's cgroup at once, long before it loads PyTorch
        # (seconds), as it would be there from its start.
        job = subprocess.Popen(
            [sys.executable, str(TRAIN_GPT), "--tag", TAG, "--timestamps", str(stamps)],
            env={"PATH": "/usr/bin:/bin", "POD_NAME": "trainer-0",
                 "POD_NAMESPACE": "ml-team", "POD_SECRET_TOKEN": "not-for-the-agent"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        (cgroup / "cgroup.procs").write_text(str(job.pid))
        assert f"0::/{cgroup.relative_to(cgroup2_mount())}" in Path(
            f"/proc/{job.pid}/cgroup").read_text()
        Target(job, stamps).wait_for_iterations(3)
        folder = service.job_folder(job.pid)
        record = json.loads((folder / "job.json").read_text())
        assert record["container_id"] == container_id
        assert record["pod"] == {"uid": pod_uid, "name": "trainer-0", "namespace": "ml-team"}
        summary = wait_for(lambda: next(iter(folder.glob("perf_summary_*.json")), None), 60,
                           "the job's summary")
        document = json.loads(summary.read_text())
        jsonschema.validate(document, SUMMARY_SCHEMA)
        job_info = document["session_info"]["job"]
        assert job_info["pod"] == record["pod"] and job_info["container_id"] == container_id
        # The metrics name the pod, in the job's one info series.
        wait_for(lambda: re.search(r'perfmon_job_info{[^}]*namespace="ml-team",pod="trainer-0"',
                                   service.metrics()), 30, "the pod in perfmon_job_info")
        # Nothing of the environment beyond the variables the agent reads.
        for path in folder.rglob("*"):
            assert path.is_dir() or b"not-for-the-agent" not in path.read_bytes()
    finally:
        if job is not None:
            _reap(job)
        service.close()


def test_a_pod_named_in_a_cgroup_a_user_made_is_no_pod(other_user) -> None:  # noqa: F811
    """A user delegated a cgroup subtree names a folder in it as a kubelet would and sets
    the downward API's variables: no pod UID, no pod name or namespace (they would label
    the metrics of a pod the user does not run). A folder root made: the pod."""

    root = cgroup2_mount()
    delegated = root / f"perfmon-test-delegated-{uuid.uuid4().hex[:6]}"
    pod_uid = str(uuid.uuid4())
    claimed = delegated / f"kubepods-besteffort-pod{pod_uid.replace('-', '_')}.slice"
    delegated.mkdir()
    proc = None
    try:
        os.chown(delegated, other_user.pw_uid, other_user.pw_gid)
        subprocess.run(["setpriv", f"--reuid={other_user.pw_uid}",
                        f"--regid={other_user.pw_gid}", "--clear-groups", "mkdir",
                        str(claimed)], check=True)
        proc = subprocess.Popen(
            ["setpriv", f"--reuid={other_user.pw_uid}", f"--regid={other_user.pw_gid}",
             "--clear-groups", sys.executable, "-c", "import time; time.sleep(60)"],
            env={"POD_NAME": "victim-0", "POD_NAMESPACE": "prod"}, start_new_session=True)
        (claimed / "cgroup.procs").write_text(str(proc.pid))
        assert "kubepods-besteffort-pod" in Path(f"/proc/{proc.pid}/cgroup").read_text()
        assert container_of(proc.pid).pod_uid is None
        snapshot = ProcessScan().scan(0.0)
        assert snapshot.container(proc.pid)[0].pod_uid is None
        target = TargetProcess(proc.pid, "python", [], {"POD_NAME": "victim-0",
                                                        "POD_NAMESPACE": "prod"}, "", 0.0)
        assert target_job(target, "host")["pod"] is None
        # The same name made by root (a kubelet) is the pod.
        claimed_by_root = delegated / f"kubepods-pod{pod_uid.replace('-', '_')}.slice"
        claimed_by_root.mkdir()
        os.chown(claimed_by_root, 0, 0)
        (claimed_by_root / "cgroup.procs").write_text(str(proc.pid))
        assert container_of(proc.pid).pod_uid == pod_uid
        assert target_job(target, "host")["pod"] == {"uid": pod_uid, "name": "victim-0",
                                                     "namespace": "prod"}
    finally:
        if proc is not None:
            _reap(proc)
        for folder in [*sorted(delegated.rglob("*.slice"), reverse=True), delegated]:
            if folder.is_dir():
                for pid in (folder / "cgroup.procs").read_text().split():
                    (root / "cgroup.procs").write_text(pid)
                folder.rmdir()
