"""perfmon.agent: the CLI and its rooms (measure, reducers, record, views, daemon, tools).

docs/architecture.md says what lives in each room and which may import which.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def agent_version() -> str:
    """The installed perfmon-agent's version ("unknown" when run from a bare tree)."""
    try:
        return version("perfmon-agent")
    except PackageNotFoundError:
        return "unknown"
