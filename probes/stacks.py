"""py-spy in a monitoring session: phase spans, iterations without eBPF, the job's
own iteration number, and stack dumps for hang reports, all as log records.

The sampling itself never blocks (PySpySampler's record windows); the blocking
``py-spy dump --locals`` reads of the job's counter run in a worker thread
(perfmon.probes.background) and come back as records on a later poll.
"""

from __future__ import annotations

import threading
from typing import Any

from perfmon.parsers.errors import PerfmonError
from perfmon.parsers.events import JobIteration, Marker, Phase, Record, StackWindow
from perfmon.parsers.pyspy import Cuts, ThreadStack
from perfmon.parsers.sampled_iterations import CounterRead, SampledIterationClock
from perfmon.parsers.stack_analysis import (
    DEFAULT_ITERATION_LOCALS,
    classify_phase,
    iteration_local,
    main_thread,
)
from perfmon.probes.background import BackgroundCalls
from perfmon.probes.procfs import TargetProcess
from perfmon.probes.pyspy import DEFAULT_RATE_HZ, PySpySampler, dump_stacks
from perfmon.probes.sampler import Source, monotonic_ns

# Reads of the job's own counter: a few at the start (a read racing the
# increment is off by one; reads late in a step and the most frequent offset
# win), then one a minute to notice a resumed or restarted loop. Until a read finds
# it, the spacing doubles after those few (read_spacing_ns): a job seen from its
# process start may take a minute to import, load and build before its loop holds a
# counter (17 s under load, where the few quick reads all came before it). When the
# counter counts iterations (py-spy mode) it is read every COUNTING_SPACING_NS
# (a read costs py-spy ~10 ms of CPU), as long as the job turns out to have one.
JOB_ITERATION_READS = 5
JOB_ITERATION_SPACING_NS = 700_000_000
JOB_ITERATION_REFRESH_NS = 60_000_000_000
COUNTING_SPACING_NS = 2_000_000_000
# A due read waits for a moment when no py-spy window hands over (PySpySampler.quiet:
# a dump then can show stale frames, and the samples around it are stamped late),
# but no longer than this, so a host too loaded to be quiet is still read.
READ_HOLD_MAX_NS = 2_000_000_000
# Without the job's counter every end comes from the samples, and py-spy's sampling
# times are Poisson: a forward of 60-80 ms goes unsampled (two backward runs merge)
# in 0.65% of iterations at 100 Hz and in none of 1813 at 200 Hz (e^-x (1 + x) at x
# sampling periods: parsers/sampled_iterations.py). py-spy's CPU nearly doubles with it
# (docs/pyspy.md, "Overhead"), for as long as no counter is found.
COUNTING_RATE_HZ = 200


def read_spacing_ns(reads: int, found: bool) -> int:
    """The time to the next read of the job's counter after ``reads`` of them (``found``:
    one found it): JOB_ITERATION_READS quick ones, then once a minute when found; not
    found, twice the last spacing each time up to a minute (a loop that starts late is
    still read within about as long as it took to start)."""
    if reads < JOB_ITERATION_READS:
        return JOB_ITERATION_SPACING_NS
    if found:
        return JOB_ITERATION_REFRESH_NS
    doublings = min(reads - JOB_ITERATION_READS + 1, 16)
    return min(JOB_ITERATION_REFRESH_NS, JOB_ITERATION_SPACING_NS << doublings)


class StackSource(Source):
    """Samples the primary rank's stacks; ``poll()`` returns log records.

    - ``phase``: spans of the training (main) thread, one record per run of
      samples in the same phase, split at each poll so the aggregator knows
      how far the samples reach;
    - ``marker`` (``optimizer_step``, named ``pyspy:<estimator>``) when
      ``detect_iterations``: iteration ends found in the samples and checked
      against the job's counter (perfmon.parsers.sampled_iterations);
    - ``job_iteration``: the job's own counter read from a local variable.
    """

    name = "pyspy"

    def __init__(self, primary: TargetProcess, *, detect_iterations: bool,
                 iteration_function: str | None = None,
                 iteration_variable: str | None = None, rate_hz: int | None = None) -> None:
        """``rate_hz``: py-spy's samples a second; None: COUNTING_RATE_HZ while iterations
        are found from samples alone (from the start until the job's counter is found),
        else DEFAULT_RATE_HZ."""
        super().__init__()
        self.primary = primary
        self._auto_rate = rate_hz is None
        rate = rate_hz or (COUNTING_RATE_HZ if detect_iterations else DEFAULT_RATE_HZ)
        self.sampler = PySpySampler([primary.pid], rate_hz=rate)
        self.clock = (SampledIterationClock(iteration_function, period_ns=10**9 // rate)
                      if detect_iterations else None)
        self.names = (iteration_variable,) if iteration_variable else DEFAULT_ITERATION_LOCALS
        self._span: list[Any] | None = None  # [phase, start, end]
        self._reads = 0
        self._reads_failed = 0
        self._counter_found = False
        self._next_read_ns = 0
        self._final = False
        self._calls = BackgroundCalls("perfmon-pyspy-dump")
        self._dump_cuts = Cuts()  # counted by the worker thread's dumps (the sampler's: by poll)

    def _start(self) -> None:
        self.sampler.start()
        self._next_read_ns = monotonic_ns()  # the first read too waits for a quiet moment

    def set_duty(self, duty: float) -> None:
        """Sample this share of the time (bursts; 1 = continuously). Iterations from
        samples need continuous sampling, so a source that finds them stays at 1."""
        if self.clock is None:
            self.sampler.set_duty(duty)

    @property
    def duty(self) -> float:
        return self.sampler.duty

    def settle(self) -> None:
        """The session ends: the next poll brings the samples of the window in flight
        (waited for, briefly) and settles every iteration end still held."""
        self._final = True
        self.sampler.settle()

    def _poll(self) -> list[Record]:
        samples = self.sampler.poll()
        main = [s for s in samples if s.tid == self.primary.pid]
        records: list[Record] = self._phase_records(main)
        for _tag, read, error in self._calls.done():
            records += self._counter_read(read, error)
        now = monotonic_ns()
        # (a window's samples_in record is timed now: it sorts after its phase spans)
        records += [StackWindow(now if samples_in else start, pid, start, samples_in)
                    for pid, start, samples_in in self.sampler.take_windows()]
        held_ns = now - self._next_read_ns
        if (held_ns >= 0 and not self._final and not self._calls.busy()
                and (self.sampler.quiet(now) or held_ns >= READ_HOLD_MAX_NS)):
            self._reads += 1
            self._calls.submit("locals", self._read_locals)
            counting = self.clock is not None and (self._counter_found
                                                   or self._reads < JOB_ITERATION_READS)
            if self.clock is not None and not counting:
                self.clock.expect_counter = False  # no counter: ends from the samples alone
            self._next_read_ns = now + (COUNTING_SPACING_NS if counting else read_spacing_ns(
                self._reads, self._counter_found))
        if self.clock is not None:
            self.clock.feed(main)
            records += [Marker(t, self.primary.pid, self.primary.pid, "optimizer_step",
                               f"pyspy:{how}") for t, how in self.clock.take(self._final)]
        return records

    def quality(self) -> dict[str, Any]:
        """The sampler's counters, and what was cut of py-spy's output to keep the agent's
        memory bounded (``windows_cut``, ``stacks_cut``, ...: perfmon.parsers.pyspy.Cuts)."""
        s = self.sampler
        return {"samples": s.samples_total, "sampling_errors": s.sampling_errors_total,
                "lost_windows": s.lost_windows, "gaps": s.gaps, "counter_reads": self._reads,
                "reads_failed": self._reads_failed, "sampled_s": round(s.sampled_ns / 1e9, 1),
                "duty_pct": round(100 * s.duty, 1), "rate_hz": s.rate_hz,
                **(s.cuts + self._dump_cuts).counters()}

    def _phase_records(self, samples: Any) -> list[Record]:
        records: list[Record] = []
        for s in samples:  # in time order
            phase, end = classify_phase(s.frames), s.t_mono_ns + s.duration_ns
            if self._span is not None and self._span[0] == phase:
                self._span[2] = max(self._span[2], end)
                continue
            if self._span is not None:
                records.append(self._span_record())
            self._span = [phase, s.t_mono_ns, end]
        if self._span is not None:
            records.append(self._span_record())
            self._span = [self._span[0], self._span[2], self._span[2]]
        return [r for r in records if isinstance(r, Phase) and r.end_mono_ns > r.t_mono_ns]

    def _span_record(self) -> Phase:
        assert self._span is not None
        phase, start, end = self._span
        return Phase(start, end, self.primary.pid, phase)

    def _read_locals(self) -> tuple[int, int, list[ThreadStack]]:
        """(start, end, threads) of one ``dump --locals``; runs in the worker thread."""
        before = monotonic_ns()
        threads = dump_stacks(self.primary.pid, locals_=True, cancel=self._calls.cancel,
                              cuts=self._dump_cuts)
        return before, monotonic_ns(), threads

    def _counter_read(self, read: tuple[int, int, list[ThreadStack]] | None,
                      error: BaseException | None) -> list[Record]:
        if error is not None or read is None:
            # A failed read is no reason to stop; the count from attach stands.
            self._reads_failed += 1
            return []
        before, end, threads = read
        found = iteration_local(threads, self.names)
        if found is None:
            return []
        name, value = found
        if not self._counter_found and self._auto_rate:
            self._set_rate(DEFAULT_RATE_HZ)  # its reads settle the count: no need for more
        self._counter_found = True
        if self.clock is not None:
            thread = main_thread(threads)
            phase = classify_phase(thread.frames) if thread is not None else "other"
            self.clock.read(CounterRead(before, end, value, phase))
        return [JobIteration(before, end, self.primary.pid, value, name)]

    def _set_rate(self, rate_hz: int) -> None:
        """From the next py-spy window on."""
        self.sampler.rate_hz = rate_hz
        if self.clock is not None:
            self.clock.period_ns = 10**9 // rate_hz

    def _close(self) -> None:
        self._calls.close()
        self.sampler.close()


def dump_ranks(targets: list[TargetProcess], cancel: threading.Event | None = None
               ) -> dict[int, list[ThreadStack]]:
    """Every rank's Python stacks, with native frames where py-spy can get them.

    A native dump pauses the rank once (py-spy cannot unwind a running
    process); when it fails, the Python-only dump is taken instead. Blocking
    (seconds): run it in a worker (perfmon.probes.background); ``cancel`` stops it.
    """
    stacks: dict[int, list[ThreadStack]] = {}
    for target in targets:
        try:
            stacks[target.pid] = dump_stacks(target.pid, native=True, timeout_s=30,
                                             cancel=cancel)
        except PerfmonError:
            try:
                stacks[target.pid] = dump_stacks(target.pid, cancel=cancel)
            except PerfmonError:
                stacks[target.pid] = []
    return stacks


def main_python_stacks(stacks: dict[int, list[ThreadStack]]) -> list[tuple[Any, ...]]:
    """The Python frames of each rank's main thread (native ones dropped: a stuck job's
    innermost native frame is a wait like clock_nanosleep, which says little)."""
    mains = [main_thread(threads) for threads in stacks.values()]
    return [tuple(f for f in m.frames if f.module is None) for m in mains if m is not None]

