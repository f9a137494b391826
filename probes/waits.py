"""Time blocked on the process group, accounted where the wait markers arrive (the
tracefs backend; the bcc backend does the same in the kernel, iterations.bpf.c).

Per thread, nested waits count once, from the outermost entry to its return, added
to the process's running total at the return (and to its point-to-point total too
when the outermost is a send's or a receive's: ``p2p_wait_*`` markers); the thread
stepping the optimizer is in no wait, so a wait whose return was lost ends at the
step. ``step`` gives the totals a ``waits`` record carries: one record per step
instead of two per collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from perfmon.parsers.events import WAIT_MARKERS, Marker, Record, WaitTotals


@dataclass
class _Thread:
    depth: int = 0
    since: int = 0
    p2p: bool = False  # the outermost wait is a point-to-point one


class WaitAccount:
    """Running wait totals of the processes whose wait markers it is given."""

    def __init__(self) -> None:
        self._threads: dict[int, _Thread] = {}
        self._totals: dict[int, list[int]] = {}  # pid -> [ns, count, p2p ns, p2p count]
        self._forget_before = 0  # (forget_open_from)

    def account(self, marker: Marker, probed: bool, raw: bool) -> list[Record]:
        """Take one marker; what of it is logged: a wait's entry and return only when
        ``raw`` (they go into the totals), a step of a ``probed`` process with the
        totals before it (a ``waits`` record)."""
        t, pid, tid, kind = marker.t_mono_ns, marker.pid, marker.tid, marker.kind
        if self._forget_before and t >= self._forget_before:
            self._threads.clear()
            self._forget_before = 0
        if kind in WAIT_MARKERS:
            if kind.endswith("_enter"):
                self.enter(tid, t, p2p=kind == "p2p_wait_enter")
            else:
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

    def enter(self, tid: int, t_ns: int, p2p: bool = False) -> None:
        thread = self._threads.get(tid)
        if thread is None:
            thread = self._threads[tid] = _Thread()
        if thread.depth == 0:
            thread.since, thread.p2p = t_ns, p2p
        thread.depth += 1

    def exit(self, pid: int, tid: int, t_ns: int) -> None:
        thread = self._threads.get(tid)
        if thread is None or thread.depth == 0:
            return  # entered before the probes were attached
        thread.depth -= 1
        if thread.depth == 0:
            self._add(pid, t_ns - thread.since, thread.p2p)

    def step(self, pid: int, tid: int, t_ns: int) -> tuple[int, int, int, int]:
        """(wait ns, waits, p2p wait ns, p2p waits) of ``pid`` so far, at an
        Optimizer.step of thread ``tid``."""
        thread = self._threads.get(tid)
        if thread is not None and thread.depth:
            thread.depth = 0
            self._add(pid, t_ns - thread.since, thread.p2p)
        ns, count, p2p_ns, p2p_count = self._totals.get(pid, (0, 0, 0, 0))
        return ns, count, p2p_ns, p2p_count

    def _add(self, pid: int, ns: int, p2p: bool) -> None:
        total = self._totals.setdefault(pid, [0, 0, 0, 0])
        total[0] += ns
        total[1] += 1
        if p2p:
            total[2] += ns
            total[3] += 1
