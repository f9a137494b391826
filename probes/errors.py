"""Errors raised while reading live processes and devices.

Every message carries the pid (and process name when known), in the manner of
psutil's ``NoSuchProcess``/``AccessDenied``.
"""

from __future__ import annotations

from perfmon.parsers.errors import PerfmonError


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
