"""Where each iteration's time goes: data loading, forward, backward, optimizer, other.

Two sources, combined per window of iterations:
- stack samples (py-spy): spans of the primary rank's training thread, each
  classified by perfmon.parsers.stack_analysis.classify_phase;
- uprobes, where they exist: ``torch::autograd::Engine::execute`` entry and exit
  give the exact backward time. (``record_function`` blocks have no exported
  exit in libtorch, so data loading and optimizer ends come from samples.)

With both, backward is the exact uprobe time and the rest of the window is
shared out in the proportions the samples show for the other phases. With
samples only, every phase comes from samples; with uprobes only, backward is
exact and the rest is ``other``. Shares always add up to 1. A window without samples
in a part of the log made coarser (its spans dropped) has no phases.
"""

from __future__ import annotations

from typing import Any

PHASES = ("data_loading", "forward", "backward", "optimizer", "other")


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


class PhaseAccount:
    """``bursts``: stack samples come in bursts (a CPU budget), so a window without
    samples (or whose samples saw only backward) has no sampled phases rather than
    all of its (other) time in ``other``."""

    def __init__(self, bursts: bool = False) -> None:
        self.bursts = bursts
        self._spans: list[tuple[int, int, str]] = []  # (start, end, phase), sampled
        self._backward: list[tuple[int, int]] = []  # (iteration end, ns in backward), uprobes
        self.watermark_ns = 0  # samples cover the primary thread up to here
        self.unsampled_until_ns = 0  # a part of the log made coarser: its spans dropped
        self.sampled = False
        self.probed = False
        self.total_ns = dict.fromkeys(PHASES, 0)
        self.total_iterations = 0
        self._windows_due: set[int] = set()  # starts of py-spy windows whose samples are not in

    def on_window(self, record: dict[str, Any]) -> None:
        """A ``stack_window`` record: a window started, or its samples are in."""
        if record["samples_in"]:
            self._windows_due.discard(record["start_mono_ns"])
        else:
            self._windows_due.add(record["start_mono_ns"])

    def samples_due(self, end_ns: int) -> bool:
        """Whether samples from before ``end_ns`` may still come (a window started
        before it is not in)."""
        return any(start < end_ns for start in self._windows_due)

    def add_span(self, start_ns: int, end_ns: int, phase: str) -> None:
        self.sampled = True
        self._spans.append((start_ns, end_ns, phase))
        self.watermark_ns = max(self.watermark_ns, end_ns)

    def add_backward(self, end_ns: int, backward_ns: int) -> None:
        """The time in backward() (uprobes) of the iteration that ended at ``end_ns``."""
        self.probed = True
        self._backward.append((end_ns, backward_ns))

    def feed_phase(self, record: dict[str, Any]) -> None:
        """A ``phase`` record (spans of other ranks than the primary are not fed here)."""
        self.add_span(record["t_mono_ns"], record["end_mono_ns"], record["phase"])

    def window_ns(self, start_ns: int, end_ns: int) -> dict[str, int] | None:
        """Nanoseconds per phase in [start, end] (the ends of iterations); None without any
        source. (Pure.)"""
        length = end_ns - start_ns
        sampled = dict.fromkeys(PHASES, 0)
        for s0, s1, phase in self._spans:
            sampled[phase] += _overlap(s0, s1, start_ns, end_ns)
        backward = sum(ns for end, ns in self._backward if start_ns < end <= end_ns)
        if not any(sampled.values()) and (not self.probed or self.bursts
                                          or end_ns <= self.unsampled_until_ns):
            return None
        if not self.probed:
            result = sampled
        else:
            rest = max(0, length - backward)
            others = {p: v for p, v in sampled.items() if p != "backward"}
            weight = sum(others.values())
            result = dict.fromkeys(PHASES, 0)
            result["backward"] = min(backward, length)
            if weight:
                for phase, ns in others.items():
                    result[phase] = round(rest * ns / weight)
            elif self.bursts:
                # A burst that saw only backward() says nothing of how the rest of the
                # window divides: as for a window without samples, no phases.
                return None
            else:
                result["other"] = rest
        return result

    def prune(self, before_ns: int) -> None:
        """Forget spans that end before ``before_ns`` (windows are asked in time order)."""
        self._spans = [s for s in self._spans if s[1] > before_ns]
        self._backward = [b for b in self._backward if b[0] > before_ns]

    def record(self, per_phase_ns: dict[str, int] | None, iterations: int) -> None:
        if per_phase_ns is None:
            return
        for phase, ns in per_phase_ns.items():
            self.total_ns[phase] += ns
        self.total_iterations += iterations

    @staticmethod
    def breakdown(per_phase_ns: dict[str, int] | None, iterations: int) -> dict[str, Any] | None:
        """``{phase: {"ms": mean per iteration, "share": 0..1}}``, or None."""
        if per_phase_ns is None or iterations <= 0:
            return None
        covered = sum(per_phase_ns.values())
        if covered <= 0:
            return None
        return {
            phase: {"ms": ns / iterations / 1e6, "share": ns / covered}
            for phase, ns in per_phase_ns.items()
        }

    @property
    def source(self) -> str | None:
        if self.probed and self.sampled:
            return "uprobe+pyspy"
        return "uprobe" if self.probed else ("pyspy" if self.sampled else None)
