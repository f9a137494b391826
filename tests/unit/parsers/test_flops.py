"""model_flops_per_iteration against hand-derived counts, one model family at a time.

Every expected value is worked out in the test from Megatron-LM's formula
(megatron/training/training.py, num_floating_point_operations): per token and
layer, 6 FLOPs (2 per multiply-add x forward, dgrad, wgrad) per weight, plus the
causal half of the s x s attention products.
"""

from __future__ import annotations

import pytest
from perfmon.parsers.errors import ModelConfigError
from perfmon.parsers.flops import model_flops_per_iteration
from perfmon.parsers.model_config import ModelConfig, model_config_from_mapping

TINY_GPT = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "seq_length": 32, "vocab_size": 128}


def cfg(**fields: object) -> ModelConfig:
    return model_config_from_mapping(fields, "test")


def test_gpt_dense_mha() -> None:
    flops = model_flops_per_iteration(cfg(**TINY_GPT), global_batch_size=2)
    # h=64, 4 heads of 64/4=16, ffn 4h=256, s=32, vocab 128 (already a multiple of 128)
    attention_layer = 6 * (64 * (64 + 64 + 64)  # Q, K, V projections: 12288
                           + 64 * 32  # causal QK^T and (QK^T)V: 64*32/2*2 = 2048
                           + 64 * 64)  # output projection: 4096
    assert attention_layer == 110592
    mlp_layer = 6 * 64 * 256 * 2  # h->4h and 4h->h
    logits = 6 * 64 * 128
    tokens = 2 * 32
    assert flops.tokens == tokens
    assert flops.attention == 2 * attention_layer * tokens
    assert flops.mlp == 2 * mlp_layer * tokens
    assert flops.logits == logits * tokens
    assert flops.mtp == 0
    assert flops.total == (2 * (110592 + 196608) + 49152) * 64 == 42467328
    assert flops.per_token == 663552
    assert flops.hardware_total == flops.total  # no recomputation
    # The closed form of Narayanan et al. (arXiv 2104.04473) without recomputation and
    # with the causal s-term halved: 72 B s L h^2 (1 + s/(12h) + V/(12 L h))
    # = 37748736 * (1 + 1/24 + 1/12)
    closed_form = 72 * 2 * 32 * 2 * 64**2 * (1 + 32 / (12 * 64) + 128 / (12 * 2 * 64))
    assert flops.total == pytest.approx(closed_form)


def test_llama_gqa_swiglu_with_kv_channels_not_hidden_over_heads() -> None:
    model = cfg(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=32,
                group_query_attention=True, num_query_groups=2, ffn_hidden_size=96, swiglu=True,
                seq_length=16, vocab_size=100)
    flops = model_flops_per_iteration(model, 1)
    # queries 4 heads x 32 = 128 wide, keys and values 2 groups x 32 = 64 wide each
    attention_layer = 6 * (64 * (128 + 64 + 64)  # QKV: 16384
                           + 128 * 16  # causal core attention: 128*16/2*2 = 2048
                           + 128 * 64)  # output projection from 128 back to 64: 8192
    assert attention_layer == 159744
    mlp_layer = 6 * 64 * 96 * 3  # gated: two h->ffn matrices and one ffn->h
    logits = 6 * 64 * 128  # vocab 100 padded up to 128
    assert flops.total == (2 * (attention_layer + mlp_layer) + logits) * 16 == 589824 * 16


def test_padded_vocab_follows_tensor_parallel_size() -> None:
    flops = model_flops_per_iteration(cfg(**{**TINY_GPT, "vocab_size": 100},
                                          tensor_model_parallel_size=2), 1)
    assert flops.logits == 6 * 64 * 256 * 32  # 100 rounded up to a multiple of 128*2
    explicit = model_flops_per_iteration(cfg(**{**TINY_GPT, "padded_vocab_size": 320}), 1)
    assert explicit.logits == 6 * 64 * 320 * 32


MOE_BASE = {"hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 128}
# Attention per layer at h=64, s=16, MHA: 6 * (64*192 + 64*16 + 64*64) = 6 * 17408
ATTENTION_S16 = 104448
LOGITS = 6 * 64 * 128


def test_moe_int_frequency_and_topk() -> None:
    model = cfg(**MOE_BASE, num_layers=4, ffn_hidden_size=256, num_experts=4,
                moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=2)
    flops = model_flops_per_iteration(model, 1)
    # freq 2: layers 0 and 2 are MoE, 1 and 3 dense
    dense = 6 * 64 * 256 * 2
    moe = 6 * 64 * (32 * 2) * 2  # 2 routed experts of width 32 per token
    assert flops.mlp == (2 * dense + 2 * moe) * 16
    assert flops.total == (4 * ATTENTION_S16 + 2 * 196608 + 2 * 49152 + LOGITS) * 16 == 958464 * 16


def test_moe_list_frequency_shared_experts_swiglu_and_mtp() -> None:
    model = cfg(**MOE_BASE, num_layers=3, ffn_hidden_size=128, swiglu=True, num_experts=8,
                moe_router_topk=3, moe_ffn_hidden_size=32,
                moe_shared_expert_intermediate_size=48, moe_layer_freq=[0, 1, 1], mtp_num_layers=1)
    flops = model_flops_per_iteration(model, 1)
    dense = 6 * 64 * 128 * 3
    moe = 6 * 64 * (32 * 3 * 3 + 48 * 3)  # 3 routed experts of 32, one shared of 48, gated
    assert moe == 165888
    assert flops.mlp == (dense + 2 * moe) * 16
    # The MTP layer is built like the last decoder layer (MoE here), plus its two
    # input norms and final norm (3h) and the 2h->h projection, plus its own logits.
    mtp = ATTENTION_S16 + moe + 6 * (3 * 64 + 2 * 64 * 64) + LOGITS
    assert flops.mtp == mtp * 16
    assert flops.total == (3 * ATTENTION_S16 + dense + 2 * moe + LOGITS + mtp) * 16


def test_mtp_on_dense_model_uses_dense_mlp() -> None:
    flops = model_flops_per_iteration(cfg(**TINY_GPT, mtp_num_layers=1), 1)
    mtp = 110592 + 196608 + 6 * (3 * 64 + 2 * 64 * 64) + 49152
    assert mtp == 406656
    assert flops.mtp == mtp * 32
    assert flops.total == (663552 + 406656) * 32
    assert flops.attention + flops.mlp + flops.logits + flops.mtp == flops.total


MLA = {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 2, "seq_length": 16,
       "vocab_size": 128, "ffn_hidden_size": 128, "multi_latent_attention": True,
       "kv_lora_rank": 32, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16}
MLA_KV = 32 * (64 + 2 * (16 + 16) + 1)  # kv down/up-projection and kv norm: 4128
MLA_ROPE_K = 64 * 8  # shared rotary key: 512
MLA_OUT = 2 * 16 * 64  # output projection: 2048
MLA_CORE = 16 * 2 * (16 + 8) // 2 + 16 * 2 * 16 // 2  # causal QK^T 384 + causal PV 256


def test_mla_without_q_lora() -> None:
    flops = model_flops_per_iteration(cfg(**MLA), 1)
    q = 64 * 2 * (16 + 8)  # direct h -> heads*(qk+rope): 3072
    attention = 6 * (q + MLA_KV + MLA_ROPE_K + MLA_OUT + MLA_CORE)
    assert attention == 6 * 10400
    assert flops.attention == attention * 16
    assert flops.total == (attention + 6 * 64 * 128 * 2 + LOGITS) * 16 == 209856 * 16


def test_mla_with_q_lora() -> None:
    flops = model_flops_per_iteration(cfg(**MLA, q_lora_rank=24), 1)
    q = 24 * (64 + 2 * (16 + 8) + 1)  # down to rank 24, norm, up to heads*(qk+rope): 2712
    attention = 6 * (q + MLA_KV + MLA_ROPE_K + MLA_OUT + MLA_CORE)
    assert flops.attention == attention * 16 == 6 * 10040 * 16


def test_full_recompute_adds_one_forward_of_the_recomputed_layers() -> None:
    base = model_flops_per_iteration(cfg(**TINY_GPT), 2)
    layer_forward = (110592 + 196608) // 3  # fwd+bwd is 3 forwards' worth
    uniform = model_flops_per_iteration(
        cfg(**TINY_GPT, recompute_granularity="full", recompute_method="uniform",
            recompute_num_layers=1), 2)
    assert uniform.total == base.total  # model FLOPs do not change
    assert uniform.hardware_total == base.total + 2 * layer_forward * 64 == 55574528
    # 2104.04473's appendix form assumes exactly this (four passes per layer, logits not
    # recomputed): 96 B s L h^2 (1 + s/(6h) + V/(16 L h)), causal s-term halved.
    paper = 96 * 2 * 32 * 2 * 64**2 * (1 + 32 / (12 * 64) + 128 / (16 * 2 * 64))
    assert uniform.hardware_total == pytest.approx(paper)
    block = model_flops_per_iteration(
        cfg(**TINY_GPT, recompute_granularity="full", recompute_method="block",
            recompute_num_layers=1), 2)
    assert block.hardware_total == base.total + 1 * layer_forward * 64


def test_block_recompute_counts_layers_per_pipeline_stage() -> None:
    model = cfg(**{**TINY_GPT, "num_layers": 4}, pipeline_model_parallel_size=2,
                recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    flops = model_flops_per_iteration(model, 1)
    # two stages of two layers; the first layer of each is recomputed
    assert flops.hardware_total - flops.total == 2 * (110592 + 196608) // 3 * 32


def test_selective_recompute_adds_core_attention_forward_only() -> None:
    flops = model_flops_per_iteration(cfg(**TINY_GPT, recompute_granularity="selective"), 2)
    core_forward = 2 * 64 * 32  # QK^T and PV, causal half, forward only
    assert flops.hardware_total == flops.total + 2 * core_forward * 64


def test_llama2_7b_agrees_with_six_n_rule() -> None:
    h, layers, ffn, vocab, s = 4096, 32, 11008, 32000, 4096
    model = cfg(num_layers=layers, hidden_size=h, num_attention_heads=32, ffn_hidden_size=ffn,
                swiglu=True, vocab_size=vocab, seq_length=s)
    flops = model_flops_per_iteration(model, global_batch_size=4)
    tokens = 4 * s
    # N: weights a token meets (attention 4h^2 + gated MLP 3 h ffn per layer, output layer
    # h V); the input embedding is a lookup and costs no FLOPs.
    n = layers * (4 * h * h + 3 * h * ffn) + h * vocab
    attention_scores = 12 * layers * h * s * tokens / 2  # causal
    assert flops.total == pytest.approx(6 * n * tokens + attention_scores, rel=1e-12)
    # With the published 6.74e9 parameters (embedding included) the rule is 2% off.
    assert flops.total == pytest.approx(6 * 6.74e9 * tokens + attention_scores, rel=0.03)


def test_batch_size_must_be_positive() -> None:
    with pytest.raises(ModelConfigError, match="'global_batch_size' must be a positive integer"):
        model_flops_per_iteration(cfg(**TINY_GPT), 0)
