"""The dynamic-symbol reader (perfmon.parsers.elf_symbols) on made-up input (on the real
libtorch_cpu.so and a library built here: tests/e2e/test_elf_symbols.py; on crafted
libraries: test_elf_symbols_hostile.py)."""

from __future__ import annotations

import pytest
from perfmon.parsers.elf_symbols import (
    ElfError,
    LoadSegment,
    file_offset,
    find_function_symbols,
    load_segments,
)


def test_file_offset_of_an_address_is_relative_to_its_segment():
    segments = [LoadSegment(0, 0, 0x1000), LoadSegment(0x1000, 0x201000, 0x500)]
    assert file_offset(segments, 0x10) == 0x10
    assert file_offset(segments, 0x201000) == 0x1000
    assert file_offset(segments, 0x2014FF) == 0x14FF
    for outside in (0x1000, 0x200FFF, 0x201500):
        with pytest.raises(ElfError, match=f"{outside:#x}"):
            file_offset(segments, outside)


def test_not_an_elf_file_is_an_error():
    with pytest.raises(ElfError, match="not an ELF file"):
        find_function_symbols(b"#!/bin/sh\n" * 10, ["x"])
    with pytest.raises(ElfError, match="not an ELF file"):
        load_segments(b"#!/bin/sh\n" * 10)
