"""The ELF reader against files an ordinary user crafted (issue 36).

Any user on a shared node can map a file named libtorch_cpu.so (or libcudart.so) and
the root agent reads it. The stated truth for every crafted buffer: the reader returns
a result or raises ElfError, never another exception, and never allocates more than a
few MiB; a symbol table over its cap is refused in one line without being read. (The
real libtorch_cpu.so against readelf, and the doctor on crafted libraries an ordinary
user's process maps: tests/e2e/test_elf_hostile.py.)
"""

from __future__ import annotations

import mmap
import os
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from perfmon.parsers import procfs
from perfmon.parsers.elf_symbols import ElfError, find_function_symbols, load_segments
from perfmon.probes.files import MappedLibrary

PREFIXES = ("probe_me", "other", "_ZN5torch8autograd8profiler25record_function_enter_new")
GIB2 = 2 << 30
# Fields, as (offset, struct format): of Elf64_Ehdr, of an Elf64_Shdr, of an Elf64_Sym.
HEADER_FIELDS = {"class": (4, "B"), "data": (5, "B"), "e_phoff": (0x20, "Q"),
                 "e_shoff": (0x28, "Q"), "e_phentsize": (0x36, "H"), "e_phnum": (0x38, "H"),
                 "e_shentsize": (0x3A, "H"), "e_shnum": (0x3C, "H")}
SECTION_FIELDS = {"sh_type": (4, "I"), "sh_offset": (24, "Q"), "sh_size": (32, "Q"),
                  "sh_link": (40, "I"), "sh_info": (44, "I"), "sh_entsize": (56, "Q")}
SYMBOL_FIELDS = {"st_name": (0, "I"), "st_info": (4, "B"), "st_shndx": (6, "H"),
                 "st_value": (8, "Q"), "st_size": (16, "Q")}
PHDR_FIELDS = {"p_type": (0, "I"), "p_offset": (8, "Q"), "p_filesz": (32, "Q")}
FUNC, OBJECT = 0x12, 0x11  # st_info: global FUNC, global OBJECT


class CraftedElf:
    """A minimal ELF64 LE shared object: one PT_LOAD, sections [null, .dynsym, .dynstr],
    symbols (name, st_info, st_shndx, value, size). Offsets kept for mutating it."""

    PHOFF, DYNSYM = 64, 120

    def __init__(self, symbols: list[tuple[str, int, int, int, int]] | None = None,
                 extra_strings: bytes = b"") -> None:
        symbols = symbols if symbols is not None else [
            ("probe_me", FUNC, 1, 0x1000, 16), ("probe_me_too", FUNC, 1, 0x1010, 8),
            ("other_data", OBJECT, 1, 0x2000, 4), ("other_undefined", FUNC, 0, 0, 0)]
        strings, name_at = bytearray(b"\0"), {}
        for name, *_ in symbols:
            name_at[name] = len(strings)
            strings += name.encode() + b"\0"
        strings += extra_strings
        self.dynstr = self.DYNSYM + 24 * (len(symbols) + 1)
        self.shoff = (self.dynstr + len(strings) + 7) & ~7
        size = self.shoff + 3 * 64
        buf = bytearray(size)
        struct.pack_into("<4sBBB9xHHIQQQIHHHHHH", buf, 0, b"\x7fELF", 2, 1, 1, 3, 62, 1, 0,
                         self.PHOFF, self.shoff, 0, 64, 56, 1, 64, 3, 0)
        struct.pack_into("<IIQQQQQQ", buf, self.PHOFF, 1, 5, 0, 0, 0, size, size, 0x1000)
        for i, (name, info, shndx, value, sym_size) in enumerate(symbols, start=1):
            struct.pack_into("<IBBHQQ", buf, self.DYNSYM + 24 * i, name_at[name], info, 0,
                             shndx, value, sym_size)
        buf[self.dynstr : self.dynstr + len(strings)] = strings
        # .dynsym (type 11, links to section 2, one local symbol: the null one), .dynstr (3).
        struct.pack_into("<IIQQQQIIQQ", buf, self.section(1), 0, 11, 2, self.DYNSYM,
                         self.DYNSYM, self.dynstr - self.DYNSYM, 2, 1, 8, 24)
        struct.pack_into("<IIQQQQIIQQ", buf, self.section(2), 0, 3, 2, self.dynstr,
                         self.dynstr, len(strings), 0, 0, 1, 0)
        self.buf = buf

    def section(self, index: int) -> int:
        return self.shoff + 64 * index

    def set(self, at: int, fmt: str, value: int) -> CraftedElf:
        struct.pack_into("<" + fmt, self.buf, at, value)
        return self


def read_everything(buf: bytes | bytearray | mmap.mmap) -> None:
    """What the agent reads of a library; ElfError is the only exception allowed out."""
    for read in (lambda: find_function_symbols(buf, PREFIXES), lambda: load_segments(buf)):
        try:
            read()
        except ElfError as err:
            assert str(err) and "\n" not in str(err)


def peak_bytes(action: Callable[[], object]) -> int:
    """Peak Python allocation while ``action`` runs (tracemalloc)."""
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def field_values(fmt: str) -> st.SearchStrategy[int]:
    """Any value of the field's width, with the edges crafted files use most."""
    top = (1 << (8 * struct.calcsize(fmt))) - 1
    return st.one_of(st.integers(0, top), st.sampled_from(
        [0, 1, 2, 3, 11, 23, 24, 56, 64, 0xFF, 0xFFFF, 0xFF00, top, top // 2 + 1, top - 1,
         GIB2, GIB2 - 1] if top > 0xFFFF else [0, 1, 2, 3, 0xFF, top, top - 1]
    ).filter(lambda v: v <= top))


# -- the parser, on crafted buffers -----------------------------------------------------


def test_the_crafted_library_reads_as_a_real_one() -> None:
    elf = CraftedElf()
    found = find_function_symbols(bytes(elf.buf), PREFIXES)
    assert sorted(s.name for s in found["probe_me"]) == ["probe_me", "probe_me_too"]
    assert found["other"] == []  # an object and an undefined function
    assert [(s.file_offset, s.file_size_bytes) for s in load_segments(elf.buf)] == [
        (0, len(elf.buf))]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(sorted(HEADER_FIELDS)), data=st.data())
def test_any_header_field_gives_a_result_or_an_elf_error(field, data) -> None:
    at, fmt = HEADER_FIELDS[field]
    elf = CraftedElf().set(at, fmt, data.draw(field_values(fmt)))
    assert peak_bytes(lambda: read_everything(bytes(elf.buf))) < 1 << 20


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(section=st.integers(0, 2), field=st.sampled_from(sorted(SECTION_FIELDS)),
       data=st.data())
def test_any_section_header_field_gives_a_result_or_an_elf_error(section, field, data) -> None:
    elf = CraftedElf()
    at, fmt = SECTION_FIELDS[field]
    elf.set(elf.section(section) + at, fmt, data.draw(field_values(fmt)))
    assert peak_bytes(lambda: read_everything(bytes(elf.buf))) < 1 << 20


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(symbol=st.integers(0, 4), field=st.sampled_from(sorted(SYMBOL_FIELDS)),
       phdr_field=st.sampled_from(sorted(PHDR_FIELDS)), data=st.data())
def test_any_symbol_or_program_header_field_gives_a_result_or_an_elf_error(
        symbol, field, phdr_field, data) -> None:
    elf = CraftedElf()
    at, fmt = SYMBOL_FIELDS[field]
    elf.set(elf.DYNSYM + 24 * symbol + at, fmt, data.draw(field_values(fmt)))
    at, fmt = PHDR_FIELDS[phdr_field]
    elf.set(elf.PHOFF + at, fmt, data.draw(field_values(fmt)))
    assert peak_bytes(lambda: read_everything(bytes(elf.buf))) < 1 << 20


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_overwritten_or_truncated_bytes_give_a_result_or_an_elf_error(data) -> None:
    buf = CraftedElf().buf
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(buf) - 1))
        buf[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    assert peak_bytes(lambda: read_everything(bytes(buf[:cut]))) < 1 << 20


def _shnum_past_the_cap(elf: CraftedElf) -> None:
    """e_shnum 0: the count is section 0's sh_size (gABI), here 2**40."""
    elf.set(0x3C, "H", 0).set(elf.section(0) + 32, "Q", 1 << 40)


def _phnum_past_the_cap(elf: CraftedElf) -> None:
    """e_phnum PN_XNUM: the count is section 0's sh_info, here 2**32 - 1."""
    elf.set(0x38, "H", 0xFFFF).set(elf.section(0) + 44, "I", 0xFFFFFFFF)


CRAFTED = {
    # what the user crafts: (how, the reader that meets it, what the one line says)
    "shorter_than_its_header": (lambda e: e.buf.__delitem__(slice(40, None)),
                                find_function_symbols, "shorter than its header"),
    "section_headers_past_the_end": (lambda e: e.set(0x28, "Q", len(e.buf) - 64),
                                     find_function_symbols, "section headers .* beyond the end"),
    "e_shnum_65535": (lambda e: e.set(0x3C, "H", 0xFFFF), find_function_symbols,
                      "65535 section headers, over the cap of 4096"),
    "sections_counted_in_section_0": (_shnum_past_the_cap, find_function_symbols,
                                      "1099511627776 section headers, over the cap of 4096"),
    "dynsym_links_past_the_sections": (lambda e: e.set(e.section(1) + 40, "I", 0xFFFFFFFF),
                                       find_function_symbols, "links to section 4294967295"),
    "dynsym_links_to_itself": (lambda e: e.set(e.section(1) + 40, "I", 1),
                               find_function_symbols, "links to section 1"),
    "dynsym_links_to_the_null_section": (lambda e: e.set(e.section(1) + 40, "I", 0),
                                         find_function_symbols, "links to section 0"),
    "dynstr_not_a_string_table": (lambda e: e.set(e.section(2) + 4, "I", 1),
                                  find_function_symbols, "of type 1, not a string table"),
    "dynstr_past_the_end": (lambda e: e.set(e.section(2) + 24, "Q", len(e.buf) - 4),
                            find_function_symbols, r"\.dynstr .* beyond the end"),
    "dynstr_offset_2_64": (lambda e: e.set(e.section(2) + 24, "Q", (1 << 64) - 1),
                           find_function_symbols, r"\.dynstr .* beyond the end"),
    "dynsym_past_the_end": (lambda e: e.set(e.section(1) + 24, "Q", len(e.buf) - 24),
                            find_function_symbols, r"\.dynsym .* beyond the end"),
    "dynsym_not_whole_symbols": (lambda e: e.set(e.section(1) + 32, "Q", 25),
                                 find_function_symbols, "not a whole number of 24-byte"),
    "dynstr_without_its_nul": (lambda e: e.set(e.section(2) + 32, "Q", 5),
                               find_function_symbols, "does not end in a NUL"),
    "empty_dynstr": (lambda e: e.set(e.section(2) + 32, "Q", 0), find_function_symbols,
                     "does not end in a NUL"),
    "program_headers_past_the_end": (lambda e: e.set(0x20, "Q", len(e.buf) - 8),
                                     load_segments, "program headers .* beyond the end"),
    "program_headers_counted_in_section_0": (_phnum_past_the_cap, load_segments,
                                             "4294967295 program headers, over the cap"),
    "xnum_without_section_0": (lambda e: e.set(0x38, "H", 0xFFFF).set(0x3C, "H", 0)
                               .set(e.section(0) + 32, "Q", 0), load_segments,
                               "section 0 it lacks"),
    "load_segment_past_the_end": (lambda e: e.set(e.PHOFF + 32, "Q", 1 << 40), load_segments,
                                  "PT_LOAD segment 0 .* beyond the end"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_each_crafted_offset_link_or_count_is_one_elf_error_naming_it(case) -> None:
    # Each of these was an IndexError, struct.error or ValueError traceback in the doctor.
    craft, reader, message = CRAFTED[case]
    elf = CraftedElf()
    craft(elf)
    with pytest.raises(ElfError, match=message) as raised:
        reader(bytes(elf.buf), PREFIXES) if reader is find_function_symbols else reader(
            bytes(elf.buf))
    assert "\n" not in str(raised.value)


def sparse_elf(path: Path, table: str, size: int = GIB2) -> Path:
    """A ``size``-byte sparse file (a few KB on disk): a crafted header whose ``table``
    (``.dynsym`` or ``.dynstr``) runs from 4 KiB to the end, all zeros."""
    elf = CraftedElf()
    section = elf.section(1 if table == ".dynsym" else 2)
    elf.set(section + 24, "Q", 4096).set(section + 32, "Q", size - 4096)
    if table == ".dynstr":  # names at the table's start, as a linker writes them
        elf.buf += bytes(4096 - len(elf.buf)) + bytes(elf.buf[elf.dynstr : elf.shoff])
    with open(path, "wb") as f:
        f.write(elf.buf)
        f.truncate(size)
    return path


@contextmanager
def mapped(path: Path) -> Iterator[mmap.mmap]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as buf:
        yield buf


@pytest.mark.parametrize("table", [".dynsym", ".dynstr"])
def test_a_2_gib_sparse_table_is_refused_in_one_line_without_being_read(tmp_path, table) -> None:
    # The agent copied a 2 GiB .dynstr whole: 253 MB -> 4.37 GB, then the OOM killer.
    path = sparse_elf(tmp_path / "libtorch_cpu.so", table)
    assert path.stat().st_blocks * 512 < 1 << 20  # sparse: nothing on disk
    cap = {".dynsym": 16 << 20, ".dynstr": 64 << 20}[table]
    raised: list[ElfError] = []

    def read(buf: mmap.mmap) -> None:
        try:
            find_function_symbols(buf, PREFIXES)
        except ElfError as err:
            raised.append(err)

    with mapped(path) as buf:
        started = time.monotonic()
        peak = peak_bytes(lambda: read(buf))
        assert time.monotonic() - started < 1.0
    assert peak < 1 << 20
    [error] = raised
    assert str(error) == (f"{table} is {GIB2 - 4096} bytes, over the cap of {cap} "
                                 f"({cap >> 20} MiB): symbol table not read")


@contextmanager
def held(path: Path) -> Iterator[MappedLibrary]:
    """``path`` as the agent holds a job's library: mapped by a process (this one), opened
    through /proc/PID/map_files, read with pread (never mapped by the reader)."""
    with mapped(path):
        maps = procfs.parse_maps(Path("/proc/self/maps").read_text())
        mapping = procfs.mapped_file(maps, path.name)
        assert mapping is not None
        library = MappedLibrary(os.getpid(), mapping)
        try:
            yield library
        finally:
            library.close()


def test_a_dynstr_at_its_cap_is_read_bounded_by_the_cap(tmp_path) -> None:
    # 64 MiB of zeros after the names: read once, searched; what the agent holds is the
    # table, never more (the file is page-aligned: CPython 3.11's find on a memory map
    # read one byte past a range that ended there, gh-105235, a SIGSEGV of the agent;
    # nothing is searched in a map now).
    cap = 64 << 20
    path = sparse_elf(tmp_path / "libtorch_cpu.so", ".dynstr", size=cap + 4096)
    with held(path) as library:
        found: dict = {}
        started = time.monotonic()
        peak = peak_bytes(lambda: found.update(find_function_symbols(library, PREFIXES)))
        assert time.monotonic() - started < 2.0
    assert peak < cap + (2 << 20)
    assert sorted(s.name for s in found["probe_me"]) == ["probe_me", "probe_me_too"]


def test_a_library_its_owner_truncates_while_it_is_read_is_one_elf_error(tmp_path) -> None:
    # Read through a memory map, a page past the new end is a SIGBUS that kills the agent.
    path = sparse_elf(tmp_path / "libtorch_cpu.so", ".dynstr", size=(1 << 20) + 4096)
    with held(path) as library:
        assert find_function_symbols(library, PREFIXES)["probe_me"]
        os.truncate(path, 8192)  # the job's user may, any time: the file is theirs
        with pytest.raises(ElfError, match=r"beyond the end of the file|changed while"):
            find_function_symbols(library, PREFIXES)


def test_too_many_matches_or_places_are_refused_and_long_names_are_cut() -> None:
    many = [(f"probe_me{i}", FUNC, 1, 0x1000 + i, 1) for i in range(4097)]
    with pytest.raises(ElfError, match="more than 4096 symbols match"):
        find_function_symbols(bytes(CraftedElf(many).buf), PREFIXES)
    places = CraftedElf(extra_strings=b"probe_me" * 70_000 + b"\0")
    with pytest.raises(ElfError, match=r"occur more than 65536 times in \.dynstr"):
        find_function_symbols(bytes(places.buf), PREFIXES)
    long_name = "probe_me" + "x" * 10_000
    found = find_function_symbols(bytes(CraftedElf([(long_name, FUNC, 1, 64, 1)]).buf),
                                  PREFIXES)
    [symbol] = found["probe_me"]
    assert symbol.name == long_name[:4096]


# -- the doctor, as root, on an ordinary user's process ---------------------------------
