"""Hugging Face config.json dicts mapped to ModelConfig fields.

The dicts are the published config.json files of the named checkpoints (keys
that do not bear on dimensions, such as token ids and rope settings, trimmed).
"""

from __future__ import annotations

import pytest
from perfmon.parsers.flops import model_flops_per_iteration
from perfmon.parsers.hf_config import hf_config_to_fields
from perfmon.parsers.model_config import model_config_from_mapping

LLAMA2_7B = {  # meta-llama/Llama-2-7b-hf
    "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
    "vocab_size": 32000,
}
QWEN2_7B = {  # Qwen/Qwen2-7B
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "sliding_window": 131072, "use_sliding_window": False,
    "vocab_size": 152064,
}
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "sliding_window": None,
    "vocab_size": 32000,
}
QWEN2_57B_A14B = {  # Qwen/Qwen2-57B-A14B
    "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 131072,
    "model_type": "qwen2_moe", "moe_intermediate_size": 2560, "num_attention_heads": 28,
    "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "shared_expert_intermediate_size": 20480, "vocab_size": 151936,
}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3
    "architectures": ["DeepseekV3ForCausalLM"], "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "tie_word_embeddings": False, "topk_group": 4, "v_head_dim": 128, "vocab_size": 129280,
}
GPT2 = {  # openai-community/gpt2
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
    "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_inner": None, "n_layer": 12,
    "n_positions": 1024, "vocab_size": 50257,
}


def test_llama2_dense_mha() -> None:
    assert hf_config_to_fields(LLAMA2_7B) == {
        "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "ffn_hidden_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096,
        "swiglu": True, "group_query_attention": False,
    }


def test_no_sequence_length_is_invented() -> None:
    for config in (LLAMA2_7B, QWEN2_7B, MIXTRAL_8X7B, DEEPSEEK_V3, GPT2):
        assert "seq_length" not in hf_config_to_fields(config)


def test_qwen2_gqa() -> None:
    fields = hf_config_to_fields(QWEN2_7B)
    assert (fields["group_query_attention"], fields["num_query_groups"]) == (True, 4)
    assert fields["swiglu"] is True
    cfg = model_config_from_mapping({**fields, "seq_length": 4096}, "config.json")
    assert cfg.effective_kv_channels == 3584 // 28 == 128


def test_head_dim_becomes_kv_channels() -> None:
    # Mistral-Nemo style: head_dim 128 while hidden/heads = 5120/32 = 160.
    fields = hf_config_to_fields({**LLAMA2_7B, "model_type": "mistral", "hidden_size": 5120,
                                  "num_key_value_heads": 8, "head_dim": 128})
    cfg = model_config_from_mapping({**fields, "seq_length": 1024}, "config.json")
    assert (cfg.effective_kv_channels, cfg.effective_num_query_groups) == (128, 8)


def test_mixtral_moe_every_layer() -> None:
    fields = hf_config_to_fields(MIXTRAL_8X7B)
    assert (fields["num_experts"], fields["moe_router_topk"]) == (8, 2)
    assert "moe_layer_freq" not in fields  # Megatron's default: every layer
    cfg = model_config_from_mapping({**fields, "seq_length": 4096}, "config.json")
    assert cfg.effective_moe_ffn_hidden_size == 14336
    assert sum(cfg.moe_layer_pattern) == 32


def test_qwen2_moe_shared_expert_and_sparse_layout() -> None:
    fields = hf_config_to_fields(QWEN2_57B_A14B)
    assert fields["num_experts"] == 64 and fields["moe_router_topk"] == 8
    assert fields["moe_ffn_hidden_size"] == 2560
    assert fields["moe_shared_expert_intermediate_size"] == 20480
    assert fields["moe_layer_freq"] == 1
    # mlp_only_layers makes layers dense; decoder_sparse_step 2 makes odd-numbered ones MoE.
    layout = hf_config_to_fields({**QWEN2_57B_A14B, "num_hidden_layers": 4,
                                  "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert layout["moe_layer_freq"] == (0, 1, 0, 0)


def test_deepseek_v3_mla_moe_mtp() -> None:
    fields = hf_config_to_fields(DEEPSEEK_V3)
    assert fields["multi_latent_attention"] is True
    assert "group_query_attention" not in fields  # MLA has no query groups
    assert (fields["q_lora_rank"], fields["kv_lora_rank"]) == (1536, 512)
    head_dims = (fields["qk_head_dim"], fields["qk_pos_emb_head_dim"], fields["v_head_dim"])
    assert head_dims == (128, 64, 128)
    assert fields["moe_layer_freq"] == (0, 0, 0) + (1,) * 58
    assert fields["moe_shared_expert_intermediate_size"] == 1 * 2048
    assert fields["num_experts"] == 256 and fields["moe_router_topk"] == 8
    assert fields["mtp_num_layers"] == 1
    cfg = model_config_from_mapping({**fields, "seq_length": 4096}, "config.json")
    # The 6N rule applies to weights only, so take away MTP and the s^2 attention scores:
    # per layer 6 * (s*heads*(qk+rope)/2 + s*heads*v/2) = 6 * (4096*128*192/2 + 4096*128*128/2).
    flops = model_flops_per_iteration(cfg, 1)
    scores_per_token = 61 * 6 * (4096 * 128 * 192 // 2 + 4096 * 128 * 128 // 2)
    weights_per_token = (flops.total - flops.mtp) / flops.tokens - scores_per_token
    # DeepSeek-V3 report: 37B activated parameters, 0.93B of them the input embedding
    # (129280 x 7168), which is a lookup.
    assert weights_per_token / 6 == pytest.approx(37e9 - 129280 * 7168, rel=0.02)


def test_gpt2_names() -> None:
    assert hf_config_to_fields(GPT2) == {
        "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "vocab_size": 50257,
        "max_position_embeddings": 1024, "swiglu": False,
    }


def test_multimodal_text_config_is_used() -> None:
    wrapped = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
               "text_config": QWEN2_7B, "vision_config": {"hidden_size": 1024}}
    assert hf_config_to_fields(wrapped)["num_layers"] == 28
    assert hf_config_to_fields(wrapped)["hidden_size"] == 3584
