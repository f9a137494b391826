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

Bounded (security issue 36): output is read element by element
(perfmon.parsers.json_stream), never whole; stacks keep their MAX_INNER_FRAMES
innermost and MAX_OUTER_FRAMES outermost frames around one marker frame; at most
MAX_THREADS threads per process; names MAX_NAME_CHARS long; one Frame object per
distinct frame and one tuple per distinct stack. What was cut is counted in a
:class:`Cuts`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import IO, Any

from perfmon.parsers.errors import PerfmonError
from perfmon.parsers.json_stream import JsonStreamError, JsonTooLarge, iter_json_array


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


class PySpyOutputTooLarge(PySpyOutputError):
    """More py-spy output than the cap: not read further (security issue 36)."""


# Bounds on what py-spy output may hold in the agent (security issue 36: a job of 65
# threads 950 frames deep with long names made a 608 MB window and an OOM-killed agent).
# A stack deeper than MAX_INNER_FRAMES + MAX_OUTER_FRAMES keeps both ends, with one
# marker frame between them: the phase rules need the training loop's frames (outer:
# Tensor.backward, DataLoader.__next__, Optimizer.step's wrapper sit just above the loop)
# and torch's (inner: module forward, autograd Functions, optimizer internals); a
# hung job's common frame is found walking in from the outside. PyTorch jobs' stacks
# are 20-100 frames deep (train_gpt.py: ~25; Megatron's nested modules: ~60).
MAX_INNER_FRAMES = 128
MAX_OUTER_FRAMES = 128
# Python threads a process's samples or dump keep (its main thread always): a
# training process has a handful (main, pin_memory, a checkpoint writer, loggers).
MAX_THREADS = 64
# Function and file names, thread names, local variables' names and reprs, in
# characters: qualified names and full paths of real jobs are under 200. A name keeps
# its end (the base name, the path under site-packages: what the phase rules read), a
# repr its start.
MAX_NAME_CHARS = 512
MAX_LOCALS = 256  # local variables per frame in a dump --locals
# Frame references all samples of one window may hold (each new stack costs its
# length; a stack seen again costs nothing): 16 MB of pointers. The main thread's
# samples are made first, so only other threads' can be cut by it.
MAX_WINDOW_FRAMES = 2_000_000
KEEP_FRAMES = MAX_INNER_FRAMES + MAX_OUTER_FRAMES
# A record window's file is read up to WINDOW_MAX_BYTES (the probe checks its size
# before reading; past it the window is not read). Read event by event, a window that
# size peaks at 5-45 MB in the agent (json.loads of it: 45-360 MB). Normal windows of
# tests/targets/train_gpt.py, 1 s: 84-410 KB at 200 Hz, 43-210 KB at 100 Hz.
WINDOW_MAX_BYTES = 16 << 20
# A dump's output is read up to this much (py-spy is killed past it, and the threads
# whole within it kept): train_gpt.py's dump --locals is 19 KB; a job of 65 threads
# 950 frames deep with long names (security issue 36) made 63 MB.
DUMP_MAX_BYTES = 8 << 20


@dataclass
class Cuts:
    """What was left out of py-spy output to keep the agent's memory bounded (cumulative;
    pass one to the parsers to count into)."""

    windows: int = 0  # record windows over the byte cap (or whose py-spy outgrew its cap): unread
    dumps: int = 0  # dumps whose output passed the byte cap: the threads after it left out
    threads: int = 0  # threads beyond MAX_THREADS in a window or dump
    stacks: int = 0  # samples or dumped threads whose stack was cut to KEEP_FRAMES
    frames: int = 0  # frames left out of those
    names: int = 0  # strings shortened to MAX_NAME_CHARS (distinct ones, per window or dump)
    samples: int = 0  # samples beyond a window's MAX_WINDOW_FRAMES
    locals: int = 0  # local variables beyond MAX_LOCALS in a frame

    def counters(self) -> dict[str, int]:
        """As data-quality counters: ``windows_cut``, ``dumps_cut``, ..."""
        return {f"{name}_cut": value for name, value in asdict(self).items()}

    def __add__(self, other: Cuts) -> Cuts:
        mine, theirs = asdict(self), asdict(other)
        return Cuts(**{name: mine[name] + theirs[name] for name in mine})


def cut_marker(frames_cut: int) -> Frame:
    """The frame standing for ``frames_cut`` frames left out of the middle of a stack."""
    return Frame(f"<{frames_cut} frames cut by perfmon-agent>", "", 0)


class _Names:
    """Frames and strings of one window or dump, each made once (a 950-frame stack seen in
    every sample is one set of Frame objects), shortened to MAX_NAME_CHARS. Kept by their
    shortened text: a long name is not held past its event."""

    def __init__(self, cuts: Cuts) -> None:
        self.cuts = cuts
        self.frames: dict[tuple[str, str, int, str | None], Frame] = {}
        self.shortened: set[str] = set()

    def text(self, value: Any, keep_end: bool = True) -> str:
        text = value if isinstance(value, str) else str(value)
        if len(text) <= MAX_NAME_CHARS:
            return text
        short = ("…" + text[1 - MAX_NAME_CHARS:] if keep_end
                 else text[:MAX_NAME_CHARS - 1] + "…")
        if short not in self.shortened:
            self.shortened.add(short)
            self.cuts.names += 1
        return short

    def frame(self, function: Any, file: Any, line: int, module: Any = None) -> Frame:
        key = (self.text(function), self.text(file), line,
               None if module is None else self.text(module))
        found = self.frames.get(key)
        if found is None:
            found = self.frames[key] = Frame(*key)
        return found


def _events(data: bytes | str | IO[bytes], max_bytes: int | None, what: str) -> Iterator[Any]:
    try:
        yield from iter_json_array(data, max_bytes=max_bytes)
    except JsonTooLarge as err:
        raise PySpyOutputTooLarge(f"py-spy {what}: {err}") from err
    except JsonStreamError as err:
        raise PySpyOutputError(f"py-spy {what}: not a valid JSON list ({err})") from err


def _malformed(what: str, value: Any) -> PySpyOutputError:
    return PySpyOutputError(f"py-spy {what}: malformed {str(value)[:200]}")


def parse_chrometrace(
    data: bytes | str | IO[bytes], *, origin_mono_ns: int,
    kernel_tids: Mapping[int, int] | None = None, max_bytes: int | None = None,
    cuts: Cuts | None = None,
) -> list[StackSample]:
    """Stack samples of a chrometrace file (bytes, text or a binary stream), by time.

    ``origin_mono_ns``: CLOCK_MONOTONIC ns of py-spy's ts = 0. ``kernel_tids``
    maps py-spy thread ids (pthread_t) to kernel tids, e.g. from a dump; ids not
    in it are kept as they are. Read event by event (perfmon.parsers.json_stream),
    and bounded: at most ``max_bytes`` of it (PySpyOutputTooLarge past them), the
    caps above on threads, frames and names, what was cut counted into ``cuts``.
    Raises PySpyOutputError.
    """
    builder = _Trace(kernel_tids or {}, cuts if cuts is not None else Cuts())
    for event in _events(data, max_bytes, "chrometrace"):
        builder.feed(event)
    return builder.samples(origin_mono_ns)


class _Node:
    """A frame on its caller's node: one node per distinct stack (from the outside in), so
    a stack seen in many samples, or by many threads, is held once."""

    __slots__ = ("anchor", "depth", "frame", "parent")

    def __init__(self, frame: Frame, parent: _Node | None) -> None:
        self.frame, self.parent = frame, parent
        self.depth: int = parent.depth + 1 if parent is not None else 1
        # The node MAX_OUTER_FRAMES deep on this stack: where a cut stack's outer end begins.
        self.anchor: _Node | None = (self if self.depth == MAX_OUTER_FRAMES
                                     else parent.anchor if parent is not None else None)

    def frames(self, count: int) -> list[Frame]:
        """This frame and its callers, innermost first, ``count`` at most."""
        out: list[Frame] = []
        node: _Node | None = self
        while node is not None and len(out) < count:
            out.append(node.frame)
            node = node.parent
        return out


@dataclass
class _Thread:
    top: _Node | None = None  # the stack now
    history: list[tuple[int, _Node | None]] = field(default_factory=list)  # (ts_us, stack)


class _Trace:
    """Each thread's stack at each change, from chrometrace events in file order.

    All events of one sample share its ts; the last one leaves the new stack. Newer
    py-spy: tid is a small index, the real thread id is in "<id>: <name>" (M events).
    """

    def __init__(self, kernel_tids: Mapping[int, int], cuts: Cuts) -> None:
        self.kernel_tids, self.cuts = kernel_tids, cuts
        self.names = _Names(cuts)
        self.remapped: dict[tuple[int, int], int] = {}
        self.threads: dict[tuple[int, int], _Thread] = {}
        self.cut_threads: set[tuple[int, int]] = set()
        self.others = 0  # threads kept besides the main one
        self.nodes: dict[tuple[int, int], _Node] = {}  # (id(caller), id(frame))
        self.markers: dict[int, Frame] = {}

    def real_tid(self, key: tuple[int, int]) -> int:
        tid = self.remapped.get(key, key[1])
        return self.kernel_tids.get(tid, tid)

    def feed(self, e: Any) -> None:
        if not isinstance(e, dict):
            raise _malformed("chrometrace event", e)
        phase = e.get("ph")
        try:
            if phase == "M":
                self._metadata(e)
                return
            if phase not in ("B", "E"):
                return
            key = (int(e["pid"]), int(e["tid"]))
            ts_us = int(e["ts"])
            thread = self.threads.get(key) or self._new_thread(key)
            if thread is None:
                return
            frame = None
            if phase == "B":
                args = e.get("args") or {}
                frame = self.names.frame(e["name"], args.get("filename", ""),
                                         int(args.get("line") or 0))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise _malformed("chrometrace event", e) from err
        if frame is not None:
            thread.top = self._push(thread.top, frame)
        elif thread.top is not None:
            thread.top = thread.top.parent  # py-spy ends frames innermost first
        history = thread.history
        if history and history[-1][0] == ts_us:
            history[-1] = (ts_us, thread.top)
        else:
            history.append((ts_us, thread.top))

    def _metadata(self, e: dict[str, Any]) -> None:
        if e.get("name") == "thread_name":
            real = str((e.get("args") or {}).get("name", ""))[:40].split(":", 1)[0]
            if real.isdigit():
                self.remapped[(int(e["pid"]), int(e["tid"]))] = int(real)

    def _new_thread(self, key: tuple[int, int]) -> _Thread | None:
        if key in self.cut_threads:
            return None
        if self.real_tid(key) != key[0]:  # the main thread (tid == pid) is always kept
            if self.others >= MAX_THREADS - 1:
                self.cut_threads.add(key)
                self.cuts.threads += 1
                return None
            self.others += 1
        thread = self.threads[key] = _Thread()
        return thread

    def _push(self, caller: _Node | None, frame: Frame) -> _Node:
        key = (id(caller), id(frame))
        node = self.nodes.get(key)
        if node is None:
            node = self.nodes[key] = _Node(frame, caller)
        return node

    def _frames(self, node: _Node, outers: dict[int, tuple[Frame, ...]]) -> tuple[Frame, ...]:
        if node.depth <= KEEP_FRAMES:
            return tuple(node.frames(KEEP_FRAMES))
        anchor = node.anchor
        assert anchor is not None
        outer = outers.get(id(anchor))
        if outer is None:
            outer = outers[id(anchor)] = tuple(anchor.frames(MAX_OUTER_FRAMES))
        cut = node.depth - KEEP_FRAMES
        marker = self.markers.get(cut)
        if marker is None:
            marker = self.markers[cut] = cut_marker(cut)
        return (*node.frames(MAX_INNER_FRAMES), marker, *outer)

    def samples(self, origin_mono_ns: int) -> list[StackSample]:
        """Every stack state, the main thread's first within MAX_WINDOW_FRAMES."""
        made: dict[int, tuple[Frame, ...]] = {}  # id(node) -> frames: a stack made once
        outers: dict[int, tuple[Frame, ...]] = {}
        spent = 0
        samples = []
        for (pid, tid), thread in sorted(self.threads.items(),
                                         key=lambda item: self.real_tid(item[0]) != item[0][0]):
            real_tid = self.real_tid((pid, tid))
            for (ts_us, node), (next_us, _) in pairwise(thread.history):
                # The final events close every open frame at the time of writing, so
                # an empty stack marks the end of the recording (or a frameless thread).
                if node is None:
                    continue
                frames = made.get(id(node))
                if frames is None:
                    cost = min(node.depth, KEEP_FRAMES + 1)
                    if spent + cost > MAX_WINDOW_FRAMES:
                        self.cuts.samples += 1
                        continue
                    spent += cost
                    frames = made[id(node)] = self._frames(node, outers)
                if node.depth > KEEP_FRAMES:
                    self.cuts.stacks += 1
                    self.cuts.frames += node.depth - KEEP_FRAMES
                samples.append(StackSample(origin_mono_ns + ts_us * 1000, pid, real_tid,
                                           frames, (next_us - ts_us) * 1000))
        samples.sort(key=lambda s: (s.t_mono_ns, s.pid, s.tid))
        return samples


def _locals(raw_frame: Mapping[str, Any], names: _Names) -> dict[str, str]:
    variables = raw_frame.get("locals") or ()
    if len(variables) > MAX_LOCALS:
        names.cuts.locals += len(variables) - MAX_LOCALS
        variables = variables[:MAX_LOCALS]
    return {names.text(v["name"]): names.text(v.get("repr"), keep_end=False) for v in variables}


def _is_main_thread(t: Any) -> bool:
    try:
        return int(t.get("os_thread_id") or t["thread_id"]) == int(t["pid"])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise _malformed("dump thread", t) from err


def _dumped_thread(t: Any, names: _Names) -> ThreadStack:
    """One thread of a dump, its stack cut to KEEP_FRAMES (both ends kept)."""
    try:
        raw_frames = t["frames"]
        if not isinstance(raw_frames, list):
            raise TypeError("frames is not a list")
        depth = len(raw_frames)
        kept: list[Any] = raw_frames
        if depth > KEEP_FRAMES:
            names.cuts.stacks += 1
            names.cuts.frames += depth - KEEP_FRAMES
            kept = [*raw_frames[:MAX_INNER_FRAMES], None, *raw_frames[-MAX_OUTER_FRAMES:]]
        name = t.get("thread_name")
        return ThreadStack(
            pid=int(t["pid"]),
            tid=int(t.get("os_thread_id") or t["thread_id"]),
            thread_name=None if name is None else names.text(name),
            frames=tuple(cut_marker(depth - KEEP_FRAMES) if f is None else names.frame(
                f["name"], f.get("filename", ""), int(f.get("line") or 0), f.get("module"))
                for f in kept),
            frame_locals=tuple({} if f is None else _locals(f, names) for f in kept),
            pyspy_thread_id=int(t["thread_id"]),
            active=bool(t.get("active", True)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise _malformed("dump thread", t) from err


def parse_dump(data: bytes | str, *, cut: bool = False, cuts: Cuts | None = None
               ) -> list[ThreadStack]:
    """Threads of ``py-spy dump --json [--locals]`` output, bounded as the samples are
    (MAX_THREADS, the main thread always kept; KEEP_FRAMES; MAX_NAME_CHARS; MAX_LOCALS),
    what was cut counted into ``cuts``. ``cut``: py-spy wrote more than ``data`` (the
    reader stopped at its cap): the threads whole within it are kept. Raises
    PySpyOutputError.
    """
    cuts = cuts if cuts is not None else Cuts()
    names = _Names(cuts)
    threads: list[ThreadStack] = []
    others = 0
    try:
        for raw in _events(data, None, "dump"):
            if not _is_main_thread(raw):
                if others >= MAX_THREADS - 1:
                    cuts.threads += 1
                    continue
                others += 1
            threads.append(_dumped_thread(raw, names))
    except PySpyOutputError:
        if not cut:
            raise
    if cut:
        cuts.dumps += 1
    return threads
