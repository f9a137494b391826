"""What Python stacks tell of a training loop: phase, iterations, hangs, iteration number.

Pure functions over :mod:`perfmon.parsers.pyspy` data (frames innermost first).
The rules are written against real stacks of PyTorch 2.x on Python 3.11, where
py-spy reports qualified names (``Optimizer.profile_hook_step.<locals>.wrapper``);
older Pythons give the bare name (``wrapper``), which the rules accept too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from perfmon.parsers.pyspy import Frame, StackSample, ThreadStack

PHASES = ("data_loading", "forward", "backward", "optimizer", "other")
DEFAULT_ITERATION_LOCALS = ("iteration", "iter_num", "step", "global_step")
_INTEGER = re.compile(r"^-?\d+$")


def _base(function: str) -> str:
    """'Optimizer.profile_hook_step.<locals>.wrapper' -> 'wrapper'."""
    return function.rsplit(".", 1)[-1]


def _is_data_loading(f: Frame) -> bool:
    # DataLoader.__iter__/__next__, its fetchers and the Dataset.__getitem__ they call.
    return "/torch/utils/data/" in f.file or "DataLoader" in f.function


def _is_backward(f: Frame) -> bool:
    # Tensor.backward, torch.autograd.backward/grad/_engine_run_backward, and Python
    # autograd Functions' backward (DeepSpeedEngine.backward, manual_backward too).
    # Not any frame of torch/autograd: a custom Function's forward runs under
    # Function.apply (function.py), and record_function (profiler.py, around every
    # optimizer step) and no_grad (grad_mode.py) wrap other phases.
    base = _base(f.function)
    return base in ("backward", "manual_backward") or (
        "/torch/autograd/" in f.file and base in ("grad", "_engine_run_backward"))


def _is_forward(f: Frame) -> bool:
    base = _base(f.function)
    if f.file.endswith("/torch/nn/modules/module.py"):
        return base in ("_call_impl", "_wrapped_call_impl")  # not zero_grad, state_dict...
    return base == "forward" or f.file.endswith("/torch/nn/functional.py")


def _is_optimizer(f: Frame) -> bool:
    base = _base(f.function)
    return (
        "/torch/optim/" in f.file
        or base == "zero_grad"
        or (base == "step" and "ptim" in f.function)  # MegatronOptimizer.step, ZeroOptimizer...
        or f.file.endswith("/torch/nn/utils/clip_grad.py")
    )


# Checked in this order; the first phase with a frame anywhere in the stack wins.
# Backward before forward: activation checkpointing re-runs forward inside
# backward. Forward and backward before optimizer: Lightning runs the training
# step as a closure inside optimizer.step().
_PHASE_RULES = (
    ("data_loading", _is_data_loading),
    ("backward", _is_backward),
    ("forward", _is_forward),
    ("optimizer", _is_optimizer),
)


def classify_phase(frames: Sequence[Frame]) -> str:
    """One of PHASES for a stack (innermost first); 'other' when no rule matches."""
    for phase, rule in _PHASE_RULES:
        if any(rule(f) for f in frames):
            return phase
    return "other"


def phase_durations_ns(samples: Iterable[StackSample]) -> dict[str, int]:
    """Nanoseconds per phase (every phase present, zeros included), weighted by duration."""
    totals = dict.fromkeys(PHASES, 0)
    for s in samples:
        totals[classify_phase(s.frames)] += s.duration_ns
    return totals


def is_optimizer_step(f: Frame) -> bool:
    """A frame of ``torch.optim.Optimizer.step``: the wrappers every Optimizer subclass
    gets in optimizer.py, or a ``<Class>.step`` in torch/optim (not the LR schedulers')."""
    if f.file.endswith("/torch/optim/optimizer.py"):
        return _base(f.function) in ("wrapper", "_use_grad")
    return (
        "/torch/optim/" in f.file
        and not f.file.endswith(("/lr_scheduler.py", "/swa_utils.py"))
        and _base(f.function) == "step"
    )


@dataclass(frozen=True)
class IterationBoundary:
    t_mono_ns: int  # the first sample inside the step episode
    pid: int
    tid: int
    step_time_ns: int | None  # since this thread's previous boundary; None at start or after a gap


class IterationDetector:
    """Iteration boundaries from stack samples: entries into an optimizer-step episode.

    A boundary is the first sample inside ``Optimizer.step`` (or a frame whose
    function matches ``function_regex``, searched with re.search; a bad pattern
    raises re.error here) after samples outside it, per thread.

    Error: py-spy samples at Poisson times (exponential gaps, mean 1/rate, to
    avoid aliasing, py-spy issue #94), so a boundary trails the true entry by an
    exponential delay of mean one sampling period (10 ms at 100 Hz), and one
    step time is off by the difference of two such delays (std ~1.4 periods).
    The mean over N consecutive steps telescopes to (last - first) / N, so its
    error is ~1.4 periods / N: 0.14 ms over 100 steps at 100 Hz. An episode
    shorter than a few periods can be missed outright (probability
    exp(-rate * episode_s)), which merges two steps into one: make sure the
    episode spans >= 5 periods (P(miss) < 1%) or raise the rate.

    ``min_outside_ns``: an entry after a stretch outside the episode shorter
    than this continues the previous episode. Such flicker comes from the few
    ms by which two consecutive py-spy windows' clocks disagree where they are
    joined, or from a stack misread while the target ran (non-blocking mode);
    a real stretch that short would be missed by sampling half the time anyway.
    Default: two periods at 100 Hz.

    ``max_gap_ns``: a hole in a thread's samples longer than this (a lost
    window, a restarted sampler) breaks the chain; the next step time is None.
    """

    def __init__(self, function_regex: str | None = None, *, min_outside_ns: int = 20_000_000,
                 max_gap_ns: int = 20_000_000) -> None:
        self._pattern = re.compile(function_regex) if function_regex else None
        self.min_outside_ns = min_outside_ns
        self.max_gap_ns = max_gap_ns
        # Per (pid, tid): when the current stretch outside the episode began
        # (None: inside, or nothing seen since the start or a gap), end of the
        # last sample, time of the last boundary (None: none since the last gap).
        self._outside_ns: dict[tuple[int, int], int | None] = {}
        self._end_ns: dict[tuple[int, int], int] = {}
        self._last_ns: dict[tuple[int, int], int | None] = {}

    def _in_episode(self, frames: Sequence[Frame]) -> bool:
        if self._pattern is not None:
            return any(self._pattern.search(f.function) for f in frames)
        return any(is_optimizer_step(f) for f in frames)

    def feed(self, samples: Iterable[StackSample]) -> list[IterationBoundary]:
        """Boundaries found in these samples (each thread's samples in time order)."""
        found = []
        for s in samples:
            key = (s.pid, s.tid)
            end = self._end_ns.get(key)
            if end is None or s.t_mono_ns - end > self.max_gap_ns:
                self._outside_ns[key], self._last_ns[key] = None, None
            outside_since = self._outside_ns[key]
            if not self._in_episode(s.frames):
                if outside_since is None:
                    self._outside_ns[key] = s.t_mono_ns
            else:
                self._outside_ns[key] = None
                if outside_since is not None and s.t_mono_ns - outside_since >= self.min_outside_ns:
                    last = self._last_ns[key]
                    found.append(IterationBoundary(
                        s.t_mono_ns, s.pid, s.tid, None if last is None else s.t_mono_ns - last
                    ))
                    self._last_ns[key] = s.t_mono_ns
            self._end_ns[key] = max(end or 0, s.t_mono_ns + s.duration_ns)
        return found


def mean_step_time_ns(boundaries: Iterable[IterationBoundary]) -> float | None:
    """Mean of the known step times (telescoping within each gap-free run), or None."""
    times = [b.step_time_ns for b in boundaries if b.step_time_ns is not None]
    return sum(times) / len(times) if times else None


def main_thread(threads: Iterable[ThreadStack]) -> ThreadStack | None:
    """The process's main thread (kernel tid == pid, or named MainThread)."""
    threads = list(threads)
    for t in threads:
        if t.tid == t.pid:
            return t
    return next((t for t in threads if t.thread_name == "MainThread"), None)


def innermost_common_frame(stacks: Sequence[Sequence[Frame]]) -> Frame | None:
    """The deepest frame every stack shares, walking in from the outermost frame.

    Pass the main threads' stacks of all ranks to see where a hung job waits.
    Frames compare by function and file (ranks may be on different lines of one
    function); the frame returned is the first stack's. None when the stacks
    share no outermost frame or none are given.
    """
    if not stacks:
        return None
    common: Frame | None = None
    for level in zip(*(reversed(s) for s in stacks), strict=False):
        first = level[0]
        if any((f.function, f.file) != (first.function, first.file) for f in level[1:]):
            break
        common = first
    return common


MAX_COUNTER = 10**12  # no job counts further


def iteration_local(
    threads: Iterable[ThreadStack], names: Sequence[str] = DEFAULT_ITERATION_LOCALS
) -> tuple[str, int] | None:
    """(name, value) of the job's own iteration counter in a ``dump --locals`` snapshot.

    Searches the main thread first, then the others; within a thread, frames from
    the outermost in (the training loop sits near the bottom; a library frame
    deeper down may have an unrelated ``step``, as Adam's does), and in each frame
    ``names`` in order. Only integer values count (a tensor's repr is not a number),
    and only those a counter can hold, 0 to MAX_COUNTER: a read that races the frame
    can give garbage (-4669202389988461694 was seen under load).
    """
    threads = list(threads)
    first = main_thread(threads)
    ordered = ([first] if first else []) + [t for t in threads if t is not first]
    for t in ordered:
        for local_vars in reversed(t.frame_locals):
            for name in names:
                value = local_vars.get(name)
                if value is not None and _INTEGER.match(value.strip()) \
                        and 0 <= int(value) <= MAX_COUNTER:
                    return name, int(value)
    return None


def iteration_from_locals(
    threads: Iterable[ThreadStack], names: Sequence[str] = DEFAULT_ITERATION_LOCALS
) -> int | None:
    """The job's own iteration number (see :func:`iteration_local`), or None."""
    found = iteration_local(threads, names)
    return found[1] if found else None
