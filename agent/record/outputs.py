"""The files the agent writes, made safe to write as root next to hostile jobs.

Every output goes into an :class:`OutputDir`, a directory held open by file
descriptor, so that renaming or replacing its path after the checks cannot
redirect a write. The directory is reached component by component with
``O_NOFOLLOW``: a symbolic link on the way is followed only when root or the
agent's own user owns it (a link planted by a job's user is refused, as the
kernel's ``fs.protected_symlinks`` does in sticky folders). The directory must
belong to root or the agent's user and must not be writable by group or others
unless its sticky bit is set (``--allow-shared-output-dir`` lifts both rules);
folders the agent creates are 0750 and its files 0600.

Every file is created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` (a fresh temporary
file for atomic rewrites, renamed into place), so an existing name, a planted
link or FIFO among them, is never opened: a clash gives the next free name.

Errors raised here are :class:`OutputDirError` (exit 2: the directory is
unfit, found before anything attaches) and :class:`OutputNotWritable` (exit 7:
a write failed at the end). Write failures during a session are data: the
caller keeps measuring and retries (perfmon.agent.record.summary.SummaryFile and
perfmon.agent.record.eventlog keep the error as data, WRITE_ERRNOS say which).
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from perfmon.parsers.errors import InputFileError, PerfmonError
from perfmon.probes.files import PathRefused, walk

DIR_MODE = 0o750
FILE_MODE = 0o600
_MAX_NAME_CLASHES = 1000
# Errors of a write that the session survives (and retries): the disk or quota
# is full, the filesystem went read-only or away, or permissions changed under us.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                          errno.EIO, errno.ENOENT, errno.ESTALE, errno.EFBIG})


def refused(err: OSError) -> OSError:
    """``err`` when it is the disk refusing a write (WRITE_ERRNOS: full, read-only, over
    quota...): the caller keeps it as data and goes on; anything else is raised again."""
    if err.errno not in WRITE_ERRNOS:
        raise err
    return err


def json_document(data: bytes, source: str, after: str = "") -> Any:
    """The JSON document in ``data``, read from ``source``: InputFileError (one line,
    ``source`` first, ``after`` last) when it is not JSON or nests deeper than Python's
    parser goes."""
    try:
        return json.loads(data)
    except RecursionError:
        raise InputFileError(f"{source}: nested too deep{after}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise InputFileError(f"{source}: not JSON ({err}){after}") from err


class OutputDirError(PerfmonError):
    """The output directory is unfit (unsafe, not a directory, not writable)."""

    exit_code = 2


class OutputNotWritable(PerfmonError):
    """A file the agent must write could not be written (at the end of a session)."""

    exit_code = 7


def finite(value: Any) -> Any:
    """The value with NaN and infinities replaced by None, recursively: strict JSON only."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def json_bytes(document: Any, *, compact: bool = False) -> bytes:
    """Strict JSON (no NaN or Infinity: None instead), with a final newline.

    Indented unless ``compact``: json's C encoder only runs without indentation,
    and is ~10 times faster on a summary of 2,000 interval entries, so the
    session's periodic rewrites are compact and its final summary indented.
    """
    indent = None if compact else 2
    try:
        text = json.dumps(document, indent=indent, allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere: the slow walk, once
        text = json.dumps(finite(document), indent=indent, allow_nan=False)
    return (text + "\n").encode()


def _walk_dir(path: Path, create: bool, what: str = "output dir") -> int:
    """An fd of the folder ``path``; missing folders made 0750 when ``create``.

    Raises OutputDirError whose message starts with ``what``.
    """
    def make(parent_fd: int, name: str) -> None:
        os.mkdir(name, DIR_MODE, dir_fd=parent_fd)

    try:
        return walk(os.path.abspath(path), make_directory=make if create else None)
    except PathRefused as err:
        raise OutputDirError(f"{what} {path}: {err}") from err
    except FileNotFoundError:
        raise OutputDirError(f"{what} {path}: does not exist") from None
    except OSError as err:
        raise OutputDirError(f"{what} {path}: cannot open: {err.strerror}") from err


class OutputDir:
    """A directory held open by fd; every file in it is created exclusively.

    ``open`` checks ownership, permissions and writability (raises
    OutputDirError). ``path`` is only for messages: all I/O goes through ``fd``.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def open(cls, path: Path, *, allow_shared: bool = False, create: bool = True) -> OutputDir:
        shown = str(path)
        fd = _walk_dir(path, create)
        try:
            st = os.fstat(fd)
            if not allow_shared:
                if st.st_uid not in (0, os.geteuid()):
                    raise OutputDirError(
                        f"output dir {shown}: owned by uid {st.st_uid}, not by root or this "
                        "agent's user: another user could swap the files in it "
                        "(--allow-shared-output-dir to write there anyway)")
                if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
                    raise OutputDirError(
                        f"output dir {shown}: writable by group or others without the sticky "
                        f"bit (mode {stat.S_IMODE(st.st_mode):o}) "
                        "(--allow-shared-output-dir to write there anyway)")
            out = cls(Path(path), fd)
            out._check_writable()
            return out
        except BaseException:
            os.close(fd)
            raise

    def _check_writable(self) -> None:
        """Create and remove a file now, so an unwritable folder fails before anything attaches."""
        name = f".perfmon-write-test-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.close(self._create(name))
            os.unlink(name, dir_fd=self.fd)
        except OSError as err:
            raise OutputDirError(f"output dir {self.path}: not writable: {err.strerror}") from err

    def _create(self, name: str, extra_flags: int = 0) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | extra_flags
        return os.open(name, flags, FILE_MODE, dir_fd=self.fd)

    def create_append(self, name: str) -> int:
        """A new file's fd (0600, O_APPEND); FileExistsError when the name is taken, by anything."""
        return self._create(name, os.O_APPEND)

    @contextmanager
    def _temp(self, name: str, data: bytes) -> Iterator[str]:
        """A fresh, fsynced temporary file holding ``data``; removed unless renamed away."""
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        fd = self._create(tmp)
        try:
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            yield tmp
        finally:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except FileNotFoundError:
                pass

    def open_read(self, name: str) -> int:
        """A read fd of the regular file ``name`` (never through a link, never blocking
        on a FIFO); OSError when it is absent or no regular file."""
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=self.fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", name)
        return fd

    @contextmanager
    def rewrite(self, name: str) -> Iterator[int]:
        """A fresh temporary file's fd to write ``name``'s new content into: once the block
        ends without error it is fsynced and replaces ``name`` atomically (readers see
        the old file or the new one); otherwise it is removed."""
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        fd = self._create(tmp)
        try:
            yield fd
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            os.fsync(self.fd)
        finally:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except FileNotFoundError:
                pass

    def replace(self, name: str, data: bytes) -> None:
        """Write ``name`` atomically: readers see the old file or the new one, never half.

        Raises OSError (the caller decides whether the session survives it).
        """
        with self._temp(name, data) as tmp:
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        os.fsync(self.fd)

    def publish_new(self, name: str, data: bytes) -> None:
        """Write a file that must not exist yet, atomically; FileExistsError when it does.

        link(2) of the complete temporary file claims the name and publishes the
        content in one step (it never replaces what is there, nor follows a link).
        """
        with self._temp(name, data) as tmp:
            os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
        os.fsync(self.fd)

    def publish_unique(self, stem: str, suffix: str, data: bytes) -> str:
        """Publish ``<stem><suffix>``, or ``<stem>_1<suffix>``... when taken; the name used."""
        for name in unique_names(stem, suffix):
            try:
                self.publish_new(name, data)
                return name
            except FileExistsError:
                continue
        raise OutputDirError(f"output dir {self.path}: every name like {stem}{suffix} is taken")

    def make_subdir(self, stem: str) -> OutputDir:
        """A new folder ``stem`` (or ``stem_1``... when taken), 0750, held open."""
        for name in unique_names(stem, ""):
            try:
                os.mkdir(name, DIR_MODE, dir_fd=self.fd)
            except FileExistsError:
                continue
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=self.fd)
            return OutputDir(self.path / name, fd)
        raise OutputDirError(f"output dir {self.path}: every name like {stem} is taken")

    def subdirs(self) -> list[str]:
        """The names of the folders in it (links and other files left out)."""
        names = []
        with os.scandir(self.fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    names.append(entry.name)
        return names

    def read_file(self, name: str, max_bytes: int) -> tuple[bytes, float] | None:
        """(content, mtime) of a regular file ``name`` (may name a file in a subfolder),
        at most ``max_bytes``; None when absent, not a regular file, or larger."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.fd)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
                return None
            return os.read(fd, max_bytes), st.st_mtime
        finally:
            os.close(fd)

    def remove_subdir(self, name: str) -> None:
        """Remove a folder and everything in it, never following a link (rmtree by fd)."""
        shutil.rmtree(name, dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def unique_names(stem: str, suffix: str) -> Iterator[str]:
    """``stem+suffix``, then ``stem_1+suffix``, ``stem_2+suffix``, ..."""
    yield f"{stem}{suffix}"
    for n in range(1, _MAX_NAME_CLASHES):
        yield f"{stem}_{n}{suffix}"


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_user_file(path: Path, data: bytes) -> None:
    """Write a file the user named (``summarize --output``) atomically.

    Its folder must exist; an existing file of that name must be a regular
    file (a link, FIFO, device or folder is refused, never written through).
    Raises OutputDirError (exit 2) for an unfit path, OutputNotWritable (exit 7)
    when writing fails.
    """
    if not path.name:
        raise OutputDirError(f"output {path}: names a folder, not a file")
    folder = OutputDir(path.parent, _walk_dir(path.parent, False, f"output {path}: folder"))
    try:
        try:
            mode = os.stat(path.name, dir_fd=folder.fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise OutputDirError(f"output {path}: {kind}: refusing to write there")
        try:
            folder.replace(path.name, data)
        except OSError as err:
            raise OutputNotWritable(f"output not writable: {path}: {err.strerror}") from err
    finally:
        folder.close()
