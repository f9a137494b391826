"""Iteration ends of a training loop from stack samples alone, without missing steps (pure).

Sampling at 100 Hz sees a phase of a few milliseconds (a small optimizer's
step) only now and then, so counting entries into Optimizer.step loses
iterations. What every iteration is sure to show, in order of preference:

1. ``counter``: the job's own iteration counter, read from its frame locals
   (``py-spy dump --locals``). The count between two reads is the counter's
   difference, exactly. Only reads taken with the training thread in the same
   phase as the boundary's anchor (inside backward: the read's snapshot and the
   samples' run over the whole read both say so) are used: a read there always
   sees the counter at the same point of the loop relative to the boundaries,
   wherever the loop increments it, so the comparison is exact.
   Between two such reads, ends the samples missed are added (in the longest
   gaps, as many as they have room for) and extra ones removed (the shortest), so
   the count matches.
2. ``phase_transitions``: the end of each run of backward samples (backward is
   long: tens of milliseconds and more at steps of >= 100 ms), one per
   micro-batch; with gradient accumulation, every M-th is an iteration end, M
   from the counter or from the spacing of the optimizer steps that were seen.
   When the samples missed a backward run, the forward runs still show its
   iteration (M forward runs each): its end is restored at the start of its
   successor's first forward. A run too long for one micro-batch, or broken by a
   forward seen only briefly, holds more than one (see _split_long_run and
   _end_backward_run: each only where the sampler's own gaps can explain it, not
   a slow iteration's). A pause (a checkpoint) shows no forward runs and adds no
   iterations.
3. ``optimizer_frame``: entries into torch.optim Optimizer.step (or the
   ``--iteration-function`` pattern: ``function``), when the loop shows no
   backward at all.

The time of an end is the first sample after the backward run (or the first
inside the optimizer step), so it trails the true instant by about one sampling
period; the mean over many steps telescopes (see IterationDetector).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from perfmon.parsers.pyspy import StackSample
from perfmon.parsers.stack_analysis import IterationDetector, classify_phase

# A new phase must last this long to begin a run (see SampledIterationClock.feed).
CONFIRM_NS = 10_000_000
MEDIAN_OF = 51  # recent backward runs whose median lengths judge a long one
MIN_RUNS = 4  # ... and at least this many (a merged run is lost in the first seconds too)
# The longest stretch the samples can miss in full, in sampling periods. py-spy's
# sampling times are Poisson (src/timer.rs), so a stretch of x periods holds fewer than
# two samples (too few to confirm a run) with probability e^-x (1 + x): 0.3% at 8
# periods, 80 ms at 100 Hz (counted without a counter, two backward runs merged in 0.65%
# of ~150 ms iterations whose forward took 60-80 ms; at 200 Hz in none of 1813). A
# backward run longer than this is never missed whole, and runs farther apart than
# this never merge: there a long run is a slow iteration. (On a busy 2-core host at
# 100 Hz py-spy saw 50 ms forwards for only 2-7 ms now and then, and once stalled for
# 128 ms; steps of 140 and 300 ms slowed 1.5-2x now and then, with 44 and 118 ms
# between backward runs. Below ~55 ms merged runs went unsplit; above ~90, slow
# iterations were split.)
MAX_UNSEEN_PERIODS = 8
PERIOD_NS = 10_000_000  # py-spy's default sampling period (100 Hz)
# Without a usable counter read for this long, held ends are passed on anyway.
MAX_HOLD_NS = 15_000_000_000
# Runs remembered to judge counter reads by: reads are settled within seconds of being
# taken, and runs come ~10 a second (three phases of ~100 ms steps).
PAST_RUNS = 1024


@dataclass(frozen=True)
class CounterRead:
    """One read of the job's counter: when (the dump's start and end), its value, and
    the phase (stack_analysis.PHASES) the training thread was in at that moment."""

    t_mono_ns: int
    end_mono_ns: int
    value: int
    phase: str


@dataclass
class _Candidate:
    t_mono_ns: int
    run_ns: int = 0  # how long the backward run before it lasted (first to last sample)
    optimizer_after: bool = False  # an optimizer sample followed before the next backward


class SampledIterationClock:
    """Feed main-thread samples (``feed``) and counter reads (``read``); ``take``
    returns the iteration ends that are settled, as (t_mono_ns, estimator).

    ``expect_counter``: hold ends until a counter read settles them (the caller
    reads the counter); set it to False once the job turns out to have none.
    """

    def __init__(self, function_regex: str | None = None, *,
                 expect_counter: bool = True, period_ns: int = PERIOD_NS) -> None:
        # Between samples (the slack of the pace and edge rules); the caller updates it
        # when the sampler's rate changes.
        self.period_ns = period_ns
        self._function = IterationDetector(function_regex) if function_regex else None
        self._optimizer = IterationDetector()  # entries into Optimizer.step
        self.expect_counter = expect_counter
        self.watermark_ns = 0  # samples cover the thread up to here
        self.microbatches: int | None = None  # M: backward runs per iteration, once known
        self._backward_seen = False
        self._run_phase: str | None = None  # the phase of the current run
        self._run_since = 0  # its first sample
        self._next_phase: str | None = None  # another phase seen once, since...
        self._next_since = 0  # ... this sample
        self._outside_since: int | None = None  # first sample outside the current run
        self._excursion: str | None = None  # a phase of a transition seen since (see blips)
        self._blips: list[tuple[int, int, bool]] = []  # (outside since, back at, optimizer)
        self._optimizer_since_backward = False  # an optimizer sample since backward began
        self._past_runs: deque[tuple[str, int, int]] = deque(maxlen=PAST_RUNS)  # (phase,
        # first sample, first sample outside) of recent runs, to judge counter reads by
        self._runs: deque[int] = deque(maxlen=MEDIAN_OF)  # recent backward run lengths
        self._outsides: deque[int] = deque(maxlen=MEDIAN_OF)  # ... and the time before each
        self._after_backward = False  # a backward run ended; the next has not begun
        self._forward_starts: deque[int] = deque(maxlen=4096)
        self._candidates: list[_Candidate] = []  # backward ends not yet checked
        self._checked: list[_Candidate] = []  # checked, not yet grouped
        self._last_checked_ns: int | None = None  # the latest checked (grouped or not)
        self._optimizer_ends: list[int] = []  # optimizer-frame (or function) entries
        self._in_group = 0  # backward runs of the current iteration so far
        self._held: list[tuple[int, str]] = []  # ends not yet passed on
        self._last_emitted: int | None = None
        self._last_end: int | None = None
        self._reads: list[CounterRead] = []  # waiting for samples to cover them
        self._anchor: CounterRead | None = None  # the last clean read
        self._ends_total = 0  # ends produced (held + emitted), for counting against reads
        self._ready: list[tuple[int, str]] = []  # settled, for the next take()

    @property
    def unseen_ns(self) -> int:
        """The longest stretch the samples can miss in full at this rate."""
        return MAX_UNSEEN_PERIODS * self.period_ns

    @property
    def estimator(self) -> str:
        """How ends not checked against the counter are found."""
        if self._function is not None:
            return "function"
        return "phase_transitions" if self._backward_seen else "optimizer_frame"

    def feed(self, samples: Iterable[StackSample]) -> None:
        """Samples of the training thread, in time order.

        Phases are followed as runs. A change of phase counts once the new phase
        has lasted CONFIRM_NS: around a transition the samples can flicker for a
        few milliseconds (two py-spy windows' clocks disagreeing where they are
        joined, or a read racing the running interpreter), and a flicker must not
        end a run. (A sample is py-spy's stack until it changed, so one sample can
        stand for a whole 100 ms backward.) The end of a backward run (its first
        sample outside) is a candidate end; the start of a forward run is evidence
        of an iteration, used to restore ends the samples missed.
        """
        batch = list(samples)
        detector = self._function or self._optimizer
        self._optimizer_ends += [b.t_mono_ns for b in detector.feed(batch)]
        for s in batch:
            phase = classify_phase(s.frames)
            if phase == "optimizer":
                self._optimizer_since_backward = True
            if phase == self._run_phase:
                if phase == "backward" and self._outside_since is not None and self._excursion:
                    self._blips.append((self._outside_since, s.t_mono_ns,
                                        self._excursion == "optimizer"))
                self._outside_since = self._next_phase = None
                self._excursion = None
            else:
                if self._outside_since is None:
                    self._outside_since = s.t_mono_ns
                if phase in ("forward", "data_loading", "optimizer") and (
                        self._excursion != "optimizer"):
                    self._excursion = phase
                if phase != self._next_phase:
                    self._next_phase, self._next_since = phase, s.t_mono_ns
                if s.t_mono_ns + s.duration_ns - self._next_since >= CONFIRM_NS:
                    self._change_run(phase)
            if phase == "optimizer" and self._candidates and self._after_backward:
                self._candidates[-1].optimizer_after = True
            self.watermark_ns = max(self.watermark_ns, s.t_mono_ns + s.duration_ns)

    def _change_run(self, phase: str) -> None:
        assert self._outside_since is not None and self._next_since is not None
        if self._run_phase is not None:
            self._past_runs.append((self._run_phase, self._run_since, self._outside_since))
        if self._run_phase == "backward":
            self._end_backward_run(self._outside_since)
            self._after_backward = True
            # (an optimizer sample that came before the run changed marks it too)
            self._candidates[-1].optimizer_after = self._optimizer_since_backward
        if phase == "backward":
            self._backward_seen = True
            self._after_backward = self._optimizer_since_backward = False
        if phase == "forward":
            self._forward_starts.append(self._next_since)
            self._after_backward = False
        self._run_phase, self._run_since = phase, self._next_since
        self._outside_since = self._next_phase = self._excursion = None

    def _end_backward_run(self, end: int) -> None:
        """A candidate end for the backward run ending at ``end``; and one at each blip
        between two stretches of it that are each at least half the usual run.

        A blip is forward, data loading or optimizer seen too briefly to confirm
        (CONFIRM_NS) between samples of backward: on a busy host py-spy reports the
        backward stack late, past the true end, and then catches the forward's last
        few milliseconds only (a 50 ms forward seen for 2 to 7 ms, merging two runs).
        A flicker at a run's start or end leaves a stretch far shorter than a run.
        """
        start = self._run_since
        if len(self._runs) >= MIN_RUNS:
            half = statistics.median(self._runs) / 2
            for blip, resumed, optimizer in self._blips:
                if blip - start >= half and end - resumed >= half:
                    self._candidates.append(_Candidate(blip, blip - start, optimizer))
                    self._forward_starts.append(blip)
                    start = resumed
        self._blips = []
        self._candidates.append(_Candidate(end, end - start))

    def read(self, read: CounterRead) -> None:
        self._reads.append(read)

    def take(self, final: bool = False) -> list[tuple[int, str]]:
        """Iteration ends settled since the last call, in time order."""
        self._group(final)
        # A read is compared once the samples reach past it and every end before it is
        # settled (a backward end is a candidate until the next run ends: a read in a
        # run the samples at hand do not end would count one short, and the repair
        # would double an end). At the end, reads the samples never reached are
        # dropped: the iterations just before them are not in the samples, and adding
        # them among the ends that are would double some.
        slack = 0 if final else CONFIRM_NS
        while self._reads and self._reads[0].end_mono_ns + slack <= self.watermark_ns and (
                not self._candidates
                or self._candidates[0].t_mono_ns > self._reads[0].t_mono_ns):
            self._settle(self._reads.pop(0))
        if final:
            self._reads = []
        if final or not self.expect_counter:
            self._emit_until(None)
        elif self._held and self._held[-1][0] - self._held[0][0] > MAX_HOLD_NS:
            self._emit_until(self._held[-1][0] - MAX_HOLD_NS)
        ready, self._ready = self._ready, []
        return ready

    # -- from candidates to ends -----------------------------------------------------

    def _group(self, final: bool) -> None:
        """Turn backward ends (or optimizer entries) into iteration ends."""
        if self._function is not None or not self._backward_seen:
            ends, self._optimizer_ends = self._optimizer_ends, []
            for t in ends:
                self._push(t)
            return
        self._optimizer_ends = []
        self._check_candidates(final)
        if self.microbatches is None:
            self.microbatches = self._microbatches_from_optimizer(final)
            if self.microbatches is None:
                return  # wait: with M unknown, grouping would be wrong
        m = self.microbatches
        while self._checked:
            candidate = self._checked.pop(0)
            self._in_group += 1
            # An optimizer step seen right after a backward run ends an iteration
            # whatever the count says: it realigns the grouping after a lost run.
            if self._in_group >= m or (m > 1 and candidate.optimizer_after):
                self._push(candidate.t_mono_ns)
                self._in_group = 0

    def _check_candidates(self, final: bool) -> None:
        """Move candidates to ``_checked``, with the ends of backward runs the samples missed.

        Between two micro-batches' backward ends lies one forward run; more than
        one means the samples missed whole backward runs, whose ends are restored
        at the starts of the forward runs after the first, where backward runs are
        short enough to be missed (no longer than unseen_ns: elsewhere a second
        forward start is the samples' flicker, as around a data loader's
        fetch). (Fewer proves nothing: a 50 ms forward goes unsampled now and then.)
        And a backward run lasting about as long as k micro-batches (k >= 2, rounded
        from its length against the usual run and time between runs) is k runs whose
        forward, optimizer and data loading in between went unsampled.
        """
        while len(self._candidates) >= (1 if final else 2):
            first = self._candidates.pop(0)
            after = (self._candidates[0].t_mono_ns - self._candidates[0].run_ns
                     - first.t_mono_ns if self._candidates else None)
            self._checked += self._split_long_run(first, after)
            if self._candidates and not (
                    self._runs and statistics.median(self._runs) > self.unseen_ns):
                nxt = self._candidates[0].t_mono_ns
                starts = [f for f in self._forward_starts if first.t_mono_ns <= f < nxt]
                self._checked += [_Candidate(f) for f in starts[1:]]
            self._last_checked_ns = self._checked[-1].t_mono_ns

    def _split_long_run(self, candidate: _Candidate, after: int | None) -> list[_Candidate]:
        """``after``: the time outside backward from this run to the next (None: not yet
        known)."""
        start = candidate.t_mono_ns - candidate.run_ns
        # Outside backward since the last end: forward, and optimizer and data loading.
        # (Not _checked[-1]: grouping empties it, and a run judged with nothing before
        # it is never split.)
        before = start - self._last_checked_ns if self._last_checked_ns is not None else None
        if before is not None and len(self._runs) >= MIN_RUNS and self._outsides:
            run, outside = statistics.median(self._runs), statistics.median(self._outsides)
            # A run holding k micro-batches lasts about k x run + (k - 1) x outside (the
            # phases between them went unsampled): k is rounded from the length. (A
            # fixed "twice the usual" missed merged runs of 166 ms against a usual 85 at
            # 120 ms cycles.) But only the sampler's own gaps merge runs, so:
            # - an iteration that is only slow (a busy host, a longer batch) is slow
            #   outside backward too: the run is judged at the pace of the time before
            #   it (each edge of which is known to a sampling period). On a busy 2-core
            #   host 140 ms steps took 250 now and then, forward and backward alike:
            #   runs of 136-171 ms against a usual 74, 68-73 ms before them against 43;
            # - not where the time between runs is longer than the sampler can miss:
            #   there a long run is a slow iteration (300 ms steps took 600, backward
            #   400 ms against a usual 205, 127 ms before it against 118);
            # - nor where the time outside backward after the run is short: a gap at
            #   the run's end hid part of it (a gap that merges runs hides the time
            #   between them, not that after them). py-spy stalled for 128 ms just after
            #   a window took over: a run of 193 ms against a usual 106, then 10 ms
            #   outside against a usual 48.
            pace = max(1.0, (before - self.period_ns) / outside) if outside > 0 else math.inf
            k = round((candidate.run_ns / pace + outside) / (run + outside))
            if k >= 2 and outside <= self.unseen_ns and (
                    after is None or after >= outside / 2 - self.period_ns):
                pieces = [_Candidate(start + (candidate.run_ns * j) // k) for j in range(1, k)]
                return [*pieces, candidate]  # (not a usual run: left out of the medians)
        if before is not None:
            self._outsides.append(before)
        self._runs.append(candidate.run_ns)
        return [candidate]

    def _microbatches_from_optimizer(self, final: bool) -> int | None:
        """M from the spacing (in backward runs) of the optimizer steps the samples saw.

        None while undecided: until a few optimizer steps were seen, or the counter
        is expected to say; 1 when nothing else can be known.
        """
        marked = [i for i, c in enumerate(self._checked) if c.optimizer_after]
        # M: a spacing that most spacings equal and (nearly) all are multiples of.
        # Under M = 1 with the optimizer seen only now and then, spacings are any
        # numbers, seldom one value half the time; a lost backward run spoils one
        # spacing, not that many. (With an optimizer step too short to be seen in
        # most iterations, M stays 1 unless the job's counter says otherwise.)
        spacings = [b - a for a, b in itertools.pairwise(marked)]
        for needed, share in ((8, 0.8), (16, 0.7)):
            if len(spacings) >= needed:
                m = max((k for k in range(2, max(spacings) + 1)
                         if sum(1 for g in spacings if g % k == 0) >= share * len(spacings)
                         and spacings.count(k) >= len(spacings) / 2),
                        default=1)
                if m > 1:
                    # Align: the backward run before a seen optimizer step ends an iteration.
                    del self._checked[:(marked[0] + 1) % m]
                    return m
        if len(spacings) >= 16 or final or (
                not self.expect_counter and len(marked) < 9 and len(self._checked) >= 64) or (
                self._checked and self._checked[-1].t_mono_ns
                - self._checked[0].t_mono_ns > MAX_HOLD_NS):
            return 1
        return None

    def _push(self, t: int) -> None:
        self._last_end = t
        self._held.append((t, ""))
        self._ends_total += 1

    # -- the counter ------------------------------------------------------------------

    def _count_until(self, t: int) -> int:
        """Ends produced up to ``t``."""
        later = sum(1 for end, _ in self._held if end > t)
        return self._ends_total - later

    def _settle(self, read: CounterRead) -> None:
        """Compare the ends since the last clean read with the counter; repair the held ones."""
        anchor_phase = "backward" if self._backward_seen else "forward"
        if read.phase != anchor_phase or self._sampled_phase(read) != anchor_phase:
            return  # the counter may sit on either side of its increment: not comparable
        before, self._anchor = self._anchor, read
        if before is None:
            self._emit_until(read.t_mono_ns)
            return
        increments = read.value - before.value
        if increments < 0:  # the loop restarted: start over from this read
            return
        lo, hi = before.t_mono_ns, read.t_mono_ns
        if self.microbatches is None and self._function is None and self._backward_seen:
            if increments == 0:
                self._anchor = before  # no step between them: wait for a later read
                return
            runs = sum(1 for c in (*self._checked, *self._candidates) if lo < c.t_mono_ns <= hi)
            self.microbatches = max(1, round(runs / increments))
            self._group(final=False)
        counted = self._count_until(hi) - self._count_until(lo)
        self._repair(lo, hi, increments - counted)
        self._held = [(t, "counter" if lo < t <= hi else how) for t, how in self._held]
        self._emit_until(hi)

    def _sampled_phase(self, read: CounterRead) -> str | None:
        """The phase of the run the samples show over the whole read (its dump's start
        to its end); None when no one run spans it.

        A read's own snapshot is one non-blocking dump, which races the running
        interpreter and can mix in a stale frame (in CI, dumps inside a 150-250 ms
        AdamW step said backward, and the repairs they drove doubled five ends in 54);
        the samples' runs are confirmed over CONFIRM_NS and do not flicker.
        """
        t0, t1 = read.t_mono_ns, read.end_mono_ns
        if self._run_phase is not None and self._run_since <= t0 and t1 < (
                self._outside_since if self._outside_since is not None else self.watermark_ns):
            return self._run_phase
        for phase, start, end in reversed(self._past_runs):
            if start <= t0 and t1 < end:
                return phase
            if end <= t0:
                break  # (runs are in time order: none earlier spans it)
        return None

    def _repair(self, lo: int, hi: int, missing: int) -> None:
        """Add ``missing`` ends (or remove ``-missing``) among the held ends in (lo, hi]."""
        if missing == 0:
            return
        span = [i for i, (t, _) in enumerate(self._held) if lo < t <= hi]
        if not span:
            return
        times = [self._held[i][0] for i in span]
        first = span[0]
        previous = (self._held[first - 1][0] if first > 0
                    else self._last_emitted if self._last_emitted is not None else lo)
        edges = [previous, *times]
        # Ends are added only where the samples have room for them: a gap about k steps
        # long can hide k - 1. A count the gaps cannot explain is not the samples'
        # miss: in CI a compare found 12 fewer ends than the counter where every gap was
        # one step long, and the midpoints put in doubled 12 steps of ~90.
        usual = statistics.median(b - a for a, b in itertools.pairwise(edges)) if len(
            edges) > 1 else 0
        room = sum(max(0, round((b - a) / usual) - 1)
                   for a, b in itertools.pairwise(edges)) if usual > 0 else 0
        for _ in range(max(0, min(missing, room))):
            gaps = [(edges[i + 1] - edges[i], i) for i in range(len(edges) - 1)]
            _, i = max(gaps)
            edges.insert(i + 1, (edges[i] + edges[i + 1]) // 2)
        for _ in range(max(0, -missing)):
            if len(edges) <= 2:
                break
            gaps = [(edges[i + 1] - edges[i], i) for i in range(len(edges) - 1)]
            _, i = min(gaps)
            del edges[max(1, i)]
        repaired = [(t, "counter") for t in edges[1:]]  # (labelled by the caller)
        self._ends_total += len(repaired) - len(span)
        self._held[first:span[-1] + 1] = repaired
        self._last_end = self._held[-1][0] if self._held else self._last_end

    def _emit_until(self, t: int | None) -> None:
        """Pass on the held ends up to ``t`` (all when None)."""
        label = self.estimator
        keep = []
        for end, how in self._held:
            if t is None or end <= t:
                self._ready.append((end, how or label))
                self._last_emitted = end
            else:
                keep.append((end, how))
        self._held = keep
