"""The elements of a JSON array, one at a time, from bytes, text or a binary stream (no I/O
but reading what the caller hands in).

``json.loads`` of a whole document holds every element as Python objects at once, about
5 to 8 times the size of the text for py-spy's small event objects (a 608 MB chrometrace
window took the agent to 1.93 GB: security issue 36). Here only the element being
decoded and a buffer of at most about two chunks are held; the caller keeps what it
needs of each element. Elements are decoded by the standard library's C scanner
(``JSONDecoder.scan_once``).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator
from typing import IO, Any

from perfmon.parsers.errors import PerfmonError

CHUNK_BYTES = 1 << 20
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER_TAIL = re.compile(r"[0-9.eE+-]*")
_NO_VALUE = ("", " ", "\t", "\n", "\r")
# (text, index) -> (value, end): the C scanner JSONDecoder.raw_decode calls.
_SCAN: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


class JsonStreamError(PerfmonError):
    """Not a JSON array, malformed, or cut short."""

    exit_code = 2


class JsonTooLarge(JsonStreamError):
    """More than ``max_bytes`` of text: reading stopped there."""


def _reader(source: bytes | str | IO[bytes]) -> Callable[[int], bytes | str]:
    if isinstance(source, str):
        chunks = iter([source])
        return lambda _size: next(chunks, "")
    if isinstance(source, (bytes, bytearray, memoryview)):
        view = memoryview(source)
        offset = 0

        def read(size: int) -> bytes:
            nonlocal offset
            chunk = bytes(view[offset:offset + size])
            offset += len(chunk)
            return chunk
        return read
    return source.read


class _Buffer:
    """Text read so far and not yet decoded, at most ``max_bytes`` of the source."""

    def __init__(self, source: bytes | str | IO[bytes], max_bytes: int | None) -> None:
        self.read = _reader(source)
        self.max_bytes = max_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self.text = ""
        self.pos = 0
        self.bytes_read = 0
        self.eof = False

    def more(self, at_least: int = 0) -> bool:
        """Read another chunk (at least ``at_least``); False at the end of the source."""
        if self.eof:
            return False
        size = max(CHUNK_BYTES, at_least)
        if self.max_bytes is not None:
            size = min(size, self.max_bytes + 1 - self.bytes_read)
        chunk = self.read(size)
        if isinstance(chunk, str):
            text, self.bytes_read = chunk, self.bytes_read + len(chunk)
        else:
            self.bytes_read += len(chunk)
            try:
                text = self.decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                raise JsonStreamError(f"not UTF-8 ({err})") from err
        if self.max_bytes is not None and self.bytes_read > self.max_bytes:
            raise JsonTooLarge(f"over {self.max_bytes} bytes")
        if not chunk:
            self.eof = True
            return False
        self.text = self.text[self.pos:] + text
        self.pos = 0
        return True

    def skip_whitespace(self) -> str:
        """The next character that is not whitespace ("" at the end)."""
        while True:
            self.pos = _WHITESPACE.match(self.text, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.more():
                return ""

    def element(self) -> Any:
        """Decode the value at ``pos``, reading more while it is cut off by the buffer's end."""
        while True:
            try:
                value, end = _SCAN(self.text, self.pos)
            except (StopIteration, json.JSONDecodeError) as err:
                # Cut off by the buffer's end, or malformed: more text tells which. A value
                # longer than the chunk is read in growing steps (no quadratic re-decoding).
                if not self.more(at_least=len(self.text) - self.pos):
                    raise JsonStreamError(str(err)[:200] if isinstance(err, ValueError)
                                          else "expected a value") from err
                continue
            except (ValueError, RecursionError) as err:  # an integer of over 4300 digits...
                raise JsonStreamError(str(err)[:200]) from err
            if (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and _NUMBER_TAIL.match(self.text, end).end() == len(self.text)  # type: ignore[union-attr]
                    and self.more()):
                continue  # a number ("0." of "0.5") may go on in the next chunk
            self.pos = end
            return value


def iter_json_array(source: bytes | str | IO[bytes], *, max_bytes: int | None = None
                    ) -> Iterator[Any]:
    """Each element of the JSON array in ``source``, in order.

    ``max_bytes``: read no more than this (JsonTooLarge past it; the elements before
    were already yielded). Raises JsonStreamError: not an array, malformed, or cut short, after
    yielding the elements before the fault.
    """
    buf = _Buffer(source, max_bytes)
    if buf.skip_whitespace() != "[":
        raise JsonStreamError("expected a JSON array")
    buf.pos += 1
    if buf.skip_whitespace() == "]":
        buf.pos += 1
    else:
        while True:
            text, pos = buf.text, buf.pos
            if (text[pos] if pos < len(text) else "") in _NO_VALUE and buf.skip_whitespace() == "":
                raise JsonStreamError("the array is cut short")
            yield buf.element()
            text, pos = buf.text, buf.pos
            # py-spy writes no whitespace: the separator is usually the next character.
            following = text[pos] if pos < len(text) else buf.skip_whitespace()
            if following not in ",]":
                following = buf.skip_whitespace()
            buf.pos += 1
            if following == "]":
                break
            if following != ",":
                raise JsonStreamError("expected ',' or ']' between elements")
    if buf.skip_whitespace() != "":
        raise JsonStreamError("text after the array")
