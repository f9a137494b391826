"""What each source saw and missed (``final_statistics.data_quality``), and the hangs.

Sources log their cumulative counters as ``quality`` records; the latest of each
source is what the summary shows, with a one-line hint for every loss, so a quiet
number is told apart from a blind one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from perfmon.parsers.figures import HangEpisode, finite
from perfmon.parsers.pyspy import (
    DUMP_MAX_BYTES,
    KEEP_FRAMES,
    MAX_INNER_FRAMES,
    MAX_NAME_CHARS,
    MAX_OUTER_FRAMES,
    MAX_THREADS,
    MAX_WINDOW_FRAMES,
    WINDOW_MAX_BYTES,
)

# Counters that are losses, and what to do about each.
HINTS = {
    "events_dropped": "the ring buffer overflowed: events were lost (the agent was starved "
                      "of CPU; see lost_events)",
    "snapshots_dropped": "CUDA step snapshots were lost to a full ring buffer",
    "restart_redone_unknown": "the job's own iteration counter was not read before or after "
                              "its restart: the iterations it redid are not in the ledger's "
                              "restart (productive instead)",
    "lost_windows": "py-spy windows gave no samples: check the py-spy errors in last_error",
    "gaps": "holes between py-spy windows: phases there are unsampled",
    "sampling_errors": "py-spy could not read some stacks (the job ran while it read); "
                       "harmless up to 5% of the samples",
    # What was left out of py-spy's output to keep the agent's memory bounded (a job of
    # very deep stacks, very many threads or very long names: security issue 36).
    "windows_cut": f"py-spy windows too large to read (over {WINDOW_MAX_BYTES >> 20} MiB, or "
                   "py-spy itself over its memory cap) were skipped: phases there are unsampled",
    "dumps_cut": f"py-spy dumps over {DUMP_MAX_BYTES >> 20} MiB were cut: the threads after the "
                 "cap are missing",
    "threads_cut": f"threads beyond {MAX_THREADS} per process were left out of py-spy's stacks",
    "stacks_cut": f"stacks deeper than {KEEP_FRAMES} frames kept their outermost "
                  f"{MAX_OUTER_FRAMES} and innermost {MAX_INNER_FRAMES} (frames_cut: how many "
                  "frames were left out)",
    "names_cut": f"function, file or variable names over {MAX_NAME_CHARS} characters were "
                 "shortened",
    "samples_cut": "stack samples of threads other than the main one were dropped: a window "
                   f"held over {MAX_WINDOW_FRAMES} frames",
    "missed_slots": "NVML samples were late or skipped (the agent was busy)",
    "read_errors": "reads of /proc failed (a rank exited)",
    "sync_untracked": "blocking CUDA calls whose return was not seen are not timed",
    "nccl_unknown_dtype_calls": "NCCL calls with an unknown datatype: bytes not counted",
    "attach_failed": "the source could not attach to some rank",
    "reads_failed": "reads of the job's iteration counter failed",
    # The iteration clock's own (source "iterations", derived from the rows).
    "none_measured": "no iteration was measured: the job did not train while attached, or "
                     "trained where no probe saw an iteration end (see the other losses)",
    "ends_estimated": "iterations estimated from py-spy stack samples, not exact markers: "
                      "counts and step times are approximate (iteration_estimators)",
    "microbatches_unknown": "iterations whose micro-batches are unknown (no backward() "
                            "probe): samples, tokens and FLOPs rest on --model-config's "
                            "global batch size",
    "microbatches_varied": "updates found by gradient reads whose backward passes differ "
                           "from the usual count: if the job reads gradients between "
                           "micro-batches, its updates were split there",
    "counter_disagrees": "the job's own iteration counter (read by py-spy) and the measured "
                         "iterations drifted apart by this many: iterations were missed or "
                         "split (e.g. gradients read between micro-batches)",
    "backward_passes_unmeasured": "backward passes of ranks where no update was ever seen "
                                  "(no torch.optim step, no gradient read outside "
                                  "backward(); the tracefs backend sees torch.optim's step "
                                  "only): their iterations are not measured; --microbatches K "
                                  "counts K backward passes as one update, or "
                                  "--iteration-source pyspy --iteration-variable NAME counts "
                                  "the job's own counter",
    "ranks_without_waits": "ranks of a distributed job none of whose probed iterations "
                           "showed a wait: their collectives block where no wait probe is "
                           "(session_info.wait_probes lists those attached; doctor --pid): "
                           "their wait reads 0 and their compute the whole step",
    "ranks_without_wait_probes": "ranks whose libtorch exports no wait point the probes "
                                 "know (doctor --pid): their waits on the process group are "
                                 "not seen, their compute is the whole step",
    "exits_unobserved": "ranks that ended without the kernel's exit status (no process-events "
                        "connector: see the exits source's warnings)",
    "log_tails_unread": "ranks whose last output lines could not be read (stdout/stderr not "
                        "a regular file the job's user may read)",
}


# Losses that are harmless within a share of their source's own total: below it they are
# listed as minor (data_quality.minor, --verbose), not as losses. py-spy reads a running
# job's memory, and a read that races the interpreter is retried at the next sample: up
# to 5% of the samples lost moves a phase's share less than the sampling itself does
# (a share from 100 samples is +-5 points).
HARMLESS = {"sampling_errors": ("samples", 0.05)}


def _harmless(counters: dict[str, Any], name: str, value: int) -> bool:
    if name not in HARMLESS:
        return False
    total_name, share = HARMLESS[name]
    total = counters.get(total_name)
    return isinstance(total, int) and value <= share * total


class DataQuality:
    """Feeds on ``quality`` records (latest counters per source wins)."""

    def __init__(self) -> None:
        self.sources: dict[str, dict[str, Any]] = {}

    def on_quality(self, record: dict[str, Any]) -> None:
        self.sources[record["source"]] = dict(record.get("counters") or {})

    def losses(self, minor: bool = False) -> list[str]:
        """One line per loss: "source: counter N (hint)"; ``minor``: those within their
        harmless range (HARMLESS) instead."""
        lines = []
        for source, counters in sorted(self.sources.items()):
            for name, value in sorted(counters.items()):
                if (name in HINTS and isinstance(value, int) and value > 0
                        and _harmless(counters, name, value) == minor):
                    lines.append(f"{source}: {name} {value} ({HINTS[name]})")
        return lines

    def summary(self, derived: dict[str, dict[str, Any]] | None = None
                ) -> tuple[dict[str, Any], dict[tuple[str, str], float]]:
        """(``data_quality``, each loss counter's value by (source, counter));
        ``derived``: sources computed by the reducers themselves (the iteration clock's),
        shown and judged as the probes' are."""
        whole = DataQuality()
        whole.sources = {**self.sources, **(derived or {})}
        counters = {(source, name): number
                    for source, values in whole.sources.items()
                    for name, value in values.items()
                    # (only the loss counters, a fixed set: the rest are volumes)
                    if name in HINTS and (number := finite(value)) is not None}
        return {
            "sources": {name: dict(sorted(c.items())) for name, c in sorted(whole.sources.items())},
            "losses": whole.losses(),
            "minor": whole.losses(minor=True),
        }, counters


class Hangs:
    """Feeds on ``hang`` and ``hang_recovered`` records."""

    def __init__(self, wall_time: Callable[[int], str]) -> None:
        self.wall_time = wall_time
        self.hangs: list[HangEpisode] = []

    def on_hang(self, record: dict[str, Any]) -> None:
        self.hangs.append(HangEpisode(
            t_ns=record["t_mono_ns"], timestamp=self.wall_time(record["t_mono_ns"]),
            last_iteration_ns=record["last_iteration_mono_ns"],
            threshold_s=record["threshold_s"], frame=record["frame"],
            report=record["report"], phase=record.get("phase")))

    def on_recovered(self, record: dict[str, Any]) -> None:
        if self.hangs:
            self.hangs[-1] = replace(self.hangs[-1],
                                     recovered_at=self.wall_time(record["t_mono_ns"]))

    @property
    def hung(self) -> bool:
        return bool(self.hangs) and self.hangs[-1].recovered_at is None


def _count(value: object) -> int | None:
    return value if type(value) is int and 0 <= value < 1 << 62 else None


class Coarsening:
    """The parts of the log made coarser once it outgrew its cap (``coarsened`` records,
    perfmon.agent.record.coarsen): ``session_info.event_log_coarsened``. A crafted
    record's counts are taken only for known record types and in range."""

    def __init__(self, wall_time: Callable[[int], str], known_types: frozenset[str]) -> None:
        self.wall_time, self.known_types = wall_time, known_types
        self.parts = 0
        self.interval_s = 0
        self.span: tuple[int, int] | None = None
        self.merged: dict[str, list[int]] = {}
        self.dropped: dict[str, int] = {}

    def on_coarsened(self, record: dict[str, Any]) -> None:
        self.parts += 1
        self.interval_s = max(1, _count(record["interval_s"]) or 1)
        a, b = record["from_mono_ns"], record["until_mono_ns"]
        self.span = (min(a, self.span[0]), max(b, self.span[1])) if self.span else (a, b)
        for kind, counts in record["merged"].items():
            if (kind not in self.known_types or not isinstance(counts, (list, tuple))
                    or len(counts) != 2):
                continue
            seen, kept = _count(counts[0]), _count(counts[1])
            if seen is not None and kept is not None:
                total = self.merged.setdefault(kind, [0, 0])
                total[0] += seen
                total[1] += kept
        for kind, n in record["dropped"].items():
            if kind in self.known_types and _count(n) is not None:
                self.dropped[kind] = self.dropped.get(kind, 0) + n

    def summary(self) -> dict[str, Any] | None:
        if not self.parts or self.span is None:
            return None
        return {"parts": self.parts, "from": self.wall_time(self.span[0]),
                "until": self.wall_time(self.span[1]), "merged_per_s": self.interval_s,
                "merged": {k: {"records": a, "kept": b} for k, (a, b) in self.merged.items()},
                "dropped": dict(self.dropped)}
