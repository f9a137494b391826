"""Parsers for py-spy output: ``record --format chrometrace`` and ``dump --json`` (no I/O).

Chrometrace (py-spy 0.4, ``src/chrometrace.rs``): a JSON list of begin ("B") and
end ("E") events per frame. py-spy emits events only where a thread's stack
*changed* since its previous sample, so a run of identical samples is one
begin; :func:`parse_chrometrace` rebuilds each thread's stack at every change
and gives it the time until the next change as ``duration_ns``. ``ts`` is
microseconds since an ``Instant::now()`` (CLOCK_MONOTONIC on Linux) that py-spy
takes when it creates the recorder, before attaching; the caller supplies that
origin on CLOCK_MONOTONIC (see probes/pyspy.py and docs/pyspy.md). Newer py-spy
remaps thread ids to small numbers and names them in "M" metadata events; both
forms are read.

Frames are innermost first, as py-spy gives them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from perfmon.parsers.errors import PerfmonError


class PySpyOutputError(PerfmonError):
    """py-spy output that cannot be decoded (truncated file, unknown format)."""

    exit_code = 2


@dataclass(frozen=True)
class Frame:
    # Qualified on Python >= 3.11: "Optimizer.profile_hook_step.<locals>.wrapper".
    function: str
    file: str  # full path as the target sees it
    line: int  # 0 when unknown (native frames, --nolineno)
    module: str | None = None  # shared library of a native frame (dump --native)


@dataclass(frozen=True)
class StackSample:
    """A thread's stack from the sample that first saw it until the next change."""

    t_mono_ns: int  # CLOCK_MONOTONIC of the first sample showing this stack
    pid: int
    tid: int  # kernel tid when known, else py-spy's thread id (a pthread_t, always > 2**22)
    frames: tuple[Frame, ...]  # innermost first
    duration_ns: int  # until the thread's next change, or the end of the recording


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a ``py-spy dump --json`` snapshot."""

    pid: int
    tid: int  # kernel tid (py-spy's os_thread_id), else py-spy's thread id
    thread_name: str | None
    frames: tuple[Frame, ...]  # innermost first
    frame_locals: tuple[dict[str, str], ...] = field(default=())  # per frame: name -> repr
    pyspy_thread_id: int = 0  # the id py-spy's chrometrace uses for this thread (pthread_t)
    active: bool = True  # py-spy's guess: running, not waiting


def _load(data: bytes | str, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise PySpyOutputError(f"py-spy {what}: not valid JSON ({err})") from err


def parse_chrometrace(
    data: bytes | str, *, origin_mono_ns: int, kernel_tids: Mapping[int, int] | None = None
) -> list[StackSample]:
    """Stack samples of a chrometrace file, sorted by time.

    ``origin_mono_ns``: CLOCK_MONOTONIC ns of py-spy's ts = 0. ``kernel_tids``
    maps py-spy thread ids (pthread_t) to kernel tids, e.g. from a dump; ids not
    in it are kept as they are. Raises PySpyOutputError.
    """
    events = _load(data, "chrometrace")
    if not isinstance(events, list):
        raise PySpyOutputError("py-spy chrometrace: expected a JSON list of events")
    kernel_tids = kernel_tids or {}
    # Newer py-spy: tid is a small index, the real thread id is in "<id>: <name>".
    remapped: dict[tuple[int, int], int] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            real = str(e.get("args", {}).get("name", "")).split(":", 1)[0]
            if real.isdigit():
                remapped[(e["pid"], e["tid"])] = int(real)

    stacks: dict[tuple[int, int], list[Frame]] = {}  # outermost first, as events build it
    changes: dict[tuple[int, int], list[tuple[int, tuple[Frame, ...]]]] = {}
    for e in events:
        phase = e.get("ph")
        if phase not in ("B", "E"):
            continue
        try:
            key = (int(e["pid"]), int(e["tid"]))
            ts_us = int(e["ts"])
            args = e.get("args") or {}
            frame = Frame(str(e["name"]), str(args.get("filename", "")), int(args.get("line") or 0))
        except (KeyError, TypeError, ValueError) as err:
            raise PySpyOutputError(f"py-spy chrometrace: malformed event {e!r}") from err
        stack = stacks.setdefault(key, [])
        if phase == "B":
            stack.append(frame)
        elif stack:
            stack.pop()  # py-spy ends frames innermost first
        # All events of one sample share its ts; the last one leaves the new stack.
        history = changes.setdefault(key, [])
        snapshot = tuple(reversed(stack))
        if history and history[-1][0] == ts_us:
            history[-1] = (ts_us, snapshot)
        else:
            history.append((ts_us, snapshot))

    samples = []
    for (pid, tid), history in changes.items():
        real_tid = remapped.get((pid, tid), tid)
        real_tid = kernel_tids.get(real_tid, real_tid)
        for (ts_us, frames), (next_us, _) in pairwise(history):
            # The final events close every open frame at the time of writing, so
            # an empty stack marks the end of the recording (or a frameless thread).
            if frames:
                samples.append(
                    StackSample(
                        origin_mono_ns + ts_us * 1000, pid, real_tid, frames,
                        (next_us - ts_us) * 1000,
                    )
                )
    samples.sort(key=lambda s: (s.t_mono_ns, s.pid, s.tid))
    return samples


def _frame(raw: Mapping[str, Any]) -> Frame:
    return Frame(str(raw["name"]), str(raw.get("filename", "")), int(raw.get("line") or 0),
                 raw.get("module"))


def parse_dump(data: bytes | str) -> list[ThreadStack]:
    """Threads of ``py-spy dump --json [--locals]`` output. Raises PySpyOutputError."""
    threads = _load(data, "dump")
    if not isinstance(threads, list):
        raise PySpyOutputError("py-spy dump: expected a JSON list of threads")
    result = []
    for t in threads:
        try:
            raw_frames = t["frames"]
            result.append(
                ThreadStack(
                    pid=int(t["pid"]),
                    tid=int(t.get("os_thread_id") or t["thread_id"]),
                    thread_name=t.get("thread_name"),
                    frames=tuple(_frame(f) for f in raw_frames),
                    frame_locals=tuple(
                        {str(v["name"]): str(v.get("repr")) for v in f.get("locals") or ()}
                        for f in raw_frames
                    ),
                    pyspy_thread_id=int(t["thread_id"]),
                    active=bool(t.get("active", True)),
                )
            )
        except (KeyError, TypeError, ValueError) as err:
            raise PySpyOutputError(f"py-spy dump: malformed thread {str(t)[:200]}") from err
    return result
