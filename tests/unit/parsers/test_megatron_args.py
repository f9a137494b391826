"""Model and batch fields picked out of training processes' argv."""

from __future__ import annotations

import pytest
from perfmon.parsers.errors import ModelConfigError
from perfmon.parsers.megatron_args import (
    cmdline_batch_fields,
    hf_config_locations,
    parse_megatron_cmdline,
)
from perfmon.parsers.model_config import model_config_from_mapping

# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh as torchrun execs it (abridged).
LLAMA3_ARGV = [
    "/usr/bin/python3", "-u", "/usr/local/bin/torchrun", "--nproc_per_node", "8",
    "examples/classes/pretrain_gpt.py", "--use-mcore-models", "--num-layers", "32",
    "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
    "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
    "--seq-length", "8192", "--max-position-embeddings", "8192", "--position-embedding-type",
    "rope", "--swiglu", "--micro-batch-size", "1", "--global-batch-size", "128",
    "--lr", "0.00015", "--bf16", "--tensor-model-parallel-size", "1",
    "--context-parallel-size", "1", "--sequence-parallel", "--vocab-size", "128256",
    "--split", "'99,1,0'", "--save", "checkpoints/llama3_8b_fp8",
]


def test_llama3_example_command_line() -> None:
    fields = parse_megatron_cmdline(LLAMA3_ARGV)
    assert fields == {
        "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
        "num_attention_heads": 32, "group_query_attention": True, "num_query_groups": 8,
        "kv_channels": 128, "seq_length": 8192, "max_position_embeddings": 8192, "swiglu": True,
        "micro_batch_size": 1, "global_batch_size": 128, "tensor_model_parallel_size": 1,
        "context_parallel_size": 1, "vocab_size": 128256, "multi_latent_attention": False,
    }
    cfg = model_config_from_mapping(fields, "cmdline")
    assert cfg.effective_num_query_groups == 8


def test_equals_form_and_last_occurrence_wins() -> None:
    fields = parse_megatron_cmdline(["x.py", "--hidden-size=1024", "--num-layers", "2",
                                     "--num-layers=4", "--recompute-granularity=full"])
    assert fields["hidden_size"] == 1024
    assert fields["num_layers"] == 4
    assert fields["recompute_granularity"] == "full"


# DeepSeek-V3's MoE, MLA and MTP flags (its dimensions, cut to four layers).
def test_moe_mla_mtp_flags() -> None:
    fields = parse_megatron_cmdline([
        "pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "7168",
        "--num-attention-heads", "128", "--multi-latent-attention", "--q-lora-rank", "1536",
        "--kv-lora-rank", "512", "--qk-head-dim", "128", "--qk-pos-emb-head-dim", "64",
        "--v-head-dim", "128", "--num-experts", "256", "--moe-router-topk", "8",
        "--moe-ffn-hidden-size", "2048", "--moe-shared-expert-intermediate-size", "2048",
        "--moe-layer-freq", "([0]*1+[1]*3)", "--mtp-num-layers", "1",
        "--expert-model-parallel-size", "8", "--make-vocab-size-divisible-by", "128",
    ])
    assert fields["moe_layer_freq"] == (0, 1, 1, 1)
    assert fields["multi_latent_attention"] is True
    assert fields["swiglu"] is False and fields["group_query_attention"] is False
    assert (fields["q_lora_rank"], fields["mtp_num_layers"]) == (1536, 1)
    assert fields["expert_model_parallel_size"] == 8


@pytest.mark.parametrize(("value", "expected"), [
    ("2", 2), ("[0,1,1]", (0, 1, 1)), ("'([1]*2+[0]*1)*2'", (1, 1, 0, 1, 1, 0)),
])
def test_moe_layer_freq_forms(value: str, expected: object) -> None:
    assert parse_megatron_cmdline(["--moe-layer-freq", value]) == {"moe_layer_freq": expected}


def test_group_query_attention_follows_megatron_defaults() -> None:
    # The flag alone: Megatron's --num-query-groups default of 1.
    flag_only = parse_megatron_cmdline(["--num-layers", "2", "--group-query-attention"])
    assert flag_only["num_query_groups"] == 1
    # Groups without the flag: Megatron ignores them and runs MHA.
    groups_only = parse_megatron_cmdline(["--num-layers", "2", "--num-query-groups", "8"])
    assert groups_only["group_query_attention"] is False
    partial = parse_megatron_cmdline(["--num-query-groups", "8"])
    assert partial == {"num_query_groups": 8, "group_query_attention": False}


def test_store_true_flags_stay_absent_without_architecture_flags() -> None:
    # A Hugging Face script with its own --seq-length must not claim swiglu=False.
    assert parse_megatron_cmdline(["train.py", "--seq-length", "2048"]) == {"seq_length": 2048}
    assert parse_megatron_cmdline(["python", "train.py", "--lr", "3e-4"]) == {}


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-layers", "abc"], "--num-layers expects an integer, got 'abc'"),
    (["--hidden-size=4096.0"], "--hidden-size expects an integer, got '4096.0'"),
    (["--num-layers"], "--num-layers has no value"),
    (["--num-layers", "--swiglu"], "--num-layers has no value"),
    (["--moe-layer-freq", "__import__('os')"], "--moe-layer-freq: unsupported expression"),
])
def test_bad_values_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ModelConfigError, match=f"^target command line: {message}"):
        parse_megatron_cmdline(argv)


def test_hf_config_locations_config_name_first() -> None:
    argv = ["torchrun", "run_clm.py", "--model_name_or_path", "meta-llama/Llama-2-7b-hf",
            "--config-name=/data/cfg", "--per_device_train_batch_size", "4"]
    assert hf_config_locations(argv) == ["/data/cfg", "meta-llama/Llama-2-7b-hf"]
    assert hf_config_locations(["--model-name-or-path=/m", "--model_name_or_path", "/m"]) == ["/m"]
    assert hf_config_locations(["train.py"]) == []


def test_hf_trainer_batch_fields() -> None:
    argv = ["run_clm.py", "--per_device_train_batch_size", "4",
            "--gradient-accumulation-steps=8", "--block_size", "2048"]
    assert cmdline_batch_fields(argv) == {"micro_batch_size": 4, "seq_length": 2048}
    assert cmdline_batch_fields(argv, world_size=16) == {
        "micro_batch_size": 4, "seq_length": 2048, "global_batch_size": 4 * 8 * 16,
    }
    # --max_seq_length wins over --model_max_length; no accumulation flag means 1 step.
    sft = ["sft.py", "--model_max_length", "4096", "--max_seq_length", "1024",
           "--per-device-train-batch-size", "2"]
    assert cmdline_batch_fields(sft, world_size=8) == {
        "micro_batch_size": 2, "seq_length": 1024, "global_batch_size": 16,
    }
    with pytest.raises(ModelConfigError, match="--block_size expects an integer, got 'auto'"):
        cmdline_batch_fields(["--block_size", "auto"])
