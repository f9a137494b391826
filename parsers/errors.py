"""The exception family shared by every layer.

Each error lives in the lowest layer that raises it and derives from
:class:`PerfmonError`; the CLI turns any of them into one line on stderr and
the error's ``exit_code``. Messages name the process (pid) or the field at
fault, so the line alone tells the user what to fix.
"""

from __future__ import annotations


class PerfmonError(Exception):
    """Base class of every error the agent reports to the user."""

    exit_code = 1


class ModelConfigError(PerfmonError):
    """A model description (file, preset, command line) is missing, unparsable or invalid."""

    exit_code = 2


class EventLogError(PerfmonError):
    """An event log cannot be decoded."""

    exit_code = 2


class InputFileError(PerfmonError):
    """A file the user named cannot be used (missing, not a regular file, too large)."""

    exit_code = 2
