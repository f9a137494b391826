"""Reading files safely as root: the files the user names, and the libraries a job maps.

- Files the *user* names on the agent's command line (``--model-config``, an
  event log) are read with the agent's own rights, but never block and never
  balloon: the file is opened ``O_NONBLOCK`` (a FIFO opens at once), must be a
  regular file (a FIFO, device or folder is refused), and is read up to a
  size cap. The path is walked one component at a time without following a
  symbolic link owned by anyone but root or the agent's user (a link a job's
  user planted in a folder on the way is refused, as the kernel's
  ``fs.protected_symlinks`` does in sticky folders).
- A library a job mapped is opened only as the very file it mapped (see
  ``open_mapped_file``), so a job cannot swap another file in under a probe.

Files the *job* names are read with the job's credentials instead:
perfmon.probes.job_files.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

from perfmon.parsers import procfs
from perfmon.parsers.errors import InputFileError

MAX_CONFIG_BYTES = 4 << 20  # model config files, config.json: far above any real one
_MAX_LINK_HOPS = 40


class PathRefused(Exception):
    """A path the walk will not take; the message names the component and why."""


def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def file_kind(mode: int) -> str:
    """What a file of ``mode`` that is not a regular file is, for a message.

    Shared with job_files, whose refusals read the same as these.
    """
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def walk(path: str, *, final_directory: bool = True,
         make_directory: Callable[[int, str], None] | None = None) -> int:
    """An fd of ``path`` (absolute), opened one component at a time.

    A symbolic link on the way is followed only when root or the agent's user
    owns it. The last component is opened as a folder (``final_directory``) or
    as a file (``O_RDONLY|O_NONBLOCK``, any type: the caller checks it). When a
    folder on the way is missing, ``make_directory(parent_fd, name)`` may create
    it. Raises PathRefused, or OSError from the last open.
    """
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    hops = 0
    try:
        while parts:
            part = parts.pop(0)
            if part == ".":
                continue
            last = not parts
            as_dir = final_directory or not last
            flags = os.O_NOFOLLOW | os.O_CLOEXEC | (
                os.O_RDONLY | os.O_DIRECTORY if as_dir else os.O_RDONLY | os.O_NONBLOCK
                | os.O_NOCTTY)
            try:
                new = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                if make_directory is None or not as_dir:
                    if last:
                        raise
                    raise PathRefused(f"{part!r} does not exist") from None
                try:
                    make_directory(fd, part)
                except FileExistsError:
                    pass  # made by someone else meanwhile: checked like any other
                except OSError as err:
                    raise PathRefused(f"cannot create {part!r}: {err.strerror}") from err
                parts.insert(0, part)
                continue
            except OSError as err:
                if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                    if last:
                        raise
                    raise PathRefused(f"cannot open {part!r}: {err.strerror}") from err
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise PathRefused(f"{part!r} is not a directory") from err
                if not _trusted_owner(st.st_uid):
                    raise PathRefused(f"{part!r} is a symbolic link owned by uid {st.st_uid}: "
                                      "not followed") from err
                hops += 1
                if hops > _MAX_LINK_HOPS:
                    raise PathRefused("too many symbolic links") from err
                target = os.readlink(part, dir_fd=fd)
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                parts[:0] = [p for p in target.split("/") if p]
                continue
            os.close(fd)
            fd = new
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_user_file(path: str, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a regular file the user named, at most ``max_bytes``.

    Raises InputFileError with one line naming ``what`` and the path.
    """
    return read_user_file_and_status(path, what, max_bytes)[0]


def read_user_file_and_status(path: str, what: str, max_bytes: int
                              ) -> tuple[bytes, os.stat_result]:
    """As read_user_file, with the status of the very file read (its owner: whether a
    file found in a shared folder is to be believed)."""
    fd = open_user_file(path, what)
    try:
        st = os.fstat(fd)
        data = read_capped(fd, max_bytes)
    except OSError as err:
        raise InputFileError(f"{what} {path}: cannot read: {err.strerror}") from err
    finally:
        os.close(fd)
    if data is None:
        raise InputFileError(f"{what} {path}: larger than {max_bytes >> 20} MiB")
    return data, st


def open_user_file(path: str, what: str) -> int:
    """A read-only fd of a regular file the user named (never blocks); InputFileError."""
    try:
        fd = walk(os.path.abspath(path), final_directory=False)
    except FileNotFoundError:
        raise InputFileError(f"{what} {path}: no such file") from None
    except PathRefused as err:
        raise InputFileError(f"{what} {path}: {err}") from err
    except OSError as err:
        raise InputFileError(f"{what} {path}: cannot open: {err.strerror}") from err
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InputFileError(f"{what} {path}: {file_kind(mode)}, not a regular file")
    return fd


def read_capped(fd: int, max_bytes: int) -> bytes | None:
    """Up to max_bytes from fd; None when there is more. Raises OSError."""
    chunks, total = [], 0
    while total <= max_bytes:
        chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return None if total > max_bytes else b"".join(chunks)


def open_mapped_file(pid: int, mapping: procfs.MappedFile) -> int:
    """A read-only fd of the very file process ``pid`` mapped (a library), never blocking.

    Through /proc/PID/map_files (needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE),
    which reaches the mapped inode whatever its path holds now; else through the
    path under /proc/PID/root, accepted only when it is still the same regular
    file (device and inode as in /proc/PID/maps), so a job cannot swap a FIFO,
    a device or another file in under the agent. Raises PathRefused or OSError.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(f"/proc/{pid}/map_files/{mapping.range_name}", flags)
        verify_inode = False
    except PermissionError:
        path = mapping.path.removesuffix(" (deleted)")
        fd = os.open(f"/proc/{pid}/root{path}", flags)
        verify_inode = True
    st = os.fstat(fd)
    same = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) == (*mapping.device,
                                                                      mapping.inode)
    if not stat.S_ISREG(st.st_mode) or (verify_inode and not same):
        os.close(fd)
        raise PathRefused(f"{mapping.path} is no longer the file pid {pid} mapped")
    return fd


class MappedLibrary:
    """A library a process mapped, held open by the agent while it probes it.

    ``probe_path`` (``/proc/self/fd/N``) names exactly that file for bcc and the
    kernel's uprobe attach, so neither opens whatever the path holds now.
    """

    def __init__(self, pid: int, mapping: procfs.MappedFile) -> None:
        self.mapping = mapping
        self.fd = open_mapped_file(pid, mapping)

    @property
    def probe_path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    # Read as perfmon.parsers.elf_symbols.ElfSource: with pread, never a memory map (its
    # owner may truncate the file meanwhile: a mapped page past the end is a SIGBUS).

    def __len__(self) -> int:
        return os.fstat(self.fd).st_size

    def read_at(self, offset: int, size: int) -> bytes | bytearray:
        """Up to ``size`` bytes at ``offset`` (fewer where the file ends sooner), read
        into one buffer (a table is held once, never twice while joined)."""
        data = bytearray(size)
        done = 0
        with memoryview(data) as view:
            while done < size:
                count = os.preadv(self.fd, [view[done:]], offset + done)
                if count == 0:
                    break
                done += count
        return data if done == size else data[:done]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
