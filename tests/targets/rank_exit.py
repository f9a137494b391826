"""A training rank that ends the way a test asks, when the test says so.

It is an ordinary PyTorch program: it trains a small model for a few steps,
printing Megatron-style iteration lines, writes ``--ready`` (its pid), then
waits for a line on stdin and ends as ``--end`` says:

- ``exit:N``: ``sys.exit(N)``;
- ``cuda-oom``: raises ``torch.OutOfMemoryError`` with the message PyTorch's CUDA
  caching allocator writes (c10/cuda/CUDACachingAllocator.cpp), from inside the
  training step, uncaught: Python prints the traceback on stderr and exits 1;
- ``wait``: sleeps until it is killed;
- ``allocate``: allocates 8 MiB tensors until something (the OOM killer) stops it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn


def format_size(size_bytes: int) -> str:
    """As c10's format_size: bytes, KiB, MiB or GiB with two decimals."""
    if size_bytes <= 1024:
        return f"{size_bytes} bytes"
    for unit, shift in (("KiB", 10), ("MiB", 20), ("GiB", 30)):
        if size_bytes < 1 << (shift + 10) or unit == "GiB":
            return f"{size_bytes / (1 << shift):.2f} {unit}"
    raise AssertionError


def cuda_out_of_memory(request_bytes: int) -> torch.OutOfMemoryError:
    """The exception the CUDA caching allocator raises (PyTorch 2.5+ wording)."""
    total, free, in_use = 79.19 * (1 << 30), 1.23 * (1 << 30), 77.94 * (1 << 30)
    return torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {format_size(request_bytes)}. GPU 0 has a total "
        f"capacity of {format_size(int(total))} of which {format_size(int(free))} is free. "
        f"Including non-PyTorch memory, this process has {format_size(int(in_use))} memory in "
        "use. Of the allocated memory 76.12 GiB is allocated by PyTorch, and 1.32 GiB is "
        "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
        "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def activations(batch: torch.Tensor, *, out_of_memory: bool) -> torch.Tensor:
    if out_of_memory:
        raise cuda_out_of_memory(20 << 30)
    return batch


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
               *, out_of_memory: bool = False) -> float:
    loss = model(activations(batch, out_of_memory=out_of_memory)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ready", type=Path, required=True)
    p.add_argument("--end", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(32, 64)
    for iteration in range(1, 4):
        started = time.perf_counter()
        loss = train_step(model, optimizer, batch)
        print(f" iteration {iteration:8d}/ 10000 | elapsed time per iteration (ms): "
              f"{(time.perf_counter() - started) * 1000:.1f} | lm loss: {loss:.6E} |", flush=True)
    args.ready.write_text(str(os.getpid()))
    sys.stdin.readline()
    if args.end.startswith("exit:"):
        sys.exit(int(args.end.partition(":")[2]))
    if args.end == "cuda-oom":
        train_step(model, optimizer, batch, out_of_memory=True)
    elif args.end == "wait":
        time.sleep(3600)
    elif args.end == "allocate":
        held = []
        while True:
            held.append(torch.ones(2 << 20))  # 8 MiB, written: charged to the memory cgroup
    raise SystemExit(f"unknown --end {args.end!r}")


if __name__ == "__main__":
    main()
