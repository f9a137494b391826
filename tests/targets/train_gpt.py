"""A small GPT-style language model trained on CPU: the demo job and the tests' target.

It is an ordinary PyTorch program with no knowledge of the agent. Its flags use
Megatron-LM's names, so its command line looks like a Megatron job's. For the
tests it can write its own iteration timestamps (CLOCK_MONOTONIC, taken just
before ``optimizer.step()``), stop making progress after N iterations, slow its
data loader, or stall forever inside a named function.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class RandomTokens(Dataset):
    """Endless synthetic token sequences; ``delay_ms`` makes loading slow on purpose."""

    def __init__(self, vocab: int, seq: int, delay_ms: float) -> None:
        self.vocab, self.seq, self.delay_s = vocab, seq, delay_ms / 1000

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        g = torch.Generator().manual_seed(index)
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=g)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, *, vocab: int, seq: int, layers: int, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln(x))


def deliberately_stalled_collective(seconds: float = 0.0) -> None:
    """Stands in for a rank stuck in a collective: never returns (or after ``seconds``)."""
    end = time.monotonic() + seconds
    while not seconds or time.monotonic() < end:
        time.sleep(min(3600.0, max(0.01, end - time.monotonic())) if seconds else 3600)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--seq-length", "--max_seq_length", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--micro-batch-size", "--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--model_name_or_path", help="a folder whose config.json (GPT-2 keys: n_layer, "
                   "n_embd, n_head, vocab_size) gives the model, as in Hugging Face scripts")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--train-iters", type=int, default=0, help="0: train until killed")
    p.add_argument("--after-train", choices=["exit", "sleep"], default="exit",
                   help="what to do after --train-iters: exit, or stay alive doing nothing")
    p.add_argument("--timestamps", help="append time.monotonic_ns() of each step here")
    p.add_argument("--data-delay-ms", type=float, default=0.0, help="sleep per sample loaded")
    p.add_argument("--data-delay-factor", type=float, default=0.0,
                   help="instead: loading a step's batches takes this many times the step's "
                        "compute (the median of its last 9 steps), a slow loader on a host of "
                        "any speed")
    p.add_argument("--stall-at", type=int, default=0, help="stall forever at this iteration")
    p.add_argument("--stall-when", metavar="PATH",
                   help="stall forever once PATH exists (looked for each iteration)")
    p.add_argument("--stall-in", choices=["between", "backward"], default="between",
                   help="where the stall sits: before the iteration's data (between "
                        "iterations), or inside its backward (a hook on the first block)")
    p.add_argument("--stall-for", type=float, default=0.0,
                   help="... or for this many seconds (a hang that resolves)")
    p.add_argument("--checkpoint", help="a file: resume from the iteration it names, and "
                   "write the iteration to it every --checkpoint-every iterations")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                   help="sgd: plain SGD, whose step takes ~1 ms on a small model")
    p.add_argument("--anonymous-loop", action="store_true",
                   help="keep no integer iteration counter in a local variable")
    p.add_argument("--ddp", action="store_true",
                   help="DistributedDataParallel over gloo (under torchrun: RANK, WORLD_SIZE...)")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP (fully_shard per block, then the model) over gloo (under torchrun)")
    p.add_argument("--tp-collectives", type=int, default=0,
                   help="this many small all-reduces per forward, spread over the layers, as "
                        "tensor parallelism makes them (under torchrun; gloo)")
    p.add_argument("--exit-code", type=int, default=0, help="exit with this after training")
    p.add_argument("--slow-ranks", default="",
                   help="comma-separated ranks whose forward is slowed by --slow-ms ('all')")
    p.add_argument("--slow-ms", type=float, default=0.0,
                   help="extra compute time (a busy loop) per micro-batch on the slow ranks")
    p.add_argument("--slow-from", type=int, default=0, help="... from this iteration")
    p.add_argument("--slow-until", type=int, default=0, help="... until this one (0: the end)")
    p.add_argument("--slow-from-s", type=float, default=0.0,
                   help="... from this many seconds after training started")
    p.add_argument("--slow-until-s", type=float, default=0.0, help="... until (0: the end)")
    p.add_argument("--slow-factor", type=float, default=0.0,
                   help="instead of --slow-ms: this fraction of the median step time the rank "
                        "measured before the slowdown (a GPU throttled by that much)")
    p.add_argument("--slow-schedule", default="",
                   help="slowdowns of the slow ranks by time: FROM-UNTIL:FACTOR,... (seconds "
                        "after training started; FACTOR as for --slow-factor, or F0/F1: "
                        "rising evenly from F0 to F1 over the window, a creep)")
    p.add_argument("--schedule-from", help="a file: the --slow-schedule's seconds count from "
                   "when it appears (looked for each iteration), not from training's start")
    p.add_argument("--device-ms", type=float, default=0.0,
                   help="each micro-batch's forward also waits this long, as the CPU of a GPU "
                        "job waits for its kernels (a stand-in for the device's time)")
    p.add_argument("--slow-wait", action="store_true",
                   help="slowed ranks wait their extra time instead of burning CPU (a slower "
                        "device: the CPU waits longer for it)")
    # Flags it does not use are ignored, as launchers often pass more than a
    # script reads (e.g. --config_name, --global-batch-size for the agent to find).
    return p.parse_known_args(argv)[0]


def apply_hf_config(args: argparse.Namespace) -> None:
    config = json.loads((Path(args.model_name_or_path) / "config.json").read_text())
    args.num_layers, args.hidden_size = config["n_layer"], config["n_embd"]
    args.num_attention_heads, args.vocab_size = config["n_head"], config["vocab_size"]


def busy_wait(seconds: float) -> None:
    """Burn CPU for ``seconds`` (a slower GPU or CPU, not a sleep: it is compute)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def device_wait(seconds: float) -> None:
    """Wait ``seconds`` as the CPU of a GPU job waits for the device's kernels: the
    step's time without the CPU's (whose pace a shared machine moves by tens of %)."""
    time.sleep(seconds)


def scheduled(args: argparse.Namespace, elapsed_s: float) -> float:
    """The --slow-schedule factor at ``elapsed_s`` (0: none)."""
    for window in filter(None, args.slow_schedule.split(",")):
        span, _, factor = window.partition(":")
        start, end = (float(x) for x in span.split("-"))
        if start <= elapsed_s < end:
            first, _, last = factor.partition("/")
            rise = (elapsed_s - start) / (end - start) if last else 0.0
            return float(first) + rise * (float(last or first) - float(first))
    return 0.0


def slowed(args: argparse.Namespace, rank: int, iteration: int, elapsed_s: float) -> bool:
    if args.slow_schedule:
        args.slow_factor = scheduled(args, elapsed_s)
    if not (args.slow_ms or args.slow_factor) or iteration < args.slow_from:
        return False
    if args.slow_until and iteration >= args.slow_until:
        return False
    if elapsed_s < args.slow_from_s or (args.slow_until_s and elapsed_s >= args.slow_until_s):
        return False
    return args.slow_ranks == "all" or str(rank) in args.slow_ranks.split(",")


def add_tp_collectives(model: nn.Module, count: int) -> None:
    """``count`` small all-reduces per forward, after each layer's compute, as a
    tensor-parallel layer reduces its partial results (each blocks in c10d Work::wait)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    partial = torch.zeros(256)

    def reduce(per_block: int) -> None:
        for _ in range(per_block):
            dist.all_reduce(partial)

    for i, block in enumerate(blocks):
        per_block = count // len(blocks) + (1 if i < count % len(blocks) else 0)
        block.register_forward_hook(lambda _m, _i, _o, n=per_block: reduce(n))


def ranks_from_slurm() -> None:
    """Tasks started by ``srun`` (no launcher) know their rank from Slurm's variables:
    torch.distributed's env:// reads RANK and WORLD_SIZE, as a job's own set-up sets them."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def train(args: argparse.Namespace) -> None:
    ranks_from_slurm()
    if args.model_name_or_path:
        apply_hf_config(args)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    device = torch.device(args.device)
    model = GPT(vocab=args.vocab_size, seq=args.seq_length, layers=args.num_layers,
                hidden=args.hidden_size, heads=args.num_attention_heads, ffn=ffn).to(device)
    rank = int(os.environ.get("RANK", "0"))
    # A slowed rank computes longer inside its forward (a pre-hook: the time is the
    # model's, as a throttled GPU's would be).
    slow = {"s": 0.0}
    if args.slow_ms or args.slow_factor or args.slow_schedule or args.device_ms:
        extra = device_wait if args.slow_wait else busy_wait

        def forward_pre_hook(_module: nn.Module, _inputs: tuple) -> None:
            if args.device_ms:
                device_wait(args.device_ms / 1000)
            if slow["s"]:
                extra(slow["s"])

        model.register_forward_pre_hook(forward_pre_hook)
    stall_in_backward = {"now": False}
    if args.stall_in == "backward":
        def backward_hook(*_args: object) -> None:
            # (the first block's input gradients: its own weights' and the embeddings'
            # are still to come, so the stall sits inside backward())
            if stall_in_backward["now"]:
                stall_in_backward["now"] = False
                deliberately_stalled_collective(args.stall_for)

        model.blocks[0].register_full_backward_hook(backward_hook)
    if args.tp_collectives:
        add_tp_collectives(model, args.tp_collectives)
    if args.ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        model = DistributedDataParallel(model)
    elif args.fsdp:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        for block in model.blocks:  # each block's parameters gathered for its own compute
            fully_shard(block)
        fully_shard(model)
    optimizer = (torch.optim.SGD(model.parameters(), lr=1e-3) if args.optimizer == "sgd"
                 else torch.optim.AdamW(model.parameters(), lr=3e-4))
    dataset = RandomTokens(args.vocab_size, args.seq_length, args.data_delay_ms)
    loader = DataLoader(dataset, batch_size=args.micro_batch_size)
    batches = iter(loader)
    stamps = open(args.timestamps, "a", buffering=1) if args.timestamps else None
    print(f"pid {os.getpid()}: training", flush=True)
    if args.anonymous_loop:
        loop(args, model, optimizer, batches, stamps, device)
        return
    # (a restarted job resumes from its last checkpoint: the iterations since are redone)
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    iteration = int(checkpoint.read_text()) if checkpoint and checkpoint.exists() else 0
    started = last = time.monotonic()
    steps: list[float] = []  # step times before the slowdown: its reference
    computes: deque[float] = deque(maxlen=9)  # a step's time less its loading
    zero = None if args.schedule_from else started  # (the schedule's clock)
    while args.train_iters == 0 or iteration < args.train_iters:
        now = time.monotonic()
        if zero is None and os.path.exists(args.schedule_from):
            zero = now
        if slowed(args, rank, iteration, now - zero if zero is not None else -1.0):
            if not slow["s"] and args.slow_ms:  # (numbered as --timestamps numbers it)
                print(f"rank {rank}: slowed from iteration {iteration + 1}", flush=True)
            slow["s"] = (args.slow_ms / 1000 if args.slow_ms else
                         args.slow_factor * sorted(steps)[len(steps) // 2] / args.grad_accum
                         if steps else 0.0)
        else:
            slow["s"] = 0.0
            if iteration and len(steps) < 10_000:
                steps.append(now - last)
        last = now
        if (args.stall_at and iteration == args.stall_at) or (
                args.stall_when and os.path.exists(args.stall_when)):
            if args.stall_in == "backward":
                stall_in_backward["now"] = True
            else:
                deliberately_stalled_collective(args.stall_for)
        loading_s = 0.0
        for _ in range(args.grad_accum):
            began = time.monotonic()
            tokens = next(batches).to(device, non_blocking=True)
            loading_s += time.monotonic() - began
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
            ) / args.grad_accum
            loss.backward()
        if stamps:
            stamps.write(f"{iteration + 1} {time.monotonic_ns()}\n")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.data_delay_factor:
            computes.append(time.monotonic() - now - loading_s)
            dataset.delay_s = (args.data_delay_factor * statistics.median(computes)
                               / (args.micro_batch_size * args.grad_accum))
        iteration += 1
        if checkpoint and args.checkpoint_every and iteration % args.checkpoint_every == 0 \
                and rank == 0:
            checkpoint.write_text(str(iteration))
        if iteration % 50 == 0:
            memory = (f" max_memory_reserved {torch.cuda.max_memory_reserved() / 1e9:.3f} GB"
                      if device.type == "cuda" else "")
            print(f"iteration {iteration} loss {loss.item() * args.grad_accum:.3f} "
                  f"ppl {math.exp(min(20.0, loss.item() * args.grad_accum)):.1f}{memory}",
                  flush=True)
    if args.after_train == "sleep":
        while True:
            time.sleep(3600)
    end_process_group(args.exit_code)
    if args.exit_code:
        sys.exit(args.exit_code)


def end_process_group(exit_code: int = 0) -> None:
    """Destroy the process group before exiting, as a job should, once every rank is
    done (a barrier), and exit without the interpreter's teardown: gloo's threads and
    a peer's store gone first can still abort a rank there (SIGABRT, "terminate called
    without an active exception", seen once in a restarted 2-rank attempt)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def loop(args, model, optimizer, batches, stamps, device) -> None:
    """The same training step, with the count kept where no local integer shows it."""
    progress = {"done": [0]}
    while args.train_iters == 0 or progress["done"][0] < args.train_iters:
        tokens = next(batches).to(device)
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        if stamps:
            stamps.write(f"{progress['done'][0] + 1} {time.monotonic_ns()}\n")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        progress["done"][0] += 1


if __name__ == "__main__":
    train(parse_args(sys.argv[1:]))
