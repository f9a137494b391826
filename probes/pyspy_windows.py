"""The py-spy record windows of PySpySampler (perfmon.probes.pyspy): one ``Window``
per py-spy process, one ``Lane`` of windows per target process."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field

from perfmon.parsers.pyspy import StackSample
from perfmon.probes.sampler import monotonic_ns

# py-spy prints this just before it samples: the window then covers from here on.
SAMPLING_LINE = b"Sampling process"
# What is kept of each of a window's stdout and stderr: the head (the "Sampling
# process" line, the first error) and the tail ("Samples: N Errors: M" at the end).
# py-spy prints a few lines a window; a cap keeps a misbehaving one from growing them.
PIPE_KEEP_BYTES = 32 << 10
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _bounded(kept: bytes, new: bytes) -> bytes:
    both = kept + new
    if len(both) <= 2 * PIPE_KEEP_BYTES:
        return both
    return both[:PIPE_KEEP_BYTES] + both[-PIPE_KEEP_BYTES:]


def read_available(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass
class Window:
    """One py-spy record process."""

    proc: subprocess.Popen
    output: str
    origin_ns: int  # CLOCK_MONOTONIC of the chrometrace's ts = 0
    stop_ns: int | None = None  # when we told it to stop; the next window covers from here
    pause_after: bool = False  # stopped at the end of a burst: no window follows at once
    sampling_since_ns: int | None = None  # when we saw it sampling
    discarded: bool = False  # killed before it sampled (the session ended): no output
    cut_reason: str | None = None  # killed for its memory (PySpySampler._watch_memory)
    stdout: bytes = b""
    stderr: bytes = b""

    def read_pipes(self) -> None:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.stdout = _bounded(self.stdout, read_available(self.proc.stdout.fileno()))
        self.stderr = _bounded(self.stderr, read_available(self.proc.stderr.fileno()))

    def rss_bytes(self) -> int:
        """py-spy's resident memory now (0 once it has exited)."""
        try:
            with open(f"/proc/{self.proc.pid}/statm", "rb") as f:
                return int(f.read().split()[1]) * _PAGE_BYTES
        except (OSError, IndexError, ValueError):
            return 0

    @property
    def sampling(self) -> bool:
        """py-spy has attached and prints its first line just before sampling."""
        return SAMPLING_LINE in self.stdout

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.stop_ns = monotonic_ns()
            self.proc.send_signal(signal.SIGINT)  # py-spy stops and writes the file

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@dataclass
class Lane:
    """The windows of one target process, oldest first."""

    pid: int
    kernel_tids: dict[int, int]
    current: Window | None = None  # sampling
    pending: Window | None = None  # started, still attaching
    finishing: list[Window] = field(default_factory=list)  # stopped, not yet harvested
    last_launch_ns: int = 0
    covered_until_ns: int | None = None  # end of the samples delivered so far
    # Per thread, the latest stack delivered, unclipped (see PySpySampler._join).
    last_seen: dict[int, StackSample] = field(default_factory=dict)
    ended: bool = False  # the target exited
