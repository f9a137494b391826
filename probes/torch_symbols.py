"""The PyTorch functions the step probes attach to, and finding them in a target.

Both marker backends, bcc (:mod:`perfmon.probes.uprobes`, and the counter snapshots
of :mod:`perfmon.probes.cuda`) and tracefs (:mod:`perfmon.probes.tracefs`), probe the
same functions of the target's libtorch_cpu and libc10, found here in the very files
the target mapped (held open, :class:`~perfmon.probes.files.MappedLibrary`) by
perfmon.parsers.elf_symbols' bounded reads of ``.dynsym``: as addresses for bcc
(:func:`find_torch_symbols`, :func:`find_grad_read`), as file offsets for tracefs'
``uprobe_events`` (:func:`find_torch_offsets`). Every failure is SymbolNotFound,
naming the process and the library.
"""

from __future__ import annotations

from dataclasses import dataclass

from perfmon.parsers import procfs
from perfmon.parsers.elf_symbols import (
    ElfError,
    ElfSymbol,
    file_offset,
    find_function_symbols,
    load_segments,
)
from perfmon.parsers.procfs import MappedFile
from perfmon.parsers.wait_symbols import C10D_PREFIX, WaitPoint, wait_point
from perfmon.probes.errors import NoSuchProcess, PrivilegeError, SymbolNotFound
from perfmon.probes.files import MappedLibrary, PathRefused
from perfmon.probes.procfs import TargetProcess, read_proc

# Mangled-name prefixes: the full names differ across releases (c10::optional
# before 2.4, std::optional after), so match the stable part.
RECORD_FUNCTION_SYMBOLS = (
    "_ZN5torch8autograd8profiler25record_function_enter_new",  # PyTorch >= 1.13
    "_ZN5torch8autograd8profiler21record_function_enterE",  # older
)
ENGINE_EXECUTE_SYMBOL = "_ZN5torch8autograd6Engine7executeE"
# c10::TensorImpl::grad() const: what every read of a parameter's gradient calls
# (Python's ``.grad``, torch.optim, the inputs of a compiled optimizer step, a
# hand-written ``p -= lr * p.grad``), out of line in libc10. Reads inside backward()
# leave nothing (iterations.bpf.c), so one event an update leaves the kernel.
GRAD_READ_SYMBOL = "_ZNK3c1010TensorImpl4gradEv"
C10_LIBRARY_PREFIX = "libc10."  # (not libc10_cuda)


@dataclass(frozen=True)
class WaitSymbol:
    """A function where a rank blocks on its process group (perfmon.parsers.wait_symbols:
    every work object's wait in the library, DDP's finalize_backward), and what it is."""

    symbol: ElfSymbol
    point: WaitPoint


def _open_mapped(target: TargetProcess, mapping: MappedFile, path: str) -> MappedLibrary:
    try:
        return MappedLibrary(target.pid, mapping)
    except (OSError, PathRefused) as err:
        raise SymbolNotFound(
            f"pid {target.pid} ({target.name}): cannot open {path}: {err}") from err


def open_torch_library(target: TargetProcess) -> MappedLibrary:
    """The target's libtorch_cpu as it mapped it, held open; SymbolNotFound when it cannot be."""
    if target.torch_mapping is None:
        raise SymbolNotFound(f"pid {target.pid} ({target.name}): libtorch_cpu is not loaded")
    return _open_mapped(target, target.torch_mapping, target.torch_library)


def find_grad_read(target: TargetProcess) -> tuple[MappedLibrary, ElfSymbol]:
    """The target's libc10 as it mapped it, held open, and its gradient read
    (GRAD_READ_SYMBOL); SymbolNotFound when either cannot be had."""
    try:
        maps = read_proc(target.pid, "maps")
    except (NoSuchProcess, PrivilegeError) as err:
        raise SymbolNotFound(f"pid {target.pid} ({target.name}): cannot read its maps: {err}"
                             ) from err
    mapping = procfs.mapped_file(procfs.parse_maps(maps), C10_LIBRARY_PREFIX)  # type: ignore[arg-type]
    if mapping is None:
        raise SymbolNotFound(f"pid {target.pid} ({target.name}): libc10 is not loaded")
    library = _open_mapped(target, mapping, mapping.path)
    try:
        found = find_function_symbols(library, (GRAD_READ_SYMBOL,))[GRAD_READ_SYMBOL]
    except (OSError, ValueError, ElfError) as err:
        library.close()
        raise SymbolNotFound(
            f"pid {target.pid} ({target.name}): cannot read symbols of {mapping.path}: {err}"
        ) from err
    exact = [sym for sym in found if sym.name == GRAD_READ_SYMBOL]
    if not exact:
        library.close()
        raise SymbolNotFound(f"pid {target.pid} ({target.name}): {mapping.path} exports no "
                             "c10::TensorImpl::grad")
    return library, exact[0]


def find_torch_symbols(target: TargetProcess, library: MappedLibrary
                       ) -> tuple[list[ElfSymbol], list[ElfSymbol], list[WaitSymbol]]:
    """(record_function entry symbols, Engine::execute symbols, the wait points) in the
    target's libtorch_cpu: every c10d function it exports that is a work object's wait
    (or DDP's finalize_backward), each at one address.

    Raises SymbolNotFound when the library cannot be read or has no
    record_function entry point; the others may be absent ([]).
    """
    try:
        found = find_function_symbols(
            library, (*RECORD_FUNCTION_SYMBOLS, ENGINE_EXECUTE_SYMBOL, C10D_PREFIX))
    except (OSError, ValueError, ElfError) as err:
        raise _unreadable(target, err) from err
    record: list[ElfSymbol] = next((found[p] for p in RECORD_FUNCTION_SYMBOLS if found[p]), [])
    if not record:
        raise SymbolNotFound(
            f"pid {target.pid} ({target.name}): {target.torch_library} exports no "
            "torch::autograd::profiler::record_function_enter_new or record_function_enter "
            "(a PyTorch older than 1.8, or a build with hidden symbols)"
        )
    waits: dict[int, WaitSymbol] = {}  # (an address once: aliases of one function)
    for sym in found[C10D_PREFIX]:
        point = wait_point(sym.name)
        if point is not None:
            waits.setdefault(sym.address, WaitSymbol(sym, point))
    return record, found[ENGINE_EXECUTE_SYMBOL], list(waits.values())


def find_torch_offsets(target: TargetProcess, library: MappedLibrary
                       ) -> tuple[list[int], list[int], list[tuple[int, WaitPoint]]]:
    """The symbols of :func:`find_torch_symbols` as file offsets in the library, as
    tracefs' ``uprobe_events`` wants them (each wait's with its point). Raises
    SymbolNotFound as it does."""
    record, engine, waits = find_torch_symbols(target, library)
    try:
        segments = load_segments(library)
        return ([file_offset(segments, s.address) for s in record],
                [file_offset(segments, s.address) for s in engine],
                [(file_offset(segments, w.symbol.address), w.point) for w in waits])
    except (OSError, ValueError, ElfError) as err:
        raise _unreadable(target, err) from err


def _unreadable(target: TargetProcess, err: Exception) -> SymbolNotFound:
    return SymbolNotFound(
        f"pid {target.pid} ({target.name}): cannot read symbols of {target.torch_library}: "
        f"{err}")
