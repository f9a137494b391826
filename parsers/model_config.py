"""A training job's model dimensions, under Megatron-LM's argument names, validated.

Every source (a ``--model-config`` YAML/JSON file, a preset, the target's Megatron
command line, a Hugging Face ``config.json``) is first turned into a *layer*: a
dict of field names to values, checked field by field. Layers are merged with
:func:`merge_model_fields` (earlier wins) and the result becomes a
:class:`ModelConfig` through :func:`model_config_from_mapping`, which adds the
checks that need several fields at once. Pure: text and dicts in, no I/O.
See docs/model-config.md for every key.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Literal

import yaml
from perfmon.parsers.errors import ModelConfigError

RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]


@dataclass(frozen=True)
class ModelConfig:
    """Model dimensions and the parallel layout that affects them, as Megatron-LM names them.

    Sizes are element counts (hidden units, tokens, layers); ``None`` means "not
    given" and the ``effective_*`` properties apply Megatron's default. Build it
    with :func:`model_config_from_mapping`; constructing it directly runs the
    same checks but names no source in its errors.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int | None = None
    padded_vocab_size: int | None = None
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    group_query_attention: bool = False
    kv_channels: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    swiglu: bool = False
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    mtp_num_layers: int | None = None
    recompute_granularity: RecomputeGranularity | None = None
    recompute_method: RecomputeMethod | None = None
    recompute_num_layers: int | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.moe_layer_freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        problem = next(_field_problems(values), None) or _cross_field_problem(values)
        if problem:
            raise ModelConfigError(f"model config: {problem}")

    @property
    def effective_kv_channels(self) -> int:
        """Per-head projection width; Megatron's default is hidden_size // num_attention_heads."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def effective_num_query_groups(self) -> int:
        """Key/value heads; Megatron ignores num_query_groups without group_query_attention."""
        if self.group_query_attention and self.num_query_groups is not None:
            return self.num_query_groups
        return self.num_attention_heads

    @property
    def effective_ffn_hidden_size(self) -> int:
        """MLP width of a dense layer, defaulted as Megatron's validate_args does."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            # Megatron keeps the gated MLP near 4h of parameters: int(4h * 2/3 / 64) * 64.
            return 8 * self.hidden_size // 3 // 64 * 64
        return 4 * self.hidden_size

    @property
    def effective_moe_ffn_hidden_size(self) -> int:
        """MLP width of one routed expert (Megatron falls back to ffn_hidden_size)."""
        if self.moe_ffn_hidden_size is not None:
            return self.moe_ffn_hidden_size
        return self.effective_ffn_hidden_size

    @property
    def effective_padded_vocab_size(self) -> int:
        """Output-layer width: vocab_size rounded up like Megatron's _vocab_size_with_padding."""
        if self.padded_vocab_size is not None:
            return self.padded_vocab_size
        assert self.vocab_size is not None  # checked at construction
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @property
    def moe_layer_pattern(self) -> tuple[int, ...]:
        """1 for each decoder layer whose MLP is a mixture of experts, 0 for a dense one."""
        if self.num_experts is None:
            return (0,) * self.num_layers
        if isinstance(self.moe_layer_freq, int):
            return tuple(int(i % self.moe_layer_freq == 0) for i in range(self.num_layers))
        return self.moe_layer_freq


_FIELD_NAMES = tuple(f.name for f in fields(ModelConfig))
_REQUIRED = tuple(f.name for f in fields(ModelConfig) if f.default is MISSING)
_DEFAULTS = {f.name: f.default for f in fields(ModelConfig) if f.default is not MISSING}
_BOOL_FIELDS = frozenset({"group_query_attention", "swiglu", "multi_latent_attention"})
_CHOICE_FIELDS: dict[str, tuple[str, ...]] = {
    "recompute_granularity": ("full", "selective"),
    "recompute_method": ("uniform", "block"),
}
# Megatron treats 0 MTP layers like none; every other size must be at least 1.
_NON_NEGATIVE_FIELDS = frozenset({"mtp_num_layers"})
_MLA_SIZES = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
# Patterns such as "([0]*3+[1]*58)*1" expand to one entry per layer; this bounds a typo's cost.
_MAX_PATTERN_LENGTH = 100_000
# Upper bounds on sizes, far above any real model, so that a value from an
# untrusted source can neither allocate per layer nor overflow a float.
_MAX_VALUE = {
    "num_layers": 10**5, "mtp_num_layers": 10**5, "recompute_num_layers": 10**5,
    "hidden_size": 10**7, "kv_channels": 10**7, "q_lora_rank": 10**7, "kv_lora_rank": 10**7,
    "qk_head_dim": 10**7, "qk_pos_emb_head_dim": 10**7, "v_head_dim": 10**7,
    "ffn_hidden_size": 10**8, "moe_ffn_hidden_size": 10**8,
    "moe_shared_expert_intermediate_size": 10**8,
    "seq_length": 10**8, "max_position_embeddings": 10**8,
    "num_attention_heads": 10**6, "num_query_groups": 10**6, "num_experts": 10**6,
    "moe_router_topk": 10**6, "make_vocab_size_divisible_by": 10**6,
    "tensor_model_parallel_size": 10**6, "pipeline_model_parallel_size": 10**6,
    "context_parallel_size": 10**6, "expert_model_parallel_size": 10**6,
}
_DEFAULT_MAX_VALUE = 10**9  # vocabularies and batch sizes
# Nesting deeper than this in a config file is not a model description.
MAX_NESTING = 32


def max_value(name: str) -> int:
    """The largest value an integer model field may take."""
    return _MAX_VALUE.get(name, _DEFAULT_MAX_VALUE)


def _shown(value: object, redact: bool) -> str:
    """A value for an error message: its repr, or only its type for untrusted sources."""
    return f"a {type(value).__name__}" if redact else repr(value)


def parse_moe_layer_freq(text: str) -> int | tuple[int, ...]:
    """Evaluate a Megatron ``--moe-layer-freq`` value without ``eval``.

    Accepts an integer ("2") or a list expression of integer literals, ``+``, ``*``
    and parentheses ("[0,1,1]", "([0]*1+[1]*26)", "([1]*3+[0]*2)*2"), as Megatron's
    moe_freq_type does. Surrounding quotes left by a shell are dropped.
    Raises ValueError on anything else.
    """
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1].strip()
    # A job's command line holds it: shown bounded, and a chain of 50,000 "+" is past
    # the parser's or the evaluator's recursion (RecursionError), not a pattern.
    shown = repr(text) if len(text) <= 60 else f"{text[:60]!r}... ({len(text)} characters)"
    try:
        tree = ast.parse(text, mode="eval")
        value = _eval_pattern(tree.body)
    except (SyntaxError, RecursionError, MemoryError) as err:
        raise ValueError(f"cannot parse {shown}") from err
    return value if isinstance(value, int) else tuple(value)


def _eval_pattern(node: ast.expr) -> int | list[int]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_eval_pattern(item) for item in node.elts]
        flat = [item for item in items if isinstance(item, int)]
        if len(flat) == len(items):
            return flat
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
        left, right = _eval_pattern(node.left), _eval_pattern(node.right)
        adding = isinstance(node.op, ast.Add)
        if isinstance(left, int) and isinstance(right, int):
            return left + right if adding else left * right
        if adding and isinstance(left, list) and isinstance(right, list):
            return left + right
        seq, times = (left, right) if isinstance(left, list) else (right, left)
        if not adding and isinstance(seq, list) and isinstance(times, int):
            if len(seq) * times > _MAX_PATTERN_LENGTH:
                raise ValueError(f"pattern longer than {_MAX_PATTERN_LENGTH} layers")
            return seq * times
    shown = ast.unparse(node)
    raise ValueError(f"unsupported expression {shown[:60]!r}"
                     + (f"... ({len(shown)} characters)" if len(shown) > 60 else ""))


def _unknown_key_message(key: object) -> str:
    if not isinstance(key, str):
        return f"key {key!r} is not a field name"
    guess = key.replace("-", "_")
    close = [guess] if guess in _FIELD_NAMES else difflib.get_close_matches(guess, _FIELD_NAMES, 1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{hint}"


def _field_problems(values: Mapping[str, Any], redact: bool = False) -> Iterator[str]:
    """Yield one message per field whose type or range is wrong (None means unset).

    ``redact``: name only the type of a wrong value (it came from a file the job
    named, which the user may not be entitled to see).
    """
    for name, value in values.items():
        if value is None:
            continue
        if name in _BOOL_FIELDS:
            if not isinstance(value, bool):
                yield f"{name!r} must be true or false, got {_shown(value, redact)}"
        elif name in _CHOICE_FIELDS:
            if not isinstance(value, str) or value not in _CHOICE_FIELDS[name]:
                choices = ", ".join(repr(c) for c in _CHOICE_FIELDS[name])
                yield f"{name!r} must be one of {choices}, got {_shown(value, redact)}"
        elif name == "moe_layer_freq" and isinstance(value, tuple | list):
            if len(value) > _MAX_PATTERN_LENGTH:
                yield f"'moe_layer_freq' has more than {_MAX_PATTERN_LENGTH} entries"
                continue
            bad = [i for i, v in enumerate(value) if type(v) is not int or v not in (0, 1)]
            if bad:
                yield (f"'moe_layer_freq' entries must be 0 or 1, "
                       f"got {_shown(value[bad[0]], redact)} at index {bad[0]}")
        else:
            lowest = 0 if name in _NON_NEGATIVE_FIELDS else 1
            if type(value) is not int or value < lowest:
                kind = "a non-negative" if lowest == 0 else "a positive"
                yield f"{name!r} must be {kind} integer, got {_shown(value, redact)}"
            elif value > max_value(name):
                yield f"{name!r} must be at most {max_value(name):,}, got {_shown(value, redact)}"


def _cross_field_problem(v: Mapping[str, Any], redact: bool = False) -> str | None:
    """The first missing or inconsistent field, or None; ``v`` holds every optional field.

    ``redact``: the message names the fields but none of their values.
    """
    def show(value: object) -> str:
        return "" if redact else f" ({value})"

    for name in _REQUIRED:
        if v.get(name) is None:
            return f"missing required field {name!r}"
    hidden, heads = v["hidden_size"], v["num_attention_heads"]
    if v["vocab_size"] is None and v["padded_vocab_size"] is None:
        return "missing required field 'vocab_size' (or 'padded_vocab_size')"
    if v["kv_channels"] is None and hidden % heads:
        return (f"num_attention_heads{show(heads)} does not divide hidden_size{show(hidden)} "
                "and kv_channels is not set")
    if v["group_query_attention"]:
        groups = v["num_query_groups"]
        if groups is None:
            return "group_query_attention is true but num_query_groups is not set"
        if heads % groups:
            return (f"num_query_groups{show(groups)} does not divide "
                    f"num_attention_heads{show(heads)}")
    if v["multi_latent_attention"]:
        if v["group_query_attention"]:
            # Megatron asserts this too: MLA has its own key/value compression.
            return "multi_latent_attention and group_query_attention cannot both be true"
        for name in _MLA_SIZES:
            if v[name] is None:
                return f"multi_latent_attention is true but {name!r} is not set"
    freq = v["moe_layer_freq"]
    if isinstance(freq, tuple | list) and len(freq) != v["num_layers"]:
        if redact:
            return "moe_layer_freq and num_layers disagree on the number of layers"
        return f"moe_layer_freq has {len(freq)} entries but num_layers is {v['num_layers']}"
    experts = v["num_experts"]
    if experts is not None and v["moe_router_topk"] > experts:
        return f"moe_router_topk{show(v['moe_router_topk'])} exceeds num_experts{show(experts)}"
    if v["recompute_method"] == "block" and v["recompute_num_layers"] is None:
        return "recompute_method 'block' needs recompute_num_layers"
    return None


def model_fields_from_mapping(mapping: Mapping[str, object], source: str,
                              redact: bool = False) -> dict[str, object]:
    """Check one source's fields on their own and return them as a layer.

    Unknown keys (with a did-you-mean), wrong types and out-of-range values raise
    ModelConfigError naming ``source`` and the field. ``None`` values are dropped
    (unset, so a later layer may supply them); a ``moe_layer_freq`` string is
    evaluated and a list becomes a tuple; num_query_groups without
    group_query_attention implies group_query_attention. Checks that need
    several fields wait for :func:`model_config_from_mapping`. ``redact``: error
    messages name fields and types but no values (an untrusted source).
    """
    layer: dict[str, object] = {}
    for key, raw in mapping.items():
        if key not in _FIELD_NAMES:
            message = "an unknown key" if redact else _unknown_key_message(key)
            raise ModelConfigError(f"model config {source}: {message}")
        value = raw
        if key == "moe_layer_freq" and isinstance(raw, str):
            try:
                value = parse_moe_layer_freq(raw)
            except ValueError as err:
                why = "not an integer or list pattern" if redact else str(err)
                raise ModelConfigError(f"model config {source}: 'moe_layer_freq': {why}"
                                       ) from err
        elif key == "moe_layer_freq" and isinstance(raw, list):
            value = tuple(raw)
        if value is not None:
            layer[key] = value
    if "num_query_groups" in layer and "group_query_attention" not in layer:
        # A source that names key/value groups means GQA; Megatron would silently ignore them.
        layer["group_query_attention"] = True
    problem = next(_field_problems(layer, redact), None)
    if problem:
        raise ModelConfigError(f"model config {source}: {problem}")
    return layer


def model_config_from_mapping(mapping: Mapping[str, object], source: str,
                              redact: bool = False) -> ModelConfig:
    """Validate a merged set of fields and build the ModelConfig.

    ``source`` names where the fields came from in every error message.
    Raises ModelConfigError for unknown keys, missing required fields (num_layers,
    hidden_size, num_attention_heads, seq_length, vocab_size or padded_vocab_size),
    wrong types, non-positive or too large sizes and inconsistent fields;
    ``redact`` as in :func:`model_fields_from_mapping`.
    """
    layer = model_fields_from_mapping(mapping, source, redact)
    problem = _cross_field_problem({**_DEFAULTS, **layer}, redact)
    if problem:
        raise ModelConfigError(f"model config {source}: {problem}")
    return ModelConfig(**layer)  # type: ignore[arg-type]  # types checked above


# FlagScale's train YAML keeps Megatron arguments in sections: model dimensions and
# batch sizes under model:, parallel sizes, recompute and vocabulary padding under
# system:, the tokenizer's vocab_size under data: tokenizer:.
_FLAGSCALE_SECTIONS = (("model",), ("system",), ("data", "tokenizer"))


def check_nesting(data: object, source: str, limit: int = MAX_NESTING) -> None:
    """Raise ModelConfigError when lists and mappings nest deeper than ``limit``.

    Iterative, and each container is visited once (YAML anchors can make a
    structure that contains itself).
    """
    seen: set[int] = set()
    stack: list[tuple[object, int]] = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, Mapping | list | tuple) or id(node) in seen:
            continue
        if depth >= limit:
            raise ModelConfigError(f"model config {source}: nested deeper than {limit} levels")
        seen.add(id(node))
        children = node.values() if isinstance(node, Mapping) else node
        stack.extend((child, depth + 1) for child in children)


def decode_config_text(data: bytes | str, source: str) -> str:
    """Config file bytes as text; ModelConfigError for binary or non-UTF-8 content."""
    if isinstance(data, str):
        return data
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ModelConfigError(
            f"model config {source}: not UTF-8 text (byte {err.start})") from None
    if "\0" in text:
        raise ModelConfigError(f"model config {source}: binary data, not a text file")
    return text


def parse_model_config_fields(data: bytes | str, source: str) -> dict[str, object]:
    """Read a YAML or JSON model config file's content into a checked layer of fields.

    The top level is a mapping of field names (strict: unknown keys are errors),
    or a FlagScale train config with a ``model:`` mapping, whose ``model:``,
    ``system:`` and ``data: tokenizer:`` sections are searched for known fields
    and whose other keys (learning rates, logging, ...) are ignored.
    Raises ModelConfigError with the parser's line and column for unparsable
    text, and for binary, non-UTF-8 or too deeply nested content.
    """
    text = decode_config_text(data, source)
    try:
        loaded: Any = yaml.safe_load(text)
    except RecursionError:
        raise ModelConfigError(
            f"model config {source}: nested deeper than {MAX_NESTING} levels") from None
    except ValueError as err:  # e.g. an integer beyond Python's digit limit
        raise ModelConfigError(f"model config {source}: unreadable value: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ModelConfigError(
            f"model config {source}: not valid YAML/JSON{where}: {problem}"
        ) from err
    if not isinstance(loaded, Mapping):
        raise ModelConfigError(
            f"model config {source}: the top level must be a mapping of field names to values, "
            f"got {type(loaded).__name__}"
        )
    check_nesting(loaded, source)
    if isinstance(loaded.get("model"), Mapping):
        loaded = merge_model_fields(*(_section(loaded, path) for path in _FLAGSCALE_SECTIONS))
    return model_fields_from_mapping(loaded, source)


def _section(data: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, object]:
    node: Any = data
    for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
    if not isinstance(node, Mapping):
        return {}
    return {k: v for k, v in node.items() if k in _FIELD_NAMES}


def merge_model_fields(*layers: Mapping[str, object]) -> dict[str, object]:
    """Merge layers of fields; for each key the earliest layer with a non-None value wins."""
    merged: dict[str, object] = {}
    for layer in layers:
        for key, value in layer.items():
            if value is not None:
                merged.setdefault(key, value)
    return merged
