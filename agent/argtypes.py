"""Command-line argument types: every bad value is refused by argparse with one line.

Shared by every sub-command, so ``--pid -5``, ``--timeout nan`` or an invalid
regex get the same treatment everywhere: exit 2 and a message naming the
option, never a traceback later on.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn


@dataclass(frozen=True)
class Command:
    """One sub-command: each command's module declares its own (``COMMAND``), the CLI's
    parser tree is made of them (perfmon.agent.cli)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    main: Callable[[argparse.Namespace], int]
    description: str | None = None
    epilog: str | None = None


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors as one line on stderr (exit 2): ``prog: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def power_of_two(text: str) -> int:
    """A positive power of two (a ring buffer's size in pages)."""
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {value}")
    return value


def pid(text: str) -> int:
    """A process id: a positive integer that fits pid_t (whether it exists is checked later)."""
    value = positive_int(text)
    if value >= 2**31:
        raise argparse.ArgumentTypeError(f"not a process id: {value}")
    return value


def _finite(text: str, fits: Callable[[float], bool], must: str) -> float:
    """A finite number that ``fits``; else ``must`` (what it must be) in the error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and fits(value)):
        raise argparse.ArgumentTypeError(f"must be {must}, got {text}")
    return value


def positive_float(text: str) -> float:
    return _finite(text, lambda value: value > 0, "a positive number")


def non_negative_float(text: str) -> float:
    return _finite(text, lambda value: value >= 0, "a number >= 0")


def regex(text: str) -> str:
    """A Python regular expression (checked here, used later)."""
    try:
        re.compile(text)
    except re.error as err:
        raise argparse.ArgumentTypeError(f"not a valid regular expression: {err}") from None
    return text


def int_list(text: str) -> list[int]:
    """Comma-separated non-negative integers."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, not {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, not {text!r}")
    return values
