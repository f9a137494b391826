"""The dynamic-symbol reader on the real libtorch_cpu.so (against nm and readelf) and on
a library built here (gcc). (On made-up input: tests/unit/parsers/test_elf_symbols.py.)"""

from __future__ import annotations

import mmap
import subprocess
from pathlib import Path

import pytest
import torch
from perfmon.parsers.elf_symbols import (
    ElfError,
    file_offset,
    find_function_symbols,
    load_segments,
)
from perfmon.probes.torch_symbols import ENGINE_EXECUTE_SYMBOL, RECORD_FUNCTION_SYMBOLS

LIBTORCH = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"


def test_finds_the_probed_functions_in_the_installed_libtorch():
    with open(LIBTORCH, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as buf:
        found = find_function_symbols(buf, (*RECORD_FUNCTION_SYMBOLS, ENGINE_EXECUTE_SYMBOL))
    (record,) = found[RECORD_FUNCTION_SYMBOLS[0]]
    assert record.name.startswith(RECORD_FUNCTION_SYMBOLS[0]) and record.address > 0
    (engine,) = found[ENGINE_EXECUTE_SYMBOL]
    assert engine.size_bytes > 0
    # nm agrees on the address.
    nm = subprocess.run(["nm", "-D", "--defined-only", str(LIBTORCH)], capture_output=True,
                        text=True, check=True).stdout
    line = next(li for li in nm.splitlines() if li.endswith(" " + engine.name))
    assert int(line.split()[0], 16) == engine.address


def readelf_loads(path: Path) -> list[tuple[int, int, int]]:
    """(p_offset, p_vaddr, p_filesz) of each LOAD line of `readelf -lW`."""
    out = subprocess.run(["readelf", "-lW", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return [(int(f[1], 16), int(f[2], 16), int(f[4], 16))
            for f in (li.split() for li in out.splitlines()) if f and f[0] == "LOAD"]


def test_file_offsets_follow_the_load_segments_of_the_installed_libtorch():
    with open(LIBTORCH, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as buf:
        segments = load_segments(buf)
        found = find_function_symbols(buf, (*RECORD_FUNCTION_SYMBOLS, ENGINE_EXECUTE_SYMBOL))
    loads = readelf_loads(LIBTORCH)
    assert [(s.file_offset, s.virtual_address, s.file_size_bytes) for s in segments] == loads
    for symbol in (*found[RECORD_FUNCTION_SYMBOLS[0]], *found[ENGINE_EXECUTE_SYMBOL]):
        # What the uprobe offset must be, from readelf's own numbers.
        offset, vaddr, _ = next(seg for seg in loads
                                if seg[1] <= symbol.address < seg[1] + seg[2])
        assert file_offset(segments, symbol.address) == symbol.address - vaddr + offset
    # A segment mapped away from its file offset (this library's data, a page apart).
    shifted = next(s for s in segments if s.virtual_address != s.file_offset)
    address = shifted.virtual_address + 16
    assert file_offset(segments, address) == shifted.file_offset + 16 != address
    # .bss follows the file bytes of the last segment: in memory, not in the file.
    last = max(segments, key=lambda s: s.virtual_address)
    with pytest.raises(ElfError, match="no PT_LOAD segment"):
        file_offset(segments, last.virtual_address + last.file_size_bytes)


def test_prefix_matches_function_symbols_only_and_skips_undefined_ones(tmp_path):
    src = tmp_path / "lib.c"
    src.write_text("int probe_me(void){return 1;}\nint probe_me_too(void){return 2;}\n"
                   "int pncclAllReduce(void){return 4;}\n"
                   "int ncclAllReduce(void) __attribute__((alias(\"pncclAllReduce\")));\n"
                   "int data_not_func = 3;\nextern int puts(const char*);\n"
                   "int calls_puts(void){return puts(\"x\");}\n")
    lib = tmp_path / "libx.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    found = find_function_symbols(lib.read_bytes(), ["probe_me", "data_not", "puts", "nothing"])
    assert sorted(s.name for s in found["probe_me"]) == ["probe_me", "probe_me_too"]
    assert found["data_not"] == []  # an object, not a function
    assert found["puts"] == []  # undefined here: it lives in libc
    assert found["nothing"] == []
    # A name stored as the tail of another (the linker merges them) is found too.
    found = find_function_symbols(lib.read_bytes(), ["ncclAllReduce", "probe_me", "probe_me_t"])
    assert [s.name for s in found["ncclAllReduce"]] == ["ncclAllReduce"]
    # Prefixes that start at the same place each get their matches.
    assert sorted(s.name for s in found["probe_me"]) == ["probe_me", "probe_me_too"]
    assert [s.name for s in found["probe_me_t"]] == ["probe_me_too"]
    # Its program headers, as readelf reads them.
    assert [(s.file_offset, s.virtual_address, s.file_size_bytes)
            for s in load_segments(lib.read_bytes())] == readelf_loads(lib)
