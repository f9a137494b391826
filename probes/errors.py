"""Errors raised while reading live processes and devices.

Every message carries the pid (and process name when known), in the manner of
psutil's ``NoSuchProcess``/``AccessDenied``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
from perfmon.parsers.errors import PerfmonError


def agent_who() -> str:
    """The agent as messages name a process: ``pid N (perfmon-agent)``, its pid now."""
    return f"pid {os.getpid()} (perfmon-agent)"


class ProbeError(PerfmonError):
    """Base class of errors about a target process or the host."""

    exit_code = 3


class NoSuchProcess(ProbeError):
    """The target pid does not exist (or exited before we could attach)."""

    exit_code = 3


class UnsuitableTarget(ProbeError):
    """The process exists but is not something we can measure (not Python, no PyTorch)."""

    exit_code = 3


class PrivilegeError(ProbeError):
    """The agent lacks the privilege or capabilities it needs."""

    exit_code = 4


class PrerequisiteMissing(ProbeError):
    """A host prerequisite (bcc, kernel headers, py-spy, NVML) is missing."""

    exit_code = 5


class SymbolNotFound(ProbeError):
    """A library the target loaded lacks a symbol we need to probe."""

    exit_code = 6


@contextmanager
def process_errors(pid: int, name: str | None = None, reading: str | None = None
                   ) -> Iterator[None]:
    """The one place where the OS's and psutil's errors about process ``pid`` become
    NoSuchProcess and PrivilegeError, in one wording (as psutil's own
    ``wrap_exceptions`` does for its calls): ``reading`` names the file being read."""
    who = f"pid {pid} ({name})" if name else f"pid {pid}"
    try:
        yield
    except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess) as err:
        raise NoSuchProcess(f"{who}: no such process (or it exited)") from err
    except (PermissionError, psutil.AccessDenied) as err:
        what = f"permission denied reading {reading}" if reading else "access denied"
        raise PrivilegeError(
            f"{who}: {what} (needs root with CAP_SYS_PTRACE; a process in another user "
            "namespace or marked undumpable stays unreadable)") from err
