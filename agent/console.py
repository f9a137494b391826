"""What the agent prints: warnings on stderr, output on stdout, and their two hazards.

- Text a job controls (its paths, its command line, names from its files) can
  reach a warning; control characters in it are escaped, so a job cannot send
  terminal escape sequences to an operator's screen.
- stdout's reader may go away (``perfmon-agent attach --json | head``): then the
  output falls silent and the caller is told once, never a traceback.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable

from rich.console import Console

PROG = "perfmon-agent"
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with control characters (ESC, CR, ...) shown as \\xNN; one line."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text.replace("\n", " "))


def warn(line: str) -> None:
    """One warning line on stderr."""
    print(f"{PROG}: warning: {printable(line)}", file=sys.stderr, flush=True)


def quiet_broken_pipe() -> None:
    """After stdout's reader went away: no more writes, no traceback at exit.

    Python's documented way: point stdout at /dev/null so that the flush at
    exit does not raise again.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)


class PipeConsole(Console):
    """A rich console that reports a closed stdout (rich itself exits with status 1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


class Output:
    """stdout through a rich console, until its reader goes away; then silence.

    ``on_closed`` is called once when that happens (a session then ends quietly
    and still writes its summary file).
    """

    def __init__(self, *, stderr: bool = False) -> None:
        self.console = PipeConsole(stderr=stderr, highlight=False)
        self.closed = False
        self.on_closed: Callable[[], None] | None = None

    def _guard(self, action: Callable[[], object]) -> None:
        if self.closed:
            return
        try:
            action()
            self.console.file.flush()
        except BrokenPipeError:
            self.closed = True
            quiet_broken_pipe()
            if self.on_closed is not None:
                self.on_closed()

    def print(self, text: str) -> None:
        self._guard(lambda: self.console.print(text))

    def write(self, text: str) -> None:
        self._guard(lambda: sys.stdout.write(text))

    def table(self, draw: Callable[[], object]) -> None:
        """Run ``draw`` (which prints on ``console``) unless stdout is gone."""
        self._guard(draw)
