"""`perfmon-agent flops`: the same model through each source gives the same FLOPs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def flops(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "perfmon.agent.cli", "flops", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def test_file_command_line_and_sources_agree(tmp_path):
    config = tmp_path / "m.yaml"
    config.write_text("num_layers: 4\nhidden_size: 256\nnum_attention_heads: 8\n"
                      "num_query_groups: 2\nswiglu: true\nseq_length: 512\nvocab_size: 1000\n"
                      "global_batch_size: 16\n")
    from_file = json.loads(flops("--model-config", str(config), "--json").stdout)
    from_cmdline = json.loads(flops(
        "--from-cmdline", "pretrain_gpt.py --num-layers 4 --hidden-size 256 "
        "--num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu "
        "--seq-length=512 --vocab-size 1000 --global-batch-size 16", "--json").stdout)
    assert from_file["flops_per_iteration"] == from_cmdline["flops_per_iteration"]
    assert from_file["tokens_per_iteration"] == 16 * 512
    parts = from_file["breakdown_per_iteration"]
    assert sum(parts.values()) == pytest.approx(from_file["flops_per_iteration"])
    assert from_file["flops_per_token"] == pytest.approx(
        from_file["flops_per_iteration"] / (16 * 512))


def test_file_beats_command_line_and_batch_flag_scales_linearly(tmp_path):
    config = tmp_path / "m.yaml"
    config.write_text("num_layers: 8\n")
    cmd = ("x --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
           "--vocab-size 100")
    one = json.loads(flops("--model-config", str(config), "--from-cmdline", cmd, "--json").stdout)
    assert one["source"] == f"model_config:{config}+cmdline"
    two = json.loads(flops("--from-cmdline", cmd, "--json").stdout)
    assert one["flops_per_iteration"] > 3 * two["flops_per_iteration"]  # 8 layers, not 2
    big = json.loads(flops("--from-cmdline", cmd, "--global-batch-size", "10", "--json").stdout)
    assert big["flops_per_iteration"] == pytest.approx(10 * two["flops_per_iteration"])


def test_recompute_reports_hardware_flops_separately():
    cmd = ("x --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
           "--vocab-size 100 --recompute-granularity full --recompute-method uniform")
    report = json.loads(flops("--from-cmdline", cmd, "--json").stdout)
    assert report["hardware_flops_per_iteration"] > report["flops_per_iteration"]
    plain_cmd = cmd.partition(" --recompute")[0]
    plain = json.loads(flops("--from-cmdline", plain_cmd, "--json").stdout)
    assert plain["flops_per_iteration"] == report["flops_per_iteration"]


def test_table_output_and_bad_input():
    table = flops("--model-preset", "llama2-7b")
    assert table.returncode == 0 and "attention" in table.stdout and "total" in table.stdout
    for args, needle in [
        ((), "give --model-config"),
        (("--model-preset", "no-such-model"), "no-such-model"),
        (("--from-cmdline", "x --num-layers 2"), "hidden_size"),
        (("--from-cmdline", "x --num-layers two"), "--num-layers"),
    ]:
        run = flops(*args)
        assert run.returncode == 2, (args, run.stderr)
        assert run.stderr.count("\n") == 1 and needle in run.stderr, run.stderr
