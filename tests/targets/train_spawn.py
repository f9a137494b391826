"""Training processes started the ways research code starts them: ``torch.multiprocessing``
(``mp.spawn`` and its fork/forkserver start methods) or none (a plain job), with or
without DataLoader workers and a process group. An ordinary PyTorch program that knows
nothing of the agent; each training process writes its own clock.

--nprocs N: 0 trains in this process (a plain job); N >= 1 starts N training processes
  with ``torch.multiprocessing.start_processes`` (``--start-method spawn``: what
  ``mp.spawn`` does) and waits for them, as PyTorch's DDP tutorial does. The parent sets
  MASTER_ADDR and MASTER_PORT in its own ``os.environ`` first, so its children inherit
  them and it does not have them in its environment at exec.
--dist: each training process joins a gloo process group (rank = its spawn index,
  world = N) and wraps the model in DistributedDataParallel.
--num-workers K: DataLoader workers per training process (fork by default on Linux;
  --worker-start-method for spawn/forkserver).
--helpers K: each training process also starts K multiprocessing children of its own
  that have PyTorch and are no DataLoader workers (a hand-made loader: they fill a
  queue the training process reads; --worker-start-method as above).
--timestamps PREFIX: training process ``r`` appends "<iteration> <CLOCK_MONOTONIC ns>"
  to ``PREFIX.r`` (``PREFIX.0`` in a plain job) just before ``optimizer.step()``, and
  writes its pid to ``PREFIX.r.pid`` first.
--setup-s S: the parent waits S seconds after importing torch before starting its
  training processes (a script that prepares its data first).
--stall-when PATH: once PATH exists (looked for each iteration), stop making progress,
  inside ``deliberately_stalled`` (a hang the test starts when it wants).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    """Endless synthetic (input, target) pairs."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        return torch.randn(self.hidden, generator=g), torch.randn(1, generator=g)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--start-method", default="spawn", choices=["spawn", "fork", "forkserver"])
    p.add_argument("--dist", action="store_true")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--helpers", type=int, default=0)
    p.add_argument("--worker-start-method", default=None,
                   choices=[None, "spawn", "fork", "forkserver"])
    p.add_argument("--timestamps", default=None)
    p.add_argument("--train-iters", type=int, default=0, help="0: until killed")
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--setup-s", type=float, default=0.0)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--stall-when", default=None)
    p.add_argument("--tag", default="", help="ignored: a mark in the command line")
    return p.parse_args(argv)


def helper(queue: mp.Queue, hidden: int, batch: int) -> None:
    """A hand-made loader's process: batches into ``queue`` (it blocks when full)."""
    torch.set_num_threads(1)
    while True:
        queue.put((torch.randn(batch, hidden), torch.randn(batch, 1)))


def helper_batches(args: argparse.Namespace):
    """Batches from ``--helpers`` processes of this one."""
    context = mp.get_context(args.worker_start_method)
    queue = context.Queue(maxsize=4)
    for _ in range(args.helpers):
        context.Process(target=helper, args=(queue, args.hidden, args.batch),
                        daemon=True).start()
    while True:
        yield queue.get()


def deliberately_stalled() -> None:
    """Stands in for a rank stuck in a collective: never returns."""
    while True:
        time.sleep(3600)


def train(index: int, args: argparse.Namespace) -> None:
    """One training process: ``index`` is its spawn index (its rank with --dist)."""
    torch.manual_seed(index)
    torch.set_num_threads(1)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.GELU()]
    model: nn.Module = nn.Sequential(*layers, nn.Linear(args.hidden, 1))
    if args.dist:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=index, world_size=args.nprocs)
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(Samples(args.hidden), batch_size=args.batch,
                        num_workers=args.num_workers,
                        multiprocessing_context=(args.worker_start_method
                                                 if args.num_workers else None))
    batches = helper_batches(args) if args.helpers else iter(loader)
    stamps = None
    if args.timestamps:
        with open(f"{args.timestamps}.{index}.pid.tmp", "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(f"{args.timestamps}.{index}.pid.tmp", f"{args.timestamps}.{index}.pid")
        stamps = open(f"{args.timestamps}.{index}", "a", buffering=1)
    iteration = 0
    while args.train_iters == 0 or iteration < args.train_iters:
        if args.stall_when and os.path.exists(args.stall_when):
            deliberately_stalled()
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if stamps:
            stamps.write(f"{iteration + 1} {time.monotonic_ns()}\n")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iteration += 1
    if args.dist:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)  # (no interpreter teardown with gloo's threads about: train_gpt.py)


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.nprocs == 0:
        train(0, args)
        return
    time.sleep(args.setup_s)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    mp.start_processes(train, args=(args,), nprocs=args.nprocs,
                       start_method=args.start_method)


if __name__ == "__main__":
    main()
