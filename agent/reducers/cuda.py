"""CUDA and NCCL activity per iteration: differences of the counters the kernel copied at
each Optimizer.step entry (perfmon.probes.cuda), so every figure is exact.

With sampled launch counting (the default), kernel launches are counted only
between snapshots taken while the launch probes were attached
(``launches_probed``); those iterations give exact launch counts, the others
count no launch and are left out of ``kernels_per_iter``.
"""

from __future__ import annotations

import itertools
from typing import Any

CUDA_MATCH_NS = 1_000_000  # a snapshot and its marker: two uprobes on one call, us apart
_SCALARS = ("kernel_launches", "sync_wait_ns", "graph_launches")
_TABLES = ("nccl_calls", "nccl_bytes")


def _delta(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    delta: dict[str, Any] = {k: last[k] - first[k] for k in _SCALARS}
    for table in _TABLES:
        delta[table] = {k: v - first[table].get(k, 0) for k, v in last[table].items()}
    return delta


def _add(total: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: total.get(k, 0) + delta[k] for k in (*_SCALARS, "launches")}
    for table in _TABLES:
        out[table] = {k: total.get(table, {}).get(k, 0) + v for k, v in delta[table].items()}
    return out


def per_iteration(delta: dict[str, Any] | None, iterations: int,
                  launch_iterations: int) -> dict[str, Any]:
    """Per-iteration figures (perfmon.parsers.figures' fields) of a counter delta
    over ``iterations`` (``launch_iterations`` of which had the launch probes attached)."""
    if delta is None or iterations <= 0:
        return {"cuda": True, **dict.fromkeys((
            "kernels_per_iter", "cpu_sync_wait_s", "nccl_calls_per_iter",
            "nccl_bytes_per_iter", "nccl_per_iter_by_collective"))}
    return {
        "cuda": True,
        "kernels_per_iter": (delta["launches"] / launch_iterations
                             if launch_iterations else None),
        "cpu_sync_wait_s": delta["sync_wait_ns"] / iterations / 1e9,
        "nccl_calls_per_iter": sum(delta["nccl_calls"].values()) / iterations,
        "nccl_bytes_per_iter": sum(delta["nccl_bytes"].values()) / iterations,
        "nccl_per_iter_by_collective": {
            name: {"calls": calls / iterations,
                   "bytes": delta["nccl_bytes"].get(name, 0) / iterations}
            for name, calls in delta["nccl_calls"].items() if calls
        },
    }


class CudaActivity:
    """Feeds on the primary rank's ``cuda`` step snapshots."""

    def __init__(self, primary_pid: int) -> None:
        self.primary_pid = primary_pid
        self._at_step: dict[int, dict[str, Any]] = {}  # t -> snapshot
        self._sum: dict[str, Any] = {}  # deltas over finalized windows
        self._iterations = 0
        self._launch_iterations = 0
        self.launch_sampled = False  # some iterations went unprobed for launches

    def on_snapshot(self, record: dict[str, Any]) -> None:
        if record["at_step"] and record["pid"] == self.primary_pid:
            self._at_step[record["t_mono_ns"]] = record

    def snapshot(self, t_ns: int) -> dict[str, Any] | None:
        """The snapshot taken at the step entry at ``t_ns`` (its marker's time)."""
        near = [t for t in self._at_step if abs(t - t_ns) < CUDA_MATCH_NS]
        return self._at_step[min(near, key=lambda t: abs(t - t_ns))] if near else None

    def window(self, start: int, end: int, count: int) -> dict[str, Any]:
        """Per-iteration figures between the step entries at ``start`` and ``end``.

        Launches count only over iterations whose two snapshots were both taken
        with the launch probes attached since the one before (exact counts).
        """
        first, last = self.snapshot(start), self.snapshot(end)
        if first is None or last is None:
            return per_iteration(None, 0, 0)
        delta = _delta(first, last)
        steps = sorted((t, s) for t, s in self._at_step.items()
                       if first["t_mono_ns"] <= t <= last["t_mono_ns"])
        launches = probed = 0
        for (_, a), (_, b) in itertools.pairwise(steps):
            if b.get("launches_probed", True):
                launches += b["kernel_launches"] - a["kernel_launches"]
                probed += 1
        self.launch_sampled |= probed < len(steps) - 1
        delta["launches"] = launches
        self._sum = _add(self._sum, delta)
        self._iterations += count
        self._launch_iterations += probed
        return per_iteration(delta, count, probed)

    def prune(self, before_ns: int) -> None:
        self._at_step = {t: c for t, c in self._at_step.items()
                         if t >= before_ns - CUDA_MATCH_NS}

    def summary(self) -> dict[str, Any]:
        figures = per_iteration(self._sum or None, self._iterations, self._launch_iterations)
        figures["kernel_launches_sampled_iterations"] = self._launch_iterations
        return figures
