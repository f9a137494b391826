"""A job's identity from its variables and its cgroup path: Slurm, torchrun, Kubernetes
(parsers only; the real daemons and cgroups: tests/e2e/test_slurm.py and
test_kubernetes.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from perfmon.parsers import job_identity as identity
from perfmon.parsers.job_identity import (
    MAX_VALUE,
    job_identity,
    rank_number,
    safe_name,
    scheduler_fields,
    slurm_tasks_here,
    world_size,
)
from perfmon.parsers.procfs import container_ids

SRUN_TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3",
             "SLURM_NTASKS": "8", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
             "SLURM_JOB_USER": "alice", "SLURM_JOB_NAME": "pretrain llama",
             "SLURM_JOB_PARTITION": "gpu", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}


def test_a_slurm_job_is_named_by_its_id_and_step_before_any_other_variable():
    assert job_identity(SRUN_TASK, "python-1") == ("slurm-4242.0", "SLURM_JOB_ID")
    batch = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"}
    torchrun = {**batch, "TORCHELASTIC_RUN_ID": "abc", "RANK": "5"}
    assert job_identity(torchrun, "python-1") == ("slurm-4242", "SLURM_JOB_ID")
    # Without Slurm: torchrun's run id, the master address, the launcher.
    assert job_identity({"TORCHELASTIC_RUN_ID": "abc"}, "x") == ("abc", "TORCHELASTIC_RUN_ID")
    assert job_identity({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "n1",
                         "MASTER_PORT": "1"}, "x") == ("n1-1", "MASTER_ADDR:MASTER_PORT")
    assert job_identity({}, "python-7") == ("python-7", "launcher")
    # A job id that is no number is not Slurm's.
    assert job_identity({"SLURM_JOB_ID": "../../etc", "TORCHELASTIC_RUN_ID": "r"},
                        "x") == ("r", "TORCHELASTIC_RUN_ID")


def test_an_srun_tasks_rank_and_world_size_and_the_tasks_on_its_node():
    assert rank_number(SRUN_TASK) == 3 and world_size(SRUN_TASK) == 8
    # RANK and WORLD_SIZE win (torchrun inside a batch script: its ranks carry both).
    assert rank_number({**SRUN_TASK, "RANK": "6"}) == 6
    assert world_size({**SRUN_TASK, "RANK": "6", "WORLD_SIZE": "16"}) == 16
    # A RANK that is no number is no rank, not SLURM_PROCID's.
    assert rank_number({**SRUN_TASK, "RANK": "x"}) is None
    assert slurm_tasks_here(SRUN_TASK) == 4
    for text, node, tasks in (("2(x3),1", 3, 1), ("2(x3),1", 2, 2), ("1,2,3", 1, 2),
                              ("2", 1, None), ("2(x", 0, None), ("", 0, None)):
        assert slurm_tasks_here({"SLURM_NODEID": str(node),
                                 "SLURM_STEP_TASKS_PER_NODE": text}) == tasks, (text, node)


def test_the_slurm_and_pod_fields_kept_are_bounded_data():
    fields = scheduler_fields({**SRUN_TASK, "SLURM_JOB_NAME": "x" * 5000 + "\x1b[2J",
                               "POD_NAME": "trainer-0", "POD_NAMESPACE": "ml"},
                              "5f0c7a8e-1b2c-4d3e-8f90-a1b2c3d4e5f6")
    slurm = fields["slurm"]
    assert slurm["job_id"] == 4242 and slurm["step_id"] == 0 and slurm["partition"] == "gpu"
    assert slurm["user"] == "alice" and len(slurm["job_name"]) == MAX_VALUE + 3
    assert fields["pod"] == {"uid": "5f0c7a8e-1b2c-4d3e-8f90-a1b2c3d4e5f6",
                             "name": "trainer-0", "namespace": "ml"}
    assert "\x1b" not in scheduler_fields({"SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "a\x1bb"},
                                          None)["slurm"]["job_name"]
    assert scheduler_fields({}, None) == {"slurm": None, "pod": None}
    # Names from them that make folders and labels are reduced and bounded.
    assert safe_name("../../x") != "../../x" and "/" not in safe_name("../../x")
    assert len(safe_name("n" * 500)) <= 64


@pytest.mark.parametrize(("cgroup", "container", "pod"), [
    # systemd driver (cgroup v2): the pod's UID with underscores, containerd's scope
    ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod5f0c7a8e_1b2c_4d3e_"
     "8f90_a1b2c3d4e5f6.slice/cri-containerd-" + "ab" * 32 + ".scope\n",
     "ab" * 32, "5f0c7a8e-1b2c-4d3e-8f90-a1b2c3d4e5f6"),
    # a guaranteed pod (no QoS level), CRI-O
    ("0::/kubepods.slice/kubepods-pod5f0c7a8e_1b2c_4d3e_8f90_a1b2c3d4e5f6.slice/crio-"
     + "cd" * 32 + ".scope\n", "cd" * 32, "5f0c7a8e-1b2c-4d3e-8f90-a1b2c3d4e5f6"),
    # cgroupfs driver (cgroup v1 line)
    ("11:memory:/kubepods/besteffort/pod5f0c7a8e-1b2c-4d3e-8f90-a1b2c3d4e5f6/" + "ef" * 32
     + "\n", "ef" * 32, "5f0c7a8e-1b2c-4d3e-8f90-a1b2c3d4e5f6"),
    # Docker alone: no pod
    ("0::/system.slice/docker-" + "12" * 32 + ".scope\n", "12" * 32, None),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", None, None),
])
def test_container_id_and_pod_uid_from_the_cgroup_path(cgroup, container, pod):
    ids = container_ids(cgroup)
    assert (ids.container_id, ids.pod_uid) == (container, pod)


@given(st.text(max_size=40))
def test_a_job_variable_of_any_text_is_a_number_or_none_never_an_error(text):
    env = {key: text for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                 "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID",
                                 "SLURM_NTASKS", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE")}
    plain = text.isascii() and text.isdigit() and len(text) <= 12
    expected = int(text) if plain else None
    assert identity.rank_number(env) == expected
    assert identity.world_size(env) == expected
    assert identity.local_rank(env) == expected
    assert identity.slurm_job(env) == (None if expected is None else {
        "job_id": expected, "step_id": expected, "user": None, "job_name": None,
        "partition": None})
    identity.slurm_tasks_here(env)
    identity.job_identity(env, "python-1")
    assert identity.local_world_size(env) == (expected if plain and len(text) <= 5 else 0)


@pytest.mark.parametrize(
    "value", ["²", "٣", "-1", "+3", " 1", "1 ", str(10**30), "", "9" * 100_000])
def test_unicode_digits_signs_and_huge_values_are_not_numbers(value):
    env = {"RANK": value, "SLURM_PROCID": "2", "SLURM_JOB_ID": value, "LOCAL_WORLD_SIZE": value}
    assert identity.rank_number(env) is None  # RANK given: never SLURM_PROCID's
    assert identity.slurm_job(env) is None and identity.local_world_size(env) == 0
    name, source = identity.job_identity(env, "python-1")
    assert (name, source) == ("python-1", "launcher")
