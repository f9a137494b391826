"""What a line of tracefs' ``trace_pipe`` says: task, time, event and its arguments (pure).

``parse_trace_line`` reads a uprobe event's line (the probe address, then the
fetched arguments: ``name="Optimizer.step#SGD.step"``), ``parse_event_line``
any event's (a tracepoint's fields follow its name); ``parse_name_arg`` takes
the ``name`` string of an rf_enter event and ``classify_step_name`` says which
step marker it is; ``oom_victim`` reads the pid out of an ``oom:mark_victim``
event. Bytes in, data out: reading the pipe is
perfmon.probes.ftrace's; perfmon.probes.tracefs (step markers) and
perfmon.probes.exits (OOM kills) read its lines with these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceLine:
    """One event line of trace_pipe: a uprobe's, or with parse_event_line any event's."""

    tid: int
    tgid: int | None  # None when the kernel had not recorded it yet ("(-------)")
    t_mono_ns: int  # floored to the microsecond trace_pipe prints
    event: str
    args: bytes  # what follows the probe address, e.g. b' name="Optimizer.step#SGD.step"'


# The context trace_pipe prints after the task's comm: "-TID (TGID) [CPU] FLAGS
# SECONDS.MICROSECONDS: EVENT: (ADDRESS)" and for a return probe "(ADDRESS <-
# FUNCTION)". The comm is printed "%16s" and is at most 15 bytes, so it fills
# exactly _COMM_WIDTH bytes; it may hold spaces or dashes, hence parsing from a
# fixed column rather than splitting. TGID is there with options/record-tgid,
# FLAGS with options/irq-info.
_COMM_WIDTH = 16
_CONTEXT_PREFIX = rb"-(\d+) +(?:\( *(\d+|-+)\) +)?\[\d+\] +(?:\S+ +)?(\d+)\.(\d{6}): (\w+): "
_CONTEXT = re.compile(_CONTEXT_PREFIX + rb"\(0x[0-9a-f]+(?: <- 0x[0-9a-f]+)?\)(.*)", re.S)
# Any event's line (a tracepoint's fields follow its name: "mark_victim: pid=1973 ...").
_ANY_EVENT = re.compile(_CONTEXT_PREFIX + rb"(.*)", re.S)
_NAME_ARG = re.compile(rb' name="(.*)"', re.S)
_VICTIM_PID = re.compile(rb"\bpid=(\d+)")


def parse_trace_line(line: bytes) -> TraceLine | None:
    """A uprobe event line of trace_pipe (without its newline), or None for any other line."""
    return _trace_line(_CONTEXT.fullmatch(line, _COMM_WIDTH))


def parse_event_line(line: bytes) -> TraceLine | None:
    """Any event line of trace_pipe (a tracepoint's too), or None for another line;
    ``args`` holds what follows the event's name (``b"pid=1973 comm=python ..."``)."""
    return _trace_line(_ANY_EVENT.fullmatch(line, _COMM_WIDTH))


def _trace_line(m: re.Match[bytes] | None) -> TraceLine | None:
    if m is None:
        return None
    tid, tgid, seconds, micros, event, args = m.groups()
    return TraceLine(
        tid=int(tid),
        tgid=int(tgid) if tgid and tgid.isdigit() else None,
        t_mono_ns=int(seconds) * 1_000_000_000 + int(micros) * 1000,
        event=event.decode("ascii"),
        args=args,
    )


def parse_name_arg(args: bytes) -> bytes | None:
    """The ``name`` string of an rf_enter event, or None when the kernel could not read
    it (``name=(fault)``)."""
    m = _NAME_ARG.fullmatch(args)
    return m.group(1) if m else None


def classify_step_name(name: bytes, prefixes: dict[str, str]) -> str | None:
    """The marker kind a record_function name marks, or None; ``prefixes`` maps name
    prefixes to kinds (perfmon.probes.uprobes.STEP_NAME_PREFIXES, or a subset of it)."""
    for prefix, kind in prefixes.items():
        if name.startswith(prefix.encode()):
            return kind
    return None


def oom_victim(line: TraceLine) -> int | None:
    """The pid (a task's) the OOM killer chose, from an ``oom:mark_victim`` event line
    (parse_event_line); None for another event."""
    m = _VICTIM_PID.search(line.args) if line.event == "mark_victim" else None
    return int(m.group(1)) if m else None


def step_name_filter(prefixes: dict[str, str]) -> str | None:
    """A tracefs event filter passing only step names, or None when a prefix holds a
    character the filter's glob would misread."""
    if any(set(p) & set('*?[]"\\') for p in prefixes):
        return None
    return " || ".join(f'name ~ "{prefix}*"' for prefix in prefixes)
