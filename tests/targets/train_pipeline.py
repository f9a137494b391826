"""A pipeline-parallel training job for the tests: torch.distributed.pipelining's
ScheduleGPipe or Schedule1F1B over ``--pipeline-model-parallel-size`` stages, gloo on
CPU, under torchrun, with Megatron-style arguments; the world beyond the stages is
data-parallel replicas (Megatron's default order: the pipeline stage is the slowest
coordinate, rank = dp + dp_size x pp), whose gradients are all-reduced over the
replicas of a stage after each step.

It writes its own truth, per rank and step, as JSON lines in ``--stamps-dir``:
the step's end (CLOCK_MONOTONIC ns, just before ``optimizer.step()``), the time its
main thread spent in the schedule's point-to-point waits (``_wait_batch_p2p``, by
micro-batch) and in the replicas' all-reduce, and its micro-batches. Rank 0 also
appends "iteration ns" to ``--timestamps`` as the other targets do.

``--slow-stage S --slow-ms X``: stage S computes X ms more per micro-batch (a busy
loop in its forward, CPU time, as a slower layer would); ``--slow-replica R`` only
its data-parallel replica R.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining import schedules as pipeline_schedules


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=0,
                   help="default: 8 micro-batches per replica")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    p.add_argument("--slow-stage", type=int, default=-1)
    p.add_argument("--slow-replica", type=int, default=-1, help="-1: every replica")
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--train-iters", type=int, default=0, help="0: until killed")
    p.add_argument("--timestamps")
    p.add_argument("--stamps-dir")
    return p.parse_args()


class Spin(torch.autograd.Function):
    """Busy ``ms`` in the forward: a stage that computes more."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ms: float) -> torch.Tensor:
        end = time.thread_time() + ms / 1e3
        while time.thread_time() < end:
            pass
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Stage(torch.nn.Module):
    def __init__(self, layers: int, hidden: int, spin_ms: float) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[
            torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                torch.nn.Linear(4 * hidden, hidden))
            for _ in range(layers)])
        self.spin_ms = spin_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spin_ms:
            x = Spin.apply(x, self.spin_ms)
        return self.layers(x)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = args.pipeline_model_parallel_size
    dp = world // pp
    stage_id, replica = rank // dp, rank % dp
    micro = (args.global_batch_size or 8 * args.micro_batch_size * dp) // (
        args.micro_batch_size * dp)
    # (every rank makes every group, as torch.distributed asks)
    pipes = [dist.new_group([d + dp * s for s in range(pp)]) for d in range(dp)]
    replicas = [dist.new_group([d + dp * s for d in range(dp)]) for s in range(pp)]
    slow = stage_id == args.slow_stage and args.slow_replica in (-1, replica)
    model = Stage(args.num_layers // pp, args.hidden_size, args.slow_ms if slow else 0.0)
    stage = PipelineStage(model, stage_id, pp, torch.device("cpu"), group=pipes[replica])
    loss_fn = torch.nn.functional.mse_loss
    schedule = (ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B)(
        stage, micro, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    p2p_ns = 0
    original_wait = pipeline_schedules._wait_batch_p2p

    def timed_wait(work):  # the job's own stamp of each point-to-point wait
        nonlocal p2p_ns
        t0 = time.monotonic_ns()
        try:
            return original_wait(work)
        finally:
            p2p_ns += time.monotonic_ns() - t0

    pipeline_schedules._wait_batch_p2p = timed_wait

    shape = (args.micro_batch_size * micro, args.seq_length, args.hidden_size)
    batch, target = torch.randn(shape), torch.randn(shape)
    stamps = open(args.timestamps, "a", buffering=1) if args.timestamps and rank == 0 else None
    truth = None
    if args.stamps_dir:
        truth = open(Path(args.stamps_dir) / f"rank{rank}.jsonl", "a", buffering=1)
    print(f"training: rank {rank} stage {stage_id} replica {replica} micro-batches {micro}",
          flush=True)
    iteration = 0
    while not args.train_iters or iteration < args.train_iters:
        iteration += 1
        p2p_ns = 0
        optimizer.zero_grad()
        if stage_id == 0:
            schedule.step(batch)
        elif stage_id == pp - 1:
            schedule.step(target=target)
        else:
            schedule.step()
        t0 = time.monotonic_ns()
        if dp > 1:
            for param in model.parameters():
                dist.all_reduce(param.grad, group=replicas[stage_id])
        allreduce_ns = time.monotonic_ns() - t0
        end = time.monotonic_ns()
        if stamps:
            stamps.write(f"{iteration} {end}\n")
        if truth:
            truth.write(json.dumps({"iteration": iteration, "end_ns": end, "p2p_wait_ns": p2p_ns,
                                    "allreduce_ns": allreduce_ns, "micro": micro,
                                    "stage": stage_id, "replica": replica}) + "\n")
        optimizer.step()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
