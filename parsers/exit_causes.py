"""Why a rank ended: its wait(2) status, and the known cause in the last lines it printed (pure).

``describe_status`` turns the kernel's exit status of a process (the ``code``
of ``do_exit``, in wait(2)'s format: exit code << 8, or the number of the
signal that killed it with 0x80 when it dumped core) into fields.

``classify_log_tail`` reads the tail of a rank's stdout/stderr and names the
failure it shows, from the messages PyTorch, NCCL, CUDA and Python actually
print (quoted from PyTorch's sources next to each pattern). When several
causes appear, the most specific wins (``CAUSES`` is ordered most specific
first: a CUDA out-of-memory error is also a RuntimeError, and its traceback
also ends in a Python exception); among lines of one cause, the last one.
What is returned is bounded and printable: a job controls its log, so control
characters are escaped (``\\x1b``) and every string is cut.
"""

from __future__ import annotations

import re
import signal
from typing import Any

# Most specific first: when several appear in one tail, the first of these wins.
CAUSES = (
    "cuda_out_of_memory",
    "nccl_watchdog_timeout",
    "nccl_error",
    "cuda_error",
    "cpu_out_of_memory",
    "distributed_error",
    "elastic_error",
    "fatal_python_error",
    "cpp_exception",
    "python_exception",
)
# How each cause reads in one line (python_exception: its exception type instead).
CAUSE_LABELS = {
    "cuda_out_of_memory": "CUDA out of memory",
    "nccl_watchdog_timeout": "NCCL watchdog timeout",
    "nccl_error": "NCCL error",
    "cuda_error": "CUDA error",
    "cpu_out_of_memory": "host out of memory",
    "distributed_error": "torch.distributed error",
    "elastic_error": "torch.distributed.elastic error",
    "fatal_python_error": "Fatal Python error",
    "cpp_exception": "C++ exception",
    "python_exception": "Python exception",
}
MESSAGE_CHARS = 500
LINE_CHARS = 500
TYPE_CHARS = 200

_PATTERNS: dict[str, tuple[re.Pattern[str], ...]] = {
    "cuda_out_of_memory": (
        # c10/cuda/CUDACachingAllocator.cpp: "CUDA out of memory. Tried to allocate "
        # (torch.OutOfMemoryError since 2.5, torch.cuda.OutOfMemoryError since 1.13,
        # RuntimeError before); a CUDA call's own cudaErrorMemoryAllocation reads
        # "CUDA error: out of memory"; cuBLAS's workspace "CUBLAS_STATUS_ALLOC_FAILED".
        re.compile(r"CUDA out of memory\b"),
        re.compile(r"CUDA error: out of memory"),
        re.compile(r"CUBLAS_STATUS_ALLOC_FAILED"),
    ),
    "nccl_watchdog_timeout": (
        # torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: "[Rank N] Watchdog caught
        # collective operation timeout: WorkNCCL(...) ran for N milliseconds before
        # timing out."; the heartbeat monitor: "ProcessGroupNCCL's watchdog got stuck
        # for N seconds without making progress in monitoring enqueued collectives."
        re.compile(r"Watchdog caught collective operation timeout"),
        re.compile(r"watchdog got stuck for \d+ seconds"),
        re.compile(r"Heartbeat monitor timed out"),
    ),
    "nccl_error": (
        # NCCLUtils.hpp C10D_NCCL_CHECK: "NCCL error in: FILE:LINE, <ncclGetErrorString>,
        # NCCL version X" (DistBackendError); WorkNCCL::handleException: "Some NCCL
        # operations have failed or timed out."; older: "NCCL error: unhandled system error".
        re.compile(r"NCCL error in: "),
        re.compile(r"NCCL error: "),
        re.compile(r"NCCL communicator was aborted"),
        re.compile(r"Some NCCL operations have failed or timed out"),
        re.compile(r"\bnccl(?:Unhandled)?(?:Internal|System|Remote|UnhandledCuda)Error\b"),
    ),
    "cuda_error": (
        # c10/cuda/CUDAException.h C10_CUDA_CHECK: "CUDA error: <cudaGetErrorString>",
        # e.g. "an illegal memory access was encountered", "device-side assert triggered".
        re.compile(r"CUDA error: "),
        re.compile(r"CUDA driver error: "),
        re.compile(r"\bCU(?:BLAS|DNN|SOLVER|SPARSE|FFT)_STATUS_[A-Z_]+"),
    ),
    "cpu_out_of_memory": (
        # c10/core/impl/alloc_cpu.cpp: "DefaultCPUAllocator: can't allocate memory: you
        # tried to allocate N bytes."; Python's own MemoryError.
        re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)"),
        re.compile(r"^MemoryError\b"),
    ),
    "distributed_error": (
        # torch.distributed.DistStoreError ("Timed out after N seconds waiting for
        # clients"), DistNetworkError ("The server socket has failed to listen on any
        # local network address"), DistBackendError not matched above.
        re.compile(r"\btorch\.distributed\.Dist(?:Store|Network|Backend)Error\b"),
        re.compile(r"^Dist(?:Store|Network|Backend)Error\b"),
    ),
    "elastic_error": (
        # torch.distributed.elastic.multiprocessing.errors.ChildFailedError (torchrun's
        # "<script> FAILED ... Root Cause (first observed failure)"), rendezvous errors,
        # api.SignalException ("Process N got signal: 15").
        re.compile(r"\btorch\.distributed\.elastic\.[\w.]*(?:Error|Exception)\b"),
        re.compile(r"\bChildFailedError\b"),
        re.compile(r"\bRendezvous\w*(?:Error|Exception)\b"),
    ),
    "fatal_python_error": (
        # Python's faulthandler / Py_FatalError: "Fatal Python error: Segmentation fault".
        re.compile(r"^Fatal Python error: "),
    ),
    "cpp_exception": (
        # libstdc++'s verbose terminate handler: "terminate called after throwing an
        # instance of 'c10::Error'" then "  what():  <message>".
        re.compile(r"terminate called after throwing an instance of '"),
    ),
}
# Prefixes that launchers put before each line of a rank: torch.distributed's
# excepthook "[rank0]: " (distributed_c10d.py), torchrun --tee "[default0]:",
# srun --label "0: ".
_LINE_PREFIX = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s?|\d{1,6}: )")
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_TRACEBACK = "Traceback (most recent call last):"
# "Type: message" or a bare "Type" ending a traceback; a dotted name (torch.OutOfMemoryError).
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
# An exception line outside a standard traceback (rich's boxed tracebacks end in one):
# only names that say they are exceptions.
_TYPED_EXCEPTION = re.compile(
    r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure|Timeout))(?::\s?(.*))?$")
_TERMINATE = re.compile(r"terminate called after throwing an instance of '([^']+)'")
_WHAT = re.compile(r"^\s*what\(\):\s*(.*)$")
_FATAL = re.compile(r"^Fatal Python error: (.*)$")


def printable(text: str, limit: int) -> str:
    """``text`` on one line, control characters shown as \\xNN, at most ``limit`` characters
    (cut ones end in "...")."""
    text = _CONTROL.sub(lambda m: " " if m.group() == "\t" else f"\\x{ord(m.group()):02x}", text)
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def _clean(line: str) -> str:
    """A log line as the patterns read it: no colour codes, no launcher prefix."""
    line = _ANSI_ESCAPE.sub("", line)
    return _LINE_PREFIX.sub("", line, count=1).rstrip()


def _final_exception_lines(lines: list[str]) -> set[int]:
    """Indices of the lines that end a standard Python traceback ("Type: message")."""
    ends = set()
    i = 0
    while i < len(lines):
        if lines[i].strip() != _TRACEBACK:
            i += 1
            continue
        # Frames, source lines and ^^^ markers are indented; the exception line is not.
        j = i + 1
        while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j]):
            j += 1
        if j < len(lines) and _EXCEPTION_LINE.match(lines[j]):
            ends.add(j)
        i = j
    return ends


def _exception_of(lines: list[str], index: int, ends: set[int]) -> tuple[str, str] | None:
    """(type, message) when line ``index`` is an exception line, else None."""
    line = lines[index]
    m = (_EXCEPTION_LINE if index in ends else _TYPED_EXCEPTION).match(line)
    if m is None:
        return None
    return m.group(1), m.group(2) or ""


def _found(cause: str, lines: list[str], index: int, ends: set[int],
           match: re.Match[str]) -> dict[str, Any]:
    line = lines[index]
    exception = _exception_of(lines, index, ends)
    exception_type, message = exception if exception else (None, line[match.start():])
    if cause == "cpp_exception" or _WHAT.match(line):
        # "terminate called after throwing an instance of 'T'" + "  what():  message".
        for k in range(index, max(-1, index - 2), -1):
            t = _TERMINATE.search(lines[k])
            if t:
                exception_type = t.group(1)
                break
        if cause == "cpp_exception":
            following = lines[index + 1] if index + 1 < len(lines) else ""
            what = _WHAT.match(following)
            message = what.group(1) if what else ""
        else:
            message = _WHAT.match(line).group(1)  # type: ignore[union-attr]
    elif cause == "fatal_python_error":
        message = _FATAL.match(line).group(1)  # type: ignore[union-attr]
    return {
        "cause": cause,
        "exception_type": printable(exception_type, TYPE_CHARS) if exception_type else None,
        "message": printable(message.strip(), MESSAGE_CHARS),
        "line": printable(line, LINE_CHARS),
    }


def classify_log_tail(text: str) -> dict[str, Any] | None:
    """The known failure the last lines of a rank's output show, or None.

    Returns ``{"cause": one of CAUSES, "exception_type": str | None, "message": str,
    "line": str}``: ``line`` is the line that names the cause (without colour codes
    or a launcher's "[rank0]: " prefix), ``message`` what it says (after
    "Type: "), ``exception_type`` the Python (or C++) exception type when the
    line is an exception. All printable and bounded.
    """
    lines = [_clean(line) for line in text.splitlines()]
    ends = _final_exception_lines(lines)
    found: dict[int, list[tuple[int, re.Match[str]]]] = {}  # rank of cause -> (line, match)
    for index, line in enumerate(lines):
        for rank, cause in enumerate(CAUSES[:-1]):
            for pattern in _PATTERNS[cause]:
                m = pattern.search(line) if line else None
                if m:
                    found.setdefault(rank, []).append((index, m))
                    break
    if found:
        rank = min(found)
        # The line that ends a traceback carries the exception's type: it is preferred;
        # else the last line of the cause, the nearest to the exit.
        index, m = next((hit for hit in reversed(found[rank]) if hit[0] in ends),
                        found[rank][-1])
        return _found(CAUSES[rank], lines, index, ends, m)
    # No known cause: the last Python exception, from a traceback or typed by name.
    for index in range(len(lines) - 1, -1, -1):
        if lines[index] and _exception_of(lines, index, ends):
            m = _EXCEPTION_LINE.match(lines[index])
            assert m is not None
            return _found("python_exception", lines, index, ends, m)
    return None


def describe_cause(cause: dict[str, Any]) -> str:
    """One line for a ``classify_log_tail`` result, e.g. "CUDA out of memory. Tried to
    allocate 20.00 GiB. ..." or "ValueError: bad shape"."""
    label = (cause.get("exception_type") if cause.get("cause") == "python_exception"
             else CAUSE_LABELS.get(cause.get("cause", ""), cause.get("cause") or "unknown"))
    label = label or CAUSE_LABELS["python_exception"]
    message = cause.get("message") or ""
    if not message:
        return label
    if message.lower().startswith(label.lower()):
        return message  # "CUDA out of memory. Tried to allocate ..." says it already
    return f"{label}: {message}"


def signal_name(number: int) -> str:
    """"SIGKILL" for 9, "SIGRTMIN+3" for real-time signals, "signal 99" otherwise."""
    try:
        return signal.Signals(number).name
    except ValueError:
        pass
    rtmin, rtmax = int(getattr(signal, "SIGRTMIN", 34)), int(getattr(signal, "SIGRTMAX", 64))
    if rtmin <= number <= rtmax:
        return f"SIGRTMIN+{number - rtmin}"
    return f"signal {number}"


def describe_status(wait_status: int) -> dict[str, Any]:
    """Fields of a process's exit status in wait(2)'s format (the kernel's exit_code).

    ``{"exit_code": int | None, "signal": "SIGKILL" | None, "core_dumped": bool}``:
    an exit (``exit_group(n)`` gives ``n << 8``) has an exit code 0-255 and no
    signal; a death by signal has the signal's name, no exit code, and
    ``core_dumped`` when the kernel wrote a core (bit 0x80).
    """
    number = wait_status & 0x7F
    if number == 0:
        return {"exit_code": (wait_status >> 8) & 0xFF, "signal": None, "core_dumped": False}
    return {"exit_code": None, "signal": signal_name(number),
            "core_dumped": bool(wait_status & 0x80)}


def describe_exit(exit_code: int | None, signal: str | None, core_dumped: bool | None,
                  oom_killed: bool | None) -> str:
    """"exit code 3", "killed by SIGKILL (the kernel's OOM killer)", "killed by SIGSEGV
    (core dumped)", or "exit status unknown"."""
    if signal is not None:
        text = f"killed by {signal}"
        if oom_killed:
            text += " (the kernel's OOM killer)"
        if core_dumped:
            text += " (core dumped)"
        return text
    if exit_code is not None:
        return f"exit code {exit_code}"
    return "killed by the kernel's OOM killer" if oom_killed else "exit status unknown"
