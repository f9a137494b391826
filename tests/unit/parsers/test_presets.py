"""Model presets: every file loads, is valid, and matches its model's published size."""

from __future__ import annotations

import pytest
from perfmon.parsers.errors import ModelConfigError
from perfmon.parsers.model_config import ModelConfig, model_config_from_mapping
from perfmon.parsers.presets import preset_fields, preset_names

# Published parameter counts (model cards, and the GPT-3 / DeepSeek-V3 papers;
# DeepSeek-V3's 671B excludes its 14B multi-token-prediction module).
PUBLISHED_PARAMETERS = {
    "llama2-7b": 6.74e9, "llama2-70b": 68.98e9, "llama3-8b": 8.03e9, "llama3-70b": 70.55e9,
    "mixtral-8x7b": 46.70e9, "qwen2-7b": 7.62e9, "gpt3-175b": 175e9, "deepseek-v3": 671e9,
}
TIED_EMBEDDINGS = {"gpt3-175b"}


def parameters(cfg: ModelConfig, tied: bool) -> int:
    """Weight count from the dimensions (norms and biases left out: well under 0.1%)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.multi_latent_attention:
        assert cfg.kv_lora_rank and cfg.qk_head_dim and cfg.qk_pos_emb_head_dim and cfg.v_head_dim
        qk = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
        rank = cfg.q_lora_rank
        q = h * rank + rank * heads * qk if rank else h * heads * qk
        kv = (h * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim)
              + cfg.kv_lora_rank * heads * (cfg.qk_head_dim + cfg.v_head_dim))
        attention = q + kv + heads * cfg.v_head_dim * h
    else:
        kv_channels = cfg.effective_kv_channels
        attention = (h * kv_channels * (heads + 2 * cfg.effective_num_query_groups)
                     + kv_channels * heads * h)
    glu = 3 if cfg.swiglu else 2
    experts = cfg.num_experts or 0
    dense = glu * h * cfg.effective_ffn_hidden_size
    moe = (experts * glu * h * cfg.effective_moe_ffn_hidden_size  # routed experts
           + glu * h * (cfg.moe_shared_expert_intermediate_size or 0)
           + h * experts)  # router
    mlp = sum(moe if is_moe else dense for is_moe in cfg.moe_layer_pattern)
    embeddings = cfg.effective_padded_vocab_size * h * (1 if tied else 2)
    return cfg.num_layers * attention + mlp + embeddings


def test_the_documented_presets_exist() -> None:
    assert preset_names() == sorted(PUBLISHED_PARAMETERS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_preset_is_valid_and_matches_published_size(name: str) -> None:
    fields = preset_fields(name)
    assert "seq_length" in fields
    assert not {"global_batch_size", "micro_batch_size"} & fields.keys()
    cfg = model_config_from_mapping(fields, f"preset {name}")
    count = parameters(cfg, tied=name in TIED_EMBEDDINGS)
    assert count == pytest.approx(PUBLISHED_PARAMETERS[name], rel=0.01)


def test_preset_fields_are_a_fresh_copy() -> None:
    preset_fields("llama3-8b")["seq_length"] = 1
    assert preset_fields("llama3-8b")["seq_length"] == 8192


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ModelConfigError) as info:
        preset_fields("llama3-8")
    message = str(info.value)
    assert message.startswith("model preset 'llama3-8': unknown (did you mean 'llama3-8b'?)")
    assert all(name in message for name in PUBLISHED_PARAMETERS)
