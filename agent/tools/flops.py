"""`perfmon-agent flops`: FLOPs per iteration and per token, with their breakdown.

Lets users check the agent's model FLOPs against their own numbers (e.g.
Megatron-LM's "throughput per GPU (TFLOP/s/GPU)" with --log-throughput).
"""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

from perfmon.agent.argtypes import Command, positive_int
from perfmon.agent.console import PipeConsole
from perfmon.agent.measure.model import read_model_config_file
from perfmon.parsers.errors import ModelConfigError
from perfmon.parsers.flops import model_flops_per_iteration
from perfmon.parsers.megatron_args import cmdline_batch_fields, parse_megatron_cmdline
from perfmon.parsers.model_config import merge_model_fields, model_config_from_mapping
from perfmon.parsers.presets import preset_fields
from rich.table import Table

FLOPS_EPILOG = """examples:
  perfmon-agent flops --model-preset llama2-7b --global-batch-size 1024
  perfmon-agent flops --model-config llama7b.yaml --json
  perfmon-agent flops --from-cmdline "pretrain_gpt.py --num-layers 32 --hidden-size 4096 \\
      --num-attention-heads 32 --seq-length 4096 --vocab-size 32000 --global-batch-size 512"

Sources combine as in attach: the file first, then the command line, then the preset.
"""


def add_flops_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-config", metavar="FILE", help="model dimensions, YAML or JSON")
    parser.add_argument("--model-preset", metavar="NAME", help="a well-known model shape")
    parser.add_argument("--from-cmdline", metavar="ARGS",
                        help="a Megatron/FlagScale-style command line, quoted as one argument")
    parser.add_argument("--global-batch-size", type=positive_int, metavar="N",
                        help="samples per iteration (default: from the sources, else 1)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def flops_report(args: argparse.Namespace) -> dict[str, Any]:
    """The report for the command's arguments; ModelConfigError names what is wrong."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if args.model_config:
        layers.append((f"model_config:{args.model_config}",
                       read_model_config_file(args.model_config)))
    if args.from_cmdline:
        try:
            argv = shlex.split(args.from_cmdline)
        except ValueError as err:
            raise ModelConfigError(f"--from-cmdline: cannot split: {err}") from err
        fields = {**cmdline_batch_fields(argv), **parse_megatron_cmdline(argv)}
        layers.append(("cmdline", fields))
    if args.model_preset:
        layers.append((f"preset:{args.model_preset}", preset_fields(args.model_preset)))
    if not layers:
        raise ModelConfigError("flops: give --model-config, --model-preset or --from-cmdline")
    source = "+".join(name for name, _ in layers)
    cfg = model_config_from_mapping(merge_model_fields(*(f for _, f in layers)), source=source)
    batch = args.global_batch_size or cfg.global_batch_size or 1
    flops = model_flops_per_iteration(cfg, batch)
    return {
        "source": source,
        "global_batch_size": batch,
        "seq_length": cfg.seq_length,
        "tokens_per_iteration": flops.tokens,
        "flops_per_iteration": flops.total,
        "flops_per_token": flops.per_token,
        "hardware_flops_per_iteration": flops.hardware_total,
        "recompute_granularity": cfg.recompute_granularity,
        "breakdown_per_iteration": {
            "attention": flops.attention,
            "mlp": flops.mlp,
            "logits": flops.logits,
            "mtp": flops.mtp,
        },
    }


def flops_main(args: argparse.Namespace) -> int:
    report = flops_report(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    total = report["flops_per_iteration"]
    table = Table(title=f"model FLOPs ({report['source']})")
    table.add_column("part")
    table.add_column("FLOPs / iteration", justify="right")
    table.add_column("FLOPs / token", justify="right")
    table.add_column("share", justify="right")
    tokens = report["tokens_per_iteration"]
    for part, value in report["breakdown_per_iteration"].items():
        table.add_row(part, f"{value:.4e}", f"{value / tokens:.4e}", f"{value / total:.1%}")
    table.add_row("total", f"{total:.4e}", f"{report['flops_per_token']:.4e}", "100.0%")
    if report["recompute_granularity"]:
        hw = report["hardware_flops_per_iteration"]
        table.add_row(f"hardware ({report['recompute_granularity']} recompute)",
                      f"{hw:.4e}", f"{hw / tokens:.4e}", f"{hw / total:.1%}")
    console = PipeConsole(highlight=False)
    console.print(table)
    console.print(f"global batch {report['global_batch_size']} x seq {report['seq_length']} = "
                  f"{tokens:,} tokens per iteration")
    return 0


COMMAND = Command(
    "flops", "print model FLOPs per iteration and per token, with their breakdown",
    add_flops_arguments, flops_main,
    description="Model FLOPs as Megatron-LM's num_floating_point_operations counts them.",
    epilog=FLOPS_EPILOG)
