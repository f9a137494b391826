"""Model fields from a Hugging Face ``config.json``, under ModelConfig's field names.

Covers LLaMA/Mistral/Qwen-style configs (GQA via num_key_value_heads, head_dim),
MoE (Mixtral, Qwen-MoE, DeepSeek), DeepSeek's multi-latent attention and MTP,
and GPT-2's n_* names. config.json has no reliable training sequence length, so
none is invented: max_position_embeddings is passed on under its own name.
Pure: a dict in (the caller reads the file).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from perfmon.parsers.errors import ModelConfigError
from perfmon.parsers.model_config import MAX_NESTING, check_nesting, decode_config_text

# ModelConfig field <- config.json keys, the first present (and not null) wins.
_RENAMES: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "ffn_hidden_size": ("intermediate_size", "n_inner"),
    "kv_channels": ("head_dim",),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "moe_router_topk": ("num_experts_per_tok",),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
    "mtp_num_layers": ("num_nextn_predict_layers",),
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_head_dim": ("qk_nope_head_dim",),
    "qk_pos_emb_head_dim": ("qk_rope_head_dim",),
    "v_head_dim": ("v_head_dim",),
}
# Architectures whose MLP is gated (three weight matrices), whatever the activation:
# Megatron's --swiglu is what selects the gated MLP, so it stands for all of them.
_GATED_MLP_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
    "deepseek_v2", "deepseek_v3", "gemma", "gemma2", "phi3", "internlm2", "olmo2",
})  # fmt: skip
_GATED_ACTIVATIONS = frozenset({"silu", "swiglu"})


def parse_hf_config(data: bytes, source: str) -> dict[str, Any]:
    """A config.json's content as a dict.

    Raises ModelConfigError for binary, non-UTF-8, unparsable or too deeply
    nested content, or a top level that is not an object; the message never
    quotes the content (the file may be one the user is not entitled to see).
    """
    text = decode_config_text(data, source)
    try:
        config = json.loads(text)
    except RecursionError:
        raise ModelConfigError(
            f"model config {source}: nested deeper than {MAX_NESTING} levels") from None
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"model config {source}: not valid JSON at line {err.lineno}, "
                               f"column {err.colno}") from None
    except ValueError:  # an integer beyond Python's digit limit
        raise ModelConfigError(f"model config {source}: a number too long to read") from None
    if not isinstance(config, dict):
        raise ModelConfigError(
            f"model config {source}: the top level is a {type(config).__name__}, not an object")
    check_nesting(config, source)
    return config


def hf_config_to_fields(config: Mapping[str, object]) -> dict[str, object]:
    """ModelConfig fields a Hugging Face config.json dict determines.

    A multimodal config's ``text_config`` is used when the top level has no
    layer count. Values are passed on unchecked; model_config_from_mapping
    reports a wrong one by its ModelConfig field name.
    """
    cfg: Mapping[str, Any] = config
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping) and "num_hidden_layers" not in config:
        cfg = {**config, **text_config}
    fields: dict[str, object] = {}
    for field, keys in _RENAMES.items():
        value = next((cfg[k] for k in keys if cfg.get(k) is not None), None)
        if value is not None:
            fields[field] = value

    model_type = cfg.get("model_type")
    activation = cfg.get("hidden_act", cfg.get("activation_function"))
    if model_type is not None or activation is not None:
        fields["swiglu"] = model_type in _GATED_MLP_MODEL_TYPES or activation in _GATED_ACTIVATIONS

    if "kv_lora_rank" in fields:
        fields["multi_latent_attention"] = True
    else:
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is not None:
            grouped = kv_heads != fields.get("num_attention_heads")
            fields["group_query_attention"] = grouped
            if grouped:
                fields["num_query_groups"] = kv_heads

    shared_experts, expert_width = cfg.get("n_shared_experts"), cfg.get("moe_intermediate_size")
    if isinstance(shared_experts, int) and isinstance(expert_width, int) and shared_experts > 0:
        # DeepSeek: n_shared_experts experts of moe_intermediate_size, fused into one MLP.
        fields["moe_shared_expert_intermediate_size"] = shared_experts * expert_width

    pattern = _moe_layer_pattern(cfg, fields.get("num_layers"))
    if pattern is not None and fields.get("num_experts"):
        fields["moe_layer_freq"] = 1 if all(pattern) else pattern
    return fields


def _moe_layer_pattern(cfg: Mapping[str, Any], num_layers: object) -> tuple[int, ...] | None:
    """1 per MoE layer from DeepSeek's or Qwen-MoE's layout keys; None if neither is present."""
    if not isinstance(num_layers, int):
        return None
    layers = range(num_layers)
    dense_prefix, step = cfg.get("first_k_dense_replace"), cfg.get("moe_layer_freq")
    if isinstance(dense_prefix, int) or isinstance(step, int):
        # DeepSeek-V2/V3 modeling code: MoE where i >= first_k_dense_replace and
        # i % moe_layer_freq == 0.
        k = dense_prefix if isinstance(dense_prefix, int) else 0
        every = step if isinstance(step, int) and step > 0 else 1
        return tuple(int(i >= k and i % every == 0) for i in layers)
    sparse_step, dense_layers = cfg.get("decoder_sparse_step"), cfg.get("mlp_only_layers")
    if isinstance(sparse_step, int) or isinstance(dense_layers, list):
        # Qwen2/3-MoE modeling code: MoE where i is not in mlp_only_layers and
        # (i + 1) % decoder_sparse_step == 0.
        every = sparse_step if isinstance(sparse_step, int) and sparse_step > 0 else 1
        dense = set(dense_layers) if isinstance(dense_layers, list) else set()
        return tuple(int(i not in dense and (i + 1) % every == 0) for i in layers)
    return None
