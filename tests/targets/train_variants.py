"""Training loops of other shapes than train_gpt.py's, each writing its own clock.

Each update appends "<update number> <CLOCK_MONOTONIC ns>" to --timestamps just
before the parameters change, as train_gpt.py does before optimizer.step().

--update:
  optim          torch.optim (--foreach / --fused, zero_grad(set_to_none=True))
  compiled_opt   model and optimizer step under torch.compile (PyTorch's
                 "compiling the optimizer" recipe: @torch.compile def opt_step())
  compiled_step  the whole train step (forward, backward, step) in one compiled function
  manual         hand-written SGD under torch.no_grad(), no torch.optim
  manual_data    hand-written SGD on .data (no no_grad), grads reset to None
  autograd_grad  hand-written SGD on the gradients torch.autograd.grad returns: no .grad
                 is ever read (no probe sees its updates)
--peek-grads-every N: read a gradient after the first backward pass of every Nth
update (a gradient-norm log between micro-batches).
--switch-when PATH --then-backwards K: once PATH exists, K backward passes an update.
--backwards K: backward passes (micro-batches) per update.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--update", default="optim",
                   choices=["optim", "compiled_opt", "compiled_step", "manual", "manual_data",
                            "autograd_grad"])
    p.add_argument("--backwards", type=int, default=1)
    p.add_argument("--peek-grads-every", type=int, default=0)
    p.add_argument("--switch-when", default=None)
    p.add_argument("--then-backwards", type=int, default=0)
    p.add_argument("--foreach", action="store_true")
    p.add_argument("--fused", action="store_true")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--timestamps", required=True)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 1))
    x = torch.randn(args.batch, args.hidden)
    y = torch.randn(args.batch, 1)
    params = list(model.parameters())
    lr = 1e-3
    opt: torch.optim.Optimizer | None = None
    if args.update in ("optim", "compiled_opt", "compiled_step"):
        kw: dict[str, object] = {}
        if args.foreach:
            kw["foreach"] = True
        if args.fused:
            kw["fused"] = True
        opt = torch.optim.AdamW(params, lr=lr, **kw)
    if args.update in ("compiled_opt", "compiled_step"):
        model = torch.compile(model)
    out = open(args.timestamps, "a", buffering=1)
    update = 0

    def stamp() -> None:
        out.write(f"{update} {time.monotonic_ns()}\n")

    def loss_of() -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(x), y) / args.backwards

    if args.update == "compiled_opt":
        @torch.compile(fullgraph=False)
        def opt_step() -> None:
            opt.step()  # type: ignore[union-attr]

    if args.update == "compiled_step":
        @torch.compile
        def train_step() -> None:
            for _ in range(args.backwards):
                loss_of().backward()
            stamp_box[0]()
            opt.step()  # type: ignore[union-attr]
            opt.zero_grad(set_to_none=True)  # type: ignore[union-attr]

        stamp_box = [stamp]

    iteration = 0  # (the job's own counter, as py-spy reads it)
    while True:
        update += 1
        iteration = update  # noqa: F841 (read by py-spy from outside)
        if args.update == "compiled_step":
            train_step()
            continue
        if args.update == "autograd_grad":
            grads = [torch.autograd.grad(loss_of(), params) for _ in range(args.backwards)]
            stamp()
            with torch.no_grad():
                for p, *gs in zip(params, *grads, strict=True):
                    p -= lr * sum(gs)  # noqa: PLW2901 (in place, as such code does)
            continue
        if args.switch_when and args.then_backwards and os.path.exists(args.switch_when):
            args.backwards, args.switch_when = args.then_backwards, None
        for b in range(args.backwards):
            loss_of().backward()
            if b == 0 and args.peek_grads_every and update % args.peek_grads_every == 0:
                float(params[0].grad.norm())
        stamp()
        if args.update == "optim":
            opt.step()  # type: ignore[union-attr]
            opt.zero_grad(set_to_none=True)  # type: ignore[union-attr]
        elif args.update == "compiled_opt":
            opt_step()
            opt.zero_grad(set_to_none=True)  # type: ignore[union-attr]
        elif args.update == "manual":
            with torch.no_grad():
                for p in params:
                    p -= lr * p.grad  # noqa: PLW2901 (in place, as such code does)
                    p.grad = None
        else:  # manual_data
            for p in params:
                p.data.add_(p.grad.data, alpha=-lr)
                p.grad = None


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    main()
