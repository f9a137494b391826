"""Which of a libtorch's exported functions block a rank on its process group, read
from the mangled names themselves (pure: a name in, a wait point or None out).

A rank waits on its process group in the ``wait`` of a work object: c10d's base
``Work::wait`` (an explicit ``work.wait()`` on most collectives, synchronous calls)
and every override of it a backend brings (gloo's ``ProcessGroupGloo::SendWork`` and
``RecvWork``, NCCL's ``ProcessGroupNCCL::WorkNCCL``, MPI's and UCC's work classes...),
and in DDP's ``Reducer::finalize_backward`` (every bucket's all-reduce at the end of
backward, through futures whose wait is inlined). Rather than a fixed list of
classes, every ``c10d::...::<class>::wait`` whose class is a work class (its name holds
``Work``) is one, so a release that adds a backend or an override is probed as it is;
stores' waits (``TCPStore::wait``: the rendezvous) are not a work object's.

Each is a point-to-point wait (``p2p``: a send's or a receive's work: a pipeline's
activations and gradients, passed stage to stage) or a collective one (all-reduce,
all-gather, all-to-all, barrier...), and belongs to a backend (``gloo``, ``nccl``,
``mpi``, ``ucc``, ...; ``any``: the base class, whichever backend's work it waits for;
``ddp``: the reducer). NCCL's point-to-point work is a ``WorkNCCL`` like its
collectives': told apart only by its op, not by its name (docs/pipeline.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

NAMESPACE = "c10d"
# What find_function_symbols is asked for: every exported c10d function (a few hundred
# in libtorch_cpu), the wait points picked from them here.
C10D_PREFIX = "_ZN4c10d"
REDUCER_WAIT = "_ZN4c10d7Reducer17finalize_backwardEv"
WaitKind = Literal["collective", "p2p"]
_P2P_CLASSES = re.compile(r"Send|Recv")
_BACKEND = re.compile(r"^ProcessGroup([A-Z][A-Za-z0-9]*)$")
_MAX_COMPONENTS = 8


@dataclass(frozen=True)
class WaitPoint:
    """A function that blocks a rank on its process group."""

    symbol: str  # the mangled name, as .dynsym holds it
    name: str  # e.g. ProcessGroupGloo::RecvWork::wait
    backend: str
    kind: WaitKind


def nested_name(mangled: str) -> list[str] | None:
    """The components of a mangled nested function name (``_ZN4c10d4Work4waitE...`` ->
    ``["c10d", "Work", "wait"]``); None for anything else (templates, operators, special
    names: nothing a wait point is)."""
    if not mangled.startswith("_ZN"):
        return None
    i = 3
    while i < len(mangled) and mangled[i] in "KVRO":  # (cv- and ref-qualifiers)
        i += 1
    parts: list[str] = []
    while i < len(mangled) and mangled[i] != "E":
        digits = re.match(r"[1-9][0-9]{0,3}", mangled[i:])
        if digits is None or len(parts) == _MAX_COMPONENTS:
            return None
        i += len(digits.group())
        length = int(digits.group())
        part = mangled[i:i + length]
        if len(part) != length or not part.isidentifier():
            return None
        parts.append(part)
        i += length
    return parts if i < len(mangled) and len(parts) >= 2 else None


def wait_point(mangled: str) -> WaitPoint | None:
    """The wait point a mangled name is, or None."""
    if mangled == REDUCER_WAIT:
        return WaitPoint(mangled, "Reducer::finalize_backward", "ddp", "collective")
    parts = nested_name(mangled)
    if parts is None or parts[0] != NAMESPACE or parts[-1] != "wait" or len(parts) < 3:
        return None
    cls = parts[-2]
    if "Work" not in cls:
        return None
    backends = [m.group(1).lower() for p in parts[1:-1] if (m := _BACKEND.match(p))]
    if backends:
        backend = backends[-1]
    elif cls == "Work":
        backend = "any"
    else:  # (a work class of no process group's: named after itself)
        backend = cls.removesuffix("Work").removeprefix("Work").lower() or "any"
    kind: WaitKind = "p2p" if _P2P_CLASSES.search(cls) else "collective"
    return WaitPoint(mangled, "::".join(parts[1:]), backend, kind)


def wait_points(mangled_names: list[str]) -> list[WaitPoint]:
    """The wait points among ``mangled_names`` (each once, in the order given)."""
    seen: dict[str, WaitPoint] = {}
    for name in mangled_names:
        point = wait_point(name)
        if point is not None:
            seen.setdefault(name, point)
    return list(seen.values())


def by_backend(points: list[WaitPoint]) -> dict[str, list[str]]:
    """The points' names by backend (``{"gloo": ["ProcessGroupGloo::RecvWork::wait",
    ...], "any": ["Work::wait"], ...}``), each list sorted: what doctor and
    session_info.wait_probes show."""
    out: dict[str, list[str]] = {}
    for point in points:
        out.setdefault(point.backend, []).append(point.name)
    return {backend: sorted(set(names)) for backend, names in sorted(out.items())}
