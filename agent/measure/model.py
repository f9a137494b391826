"""Where the model's dimensions and the batch come from, and what one iteration computes.

Sources, earliest wins field by field: ``--model-config FILE``, the target's
own Megatron/FlagScale-style command line, a Hugging Face ``config.json`` its
command line points at (read through /proc/PID/root and relative to
/proc/PID/cwd, so containers work), and last ``--model-preset NAME``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from perfmon.parsers.errors import InputFileError, ModelConfigError
from perfmon.parsers.flops import model_flops_per_iteration
from perfmon.parsers.hf_config import hf_config_to_fields, parse_hf_config
from perfmon.parsers.job_identity import world_size as env_world_size
from perfmon.parsers.megatron_args import (
    cmdline_batch_fields,
    hf_config_locations,
    parse_megatron_cmdline,
)
from perfmon.parsers.model_config import (
    ModelConfig,
    merge_model_fields,
    model_config_from_mapping,
    model_fields_from_mapping,
    parse_model_config_fields,
)
from perfmon.parsers.parallel_layout import ParallelLayout, parse_layout
from perfmon.parsers.presets import preset_fields
from perfmon.parsers.workload import Workload
from perfmon.probes.files import read_user_file
from perfmon.probes.job_files import JobFileError, JobFileMissing, read_job_file
from perfmon.probes.procfs import TargetProcess


def job_layout(target: TargetProcess, fields: dict[str, Any]) -> tuple[dict[str, Any],
                                                                        str | None]:
    """session_info.layout of the job (perfmon.parsers.parallel_layout): as its command
    line states it, else as the model's fields (``--model-config``) do; and a warning
    where the command line states one its world cannot hold."""
    world, _ = _world_size(target.environ)
    try:
        layout = parse_layout(target.cmdline, world)
    except ModelConfigError as err:
        return ParallelLayout(world, stated=False).to_facts(None), (
            f"pid {target.pid}: parallel layout not used: {err}")
    if layout.stated:
        return layout.to_facts("command_line"), None
    sizes = {k: fields.get(f"{name}_parallel_size", 1) for k, name in (
        ("tp", "tensor_model"), ("pp", "pipeline_model"), ("cp", "context"),
        ("ep", "expert_model"))}
    if any(v != 1 for v in sizes.values()) and world % (sizes["tp"] * sizes["pp"]
                                                         * sizes["cp"]) == 0:
        return ParallelLayout(world, **sizes, etp=sizes["tp"]).to_facts("model_config"), None
    return layout.to_facts(None), None


def read_model_config_file(path: str) -> dict[str, Any]:
    """The fields a YAML/JSON model config file sets; ModelConfigError names the file and field.

    The file is the user's: read with the agent's rights, but only a regular
    file of at most MAX_CONFIG_BYTES, never through a link another user owns.
    """
    try:
        data = read_user_file(path, "model config")
    except InputFileError as err:
        raise ModelConfigError(str(err)) from err
    return parse_model_config_fields(data, source=path)


def _hf_fields(target: TargetProcess) -> tuple[dict[str, Any], str | None, list[str]]:
    """(fields, location, warnings) of the first config.json the job names that can be read.

    Read with the job's credentials (perfmon.probes.job_files.read_job_file): what
    the job's user may not read, the agent does not read either.
    """
    warnings: list[str] = []
    for location in hf_config_locations(target.cmdline):
        # A folder holding config.json (the usual), or the config file itself.
        candidates = [location] if location.endswith(".json") else [
            f"{location.rstrip('/')}/config.json", location]
        for candidate in candidates:
            try:
                data = read_job_file(target.pid, candidate)
                fields = hf_config_to_fields(parse_hf_config(data, candidate))
                # Checked field by field here (redacted: the job's file), so that a
                # config.json with impossible values is passed over like an unreadable one.
                model_fields_from_mapping(fields, f"pid {target.pid}: {candidate}", redact=True)
                return fields, location, warnings
            except JobFileMissing as err:
                if err.under_a_file:
                    continue  # the location is a file: try it as the config itself
                break  # a hub model name rather than a folder: nothing to read
            except (JobFileError, ModelConfigError) as err:
                warnings.append(f"config.json the job names not used: {err}")
                break
    return {}, None, warnings


@dataclass(frozen=True)
class ResolvedModel:
    """The model config when complete, the fields every source gave, and their description."""

    config: ModelConfig | None
    fields: dict[str, Any]
    description: dict[str, Any]
    warnings: tuple[str, ...] = ()


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
) -> ResolvedModel:
    """The model config from every source, and a description of where each part came from.

    ``explicit`` comes from :func:`explicit_model_fields` and wins over what the
    target's command line and Hugging Face config say. ``config`` is None when
    no source names the model's dimensions or they are incomplete (then
    ``description['problem']`` says why, naming fields but no values from the
    job's files); ``fields`` still holds what was given (batch, sequence length).
    """
    # A preset is a typical shape: what the job itself says (its command line,
    # its config.json) beats it, and only the user's own file beats the job.
    layers = [layer for layer in explicit if not layer[0].startswith("preset:")]
    cmdline_fields = {**cmdline_batch_fields(target.cmdline),
                      **parse_megatron_cmdline(target.cmdline)}
    if cmdline_fields:
        layers.append(("cmdline", cmdline_fields))
    hf, location, warnings = _hf_fields(target)
    if hf:
        layers.append((f"hf_config:{location}", hf))
    layers += [layer for layer in explicit if layer[0].startswith("preset:")]
    used = [name for name, fields in layers if fields]
    description: dict[str, Any] = {"source": "+".join(used) if used else "none"}
    if not used:
        return ResolvedModel(None, {}, description, tuple(warnings))
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
        config = model_config_from_mapping(merged, source=description["source"], redact=bool(hf))
    except ModelConfigError as err:
        if explicit:
            raise  # the user named the model: an incomplete or wrong one is an error
        # Found on the job's own command line or config.json: a job that names only
        # some dimensions is still measured, without FLOPs.
        description["problem"] = str(err)
        return ResolvedModel(None, _valid_fields(merged), description, tuple(warnings))
    return ResolvedModel(config, merged, description, tuple(warnings))


def _valid_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields that are valid each on its own (of an incomplete or inconsistent set)."""
    valid = {}
    for key, value in fields.items():
        try:
            valid.update(model_fields_from_mapping({key: value}, "", redact=True))
        except ModelConfigError:
            continue
    return valid


def build_workload(
    model: ResolvedModel, target: TargetProcess, peak_tflops: float | None
) -> tuple[Workload, dict[str, Any]]:
    """The per-iteration workload and the model section of session_info.

    Without complete dimensions there are no FLOPs, but tokens/s and samples/s
    still follow from the batch and sequence length when the sources give them.
    """
    world_size, world_size_from = _world_size(target.environ)
    cfg = model.config
    if cfg is None:
        return _throughput_only(model.fields, world_size, peak_tflops)
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
        "world_size_from": world_size_from,
        "data_parallel_size": world_size // parallel,
    }
    return workload, info


def _throughput_only(fields: dict[str, Any], world_size: int, peak_tflops: float | None
                     ) -> tuple[Workload, dict[str, Any]]:
    """The workload of a job whose batch and sequence length are known, but not its model."""
    parallel = 1
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "context_parallel_size"):
        parallel *= fields.get(key, 1)
    data_parallel = world_size // parallel if world_size % parallel == 0 else 1
    workload = Workload(
        seq_length=fields.get("seq_length"), global_batch_size=fields.get("global_batch_size"),
        micro_batch_size=fields.get("micro_batch_size"), data_parallel_size=data_parallel,
        world_size=world_size, peak_tflops=peak_tflops)
    if workload.seq_length is None and workload.global_batch_size is None \
            and workload.micro_batch_size is None:
        return workload, {}
    batch = "given" if workload.global_batch_size else (
        "derived: micro_batch_size x microbatches_per_step x data_parallel_size"
        if workload.micro_batch_size else "unknown")
    return workload, {"global_batch_size": batch, "world_size": world_size,
                      "data_parallel_size": data_parallel,
                      "seq_length": workload.seq_length}


# WORLD_SIZE is the job's to set; beyond this it is not a world size.
MAX_WORLD_SIZE = 10**7


def _world_size(env: dict[str, str]) -> tuple[int, str]:
    """The job's ranks and where that came from: WORLD_SIZE, else SLURM_NTASKS (ranks
    started by srun, no launcher), else 1."""
    size = env_world_size(env)
    if size is None or not 0 < size <= MAX_WORLD_SIZE:
        return 1, "default 1"
    return size, "WORLD_SIZE" if "WORLD_SIZE" in env else "SLURM_NTASKS"

