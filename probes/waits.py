"""Time blocked on collectives, accounted where the wait markers arrive (the tracefs
backend; the bcc backend does the same in the kernel, iterations.bpf.c).

Per thread, nested waits count once, from the outermost entry to its return, added
to the process's running total at the return; the thread stepping the optimizer is
in no wait, so a wait whose return was lost ends at the step. ``step`` gives the
totals a ``waits`` record carries: one record per step instead of two per collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from perfmon.parsers.events import Marker, Record, WaitTotals


@dataclass
class _Thread:
    depth: int = 0
    since: int = 0


class WaitAccount:
    """Running wait totals of the processes whose wait markers it is given."""

    def __init__(self) -> None:
        self._threads: dict[int, _Thread] = {}
        self._totals: dict[int, list[int]] = {}  # pid -> [ns, count]
        self._forget_before = 0  # (forget_open_from)

    def account(self, marker: Marker, probed: bool, raw: bool) -> list[Record]:
        """Take one marker; what of it is logged: a wait's entry and return only when
        ``raw`` (they go into the totals), a step of a ``probed`` process with the
        totals before it (a ``waits`` record)."""
        t, pid, tid, kind = marker.t_mono_ns, marker.pid, marker.tid, marker.kind
        if self._forget_before and t >= self._forget_before:
            self._threads.clear()
            self._forget_before = 0
        if kind == "wait_enter":
            self.enter(tid, t)
        elif kind == "wait_exit":
            self.exit(pid, tid, t)
        elif kind == "optimizer_step" and probed:
            return [WaitTotals(t, pid, *self.step(pid, tid, t)), marker]
        else:
            return [marker]
        return [marker] if raw else []

    def forget_open_from(self, t_ns: int) -> None:
        """At the first marker from ``t_ns`` on, forget the waits open then (the probes
        were off, their returns unseen; markers from before may still be on their way)."""
        self._forget_before = t_ns

    def enter(self, tid: int, t_ns: int) -> None:
        thread = self._threads.get(tid)
        if thread is None:
            thread = self._threads[tid] = _Thread()
        if thread.depth == 0:
            thread.since = t_ns
        thread.depth += 1

    def exit(self, pid: int, tid: int, t_ns: int) -> None:
        thread = self._threads.get(tid)
        if thread is None or thread.depth == 0:
            return  # entered before the probes were attached
        thread.depth -= 1
        if thread.depth == 0:
            self._add(pid, t_ns - thread.since)

    def step(self, pid: int, tid: int, t_ns: int) -> tuple[int, int]:
        """(wait ns, waits) of ``pid`` so far, at an Optimizer.step of thread ``tid``."""
        thread = self._threads.get(tid)
        if thread is not None and thread.depth:
            thread.depth = 0
            self._add(pid, t_ns - thread.since)
        ns, count = self._totals.get(pid, (0, 0))
        return ns, count

    def _add(self, pid: int, ns: int) -> None:
        total = self._totals.setdefault(pid, [0, 0])
        total[0] += ns
        total[1] += 1
