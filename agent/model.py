"""Where the model's dimensions and the batch come from, and what one iteration computes.

Sources, earliest wins field by field: ``--model-config FILE``, the target's
own Megatron/FlagScale-style command line, a Hugging Face ``config.json`` its
command line points at (read through /proc/PID/root and relative to
/proc/PID/cwd, so containers work), and last ``--model-preset NAME``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from perfmon.agent.aggregate import Workload
from perfmon.parsers.errors import ModelConfigError
from perfmon.parsers.flops import model_flops_per_iteration
from perfmon.parsers.hf_config import hf_config_to_fields
from perfmon.parsers.megatron_args import (
    cmdline_batch_fields,
    hf_config_locations,
    parse_megatron_cmdline,
)
from perfmon.parsers.model_config import (
    ModelConfig,
    merge_model_fields,
    model_config_from_mapping,
    parse_model_config_fields,
)
from perfmon.parsers.presets import preset_fields
from perfmon.probes.procfs import TargetProcess


def read_model_config_file(path: str) -> dict[str, Any]:
    """The fields a YAML/JSON model config file sets; ModelConfigError names the file and field."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError as err:
        raise ModelConfigError(f"model config {path}: no such file") from err
    except OSError as err:
        raise ModelConfigError(f"model config {path}: cannot read: {err.strerror}") from err
    return parse_model_config_fields(text, source=path)


def _hf_fields(target: TargetProcess) -> tuple[dict[str, Any], str | None]:
    for location in hf_config_locations(target.cmdline):
        base = Path(location)
        if not base.is_absolute():
            base = Path(f"/proc/{target.pid}/cwd") / base
        else:
            base = Path(f"/proc/{target.pid}/root{location}")
        candidate = base / "config.json" if not base.name.endswith(".json") else base
        try:
            data = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            return hf_config_to_fields(data), location
    return {}, None


def explicit_model_fields(
    config_file: str | None, preset: str | None
) -> list[tuple[str, dict[str, Any]]]:
    """The user's own model sources (file, preset), read and checked before any process is."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if config_file:
        layers.append((f"model_config:{config_file}", read_model_config_file(config_file)))
    if preset:
        layers.append((f"preset:{preset}", preset_fields(preset)))
    return layers


def resolve_model(
    target: TargetProcess, explicit: list[tuple[str, dict[str, Any]]]
) -> tuple[ModelConfig | None, dict[str, Any]]:
    """The model config from every source, and a description of where each part came from.

    ``explicit`` comes from :func:`explicit_model_fields` and wins over what the
    target's command line and Hugging Face config say. Returns (None,
    description) when no source names the model's dimensions.
    """
    # A preset is a typical shape: what the job itself says (its command line,
    # its config.json) beats it, and only the user's own file beats the job.
    layers = [layer for layer in explicit if not layer[0].startswith("preset:")]
    cmdline_fields = {**cmdline_batch_fields(target.cmdline),
                      **parse_megatron_cmdline(target.cmdline)}
    if cmdline_fields:
        layers.append(("cmdline", cmdline_fields))
    hf, location = _hf_fields(target)
    if hf:
        layers.append((f"hf_config:{location}", hf))
    layers += [layer for layer in explicit if layer[0].startswith("preset:")]
    used = [name for name, fields in layers if fields]
    description: dict[str, Any] = {"source": "+".join(used) if used else "none"}
    if not used:
        return None, description
    merged = merge_model_fields(*(fields for _, fields in layers))
    # Which source gave each field, so the summary says what was given and by whom.
    description["field_sources"] = {
        key: next(name for name, fields in layers if fields.get(key) is not None)
        for key in merged
    }
    if "seq_length" not in merged and "max_position_embeddings" in merged:
        merged["seq_length"] = merged["max_position_embeddings"]
        description["field_sources"]["seq_length"] = "max_position_embeddings"
    try:
        return model_config_from_mapping(merged, source=description["source"]), description
    except ModelConfigError as err:
        if explicit:
            raise  # the user named the model: an incomplete or wrong one is an error
        # Found on the job's own command line or config.json: a job that names only
        # some dimensions is still measured, without FLOPs.
        description["problem"] = str(err)
        return None, description


def build_workload(
    cfg: ModelConfig | None, target: TargetProcess, peak_tflops: float | None
) -> tuple[Workload, dict[str, Any]]:
    """The per-iteration workload and the model section of session_info."""
    world_size = _positive_int(target.environ.get("WORLD_SIZE")) or 1
    if cfg is None:
        return Workload(world_size=world_size, peak_tflops=peak_tflops), {}
    parallel = (
        cfg.tensor_model_parallel_size
        * cfg.pipeline_model_parallel_size
        * cfg.context_parallel_size
    )
    if world_size % parallel:
        raise ModelConfigError(
            f"pid {target.pid}: WORLD_SIZE {world_size} is not a multiple of "
            f"tensor x pipeline x context parallel size ({parallel})"
        )
    flops_per_sample = model_flops_per_iteration(cfg, 1)
    workload = Workload(
        flops_per_sample=flops_per_sample.total,
        hardware_flops_per_sample=(
            flops_per_sample.hardware_total if cfg.recompute_granularity else None
        ),
        seq_length=cfg.seq_length,
        global_batch_size=cfg.global_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        data_parallel_size=world_size // parallel,
        world_size=world_size,
        peak_tflops=peak_tflops,
    )
    batch = "given" if cfg.global_batch_size else (
        "derived: micro_batch_size x microbatches_per_step x data_parallel_size"
        if cfg.micro_batch_size else "unknown"
    )
    info = {
        "dimensions": {k: v for k, v in asdict(cfg).items() if v is not None},
        "flops_per_sample": flops_per_sample.total,
        "flops_per_iteration": (
            flops_per_sample.total * cfg.global_batch_size if cfg.global_batch_size else None
        ),
        # Activation recomputation repeats forward passes: more work for the
        # hardware, the same model FLOPs (docs/flops.md).
        "hardware_flops_per_sample": (
            flops_per_sample.hardware_total if cfg.recompute_granularity else None
        ),
        "flops_breakdown_per_sample": {
            "attention": flops_per_sample.attention,
            "mlp": flops_per_sample.mlp,
            "logits": flops_per_sample.logits,
            "mtp": flops_per_sample.mtp,
        },
        "global_batch_size": batch,
        "world_size": world_size,
        "world_size_from": "WORLD_SIZE" if "WORLD_SIZE" in target.environ else "default 1",
        "data_parallel_size": world_size // parallel,
    }
    return workload, info


def _positive_int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() and int(value) > 0 else None

