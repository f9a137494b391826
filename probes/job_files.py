"""Files a job names, opened with the job's credentials, never with the agent's.

Why: the agent runs as root, and what a job names (its ``--model_name_or_path``,
a config.json, its own stdout and stderr) is the job's to choose. Read as root, a
job could name a root-only file and have what it holds reach the agent's outputs.
Read as the job's user, as the job itself would read it, a file the job could not
read is as unreadable to the agent, and nothing it holds can leak. The reading is
done by a child process: entering the job's root and dropping to its user cannot
be undone in the agent, and a read that never returns is the child's, killed at
a timeout.

How:

- Files the job names by path (paths relative to its working folder too) are
  read by a short-lived child process that enters the job's root
  (``/proc/PID/root``, so containers work) and working folder
  (``/proc/PID/cwd``), drops to the job's filesystem uid, gid and groups (from
  ``/proc/PID/status``), and opens the file there with ``O_NOFOLLOW`` on its
  last component, regular files only, size-capped, within a timeout.
- The job's own stdout and stderr (for the cause of its exit) are opened the
  same way, as the job's user, through ``/proc/PID/fd/1`` and ``/2``: the
  kernel's link to the open file itself, not a path a job could re-point.
  Only regular files are opened (a FIFO, device or socket never is), and only
  their last bytes are read, by a child process within a timeout, so a file on
  a stalled network or FUSE filesystem cannot block the agent.

Needs: root (CAP_SYS_CHROOT, CAP_SETUID, CAP_SETGID, and CAP_SYS_PTRACE to reach
/proc/PID/root).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass

from perfmon.parsers import procfs
from perfmon.parsers.errors import PerfmonError
from perfmon.probes.files import MAX_CONFIG_BYTES, file_kind

JOB_FILE_TIMEOUT_S = 1.0
# Of a job's stdout/stderr only the end is read: the lines before it exited.
OUTPUT_TAIL_BYTES = 64 << 10
# How an output that is no file ends its reason ("a FIFO, not a regular file").
NOT_A_FILE = ", not a regular file"


class JobFileError(PerfmonError):
    """A file the job names cannot be read as the job's user (a warning, not fatal)."""

    exit_code = 3


class JobFileMissing(JobFileError):
    """The file the job names does not exist (e.g. a hub model name, not a folder).

    ``under_a_file``: a component of the path is a file, not a folder.
    """

    def __init__(self, message: str, under_a_file: bool = False) -> None:
        super().__init__(message)
        self.under_a_file = under_a_file


# Runs in the child, as root until it has entered the job's root and working
# folder, then as the job's user. -I -S: nothing from the environment or the
# job's folders reaches this interpreter. Exit 0 with the bytes on stdout, or
# non-zero with a short reason on stderr.
_CHILD = r"""
import errno, os, stat, sys
path, cap, root_fd, cwd_fd, uid, gid = sys.argv[1], *map(int, sys.argv[2:7])
groups = [int(g) for g in sys.argv[7].split(",") if g]
try:
    os.fchdir(root_fd)
    os.chroot(".")
    os.fchdir(cwd_fd)
    os.close(root_fd)
    os.close(cwd_fd)
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file")
        sys.stderr.write(kind + ", not a regular file")
        sys.exit(3)
    data = b""
    while len(data) <= cap:
        chunk = os.read(fd, cap + 1 - len(data))
        if not chunk:
            break
        data += chunk
    if len(data) > cap:
        sys.stderr.write("larger than %d MiB" % (cap >> 20))
        sys.exit(4)
    sys.stdout.buffer.write(data)
except OSError as err:
    if err.errno in (errno.ENOENT, errno.ENOTDIR):
        sys.stderr.write(os.strerror(err.errno))
        sys.exit(5 if err.errno == errno.ENOENT else 6)
    if err.errno == errno.ELOOP:
        sys.stderr.write("a symbolic link: not followed")
    else:
        sys.stderr.write(os.strerror(err.errno))
    sys.exit(2)
"""


def job_credentials(pid: int) -> tuple[int, int, list[int]]:
    """(filesystem uid, filesystem gid, supplementary groups) of a process.

    Raises JobFileError when /proc/PID/status cannot be read.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            status = procfs.parse_status(f.read())
    except OSError as err:
        raise JobFileError(f"pid {pid}: cannot read its credentials: {err.strerror}") from err
    if status.fs_uid is None or status.fs_gid is None:
        raise JobFileError(f"pid {pid}: no Uid/Gid in /proc/{pid}/status")
    return status.fs_uid, status.fs_gid, list(status.groups)


def read_job_file(pid: int, path: str, max_bytes: int = MAX_CONFIG_BYTES,
                  timeout_s: float = JOB_FILE_TIMEOUT_S) -> bytes:
    """The bytes of a file process ``pid`` names, read with its credentials.

    ``path`` is as the job sees it: absolute within its root, or relative to its
    working folder. The last component must not be a symbolic link and must be
    a regular file of at most ``max_bytes``. Raises JobFileError whose message
    names the pid and path and why (never any of the file's content).
    """
    uid, gid, groups = job_credentials(pid)
    shown = f"pid {pid}: {path}"
    try:
        root_fd = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise JobFileError(f"{shown}: cannot enter the job's root: {err.strerror}") from err
    try:
        cwd_fd = os.open(f"/proc/{pid}/cwd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        os.close(root_fd)
        raise JobFileError(f"{shown}: cannot enter the job's folder: {err.strerror}") from err
    try:
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _CHILD, path, str(max_bytes), str(root_fd),
             str(cwd_fd), str(uid), str(gid), ",".join(map(str, groups))],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(root_fd, cwd_fd), env={}, cwd="/")
    except OSError as err:
        raise JobFileError(f"{shown}: cannot start the reader: {err.strerror}") from err
    finally:
        os.close(root_fd)
        os.close(cwd_fd)
    try:
        out, err_text = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise JobFileError(f"{shown}: not read within {timeout_s:g} s") from None
    if child.returncode in (5, 6):
        raise JobFileMissing(f"{shown}: no such file", under_a_file=child.returncode == 6)
    if child.returncode != 0:
        reason = err_text.decode("utf-8", "replace").strip()[:200] or f"exit {child.returncode}"
        raise JobFileError(f"{shown}: as uid {uid}: {reason}")
    return out


# Runs in a child as root until it has taken the job's credentials; then, for each
# fd number, opens /proc/PID/fd/N (the kernel's link to the open file itself, so
# no path the job controls is walked) when it is a regular file the job's user may
# read, and passes the fd back over a socket (SCM_RIGHTS). stat() first, so a FIFO
# or device is never opened at all; fstat() after, in case the job swapped its fd
# in between. One line per fd number on stdout when it was not passed.
_OUTPUT_OPENER = r"""
import os, socket, stat, sys
pid, sock_fd, uid, gid = map(int, sys.argv[1:5])
groups = [int(g) for g in sys.argv[5].split(",") if g]
sock = socket.socket(fileno=sock_fd)
os.setgroups(groups)
os.setresgid(gid, gid, gid)
os.setresuid(uid, uid, uid)
for number in sys.argv[6:]:
    path = "/proc/%d/fd/%s" % (pid, number)
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode):
                socket.send_fds(sock, [number.encode()], [fd])
                os.close(fd)
                continue
            os.close(fd)
        print(number, "mode", mode, flush=True)
    except OSError as err:
        print(number, "error", err.strerror, flush=True)
"""


def open_job_outputs(pid: int, fd_numbers: tuple[int, ...] = (1, 2),
                     timeout_s: float = JOB_FILE_TIMEOUT_S) -> dict[int, int | str]:
    """For each of ``fd_numbers`` of process ``pid``: a read-only fd of the regular file it
    has open there (its stdout, stderr), opened with the job's credentials; else why not
    (e.g. "a FIFO, not a regular file", "Permission denied").

    The fds are the caller's to close (close-on-exec, non-blocking). Raises JobFileError
    (naming the pid) when the job's credentials cannot be read or the opener fails.
    """
    uid, gid, groups = job_credentials(pid)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    results: dict[int, int | str] = {}
    try:
        try:
            child = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _OUTPUT_OPENER, str(pid), str(theirs.fileno()),
                 str(uid), str(gid), ",".join(map(str, groups)), *map(str, fd_numbers)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),), env={}, cwd="/")
        except OSError as err:
            raise JobFileError(f"pid {pid}: cannot start the opener of its outputs: "
                               f"{err.strerror}") from err
        finally:
            theirs.close()
        try:
            out, err_text = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err_text = child.communicate()
            err_text = f"not opened within {timeout_s:g} s".encode()
        ours.setblocking(False)
        while True:
            try:
                tag, fds, _, _ = socket.recv_fds(ours, 16, 1, socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                break
            for fd in fds:
                if tag.isdigit() and int(tag) in fd_numbers and int(tag) not in results:
                    results[int(tag)] = fd
                else:
                    os.close(fd)
            if not fds:
                break
    except BaseException:
        for value in results.values():
            if isinstance(value, int):
                os.close(value)
        raise
    finally:
        ours.close()
    for line in out.decode("ascii", "replace").splitlines():
        field, _, rest = line.partition(" ")
        kind, _, value = rest.partition(" ")
        if field.isdigit() and int(field) in fd_numbers and int(field) not in results:
            results[int(field)] = (f"{file_kind(int(value))}{NOT_A_FILE}"
                                 if kind == "mode" and value.isdigit() else value[:200])
    for number in fd_numbers:
        if number not in results:
            reason = err_text.decode("utf-8", "replace").strip().splitlines()
            results[number] = (reason[-1][:200] if reason else f"exit {child.returncode}")
    return results


@dataclass(frozen=True)
class FileTail:
    """The last bytes of a file: ``data`` begins at byte ``offset`` (0: the whole file)."""

    data: bytes
    offset: int


# Runs in a child with the fds passed to it: the last CAP bytes of each, so that a read
# that never returns (a FUSE daemon that stalls, a hard NFS mount whose server is gone)
# is the child's and is killed at the timeout. "FD OFFSET LENGTH\n" then the bytes, or
# "FD -1 0\n" when the read failed.
_TAIL_READER = r"""
import os, sys
cap = int(sys.argv[1])
out = sys.stdout.buffer
for fd in map(int, sys.argv[2:]):
    try:
        start = max(0, os.fstat(fd).st_size - cap)
        data = b""
        while len(data) < cap:
            chunk = os.pread(fd, cap - len(data), start + len(data))
            if not chunk:
                break
            data += chunk
        out.write(b"%d %d %d\n" % (fd, start, len(data)) + data)
    except OSError:
        out.write(b"%d -1 0\n" % fd)
    out.flush()
"""


def read_file_tails(fds: list[int], max_bytes: int = OUTPUT_TAIL_BYTES,
                    timeout_s: float = JOB_FILE_TIMEOUT_S) -> dict[int, FileTail | str]:
    """The last ``max_bytes`` of each regular file open at ``fds``, read by one child
    process within ``timeout_s``; for an fd whose file could not be read, why not."""
    results: dict[int, FileTail | str] = {}
    if not fds:
        return results
    try:
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _TAIL_READER, str(max_bytes), *map(str, fds)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            pass_fds=tuple(fds), env={}, cwd="/")
    except OSError as err:
        return {fd: f"cannot start the reader: {err.strerror}" for fd in fds}
    try:
        out, _ = child.communicate(timeout=timeout_s)
        late = False
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
        late = True
    position = 0
    while position < len(out):
        end = out.find(b"\n", position)
        if end < 0:
            break
        header = out[position:end].split()
        if len(header) != 3:
            break
        fd, offset, length = map(int, header)
        data = out[end + 1:end + 1 + length]
        if len(data) < length:
            break  # cut short by the timeout
        results[fd] = FileTail(data, offset) if offset >= 0 else "cannot read it"
        position = end + 1 + length
    for fd in fds:
        if fd not in results:
            results[fd] = f"not read within {timeout_s:g} s" if late else "cannot read it"
    return results
