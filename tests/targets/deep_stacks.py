"""A hostile job for the py-spy bounds (security issue 36): deep stacks, many threads, long names.

``--threads`` threads each recurse ``--depth`` frames deep through functions with
``--name-length``-character names (made with exec, in a module whose file name is
``--file-length`` characters long), then sleep there; the main thread does the same
through its own functions, so every py-spy sample and dump carries
threads x depth frames of long names. Every ``--flip-s`` seconds (0: never) each
thread climbs out of its recursion and goes down again through a second set of
functions: py-spy then writes the whole stack again, for every thread, in one window.

PyTorch is imported (the agent attaches only to processes that map libtorch); nothing
is trained. It prints ``ready`` once every thread is at the bottom.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch  # noqa: F401  (mapped libtorch: the agent takes this for a PyTorch job)


def _module_source(prefix: str, depth: int, name_length: int) -> str:
    """``depth`` functions, each calling the next; the last one waits."""
    pad = "x" * max(1, name_length - len(prefix) - 8)
    lines = []
    for level in range(depth):
        name = f"{prefix}{pad}{level:07d}"
        following = f"{prefix}{pad}{level + 1:07d}" if level + 1 < depth else None
        lines.append(f"def {name}(bottom):")
        lines.append(f"    return {following}(bottom)" if following else "    return bottom()")
    return "\n".join(lines) + "\n"


def _load(file_length: int, source: str, tag: str) -> dict[str, object]:
    """Exec ``source`` as code from a (made-up) file whose path is ``file_length`` long."""
    stem = f"/nonexistent/deep_stacks_{tag}_"
    path = stem + "d" * max(1, file_length - len(stem) - 3) + ".py"
    namespace: dict[str, object] = {}
    exec(compile(source, path, "exec"), namespace)  # made-up code: the point of this target
    return namespace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=65, help="threads besides the main one")
    p.add_argument("--depth", type=int, default=950)
    p.add_argument("--name-length", type=int, default=200)
    p.add_argument("--file-length", type=int, default=300)
    p.add_argument("--flip-s", type=float, default=0.0)
    args = p.parse_args()
    sys.setrecursionlimit(args.depth * 2 + 1000)
    threading.stack_size(64 << 20)  # a C stack deep enough for the recursion
    chains = []
    for tag in ("a", "b"):
        source = _module_source(f"deep_{tag}_", args.depth, args.name_length)
        namespace = _load(args.file_length, source, tag)
        first = next(k for k in namespace if k.startswith(f"deep_{tag}_"))
        chains.append(namespace[first])
    arrived: set[int] = set()
    lock = threading.Lock()

    def bottom_waiting() -> None:
        with lock:
            if threading.get_ident() not in arrived:
                arrived.add(threading.get_ident())
                if len(arrived) == args.threads + 1:
                    print("ready", flush=True)
        while True:
            if args.flip_s:
                time.sleep(args.flip_s)
                return  # climbs out: the caller goes down the other chain
            time.sleep(3600)

    def worker() -> None:
        k = 0
        while True:
            chains[k % 2](bottom_waiting)  # type: ignore[operator]
            k += 1

    for _ in range(args.threads):
        threading.Thread(target=worker, daemon=True).start()
    worker()


if __name__ == "__main__":
    main()
