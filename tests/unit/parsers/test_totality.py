"""The parsers of what a process controls are total: any value gives a result, or the one
error the parser documents, never another exception (issue 36: one job variable, '²',
killed the node service). Generated cases; the truth each states is in its assertions.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from perfmon.parsers import job_identity, megatron_args, procfs
from perfmon.parsers.errors import ModelConfigError

# Text a user can put in an argument, a variable or a file name: any code point but NUL
# (the kernel ends each there), digits of every script and signs weighted in.
ANY_TEXT = st.text(st.characters(blacklist_characters="\0"), max_size=64) | st.sampled_from(
    ["²", "٣", "-1", "+3", " 7", "1_000", "0x10", "1e3", str(10**30), "9" * 5000, "",
     "+".join(["1"] * 50_000), "+".join(["[1]"] * 20_000), "(" * 300 + "1" + ")" * 300])
JOB_KEYS = st.sampled_from(job_identity.JOB_KEYS)


@given(st.dictionaries(JOB_KEYS, ANY_TEXT))
def test_job_variables_give_a_job_and_numbers_or_none(env):
    name, source = job_identity.job_identity(env, "python-1")
    assert name and len(name) <= job_identity.MAX_NAME and source
    for value in (job_identity.rank_number(env), job_identity.world_size(env),
                  job_identity.local_rank(env), job_identity.slurm_tasks_here(env)):
        assert value is None or 0 <= value < 10**12
    assert 0 <= job_identity.local_world_size(env) < 10**5
    fields = job_identity.scheduler_fields(env, None)
    assert fields["pod"] is None  # no pod without a kubelet's cgroup


@given(st.lists(st.tuples(JOB_KEYS | ANY_TEXT, ANY_TEXT), max_size=12))
def test_an_environ_of_any_bytes_keeps_only_the_wanted_variables(pairs):
    data = b"\0".join(f"{k}={v}".encode("utf-8", "surrogatepass") for k, v in pairs)
    env = procfs.parse_environ(data, job_identity.JOB_KEYS)
    assert set(env) <= set(job_identity.JOB_KEYS)


@given(st.binary(max_size=512))
def test_a_cmdline_of_any_bytes_is_a_list_of_strings(data):
    assert all(isinstance(arg, str) for arg in procfs.parse_cmdline(data))


@given(ANY_TEXT, st.integers(0, 2**40))
def test_a_stat_line_with_any_command_name_reads_its_fields(comm, start_ticks):
    line = (f"4242 ({comm}) S 1 4242 4242 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 "
            f"{start_ticks} 16961536 3349 18446744073709551615")
    stat = procfs.parse_stat(line)
    assert (stat.ppid, stat.start_ticks, stat.state) == (1, start_ticks, "S")


@given(st.lists(st.tuples(st.integers(0, 12), ANY_TEXT, ANY_TEXT), max_size=6))
def test_a_cgroup_file_of_any_paths_gives_ids_or_none(lines):
    text = "\n".join(f"{n}:{controllers}:{path}" for n, controllers, path in lines)
    ids = procfs.container_ids(text)
    assert (ids.pod_uid is None) == (ids.pod_cgroup is None)


@settings(max_examples=300)
@given(st.lists(st.sampled_from(["--num-layers", "--hidden-size", "--seq-length",
                                 "--moe-layer-freq", "--num-query-groups",
                                 "--per_device_train_batch_size", "--block_size",
                                 "--gradient_accumulation_steps", "--swiglu"]) | ANY_TEXT,
                max_size=10))
def test_a_command_line_of_any_arguments_gives_fields_or_one_model_config_error(argv):
    for parse in (megatron_args.parse_megatron_cmdline,
                  lambda a: megatron_args.cmdline_batch_fields(a, 8),
                  megatron_args.hf_config_locations):
        try:
            parse(argv)
        except ModelConfigError as err:
            assert len(str(err)) < 300  # the job's value is not printed whole
