"""Exported function symbols from an ELF64 shared library's dynamic symbol table,
and the PT_LOAD program headers that turn a symbol's address into a file offset.

Pure: takes any bytes-like buffer (``bytes`` or an ``mmap`` of the file) and
returns data. Hand-written rather than pyelftools because libtorch_cpu.so is
~400 MB with ~75,000 dynamic symbols: searching ``.dynstr`` for a prefix with
``bytes.find`` and then scanning ``.dynsym`` once with ``struct.iter_unpack``
takes tens of milliseconds, where a general ELF reader takes seconds.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from perfmon.parsers.errors import PerfmonError


class ElfError(PerfmonError):
    """The buffer is not an ELF64 little-endian shared object we can read."""

    exit_code = 6


@dataclass(frozen=True)
class ElfSymbol:
    name: str
    address: int  # st_value: virtual address in the library
    size_bytes: int


_SHT_DYNSYM = 11
_STT_FUNC = 2
_SHN_UNDEF = 0
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym: name, info, other, shndx, value, size
_SHDR = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr
_PHDR = struct.Struct("<IIQQQQQQ")  # Elf64_Phdr: type, flags, offset, vaddr, paddr, filesz, ...
_PT_LOAD = 1
_PN_XNUM = 0xFFFF  # e_phnum when the count lives in section 0's sh_info


@dataclass(frozen=True)
class LoadSegment:
    """A PT_LOAD program header: ``file_size_bytes`` bytes of the file from
    ``file_offset`` are mapped at ``virtual_address`` (relative to the load base)."""

    file_offset: int  # p_offset
    virtual_address: int  # p_vaddr
    file_size_bytes: int  # p_filesz (the rest of p_memsz is zero-filled, not in the file)


def _check_header(buf: bytes | memoryview) -> None:
    if bytes(buf[:4]) != b"\x7fELF":
        raise ElfError("not an ELF file")
    if buf[4] != 2 or buf[5] != 1:
        raise ElfError("only 64-bit little-endian ELF is supported")


def _sections(buf: bytes | memoryview) -> list[tuple[int, ...]]:
    _check_header(buf)
    e_shoff = struct.unpack_from("<Q", buf, 0x28)[0]
    e_shentsize, e_shnum = struct.unpack_from("<HH", buf, 0x3A)
    if e_shoff == 0 or e_shentsize != _SHDR.size:
        raise ElfError("ELF file has no section headers")
    return [_SHDR.unpack_from(buf, e_shoff + i * e_shentsize) for i in range(e_shnum)]


def load_segments(buf: bytes | memoryview) -> list[LoadSegment]:
    """The PT_LOAD program headers of an ELF64 LE file, in file order.

    Raises :class:`ElfError` for a buffer that is not ELF64 LE or whose program
    headers lie outside it.
    """
    _check_header(buf)
    e_phoff = struct.unpack_from("<Q", buf, 0x20)[0]
    e_phentsize, e_phnum = struct.unpack_from("<HH", buf, 0x36)
    if e_phoff == 0 or e_phnum == 0:
        raise ElfError("ELF file has no program headers")
    if e_phentsize != _PHDR.size:
        raise ElfError(f"unexpected program header size {e_phentsize}")
    if e_phnum == _PN_XNUM:  # more than 65534 headers: the count is section 0's sh_info
        e_phnum = _sections(buf)[0][7]
    if e_phoff + e_phnum * e_phentsize > len(buf):
        raise ElfError("ELF program headers lie beyond the end of the file")
    segments = []
    for i in range(e_phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz, _memsz, _align = _PHDR.unpack_from(
            buf, e_phoff + i * e_phentsize)
        if p_type == _PT_LOAD:
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


def find_function_symbols(
    buf: bytes | memoryview, prefixes: Iterable[str]
) -> dict[str, list[ElfSymbol]]:
    """Defined function symbols in ``.dynsym`` whose names start with each prefix.

    Returns ``{prefix: [symbols]}`` with an empty list for a prefix that matched
    nothing. Raises :class:`ElfError` for a buffer that is not ELF64 LE or has no
    dynamic symbol table.
    """
    sections = _sections(buf)
    dynsym = next((s for s in sections if s[1] == _SHT_DYNSYM), None)
    if dynsym is None:
        raise ElfError("ELF file has no .dynsym section")
    _, _, _, _, sym_off, sym_size, str_link, *_ = dynsym
    strtab = sections[str_link]
    str_off, str_size = strtab[4], strtab[5]
    dynstr = bytes(buf[str_off : str_off + str_size])

    # Offsets in .dynstr where the prefix occurs. Not only at string starts: the
    # linker stores a name that is the tail of another only once, so a symbol's
    # name can begin mid-string (libcudart's "cudaLaunchKernel" inside
    # "__cudaLaunchKernel", libnccl's "ncclAllReduce" inside "pncclAllReduce").
    # An offset counts only when a symbol's st_name points at it.
    # Several prefixes can start at one offset ("ncclReduce", "ncclReduceScatter").
    wanted: dict[int, list[str]] = {}
    for prefix in prefixes:
        needle = prefix.encode()
        at = dynstr.find(needle)
        while at != -1:
            wanted.setdefault(at, []).append(prefix)
            at = dynstr.find(needle, at + 1)

    found: dict[str, list[ElfSymbol]] = {p: [] for p in prefixes}
    if not wanted:
        return found
    view = memoryview(buf)[sym_off : sym_off + sym_size]
    for st_name, st_info, _other, st_shndx, st_value, st_size in _SYM.iter_unpack(view):
        matches = wanted.get(st_name)
        if matches is None or st_shndx == _SHN_UNDEF or st_info & 0xF != _STT_FUNC:
            continue
        end = dynstr.index(b"\0", st_name)
        name = dynstr[st_name:end].decode("ascii", "replace")
        for prefix in matches:
            found[prefix].append(ElfSymbol(name, st_value, st_size))
    return found
