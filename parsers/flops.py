"""Floating-point operations of one training iteration, as Megatron-LM counts them.

``total`` is term by term Megatron-LM's ``num_floating_point_operations(args,
batch_size)`` (megatron/training/training.py, transformer branch, read at commit
001b00c2734d8f0fad096fe48a382fedf755d321), itself the per-GEMM count of
Narayanan et al., arXiv 2104.04473, appendix: every GEMM costs 2 FLOPs per
multiply-add and runs three times (forward, data gradient, weight gradient).
``hardware_total`` adds the forward passes that activation recomputation repeats.
Arithmetic is exact (fractions) until the final float. See docs/flops.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from perfmon.parsers.errors import ModelConfigError
from perfmon.parsers.model_config import ModelConfig

# 3 GEMMs per weight (forward, dgrad, wgrad) x 2 FLOPs per multiply-add.
_FWD_BWD_GEMM = 6


@dataclass(frozen=True)
class FlopsBreakdown:
    """FLOPs of one iteration (forward + backward) over ``tokens`` tokens, split by where spent.

    ``attention``, ``mlp`` and ``logits`` cover the ``num_layers`` decoder layers and
    the output layer; ``mtp`` everything multi-token prediction adds (its
    transformer layers, norms, projection and extra logits), so the four add up
    to ``total``, Megatron's model FLOPs. ``hardware_total`` also counts the
    forward passes repeated by activation recomputation. All in FLOPs.
    """

    attention: float
    mlp: float
    logits: float
    mtp: float
    total: float
    hardware_total: float
    tokens: int

    @property
    def per_token(self) -> float:
        """Model FLOPs per token (forward + backward)."""
        return self.total / self.tokens


@dataclass(frozen=True)
class _PerToken:
    """Forward+backward FLOPs per token of one layer's parts."""

    attention: Fraction  # projections plus core attention
    core_attention: Fraction  # the s^2 part only: QK^T and (QK^T)V
    dense_mlp: Fraction
    moe_mlp: Fraction  # routed experts actually used plus shared experts


def _per_token(cfg: ModelConfig) -> _PerToken:
    h, s, heads = cfg.hidden_size, cfg.seq_length, cfg.num_attention_heads
    if cfg.multi_latent_attention:
        assert cfg.kv_lora_rank is not None and cfg.qk_head_dim is not None
        assert cfg.qk_pos_emb_head_dim is not None and cfg.v_head_dim is not None
        qk, rope, v = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank is None:
            q_proj = h * heads * (qk + rope)
        else:
            # down-projection, up-projection, and the q norm (+1)
            q_proj = cfg.q_lora_rank * (h + heads * (qk + rope) + 1)
        linear = (
            q_proj
            + cfg.kv_lora_rank * (h + heads * (qk + v) + 1)  # kv down/up-projection + kv norm
            + h * rope  # the shared rotary key
            + heads * v * h  # output projection
        )
        # Causal mask: only half of the s x s scores are computed.
        core = Fraction(s * heads * (qk + rope), 2) + Fraction(s * heads * v, 2)
    else:
        kv = cfg.effective_kv_channels
        query = kv * heads
        key_value = kv * cfg.effective_num_query_groups
        linear = h * (query + 2 * key_value) + query * h  # QKV and output projections
        core = Fraction(query * s, 2) * 2  # causal half of QK^T, and of (QK^T)V
    glu = 3 if cfg.swiglu else 2  # a gated MLP has two input matrices
    moe_width = cfg.effective_moe_ffn_hidden_size * cfg.moe_router_topk
    moe_width += cfg.moe_shared_expert_intermediate_size or 0  # shared experts see every token
    return _PerToken(
        attention=_FWD_BWD_GEMM * (linear + core),
        core_attention=_FWD_BWD_GEMM * core,
        dense_mlp=Fraction(_FWD_BWD_GEMM * h * cfg.effective_ffn_hidden_size * glu),
        moe_mlp=Fraction(_FWD_BWD_GEMM * h * moe_width * glu),
    )


def _recomputed_layers(cfg: ModelConfig) -> list[int]:
    """Decoder layers whose forward runs twice under full recomputation."""
    if cfg.recompute_method != "block":
        return list(range(cfg.num_layers))  # "uniform" checkpoints every layer
    # "block" checkpoints the first recompute_num_layers layers of each pipeline stage;
    # stages are taken as equal, ceil(num_layers / pipeline size) layers each.
    stage = -(-cfg.num_layers // cfg.pipeline_model_parallel_size)
    first = cfg.recompute_num_layers or 0
    return [i for i in range(cfg.num_layers) if i % stage < first]


def model_flops_per_iteration(cfg: ModelConfig, global_batch_size: int) -> FlopsBreakdown:
    """FLOPs of one training iteration over ``global_batch_size`` sequences of cfg.seq_length.

    Raises ModelConfigError if global_batch_size is not a positive integer.
    """
    if type(global_batch_size) is not int or global_batch_size < 1:
        raise ModelConfigError(
            "model config: 'global_batch_size' must be a positive integer, "
            f"got {global_batch_size!r}"
        )
    part = _per_token(cfg)
    pattern = cfg.moe_layer_pattern
    num_moe = sum(pattern)
    mtp_layers = cfg.mtp_num_layers or 0
    h = cfg.hidden_size
    logits = Fraction(_FWD_BWD_GEMM * h * cfg.effective_padded_vocab_size)
    # Megatron builds MTP layers like the last decoder layer (MoE or dense).
    mtp_mlp = part.moe_mlp if pattern[-1] else part.dense_mlp
    mtp_norms_proj = _FWD_BWD_GEMM * (3 * h + 2 * h * h)  # eh norms + final norm, eh projection

    attention = cfg.num_layers * part.attention
    mlp = (cfg.num_layers - num_moe) * part.dense_mlp + num_moe * part.moe_mlp
    mtp = mtp_layers * (part.attention + mtp_mlp + mtp_norms_proj + logits)
    total = attention + mlp + logits + mtp

    # Recomputation repeats forwards only: a forward is 1/3 of a layer's fwd+bwd FLOPs.
    repeated = Fraction(0)
    if cfg.recompute_granularity == "full":
        layer_mlp = [part.moe_mlp if moe else part.dense_mlp for moe in pattern]
        repeated = sum(
            (part.attention + layer_mlp[i] for i in _recomputed_layers(cfg)), Fraction(0)
        )
        # Megatron-core's MultiTokenPredictionLayer checkpoints itself under "full" too.
        repeated += mtp_layers * (part.attention + mtp_mlp)
    elif cfg.recompute_granularity == "selective":
        # Selective recomputation (Korthikanti et al., arXiv 2205.05198) redoes core attention.
        repeated = (cfg.num_layers + mtp_layers) * part.core_attention
    tokens = global_batch_size * cfg.seq_length
    return FlopsBreakdown(
        attention=float(attention * tokens),
        mlp=float(mlp * tokens),
        logits=float(logits * tokens),
        mtp=float(mtp * tokens),
        total=float(total * tokens),
        hardware_total=float((total + repeated / 3) * tokens),
        tokens=tokens,
    )
