"""Exported function symbols from an ELF64 shared library's dynamic symbol table,
and the PT_LOAD program headers that turn a symbol's address into a file offset.

Pure: reads the file through an :class:`ElfSource` (``read_at``: the probes give
one that reads a held file descriptor with pread; a ``bytes`` buffer is one too)
and returns data. Hand-written rather than pyelftools because libtorch_cpu.so is
~400 MB with ~75,000 dynamic symbols: reading the headers and the two dynamic
tables (7 MB), searching ``.dynstr`` for a prefix with ``bytes.find`` and then
scanning ``.dynsym`` once with ``struct.iter_unpack`` takes about 10 ms, where a
general ELF reader takes seconds.

Total and bounded (issue 36): the file may be any user's (a job maps a file named
libtorch_cpu.so and the root agent reads it), so every offset, size and link is
checked against the file, every table and count has a cap, only the headers and
the two capped tables are read, and anything wrong is an :class:`ElfError` naming
it. Never through a memory map of the file: its owner can truncate it while it is
read, and a read of a mapped page past the new end is a SIGBUS of the agent; a
short read is an error here.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from perfmon.parsers.errors import PerfmonError


class ElfError(PerfmonError):
    """The buffer is not an ELF64 little-endian shared object we can read."""

    exit_code = 6


class ElfSource(Protocol):
    """A file as the functions read it: its size, and ``size`` bytes at ``offset`` (fewer
    where the file ended sooner: it changed while being read)."""

    def __len__(self) -> int: ...

    def read_at(self, offset: int, size: int) -> bytes | bytearray: ...


class BufferSource:
    """An :class:`ElfSource` over bytes already in memory."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._data = data

    def __len__(self) -> int:
        return len(self._data)

    def read_at(self, offset: int, size: int) -> bytes:
        return bytes(self._data[offset : offset + size])


# An ElfSource, or the file's bytes in memory (bytes, or a memory map in tests).
ElfInput = ElfSource | bytes | bytearray | memoryview


def _source(elf: ElfInput) -> ElfSource:
    return elf if hasattr(elf, "read_at") else BufferSource(elf)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ElfSymbol:
    name: str
    address: int  # st_value: virtual address in the library
    size_bytes: int


_SHT_DYNSYM = 11
_SHT_STRTAB = 3
_STT_FUNC = 2
_SHN_UNDEF = 0
_EHDR_SIZE = 64  # Elf64_Ehdr
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym: name, info, other, shndx, value, size
_SHDR = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr
_PHDR = struct.Struct("<IIQQQQQQ")  # Elf64_Phdr: type, flags, offset, vaddr, paddr, filesz, ...
_PT_LOAD = 1
_PN_XNUM = 0xFFFF  # e_phnum when the count lives in section 0's sh_info

# Caps on what one library may make the agent read (issue 36: a 2 GiB sparse .dynstr,
# copied whole, took the service from 253 MB to 4.37 GB and the OOM killer). Measured
# on the installed torch's libtorch_cpu.so (434 MB): .dynsym 1,809,960 bytes (75,415
# symbols), .dynstr 5,169,025 bytes, 38 section headers, 9 program headers, longest
# name 574 bytes, each probed prefix found once. libtorch_cpu of a CUDA build exports
# about as much (the CUDA kernels are in libtorch_cuda, which is not read), and
# libcudart, libcuda and libnccl export far fewer. Each cap is 8x or more above that,
# so a bigger future libtorch still fits, and the worst a crafted file can make the
# agent touch is the two tables (80 MiB of its pages) and at most 16 MiB of names.
_MAX_DYNSYM_BYTES = 16 << 20  # 9x: ~700,000 symbols
_MAX_DYNSTR_BYTES = 64 << 20  # 13x
_MAX_SECTIONS = 4096  # 100x; the header's count is 16 bits, section 0's sh_size 64
_MAX_PROGRAM_HEADERS = 4096  # 450x; PN_XNUM's count (section 0's sh_info) is 32 bits
_MAX_PREFIX_PLACES = 1 << 16  # places in .dynstr where a wanted prefix starts
_MAX_MATCHES = 1 << 12  # symbols returned, all prefixes together
_MAX_NAME_BYTES = 4096  # 7x; a longer name is cut here (it still starts with its prefix)


@dataclass(frozen=True)
class LoadSegment:
    """A PT_LOAD program header: ``file_size_bytes`` bytes of the file from
    ``file_offset`` are mapped at ``virtual_address`` (relative to the load base)."""

    file_offset: int  # p_offset
    virtual_address: int  # p_vaddr
    file_size_bytes: int  # p_filesz (the rest of p_memsz is zero-filled, not in the file)


def _read(src: ElfSource, offset: int, size: int, what: str) -> bytes | bytearray:
    """``size`` bytes from ``offset``; ElfError unless they lie inside the file and were
    all read (a file its owner truncated meanwhile)."""
    if offset + size > len(src):
        raise ElfError(f"ELF {what} ({size} bytes at offset {offset:#x}) lie beyond the end "
                       f"of the file ({len(src)} bytes)")
    data = src.read_at(offset, size)
    if len(data) != size:
        raise ElfError(f"ELF {what}: the file changed while it was read (got {len(data)} of "
                       f"{size} bytes at offset {offset:#x})")
    return data


def _header(src: ElfSource) -> bytes | bytearray:
    if src.read_at(0, 4) != b"\x7fELF":
        raise ElfError("not an ELF file")
    if len(src) < _EHDR_SIZE:
        raise ElfError(f"ELF file of {len(src)} bytes is shorter than its header")
    head = _read(src, 0, _EHDR_SIZE, "header")
    if head[4] != 2 or head[5] != 1:
        raise ElfError("only 64-bit little-endian ELF is supported")
    return head


def _sections(src: ElfSource) -> list[tuple[int, ...]]:
    head = _header(src)
    e_shoff = struct.unpack_from("<Q", head, 0x28)[0]
    e_shentsize, e_shnum = struct.unpack_from("<HH", head, 0x3A)
    if e_shoff == 0:
        raise ElfError("ELF file has no section headers")
    if e_shentsize != _SHDR.size:
        raise ElfError(f"unexpected section header size {e_shentsize}")
    if e_shnum == 0:  # 0xff00 sections or more: the count is section 0's sh_size (gABI)
        e_shnum = _SHDR.unpack(_read(src, e_shoff, _SHDR.size, "section header 0"))[5]
    if e_shnum > _MAX_SECTIONS:
        raise ElfError(f"ELF file has {e_shnum} section headers, over the cap of "
                       f"{_MAX_SECTIONS}: not read")
    table = _read(src, e_shoff, e_shnum * _SHDR.size, "section headers")
    return list(_SHDR.iter_unpack(table))


def load_segments(elf: ElfInput) -> list[LoadSegment]:
    """The PT_LOAD program headers of an ELF64 LE file, in file order.

    Raises :class:`ElfError` for a file that is not ELF64 LE, whose program
    headers or segments lie outside it, or with more than 4096 program headers.
    """
    src = _source(elf)
    head = _header(src)
    e_phoff = struct.unpack_from("<Q", head, 0x20)[0]
    e_phentsize, e_phnum = struct.unpack_from("<HH", head, 0x36)
    if e_phoff == 0 or e_phnum == 0:
        raise ElfError("ELF file has no program headers")
    if e_phentsize != _PHDR.size:
        raise ElfError(f"unexpected program header size {e_phentsize}")
    if e_phnum == _PN_XNUM:  # more than 65534 headers: the count is section 0's sh_info
        sections = _sections(src)
        if not sections:
            raise ElfError("ELF file counts its program headers in a section 0 it lacks")
        e_phnum = sections[0][7]
    if e_phnum > _MAX_PROGRAM_HEADERS:
        raise ElfError(f"ELF file has {e_phnum} program headers, over the cap of "
                       f"{_MAX_PROGRAM_HEADERS}: not read")
    table = _read(src, e_phoff, e_phnum * _PHDR.size, "program headers")
    segments = []
    for i, header in enumerate(_PHDR.iter_unpack(table)):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz, _memsz, _align = header
        if p_type == _PT_LOAD:
            if p_offset + p_filesz > len(src):
                raise ElfError(f"ELF PT_LOAD segment {i} ({p_filesz} bytes at offset "
                               f"{p_offset:#x}) lies beyond the end of the file "
                               f"({len(src)} bytes)")
            segments.append(LoadSegment(p_offset, p_vaddr, p_filesz))
    return segments


def file_offset(segments: Iterable[LoadSegment], address: int) -> int:
    """The file offset of virtual address ``address`` (e.g. a symbol's st_value).

    Uprobes name a probe point by file offset (``PATH:OFFSET``), and a
    library's code segment need not be mapped at its file offset (lld and gold
    shift it by a page or more). Raises :class:`ElfError` when no PT_LOAD
    segment holds ``address`` within its file bytes (an address in ``.bss``,
    or outside the library).
    """
    for seg in segments:
        if seg.virtual_address <= address < seg.virtual_address + seg.file_size_bytes:
            return address - seg.virtual_address + seg.file_offset
    raise ElfError(f"no PT_LOAD segment holds address {address:#x} in the file")


def _dynamic_tables(src: ElfSource) -> tuple[bytes | bytearray, bytes | bytearray]:
    """``.dynsym`` and the ``.dynstr`` it links to, each checked and capped, then read."""
    sections = _sections(src)
    index = next((i for i, s in enumerate(sections) if s[1] == _SHT_DYNSYM), None)
    if index is None:
        raise ElfError("ELF file has no .dynsym section")
    _, _, _, _, sym_off, sym_size, str_link, *_ = sections[index]
    if sym_size > _MAX_DYNSYM_BYTES:
        raise ElfError(f".dynsym is {sym_size} bytes, over the cap of {_MAX_DYNSYM_BYTES} "
                       f"({_MAX_DYNSYM_BYTES >> 20} MiB): symbol table not read")
    if sym_size % _SYM.size:
        raise ElfError(f".dynsym is {sym_size} bytes, not a whole number of "
                       f"{_SYM.size}-byte symbols")
    if not 0 < str_link < len(sections) or str_link == index:
        raise ElfError(f".dynsym links to section {str_link}, not a string table of the "
                       f"{len(sections)} sections")
    _, str_type, _, _, str_off, str_size, *_ = sections[str_link]
    if str_type != _SHT_STRTAB:
        raise ElfError(f".dynsym links to section {str_link} of type {str_type}, "
                       "not a string table")
    if str_size > _MAX_DYNSTR_BYTES:
        raise ElfError(f".dynstr is {str_size} bytes, over the cap of {_MAX_DYNSTR_BYTES} "
                       f"({_MAX_DYNSTR_BYTES >> 20} MiB): symbol table not read")
    dynsym = _read(src, sym_off, sym_size, ".dynsym")
    dynstr = _read(src, str_off, str_size, ".dynstr")
    if not dynstr.endswith(b"\0"):
        raise ElfError(".dynstr does not end in a NUL byte")
    return dynsym, dynstr


def _prefix_places(dynstr: bytes | bytearray, prefixes: list[str]) -> dict[int, list[str]]:
    """Offset in the string table -> the prefixes that start there.

    Not only string starts: the linker stores a name that is the tail of another
    only once, so a symbol's name can begin mid-string (libcudart's
    "cudaLaunchKernel" inside "__cudaLaunchKernel", libnccl's "ncclAllReduce"
    inside "pncclAllReduce"). An offset counts only when a symbol's st_name points
    at it. Several prefixes can start at one offset ("ncclReduce",
    "ncclReduceScatter").
    """
    wanted: dict[int, list[str]] = {}
    places = 0
    for prefix in prefixes:
        needle = prefix.encode()
        if not needle or b"\0" in needle:
            raise ValueError(f"symbol prefix {prefix!r}: a name is non-empty, without NUL")
        at = dynstr.find(needle)
        while at != -1:
            places += 1
            if places > _MAX_PREFIX_PLACES:
                raise ElfError(f"the probed names occur more than {_MAX_PREFIX_PLACES} "
                               "times in .dynstr: not a library the agent reads")
            wanted.setdefault(at, []).append(prefix)
            at = dynstr.find(needle, at + 1)
    return wanted


def _defined_functions(dynsym: bytes | bytearray, wanted: dict[int, list[str]]
                       ) -> list[tuple[int, int, int]]:
    """(st_name, st_value, st_size) of the defined functions whose names are wanted;
    stops after one more than the cap (the caller refuses that)."""
    hits = []
    for st_name, st_info, _other, st_shndx, st_value, st_size in _SYM.iter_unpack(dynsym):
        if st_name in wanted and st_shndx != _SHN_UNDEF and st_info & 0xF == _STT_FUNC:
            hits.append((st_name, st_value, st_size))
            if len(hits) > _MAX_MATCHES:
                break
    return hits


def find_function_symbols(elf: ElfInput, prefixes: Iterable[str]) -> dict[str, list[ElfSymbol]]:
    """Defined function symbols in ``.dynsym`` whose names start with each prefix.

    Returns ``{prefix: [symbols]}`` with an empty list for a prefix that matched
    nothing; a name longer than 4096 bytes is cut there. Raises :class:`ElfError`
    for a file that is not ELF64 LE, has no dynamic symbol table, has one that
    lies outside it or is over its cap (.dynsym 16 MiB, .dynstr 64 MiB), changed
    while read, or has more than 4096 matching symbols; ValueError for an empty
    prefix or one with a NUL.
    """
    prefixes = list(prefixes)
    dynsym, dynstr = _dynamic_tables(_source(elf))
    wanted = _prefix_places(dynstr, prefixes)
    found: dict[str, list[ElfSymbol]] = {p: [] for p in prefixes}
    if not wanted:
        return found
    hits = _defined_functions(dynsym, wanted)
    if len(hits) > _MAX_MATCHES:
        raise ElfError(f"more than {_MAX_MATCHES} symbols match the probed names: "
                       "not a library the agent reads")
    for st_name, st_value, st_size in hits:
        limit = st_name + _MAX_NAME_BYTES  # .dynstr ends in a NUL: every name ends
        end = dynstr.find(b"\0", st_name, limit)
        name = dynstr[st_name : limit if end == -1 else end]
        for prefix in wanted[st_name]:
            found[prefix].append(ElfSymbol(name.decode("ascii", "replace"), st_value, st_size))
    return found
