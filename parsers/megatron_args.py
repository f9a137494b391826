"""Model and batch fields read from a training process's command line (its argv).

Megatron-LM and FlagScale jobs carry the whole model on their command line
(``--num-layers 32 --hidden-size=4096 ...``); Hugging Face Trainer jobs carry
where their ``config.json`` lives and the per-device batch. Only the flags listed
here are read; everything else in argv is ignored. Pure: a list of strings in.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from perfmon.parsers.errors import ModelConfigError
from perfmon.parsers.model_config import parse_moe_layer_freq

_INT_FLAGS = {
    f"--{name.replace('_', '-')}": name
    for name in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
        "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings",
        "micro_batch_size", "global_batch_size", "tensor_model_parallel_size",
        "pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
        "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size", "vocab_size", "padded_vocab_size",
        "make_vocab_size_divisible_by", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
        "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers", "recompute_num_layers",
    )
}  # fmt: skip
_STR_FLAGS = {"--recompute-granularity": "recompute_granularity",
              "--recompute-method": "recompute_method"}
_BOOL_FLAGS = {"--group-query-attention": "group_query_attention",
               "--swiglu": "swiglu",
               "--multi-latent-attention": "multi_latent_attention"}
# Any of these means argv describes a Megatron model, so an absent store_true flag is False.
_ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads")
# Megatron's argparse default for --num-query-groups, used when only the flag is given.
_MEGATRON_DEFAULT_QUERY_GROUPS = 1

_HF_CONFIG_FLAGS = ("--config_name", "--config-name",
                    "--model_name_or_path", "--model-name-or-path")
_HF_MICRO_BATCH_FLAGS = ("--per_device_train_batch_size", "--per-device-train-batch-size")
_HF_ACCUMULATION_FLAGS = ("--gradient_accumulation_steps", "--gradient-accumulation-steps")
# run_mlm/TRL SFT, run_clm, and FastChat/Alpaca-style scripts, in that order of preference.
_HF_SEQ_LENGTH_FLAGS = ("--max_seq_length", "--max-seq-length", "--block_size", "--block-size",
                        "--model_max_length", "--model-max-length")


def scan_flags(argv: Sequence[str], value_flags: Sequence[str],
          bool_flags: Sequence[str] = ()) -> Iterator[tuple[str, str | None]]:
    """Yield (flag, value) for each listed flag in argv; value is None for a bool flag.

    Takes both "--flag value" and "--flag=value". Raises ModelConfigError for a
    value flag with nothing after it.
    """
    i = 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        if name in bool_flags and not eq:
            yield name, None
        elif name in value_flags:
            if eq:
                yield name, inline
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1
                yield name, argv[i]
            else:
                raise ModelConfigError(f"target command line: {name} has no value")
        i += 1


def int_flag(flag: str, value: str) -> int:
    try:
        return int(value)  # what argparse's type=int accepts
    except ValueError:
        # The job's value, bounded: a command line can hold 100 KB in one argument.
        shown = repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value)} characters)"
        raise ModelConfigError(
            f"target command line: {flag} expects an integer, got {shown}"
        ) from None


def parse_megatron_cmdline(argv: Sequence[str]) -> dict[str, object]:
    """The Megatron/FlagScale model fields in argv, under ModelConfig's field names.

    Later occurrences of a flag win, as with argparse. When argv names the
    architecture (--num-layers, --hidden-size or --num-attention-heads), absent
    store_true flags (--swiglu, --group-query-attention, --multi-latent-attention)
    are reported False, as Megatron reads them, and so is --group-query-attention
    whenever --num-query-groups is given without it; ``--group-query-attention``
    without ``--num-query-groups`` gives Megatron's default of 1 group.
    Returns {} when argv has none of these flags. Raises ModelConfigError naming
    the flag when a value is not a number or a valid --moe-layer-freq.
    """
    fields: dict[str, object] = {}
    value_flags = [*_INT_FLAGS, *_STR_FLAGS, "--moe-layer-freq"]
    for flag, value in scan_flags(argv, value_flags, list(_BOOL_FLAGS)):
        if value is None:
            fields[_BOOL_FLAGS[flag]] = True
        elif flag in _STR_FLAGS:
            fields[_STR_FLAGS[flag]] = value
        elif flag == "--moe-layer-freq":
            try:
                fields["moe_layer_freq"] = parse_moe_layer_freq(value)
            except ValueError as err:
                raise ModelConfigError(f"target command line: --moe-layer-freq: {err}") from err
        else:
            fields[_INT_FLAGS[flag]] = int_flag(flag, value)
    if any(name in fields for name in _ARCHITECTURE_FIELDS):
        for name in _BOOL_FLAGS.values():
            fields.setdefault(name, False)
    if "num_query_groups" in fields:
        fields.setdefault("group_query_attention", False)  # Megatron ignores groups without it
    if fields.get("group_query_attention"):
        fields.setdefault("num_query_groups", _MEGATRON_DEFAULT_QUERY_GROUPS)
    return fields


def hf_config_locations(argv: Sequence[str]) -> list[str]:
    """Where a Hugging Face job's config.json may be: --config_name first, then
    --model_name_or_path (directories or hub names, as given; dash spellings too).
    """
    found: dict[str, list[str]] = {"config": [], "model": []}
    for flag, value in scan_flags(argv, _HF_CONFIG_FLAGS):
        assert value is not None
        found["config" if "config" in flag else "model"].append(value)
    # Last occurrence wins in argparse, so it goes first within its kind.
    ordered = [*reversed(found["config"]), *reversed(found["model"])]
    return list(dict.fromkeys(ordered))


def cmdline_batch_fields(argv: Sequence[str], world_size: int | None = None) -> dict[str, object]:
    """Batch fields of a Hugging Face Trainer-style command line.

    micro_batch_size from --per_device_train_batch_size; seq_length from
    --max_seq_length, else --block_size, else --model_max_length; and, when
    ``world_size`` (data-parallel ranks) is given, global_batch_size =
    per-device batch x --gradient_accumulation_steps (default 1) x world_size.
    Absent flags give absent fields. Raises ModelConfigError naming a flag whose
    value is not an integer.
    """
    values: dict[str, int] = {}
    flags = (*_HF_MICRO_BATCH_FLAGS, *_HF_ACCUMULATION_FLAGS, *_HF_SEQ_LENGTH_FLAGS)
    for flag, value in scan_flags(argv, flags):
        assert value is not None
        values[flag.lstrip("-").replace("-", "_")] = int_flag(flag, value)
    fields: dict[str, object] = {}
    seq_length = next((values[k] for k in ("max_seq_length", "block_size", "model_max_length")
                       if k in values), None)
    if seq_length is not None:
        fields["seq_length"] = seq_length
    micro = values.get("per_device_train_batch_size")
    if micro is not None:
        fields["micro_batch_size"] = micro
        if world_size is not None:
            accumulation = values.get("gradient_accumulation_steps", 1)
            fields["global_batch_size"] = micro * accumulation * world_size
    return fields
