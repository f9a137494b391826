"""The byte stream of an event-log part: the agent's zstd stream, decoded as it is read,
or plain msgpack (older agents' logs, tests'), told apart by the zstd magic (pure).

A stream cut anywhere decodes up to its last whole block (zstd decodes whole blocks
only, and a missing frame end is no error), which is what makes a killed agent's log
readable. A stream asking for a window over MAX_ZSTD_WINDOW_BYTES is refused.
"""

from __future__ import annotations

import io
from typing import IO

import zstandard

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# The writer's window is 4 MiB (perfmon.agent.record.eventlog): a stream asking for
# more is refused, not given the memory.
MAX_ZSTD_WINDOW_BYTES = 8 << 20
# What a broken stream raises while it is read.
ZstdError = zstandard.ZstdError


class Decoded(io.RawIOBase):
    """A zstd stream's decoded bytes; ``count`` says how many it gave so far."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = zstandard.ZstdDecompressor(
            max_window_size=MAX_ZSTD_WINDOW_BYTES).stream_reader(
                stream, read_across_frames=True, closefd=False)
        self.count = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self.count += len(data)
        return data


def open_log_stream(stream: IO[bytes]) -> IO[bytes] | Decoded:
    """The records' bytes of a seekable part: decoded when it is a zstd stream."""
    compressed = stream.read(len(ZSTD_MAGIC)) == ZSTD_MAGIC
    stream.seek(0)
    return Decoded(stream) if compressed else stream
