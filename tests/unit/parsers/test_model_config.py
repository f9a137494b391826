"""ModelConfig validation, file parsing and layer merging."""

from __future__ import annotations

import pytest
from perfmon.parsers.errors import ModelConfigError
from perfmon.parsers.model_config import (
    ModelConfig,
    merge_model_fields,
    model_config_from_mapping,
    model_fields_from_mapping,
    parse_model_config_fields,
    parse_moe_layer_freq,
)

BASE = {"num_layers": 4, "hidden_size": 4096, "num_attention_heads": 32,
        "seq_length": 2048, "vocab_size": 32000}


def _parse_text(text: bytes | str, source: str) -> ModelConfig:
    """A whole config file's model (as --model-config reads one)."""
    return model_config_from_mapping(parse_model_config_fields(text, source), source)


def build(**changes: object) -> ModelConfig:
    return model_config_from_mapping({**BASE, **changes}, "test.yaml")


def rejects(message: str, **changes: object) -> None:
    with pytest.raises(ModelConfigError) as info:
        build(**changes)
    assert str(info.value) == f"model config test.yaml: {message}"


def test_defaults_follow_megatron() -> None:
    cfg = build()
    assert cfg.effective_kv_channels == 4096 // 32
    assert cfg.effective_num_query_groups == 32
    assert cfg.effective_ffn_hidden_size == 4 * 4096
    assert cfg.effective_moe_ffn_hidden_size == 4 * 4096
    assert cfg.moe_router_topk == 2
    assert cfg.make_vocab_size_divisible_by == 128
    assert cfg.moe_layer_pattern == (0, 0, 0, 0)


def test_swiglu_ffn_default_is_megatrons_two_thirds_rounded_to_64() -> None:
    # int(4 * 4096 * 2 / 3 / 64) * 64 = int(170.67) * 64 = 170 * 64 = 10880
    assert build(swiglu=True).effective_ffn_hidden_size == 10880


def test_padded_vocab_rounds_up_to_divisor_times_tensor_parallel() -> None:
    # 32001 rounded up to a multiple of 128 * 2 = 256: 126 * 256 = 32256
    cfg = build(vocab_size=32001, tensor_model_parallel_size=2)
    assert cfg.effective_padded_vocab_size == 32256
    assert build(vocab_size=32000).effective_padded_vocab_size == 32000
    assert build(padded_vocab_size=32768).effective_padded_vocab_size == 32768


def test_query_groups_count_only_with_group_query_attention() -> None:
    assert build(group_query_attention=True, num_query_groups=8).effective_num_query_groups == 8
    # FlagScale's llama2-7b config carries exactly this: Megatron then runs plain MHA.
    assert build(group_query_attention=False, num_query_groups=8).effective_num_query_groups == 32


def test_query_groups_alone_in_a_source_mean_gqa() -> None:
    layer = model_fields_from_mapping({"num_query_groups": 8}, "f.yaml")
    assert layer == {"num_query_groups": 8, "group_query_attention": True}
    assert build(num_query_groups=8).effective_num_query_groups == 8


def test_moe_layer_pattern_from_int_and_list() -> None:
    assert build(num_experts=8, moe_layer_freq=2).moe_layer_pattern == (1, 0, 1, 0)
    assert build(num_experts=8, moe_layer_freq=[0, 1, 1, 1]).moe_layer_pattern == (0, 1, 1, 1)
    assert build(num_experts=8, moe_layer_freq="[0]*2+[1]*2").moe_layer_freq == (0, 0, 1, 1)


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_layer": 4}, "unknown key 'num_layer' (did you mean 'num_layers'?)"),
    ({"num-layers": 4}, "unknown key 'num-layers' (did you mean 'num_layers'?)"),
    ({"learning_rate": 1e-4}, "unknown key 'learning_rate'"),
    ({"hidden_size": -4}, "'hidden_size' must be a positive integer, got -4"),
    ({"hidden_size": 0}, "'hidden_size' must be a positive integer, got 0"),
    ({"hidden_size": 4096.0}, "'hidden_size' must be a positive integer, got 4096.0"),
    ({"hidden_size": "4096"}, "'hidden_size' must be a positive integer, got '4096'"),
    ({"num_layers": True}, "'num_layers' must be a positive integer, got True"),
    ({"mtp_num_layers": -1}, "'mtp_num_layers' must be a non-negative integer, got -1"),
    ({"swiglu": "yes"}, "'swiglu' must be true or false, got 'yes'"),
    ({"swiglu": 1}, "'swiglu' must be true or false, got 1"),
    ({"recompute_granularity": "ful"},
     "'recompute_granularity' must be one of 'full', 'selective', got 'ful'"),
    ({"num_attention_heads": 7},
     "num_attention_heads (7) does not divide hidden_size (4096) and kv_channels is not set"),
    ({"group_query_attention": True, "num_query_groups": 5},
     "num_query_groups (5) does not divide num_attention_heads (32)"),
    ({"group_query_attention": True},
     "group_query_attention is true but num_query_groups is not set"),
    ({"num_experts": 8, "moe_layer_freq": [1, 1, 1]},
     "moe_layer_freq has 3 entries but num_layers is 4"),
    ({"num_experts": 8, "moe_layer_freq": [1, 2, 1, 1]},
     "'moe_layer_freq' entries must be 0 or 1, got 2 at index 1"),
    ({"num_experts": 2, "moe_router_topk": 4}, "moe_router_topk (4) exceeds num_experts (2)"),
    ({"multi_latent_attention": True, "kv_lora_rank": 512, "qk_head_dim": 128, "v_head_dim": 128},
     "multi_latent_attention is true but 'qk_pos_emb_head_dim' is not set"),
    ({"multi_latent_attention": True, "group_query_attention": True, "num_query_groups": 8},
     "multi_latent_attention and group_query_attention cannot both be true"),
    ({"recompute_granularity": "full", "recompute_method": "block"},
     "recompute_method 'block' needs recompute_num_layers"),
])
def test_invalid_fields_are_named(changes: dict[str, object], message: str) -> None:
    rejects(message, **changes)


def test_missing_fields_are_named() -> None:
    fields = dict(BASE)
    del fields["hidden_size"]
    missing = r"^model config x: missing required field 'hidden_size'$"
    with pytest.raises(ModelConfigError, match=missing):
        model_config_from_mapping(fields, "x")
    del fields["vocab_size"]
    fields["hidden_size"] = 64
    with pytest.raises(ModelConfigError, match=r"missing required field 'vocab_size' \(or"):
        model_config_from_mapping(fields, "x")


def test_kv_channels_makes_indivisible_heads_valid() -> None:
    assert build(num_attention_heads=7, kv_channels=128).effective_kv_channels == 128


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(ModelConfigError, match="'hidden_size' must be a positive integer"):
        ModelConfig(num_layers=2, hidden_size=0, num_attention_heads=4, seq_length=8, vocab_size=8)


def test_null_means_unset() -> None:
    assert build(kv_channels=None).kv_channels is None
    layer = model_fields_from_mapping({"kv_channels": None, "num_layers": 2}, "x")
    assert layer == {"num_layers": 2}


def test_moe_layer_freq_patterns_evaluate_without_eval() -> None:
    assert parse_moe_layer_freq("2") == 2
    assert parse_moe_layer_freq("[0,1,1]") == (0, 1, 1)
    assert parse_moe_layer_freq("([0]*1+[1]*3)") == (0, 1, 1, 1)
    assert parse_moe_layer_freq("([1]*2+[0]*1)*2") == (1, 1, 0, 1, 1, 0)
    assert parse_moe_layer_freq("'([1]*3)'") == (1, 1, 1)  # quotes a shell left in argv
    unsafe_patterns = ("__import__('os').system('true')", "[0]*10**9", "[[0]]", "[0]*99999999",
                       "[0]+1")
    for unsafe in unsafe_patterns:
        with pytest.raises(ValueError):
            parse_moe_layer_freq(unsafe)


def test_parse_yaml_and_json() -> None:
    yaml_cfg = _parse_text(
        "num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 16\n"
        "vocab_size: 100\nswiglu: true\nmoe_layer_freq: '[0]+[1]'\nnum_experts: 4\n",
        "a.yaml",
    )
    json_cfg = _parse_text(
        '{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16,'
        ' "vocab_size": 100, "swiglu": true, "moe_layer_freq": [0, 1], "num_experts": 4}',
        "a.json",
    )
    assert yaml_cfg == json_cfg
    assert yaml_cfg.moe_layer_pattern == (0, 1)


FLAGSCALE = """\
system:
  tensor_model_parallel_size: 8
  pipeline_model_parallel_size: 4
  make_vocab_size_divisible_by: 64
  sequence_parallel: True
  precision:
    bf16: True
model:
  num_layers: 80
  hidden_size: 8192
  num_attention_heads: 64
  group_query_attention: True
  num_query_groups: 8
  ffn_hidden_size: 28672
  seq_length: 8192
  norm_epsilon: 1e-5
  swiglu: True
  micro_batch_size: 1
  global_batch_size: 1024
  optimizer:
    lr_scheduler:
      lr: 1.5e-4
data:
  data_path: ${data_path:??}
  tokenizer:
    tokenizer_type: Llama3TokenizerFS
    vocab_size: 128256
"""


def test_flagscale_layout_reads_model_system_and_tokenizer_sections() -> None:
    # Excerpt of FlagScale's examples/llama/conf/train/train_llama3_70b.yaml.
    cfg = _parse_text(FLAGSCALE, "train_llama3_70b.yaml")
    assert (cfg.num_layers, cfg.effective_num_query_groups, cfg.vocab_size) == (80, 8, 128256)
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (8, 4)
    assert cfg.make_vocab_size_divisible_by == 64
    assert cfg.global_batch_size == 1024


def test_flat_layout_is_strict_and_errors_carry_position() -> None:
    with pytest.raises(ModelConfigError, match="unknown key 'norm_epsilon'"):
        parse_model_config_fields("num_layers: 2\nnorm_epsilon: 1e-5\n", "f.yaml")
    position = r"^model config f\.yaml: not valid YAML/JSON at line 2, column 1"
    with pytest.raises(ModelConfigError, match=position):
        parse_model_config_fields("num_layers: [2\nhidden_size: 4\n", "f.yaml")
    with pytest.raises(ModelConfigError, match=r"top level must be a mapping .* got list"):
        parse_model_config_fields("- 1\n- 2\n", "f.yaml")


def test_fields_layer_checks_each_field_but_not_completeness() -> None:
    assert parse_model_config_fields("seq_length: 4096\n", "s.yaml") == {"seq_length": 4096}
    with pytest.raises(ModelConfigError, match="'seq_length' must be a positive integer, got 0"):
        parse_model_config_fields("seq_length: 0\n", "s.yaml")


def test_merge_earlier_layers_win_and_none_does_not_mask() -> None:
    file_layer = {"seq_length": 4096, "kv_channels": None}
    cmdline = {"seq_length": 2048, "num_layers": 32}
    hf = {"num_layers": 30, "kv_channels": 128, "hidden_size": 4096}
    assert merge_model_fields(file_layer, cmdline, hf) == {
        "seq_length": 4096, "num_layers": 32, "kv_channels": 128, "hidden_size": 4096,
    }
