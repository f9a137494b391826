"""How each rank ended, and which one ended the job (``session_info.exit``).

Feeds on ``rank_exit`` records (perfmon.probes.exits). The job's cause is the
first rank, by the kernel's time of its exit, that failed: a non-zero exit
code, a death by signal, or (status not observed) a known failure in its last
lines. When one rank fails, launchers (torchrun, mpirun, Slurm) stop the others
with SIGTERM then SIGKILL, and their collectives fail with NCCL errors: those
come later, so they are never the cause. At an equal time a rank that failed
on its own wins over one stopped by a signal a launcher sends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from perfmon.parsers.exit_causes import describe_cause, describe_exit

# Signals a launcher or scheduler stops ranks with: at an equal time, not the cause.
STOP_SIGNALS = frozenset({"SIGTERM", "SIGKILL", "SIGINT", "SIGHUP"})
WHAT_CHARS = 300


def failed(record: dict[str, Any]) -> bool:
    """Whether a rank_exit record is a failure: non-zero exit code, killed by a signal, or
    (status not observed) a known failure in its last lines."""
    if record.get("signal") is not None:
        return True
    code = record.get("exit_code")
    if code is not None:
        return code != 0
    return record.get("log_tail_cause") is not None or bool(record.get("oom_killed"))


def what(record: dict[str, Any]) -> str:
    """One line for a rank's end: "exit code 3", "killed by SIGKILL", "CUDA out of memory.
    Tried to allocate ... (exit code 1)"."""
    status = describe_exit(record.get("exit_code"), record.get("signal"),
                           record.get("core_dumped"), record.get("oom_killed"))
    cause = record.get("log_tail_cause")
    if not cause:
        return status
    room = WHAT_CHARS - len(status) - 3  # the status always shows: the message is cut
    text = describe_cause(cause)
    if len(text) > room:
        text = text[: max(0, room - 3)] + "..."
    return f"{text} ({status})"


class Exits:
    """Feed ``rank_exit`` records (``on_exit``); read ``summary()``.

    ``wall_time`` (optional) turns a CLOCK_MONOTONIC time into the summary's ISO 8601
    local time (perfmon.agent.reducers.Summarizer.wall_time).
    """

    def __init__(self, wall_time: Callable[[int], str] | None = None) -> None:
        self.wall_time = wall_time
        self.ranks: dict[int, dict[str, Any]] = {}
        self._first: tuple[tuple[int, bool, int], dict[str, Any]] | None = None

    def on_exit(self, record: dict[str, Any]) -> None:
        pid = record["pid"]
        entry = {
            "rank": record.get("rank"),
            "exit_code": record.get("exit_code"),
            "signal": record.get("signal"),
            "core_dumped": record.get("core_dumped"),
            "oom_killed": record.get("oom_killed"),
            "log_tail_cause": record.get("log_tail_cause"),
            "source": record.get("source"),
            "failed": failed(record),
            "what": what(record),
            "t_mono_ns": record["t_mono_ns"],
        }
        if self.wall_time is not None:
            entry["time"] = self.wall_time(record["t_mono_ns"])
        self.ranks[pid] = entry
        if entry["failed"]:
            # By time; at an equal time a failure of its own before a launcher's stop signal.
            key = (record["t_mono_ns"], record.get("signal") in STOP_SIGNALS, pid)
            if self._first is None or key < self._first[0]:
                self._first = (key, {"pid": pid, "rank": entry["rank"], "what": entry["what"]})

    @property
    def clean(self) -> bool:
        """Every rank seen to exit did so with status 0 (and one was): the job ended as
        it meant to, however long its ranks took to get there."""
        return bool(self.ranks) and all(e["exit_code"] == 0 for e in self.ranks.values())

    @property
    def cause(self) -> dict[str, Any] | None:
        """{"pid", "rank", "what"} of the first rank that failed, or None."""
        return dict(self._first[1]) if self._first is not None else None

    def summary(self) -> dict[str, Any]:
        """``{"ranks": {"<pid>": {...}}, "cause": {...} | None}`` (pids as JSON keys)."""
        return {"ranks": {str(pid): dict(entry) for pid, entry in sorted(self.ranks.items())},
                "cause": self.cause}
