"""The BPF programs' records as Python reads them agree with their C declarations.

iterations.bpf.c writes ``struct event_t`` into the ring buffer and
perfmon.probes.uprobes reads it with a hand-written ``struct`` layout
(``EVENT_HEAD_FIELDS``); its ``enum event_kind`` numbers the kinds of
perfmon.parsers.events.MARKER_KINDS. Both are read here from the C text (no bcc, no
compiler): a field added, moved or resized on one side only fails here. (cuda.bpf.c's
records are read through bcc's own ctypes of the C struct: nothing is mirrored.)
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import perfmon.probes
from perfmon.parsers.events import MARKER_KINDS
from perfmon.probes.uprobes import EVENT_HEAD, EVENT_HEAD_FIELDS, NAME_LEN_BYTES

BPF_DIR = Path(perfmon.probes.__file__).parent / "bpf"
C_SIZES = {"u8": 1, "s8": 1, "char": 1, "u16": 2, "s16": 2, "u32": 4, "s32": 4, "u64": 8,
           "s64": 8}


def _without_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)


def _c_text(file_name: str) -> str:
    return _without_comments((BPF_DIR / file_name).read_text())


def c_struct(text: str, name: str) -> list[tuple[str, int, int, str | None]]:
    """(field, offset, size, array length as written or None) of ``struct name`` in C
    ``text``, laid out as the compiler lays it out: each field at a multiple of its size."""
    body = re.search(rf"struct\s+{name}\s*\{{(.*?)\}};", _without_comments(text), re.S)
    assert body is not None, f"no struct {name}"
    fields, offset = [], 0
    for declaration in filter(None, (d.strip() for d in body.group(1).split(";"))):
        m = re.fullmatch(r"(\w+)\s+(\w+)(?:\s*\[\s*(\w+)\s*\])?", declaration)
        assert m is not None, f"cannot read {declaration!r} of struct {name}"
        c_type, field, length = m.groups()
        size = C_SIZES[c_type]
        offset += -offset % size
        fields.append((field, offset, size, length))
        offset += size * (1 if length is None else 0)  # (an array ends the checked part)
    return fields


def python_layout(fields: tuple[tuple[str, str], ...]) -> list[tuple[str, int, int]]:
    """(field, offset, size) of a little-endian struct layout declared field by field."""
    layout, offset = [], 0
    for field, code in fields:
        size = struct.calcsize("<" + code)
        layout.append((field, offset, size))
        offset += size
    return layout


def test_the_event_head_read_in_python_is_struct_event_t_up_to_its_name():
    c_fields = c_struct(_c_text("iterations.bpf.c"), "event_t")
    *head, (name, name_offset, name_size, name_length) = c_fields
    assert [(f, o, s) for f, o, s, _ in head] == python_layout(EVENT_HEAD_FIELDS)
    assert all(length is None for *_, length in head)
    # The name follows the head at once, NAME_LEN bytes (the -D cflag uprobes gives).
    assert (name, name_size, name_length) == ("name", 1, "NAME_LEN")
    assert name_offset == EVENT_HEAD.size == struct.calcsize(EVENT_HEAD.format)
    default = re.search(r"#define\s+NAME_LEN\s+(\d+)", _c_text("iterations.bpf.c"))
    assert default is not None and int(default.group(1)) == NAME_LEN_BYTES


def test_the_event_kinds_number_marker_kinds_from_one():
    enum = re.search(r"enum\s+event_kind\s*\{(.*?)\};", _c_text("iterations.bpf.c"), re.S)
    assert enum is not None
    kinds = dict(re.findall(r"EV_(\w+)\s*=\s*(\d+)", enum.group(1)))
    assert {k.lower(): int(v) for k, v in kinds.items()} \
        == {kind: i + 1 for i, kind in enumerate(MARKER_KINDS)}


def test_a_field_moved_on_one_side_only_is_seen():
    # A u32 before a u64: the compiler pads it, a "<" struct format does not.
    c_fields = c_struct("struct t {\n    u32 a;  // x\n    u64 b;\n    char n[N];\n};", "t")
    assert c_fields == [("a", 0, 4, None), ("b", 8, 8, None), ("n", 16, 1, "N")]
    assert [(f, o, s) for f, o, s, _ in c_fields[:2]] \
        != python_layout((("a", "I"), ("b", "Q")))
    assert [(f, o, s) for f, o, s, _ in c_fields[:2]] \
        == python_layout((("a", "I"), ("_", "4x"), ("b", "Q")))[::2]
