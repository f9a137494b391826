"""The dynamic-symbol reader on the real libtorch_cpu.so and on a library built here."""

from __future__ import annotations

import mmap
import subprocess
from pathlib import Path

import pytest
import torch
from perfmon.parsers.elf_symbols import ElfError, find_function_symbols
from perfmon.probes.uprobes import ENGINE_EXECUTE_SYMBOL, RECORD_FUNCTION_SYMBOLS

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


def test_not_an_elf_file_is_an_error():
    with pytest.raises(ElfError, match="not an ELF file"):
        find_function_symbols(b"#!/bin/sh\n" * 10, ["x"])
