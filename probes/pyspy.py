"""Python stacks of training processes, sampled by py-spy from outside.

Measures: every Python thread's stack (``--idle`` keeps waiting threads, such as
a main thread blocked in a data loader) at ``rate_hz`` samples a second
(:class:`PySpySampler`), and one-off snapshots with local variables or native
frames (:func:`dump_stacks`). The session turns these into iterations without
eBPF, a phase breakdown, the job's own iteration number and hang reports
(perfmon.parsers.stack_analysis).

How: ``py-spy record --format chrometrace`` writes its timestamped events only
when it exits, so the sampler runs consecutive windows (``window_s`` each). The
next window is started before the current one is stopped (SIGINT, on which
py-spy writes its file) as soon as it prints that it is sampling, so windows
overlap by about one poll and leave no hole; the overlap is dropped when merging.

Clock: chrometrace ``ts`` is microseconds since an ``Instant::now()`` (Linux:
CLOCK_MONOTONIC) py-spy takes when it creates the recorder, before attaching,
stamped when its main thread receives each sample (src/chrometrace.rs,
src/main.rs). We take that origin as the time just before spawning py-spy plus
PYSPY_STARTUP_NS. Checked against a uprobe on py-spy's ``Chrometrace::increment``,
the origin is within ~1 ms in the median and ~4 ms at worst on a busy host;
when the CPUs are saturated at spawn, py-spy can start up to ~12 ms later
(samples then read early by that much; docs/pyspy.md).

Cost: always ``--nonblocking``, so the target is never stopped: blocking
sampling ptrace-stops every thread each sample, which on PyTorch processes
(~150 threads) slowed training 5-15x at 100 Hz (py-spy issue #872). py-spy
itself uses ~4% of one core per process at 100 Hz, plus ~5 ms of CPU and
20-60 ms of wall time to attach per window. Native stacks cannot be read
without stopping the process, so ``dump_stacks(native=True)`` pauses it once.

Bounded (security issue 36: a job's deep stacks made one window 608 MB and the agent
was OOM-killed): a window's file over WINDOW_MAX_BYTES is not read, and is read event
by event otherwise; a py-spy record grown past PYSPY_MAX_RSS_BYTES is killed; a dump's
output is read up to DUMP_MAX_BYTES; threads, frames and names are capped by the
parser (perfmon.parsers.pyspy), and what was cut is counted (``cuts``). Every py-spy
is started as the OOM killer's first choice (perfmon.probes.pyspy_process).

Needs: py-spy >= 0.4 (``pip install py-spy``), and ptrace access to the target:
root with CAP_SYS_PTRACE (in a container, ``--cap-add SYS_PTRACE``), or the
job's own user with /proc/sys/kernel/yama/ptrace_scope = 0. Python 3.x targets
that py-spy supports (3.3 to 3.13 for 0.4).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

import psutil
from perfmon.parsers.pyspy import (
    WINDOW_MAX_BYTES,
    Cuts,
    PySpyOutputError,
    PySpyOutputTooLarge,
    StackSample,
    ThreadStack,
    parse_chrometrace,
    parse_dump,
)
from perfmon.probes.errors import (
    NoSuchProcess,
    PrerequisiteMissing,
    ProbeError,
)
from perfmon.probes.pyspy_process import (
    find_pyspy,
    pyspy_failure,
    run_pyspy,
    spawn_pyspy,
)
from perfmon.probes.pyspy_windows import Lane, Window
from perfmon.probes.sampler import Sampler, monotonic_ns

DEFAULT_RATE_HZ = 100
DEFAULT_WINDOW_S = 1.0
MIN_DUTY = 0.01  # at least one 1 s window every 100 s
SETTLE_TIMEOUT_S = 2.0  # py-spy writes a 1 s window's file within ~0.1 s of SIGINT
# From spawning py-spy to the Instant::now() that is its chrometrace's ts = 0:
# exec of the static binary, Rust start-up and argument parsing. Measured with
# a uprobe on py-spy 0.4.3's Chrometrace::increment (docs/pyspy.md): median
# 1.0-1.8 ms on an idle or busy 2-core host, up to ~13 ms when saturated.
PYSPY_STARTUP_NS = 1_000_000
# A non-blocking dump races the running target ("Failed to get stack traces"): ~1 in 50
# on a busy host, most of them in a row while the job rewrites deep stacks (a job 950
# frames deep in 65 threads, climbing out and down every 2 s, failed three dumps in a row
# with no pause between). The tries are spread over ~4 s, within the dump's timeout.
_DUMP_RETRY_PAUSES_S = (0.2, 0.5, 1.0, 2.0)
# py-spy record holds a whole window in memory before writing it, ~3.6 times the file
# it then writes: a record process grown past this is killed (its window counted as
# cut), as its file would be over WINDOW_MAX_BYTES. Normal: ~7 MB at 200 Hz; a job of
# 65 threads 950 frames deep (security issue 36): 280 MB for a 77 MB window, 2.8 GB
# for the reported 608 MB.
PYSPY_MAX_RSS_BYTES = 128 << 20
_SAMPLES_LINE = re.compile(rb"Samples: (\d+) Errors: (\d+)")


def dump_stacks(
    pid: int, *, native: bool = False, locals_: bool = False, timeout_s: float = 10,
    executable: str | None = None, cancel: threading.Event | None = None,
    cuts: Cuts | None = None,
) -> list[ThreadStack]:
    """One snapshot of every Python thread of ``pid`` (``py-spy dump --json``).

    Bounded (security issue 36): at most DUMP_MAX_BYTES of py-spy's output are read
    (py-spy is killed past them; the threads whole within them are kept), and the
    parser's caps on threads, frames per stack, names and locals apply; what was
    cut is counted into ``cuts``.

    Non-blocking, except with ``native``: py-spy cannot unwind native frames of
    a running process, so it pauses the target once for the dump (seconds with
    a large libtorch, most of it reading symbols before the pause). ``cancel``:
    when set (from another thread), the dump is killed within 0.1 s (py-spy's
    death detaches it from a paused target, which goes on).
    A dump that fails as one racing the running target does is tried again, up to four
    times over ~4 s within ``timeout_s`` (_DUMP_RETRY_PAUSES_S).
    Raises PrerequisiteMissing, PrivilegeError, NoSuchProcess, UnsuitableTarget
    or ProbeError (including a dump that outlives ``timeout_s`` or is cancelled).
    """
    args = [executable or find_pyspy(), "dump", "--pid", str(pid), "--json"]
    args += ["--native"] if native else ["--nonblocking"]
    args += ["--locals"] if locals_ else []
    deadline = time.monotonic() + timeout_s
    for pause_s in (*_DUMP_RETRY_PAUSES_S, None):
        try:
            done = run_pyspy(args, max(0.1, deadline - time.monotonic()), cancel)
        except subprocess.TimeoutExpired as err:
            what = "was cancelled" if cancel is not None and cancel.is_set() else (
                f"did not finish in {timeout_s} s")
            raise ProbeError(f"pid {pid}: py-spy dump {what}") from err
        except OSError as err:  # missing, not executable, wrong architecture
            raise PrerequisiteMissing(
                f"pid {pid}: cannot run {args[0]} ({err.strerror}): pip install py-spy"
            ) from err
        if done.returncode == 0 or done.cut:
            try:
                return parse_dump(done.stdout, cut=done.cut, cuts=cuts)
            except PySpyOutputError as err:
                error: ProbeError = ProbeError(f"pid {pid}: {err}")
        else:
            error = pyspy_failure(pid, done.stderr, "dump")
        # A race with the running target is worth another try (_DUMP_RETRY_PAUSES_S);
        # a missing process or privilege is not.
        if (type(error) is not ProbeError or pause_s is None
                or time.monotonic() + pause_s >= deadline):
            break
        if (cancel if cancel is not None else threading.Event()).wait(pause_s):
            raise ProbeError(f"pid {pid}: py-spy dump was cancelled")
    raise error


def _exited(pid: int) -> bool:
    """Gone, or a zombie (whose memory py-spy can no longer read)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


class PySpySampler(Sampler[StackSample]):
    """Stack samples of one or more processes from consecutive py-spy record windows.

    ``poll()`` returns the samples of the windows that finished since the last
    call (so data arrives about ``window_s`` late) and starts the next window
    when one is due; call it at least every ``window_s / 4`` for seamless
    windows. Counters, all data rather than failures: ``samples_total`` and
    ``sampling_errors_total`` (py-spy's own counts), ``lost_windows`` (no usable
    output), ``gaps`` (a hole between consecutive windows), ``last_error``, and
    ``cuts``: what was left out to keep memory bounded (security issue 36: windows
    over ``max_window_bytes`` or whose py-spy grew past ``max_pyspy_rss_bytes``
    are not read; threads, frames and names over the parser's caps).
    ``ended_pids``: targets that exited.
    """

    def __init__(
        self, pids: Sequence[int], *, rate_hz: int = DEFAULT_RATE_HZ,
        window_s: float = DEFAULT_WINDOW_S, executable: str | None = None,
    ) -> None:
        super().__init__()
        if rate_hz <= 0 or window_s <= 0:
            raise ValueError("rate_hz and window_s must be positive")
        self.pids = list(pids)
        self.rate_hz = rate_hz
        self.window_ns = int(window_s * 1e9)
        self.executable = executable
        self.samples_total = 0
        self.sampling_errors_total = 0
        self.lost_windows = 0
        self.gaps = 0
        self.sampled_ns = 0  # time the samples delivered so far cover
        self.duty = 1.0
        self.last_error: str | None = None
        self.cuts = Cuts()
        self.max_window_bytes = WINDOW_MAX_BYTES
        self.max_pyspy_rss_bytes = PYSPY_MAX_RSS_BYTES
        self._windows: list[tuple[int, int, bool]] = []  # for take_windows()
        self._settled = False
        self._lanes: list[Lane] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._launched = 0

    @property
    def ended_pids(self) -> list[int]:
        return [lane.pid for lane in self._lanes if lane.ended]

    @property
    def sampling_pids(self) -> list[int]:
        """Targets whose window samples now."""
        return [lane.pid for lane in self._lanes if lane.current is not None]

    def _start(self) -> None:
        self.executable = self.executable or find_pyspy()
        # One dump per target: fails early with the real reason (privilege, not
        # Python, gone), and maps py-spy's thread ids to kernel tids.
        lanes = []
        for pid in self.pids:
            threads = dump_stacks(pid, executable=self.executable)
            lanes.append(Lane(pid, {t.pyspy_thread_id: t.tid for t in threads}))
        self._tmp = tempfile.TemporaryDirectory(prefix="perfmon-pyspy-")
        self._lanes = lanes
        for lane in self._lanes:
            lane.pending = self._launch(lane)

    def _launch(self, lane: Lane) -> Window:
        assert self._tmp is not None and self.executable is not None
        self._launched += 1
        output = os.path.join(self._tmp.name, f"{lane.pid}-{self._launched}.json")
        # --duration only caps a window whose stop never comes (the agent hung or
        # was killed), so an orphaned py-spy ends by itself.
        cap_s = max(2, int(4 * self.window_ns / 1e9) + 1)
        args = [
            self.executable, "record", "--pid", str(lane.pid), "--format", "chrometrace",
            "--output", output, "--rate", str(self.rate_hz), "--duration", str(cap_s),
            "--nonblocking", "--idle", "--full-filenames",
        ]
        t_spawn_ns = monotonic_ns()
        proc = spawn_pyspy(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for pipe in (proc.stdout, proc.stderr):
            assert pipe is not None
            os.set_blocking(pipe.fileno(), False)
        lane.last_launch_ns = t_spawn_ns
        window = Window(proc, output, t_spawn_ns + PYSPY_STARTUP_NS)
        self._windows.append((lane.pid, window.origin_ns, False))
        return window

    def take_windows(self) -> list[tuple[int, int, bool]]:
        """(pid, start, samples_in) since the last call: a window started (its samples
        are from ``start`` on), or its samples (none if it failed) returned by poll()."""
        windows, self._windows = self._windows, []
        return windows

    def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        """The session ends: stop every window now and wait (at most ``timeout_s``) for
        py-spy to write its samples, so that the next ``poll()`` returns them (a burst
        in flight would be lost otherwise); no window starts after this."""
        self._settled = True
        for lane in self._lanes:
            if lane.current is not None:
                lane.current.stop()
                lane.finishing.append(lane.current)
                lane.current = None
            if lane.pending is not None:  # not sampling yet: nothing to keep
                lane.pending.kill()
                lane.pending.discarded = True
                lane.finishing.append(lane.pending)
                lane.pending = None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(
                w.proc.poll() is None for lane in self._lanes for w in lane.finishing):
            time.sleep(0.02)

    def _poll(self) -> list[StackSample]:
        samples: list[StackSample] = []
        now = monotonic_ns()
        for lane in self._lanes:
            self._watch_memory(lane)
            self._advance(lane, now)
            while lane.finishing and lane.finishing[0].proc.poll() is not None:
                samples += self._harvest(lane, lane.finishing.pop(0))
        samples.sort(key=lambda s: (s.t_mono_ns, s.pid, s.tid))
        return samples

    def quiet(self, now: int | None = None) -> bool:
        """No window hands over near ``now``: none is attaching or writing its file,
        none began sampling within a quarter window, none is due within one.

        A handover is when a 2-core host is busiest (py-spy attaching, py-spy
        writing its file): a ``dump --locals`` then races the target (stale
        frames) and py-spy stamps the samples around it late (10-40 ms), so
        the agent's reads of the job's counter wait for a quiet moment.
        """
        now = monotonic_ns() if now is None else now
        margin = self.window_ns // 4
        period = int(self.window_ns / self.duty)
        for lane in self._lanes:
            if lane.ended:
                continue
            if lane.pending is not None or lane.finishing:
                return False
            current = lane.current
            if current is not None and now - (current.sampling_since_ns or now) < margin:
                return False
            if not self._settled and lane.last_launch_ns + period - now < margin:
                return False
        return True

    def set_duty(self, duty: float) -> None:
        """Sample this share of the time (0.01..1): one window every window_s / duty.

        At 1 the windows follow each other seamlessly; below, each window is
        stopped after window_s and the next one starts later (bursts), which
        costs py-spy's CPU in proportion.
        """
        self.duty = min(1.0, max(MIN_DUTY, duty))

    def _watch_memory(self, lane: Lane) -> None:
        """Kill a py-spy record grown past ``max_pyspy_rss_bytes``: it holds its window's
        samples until it writes them, and a job of very deep or very many stacks makes
        them gigabytes (security issue 36). Its window is counted as cut."""
        for window in (lane.current, lane.pending, *lane.finishing):
            if (window is None or window.cut_reason is not None
                    or window.proc.returncode is not None):  # reaped: its pid may be reused
                continue
            rss = window.rss_bytes()
            if rss > self.max_pyspy_rss_bytes:
                window.cut_reason = (f"py-spy record grew to {rss >> 20} MiB, over its cap of "
                                     f"{self.max_pyspy_rss_bytes >> 20} MiB: window not read "
                                     "(very deep or very many stacks)")
                window.proc.kill()  # reaped by the harvest, like any ended window

    def _advance(self, lane: Lane, now: int) -> None:
        """Hand over from the current window to the next one once that one samples."""
        if lane.pending is not None:
            lane.pending.read_pipes()
            if lane.pending.sampling:
                if lane.current is not None:
                    lane.current.stop()
                    lane.finishing.append(lane.current)
                lane.current, lane.pending = lane.pending, None
                lane.current.sampling_since_ns = now
            elif lane.pending.proc.poll() is not None:  # failed while attaching
                lane.finishing.append(lane.pending)
                lane.pending = None
        if lane.current is not None and lane.current.proc.poll() is not None:
            lane.finishing.append(lane.current)  # ended by itself: target exited, or capped
            lane.current = None
        period = int(self.window_ns / self.duty)
        if (self.duty < 1.0 and lane.current is not None
                and now - (lane.current.sampling_since_ns or now) >= self.window_ns):
            # A burst ends window_s after it began to sample (attaching can take seconds
            # on a loaded host); the next one starts a period after the last launch.
            lane.current.stop()
            lane.current.pause_after = True
            lane.finishing.append(lane.current)
            lane.current = None
        due = now - lane.last_launch_ns >= period
        if due and lane.pending is None and not lane.ended and not self._settled:
            lane.pending = self._launch(lane)

    def _harvest(self, lane: Lane, window: Window) -> list[StackSample]:
        samples = [] if window.discarded else self._read_window(lane, window)
        self._windows.append((lane.pid, window.origin_ns, True))
        return samples

    def _read_window(self, lane: Lane, window: Window) -> list[StackSample]:
        window.read_pipes()
        window.kill()  # already exited: just reaps and closes the pipes
        counts = _SAMPLES_LINE.search(window.stdout)
        if counts:
            self.samples_total += int(counts.group(1))
            self.sampling_errors_total += int(counts.group(2))
        try:
            f = open(window.output, "rb")  # closed below, after the size check
        except FileNotFoundError:
            if window.cut_reason is not None:
                return self._cut(lane, window.cut_reason)
            error = pyspy_failure(lane.pid, window.stderr, "record")
            if isinstance(error, NoSuchProcess) or _exited(lane.pid):
                lane.ended = True  # the target exited: the end, not a failure
            else:
                self.lost_windows += 1
                self.last_error = str(error)
            return []
        with f:
            os.unlink(window.output)
            size = os.fstat(f.fileno()).st_size
            if window.cut_reason is not None:
                return self._cut(lane, window.cut_reason)
            if size > self.max_window_bytes:
                return self._cut(lane, f"a py-spy window of {size} bytes, over the cap of "
                                       f"{self.max_window_bytes}: not read (very deep or very "
                                       "many stacks)")
            try:
                samples = parse_chrometrace(
                    f, origin_mono_ns=window.origin_ns, kernel_tids=lane.kernel_tids,
                    max_bytes=self.max_window_bytes, cuts=self.cuts,
                )
            except PySpyOutputTooLarge as err:  # grew after the check: not py-spy's way
                return self._cut(lane, str(err))
            except PySpyOutputError as err:
                self.lost_windows += 1
                self.last_error = f"pid {lane.pid}: {err}"
                return []
        return self._join(lane, samples, window.stop_ns, window.pause_after)

    def _cut(self, lane: Lane, reason: str) -> list[StackSample]:
        self.cuts.windows += 1
        self.last_error = f"pid {lane.pid}: {reason}"
        return []

    def _join(self, lane: Lane, samples: list[StackSample], stop_ns: int | None,
              pause_after: bool = False) -> list[StackSample]:
        """This window's samples from where the previous one stopped to where it was stopped.

        The next window already samples when we stop this one, and this one's
        last stack is only known up to its last sample, so the newer window
        takes over from the moment of the stop, except where its stack reaching
        over the stop was first seen before the previous window's last one: there
        the previous window's stack goes on until the newer window's next. (A
        stack stands until py-spy sees a change, and a new window's first samples
        can be 100 ms and more apart, py-spy reading a process it has just
        attached to on a busy host: such a stack was a phase the thread had left,
        backward inside an optimizer step, and an iteration was counted twice.)
        """
        if not samples:
            return []
        start = lane.covered_until_ns
        end = max(s.t_mono_ns + s.duration_ns for s in samples)
        if stop_ns is not None:
            end = min(end, stop_ns)
        # Each window's origin is estimated on its own (a few ms of error), so
        # only a hole longer than two sampling periods counts as a gap.
        if start is not None and samples[0].t_mono_ns > start + 2 * 10**9 // self.rate_hz:
            self.gaps += 1
        start = start if start is not None else samples[0].t_mono_ns
        lane.covered_until_ns = max(lane.covered_until_ns or 0, end)
        self.sampled_ns += max(0, end - start)
        kept = []
        for s in samples:
            t0, t1 = max(s.t_mono_ns, start), min(s.t_mono_ns + s.duration_ns, end)
            if t1 <= t0:
                continue
            seen = s
            if s.t_mono_ns < t0:  # reaches over the stop: the later-seen stack wins
                older = lane.last_seen.get(s.tid)
                if older is not None and older.t_mono_ns > s.t_mono_ns:
                    seen = older
            lane.last_seen[s.tid] = seen
            kept.append(seen if (t0, t1 - t0) == (seen.t_mono_ns, seen.duration_ns)
                        else replace(seen, t_mono_ns=t0, duration_ns=t1 - t0))
        if pause_after:
            lane.covered_until_ns = None  # a pause between bursts is no gap
            lane.last_seen = {}
        return kept

    def _close(self) -> None:
        for lane in self._lanes:
            windows: Iterable[Window | None] = (lane.current, lane.pending, *lane.finishing)
            for window in windows:
                if window is not None:
                    window.kill()
            lane.current, lane.pending, lane.finishing = None, None, []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
