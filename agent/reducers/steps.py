"""From markers and wait totals to step rows: one row per rank and iteration end.

The rule of an iteration end is the same for every rank: an ``optimizer_step``
after at least one ``backward()`` since the previous end (steps with none between
them, e.g. several optimizers of one iteration, count once), every step when the
rank never called ``backward()``. A rank that never showed an ``optimizer_step`` (a
compiled optimizer step, a hand-written update) ends an iteration where its first
``grad_read`` after a backward pass (the probes send one an update: the first read
of a gradient outside backward()) found an update: at that update's last backward
pass's return, once its next backward pass confirms that no ``optimizer_step``
followed (clipping reads the gradients just before the step). Those ends are held
for HOLD_NS after a rank's first (``take`` leaves them out): an ``optimizer_step`` in
that time says they were reads inside an iteration (a pipeline stage passing its input
gradients back after each micro-batch's backward, a check between micro-batches), and
they are dropped; else they stand (a hand-written update), from the first. A
rank that showed neither, where the user declared the backward passes per update
(``--microbatches K``), ends one at every K-th backward pass's return (``backward``);
the first ``grad_read`` that comes later (K was wrong) takes over. Markers from
before attach fall outside the window.

Gradient reads cost a trap each (a few per parameter an update), so once a rank's
updates have shown the same K backward passes LEARN_UPDATES times in a row the session
may have it counted instead (``count_by``: an end at every K-th backward pass's return,
``counted``) and detach the probe, attaching it again now and then to check K: a
``grad_read`` right after a counted end confirms it (``counted``); one after some
backward passes of the next update says K changed, and the rank is back on gradient
reads (perfmon.agent.measure.update_sampling).

A row holds what the reducers need of the iteration (perfmon.parsers.events.Steps):
its end, its micro-batches, its time blocked on collectives and how many waits
ended, how the end was found, its time in backward() (nested calls once) and where
its backward() calls began and ended.
The wait is the difference of the rank's ``waits`` totals at the two ends (the
probes add each thread's wait, nested calls once, when it returns); a log without
totals (an older agent's) gives it from the ``wait_enter``/``wait_exit`` markers:
the union over the rank's threads (a nested or concurrent wait counts once), a
wait open at an iteration end split there. Either way the thread stepping the
optimizer is in no wait: one whose return was lost ends there.

When the session probes the waits on sampled iterations only (``waits_probed``), a
row whose iteration the probes did not cover whole has ``waits`` -1 (not measured).

The live session turns each poll's markers into one ``steps`` record (``take``)
and logs that instead of them; replaying an older log turns its markers into the
same rows here (``RowSource``), so both feed the reducers rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from perfmon.parsers.events import WAIT_MARKERS
from perfmon.parsers.step_rows import StepBlock, block_of, decode_steps

UPROBE = "uprobe"
GRAD_READ = "grad_read"  # the how of an end found by a gradient read
BACKWARD = "backward"  # ... by counting the declared backward passes per update
COUNTED = "counted"  # ... by counting the backward passes per update the reads showed
HOWS = {"grad_read": GRAD_READ}  # (else the marker: uprobe)
LEARN_UPDATES = 16  # the same backward passes this many updates in a row: K is learnt
# A rank's first gradient-read ends wait this long (of its own record time) for an
# optimizer_step that would make them reads inside an iteration (a pipeline's steps are
# shorter: a step longer than this still has its first one split).
HOLD_NS = 5_000_000_000


@dataclass
class _Rank:
    backward_seen: bool = False
    backwards: int = 0  # backward() calls since the last end
    backward_from: int | None = None
    backward_to: int | None = None
    backward_open: int | None = None  # since when in backward() (nested calls once)
    backward_ns: int = 0
    depth: dict[int, int] = field(default_factory=dict)  # tid -> nested waits open
    open_threads: int = 0
    open_since: int = 0  # union of waits: since when some thread waits
    pending_ns: int = 0  # wait of the iteration in progress (markers)
    pending_count: int = 0
    # The latest ``waits`` (wait, count, point-to-point wait; None: markers count).
    totals: tuple[int, int, int] | None = None
    totals_at_end: tuple[int, int, int] | None = None
    last_end: int | None = None
    ends: int = 0
    stepped: bool = False  # an optimizer_step was seen: the rank's exact clock
    grad_reads: bool = False  # a grad_read began an update: no declared count then
    update: dict[str, Any] | None = None  # a grad_read end, until the next backward pass
    count_k: int | None = None  # counted: backward passes per update (count_by)
    same_k: tuple[int, int] = (0, 0)  # (K, grad_read ends in a row with K backward passes)
    confirmed: int = 0  # gradient reads right after a counted end, since count_by
    counted_ends: int = 0  # counted ends since the last gradient read
    synced: bool = False  # a read since count_by or recheck (the first only syncs)
    # Its rows since its first gradient-read end, while held (None: none held, or no
    # longer: an optimizer_step came, or HOLD_NS passed), and since when.
    held: list[tuple[Any, ...]] | None = None  # (as rows, their how a name)
    held_since: int = 0
    reads_judged: bool = False  # its gradient-read ends were kept or dropped


class StepRows:
    """Feed markers and ``waits`` records (in log order); ``take`` the rows made."""

    def __init__(self, start_t_mono_ns: int, declared_microbatches: int | None = None) -> None:
        self.start_t_mono_ns = start_t_mono_ns
        self.declared_microbatches = declared_microbatches  # --microbatches
        self._ranks: dict[int, _Rank] = {}
        self._rows: list[tuple[int, ...]] = []
        self._hows: dict[str, int] = {}
        # When the wait probes were on: (from, until; None: still on), the latest last.
        # On from before the first row unless the session says otherwise.
        self._probed: list[tuple[int, int | None]] = [(0, None)]
        self.recent: deque[tuple[int, int]] = deque(maxlen=64)  # (step, waits) probed
        self.probed_rows = 0  # rows with their wait measured, so far

    def waits_probed(self, on: bool, t_ns: int) -> None:
        """The wait probes are on from ``t_ns`` (attached by then), or off from it (not
        yet detached): only rows inside one such window have their wait measured."""
        last_on = self._probed[-1][1] is None
        if on and not last_on:
            self._probed.append((t_ns, None))
            del self._probed[:-16]  # (rows come within a poll or two of their end)
        elif not on and last_on:
            self._probed[-1] = (self._probed[-1][0], t_ns)

    def _was_probed(self, since: int, until: int) -> bool:
        return any(a <= since and (b is None or until <= b) for a, b in reversed(self._probed))

    def ends_of(self, pid: int) -> int:
        """Iteration ends of ``pid`` so far."""
        r = self._ranks.get(pid)
        return r.ends if r is not None else 0

    def feed(self, record: dict[str, Any]) -> None:
        r = self._ranks.get(record["pid"])
        if r is None:
            r = self._ranks[record["pid"]] = _Rank()
        if record["type"] == "waits":
            if r.totals is None:  # from now on the totals count, not the markers
                r.depth.clear()
                r.open_threads = 0
            # (p2p_wait_ns: absent in an older agent's log, none)
            r.totals = (record["wait_ns"], record["waits"], record.get("p2p_wait_ns", 0))
            return
        t = record["t_mono_ns"]
        if t < self.start_t_mono_ns:
            return
        kind = record["kind"]
        if kind == "backward_enter":
            if r.update is not None:  # (no optimizer_step came: it began the update)
                # Ended where a counted or declared one ends too: at its last backward
                # pass's return (the reads that found it come just after).
                self._end(r.update, r, r.backward_to or r.update["t_mono_ns"])
                r.update = None
            r.backwards += 1
            r.backward_seen = True
            if r.backward_from is None:
                r.backward_from = t
            if r.backward_open is None:
                r.backward_open = t
        elif kind == "backward_exit":
            r.backward_to = t
            if r.backward_open is not None:
                r.backward_ns += t - r.backward_open
                r.backward_open = None
            if r.stepped:
                pass
            elif r.count_k is not None and r.backwards >= r.count_k:
                self._end(record, r, t, COUNTED)
            elif (k := self.declared_microbatches) and r.backwards >= k and not r.grad_reads:
                self._end(record, r, t, BACKWARD)
        elif kind in WAIT_MARKERS:
            if r.totals is None:  # (raw waits beside the totals are already in them)
                self._on_wait_marker(r, record["tid"], t, kind.endswith("_enter"))
        elif kind == "grad_read":
            if not r.stepped:
                r.grad_reads = True  # (its updates are seen: no declared count from now)
                if r.count_k is not None:
                    self._check_count(r, record)
                elif r.backwards:
                    r.update = record
        elif kind == "optimizer_step":
            if r.held is not None:  # (reads inside its iterations: no ends)
                r.ends -= len(r.held)
                r.held, r.reads_judged = None, True
            r.stepped, r.update = True, None
            if r.depth.get(record["tid"]):
                r.depth[record["tid"]] = 0
                self._thread_left_wait(r, t)
            if r.backward_seen and r.backwards == 0:
                return  # another optimizer of the same iteration
            self._end(record, r, t)

    def _on_wait_marker(self, r: _Rank, tid: int, t: int, enter: bool) -> None:
        depth = r.depth.get(tid, 0)
        if enter:
            r.depth[tid] = depth + 1
            if depth == 0:
                if r.open_threads == 0:
                    r.open_since = t
                r.open_threads += 1
        elif depth:  # (else entered before attach)
            r.depth[tid] = depth - 1
            if depth == 1:
                self._thread_left_wait(r, t)

    @staticmethod
    def _thread_left_wait(r: _Rank, t: int) -> None:
        r.open_threads -= 1
        r.pending_count += 1
        if r.open_threads == 0:
            r.pending_ns += t - r.open_since

    @staticmethod
    def _check_count(r: _Rank, record: dict[str, Any]) -> None:
        """A gradient read of a counted rank: one counted end since the previous read,
        just before it, confirms K; more ends, or backward passes since the last one,
        say K changed (the rank is back on gradient reads, this read its update's
        start). The first read after count_by or a recheck only syncs."""
        ends, r.counted_ends = r.counted_ends, 0
        if not r.synced:
            r.synced = True
        elif r.backwards or ends != 1:
            r.count_k, r.same_k = None, (0, 0)
            r.update = record if r.backwards else None
        else:
            r.confirmed += 1

    def learnt(self, pid: int) -> int | None:
        """K, once the rank's last LEARN_UPDATES updates (found by gradient reads) each
        had K backward passes and it is not counted yet; else None."""
        r = self._ranks.get(pid)
        if r is None or r.stepped or r.count_k is not None or r.same_k[1] < LEARN_UPDATES:
            return None
        return r.same_k[0]

    def count_by(self, pid: int, k: int) -> None:
        """End the rank's iterations at every K-th backward pass's return from now on
        (until a gradient read says K changed)."""
        r = self._ranks[pid]
        r.count_k, r.confirmed, r.synced = k, 0, False
        if r.update is None and r.backwards >= k and r.backward_to is not None:
            # Its update's K backward passes are in, its read not yet (it comes in a
            # later poll): ended here, or it would be counted with the next update's.
            self._end({"pid": pid, "kind": "backward_exit", "name": ""}, r, r.backward_to,
                       COUNTED)

    def counted(self, pid: int) -> tuple[bool, int]:
        """(whether the rank is counted, the gradient reads that confirmed K since
        ``count_by`` or the last ``recheck``)."""
        r = self._ranks.get(pid)
        return (False, 0) if r is None else (r.count_k is not None, r.confirmed)

    def recheck(self, pid: int) -> None:
        """The reads are probed again to check K: count their confirmations afresh."""
        if pid in self._ranks:
            self._ranks[pid].confirmed, self._ranks[pid].synced = 0, False

    def _end(self, record: dict[str, Any], r: _Rank, t: int, how: str | None = None) -> None:
        if r.open_threads:  # a wait open across the end: split there
            r.pending_ns += t - r.open_since
            r.open_since = t
        if r.backward_open is not None:  # (so is a backward() open across it)
            r.backward_ns += t - r.backward_open
            r.backward_open = t
        wait, count, p2p = r.pending_ns, r.pending_count, 0
        if r.totals is not None:
            if r.totals_at_end is not None and r.totals[0] >= r.totals_at_end[0]:
                wait += r.totals[0] - r.totals_at_end[0]
                count += max(0, r.totals[1] - r.totals_at_end[1])
                p2p = min(wait, max(0, r.totals[2] - r.totals_at_end[2]))
            r.totals_at_end = r.totals
            if r.last_end is not None:
                if self._was_probed(r.last_end, t):
                    self.recent.append((t - r.last_end, count))
                    self.probed_rows += 1
                else:
                    wait, count, p2p = 0, -1, 0  # (the probes were off for some of it)
        r.last_end = t
        r.ends += 1
        name = record["name"]
        if how is None:
            how = ((name.partition(":")[2] or "optimizer_frame") if name.startswith("pyspy")
                   else HOWS.get(record["kind"], UPROBE))
        if how == GRAD_READ:  # (K is learnt from a run of updates of the same K)
            r.same_k = (r.backwards, r.same_k[1] + 1 if r.same_k[0] == r.backwards else 1)
        elif how == COUNTED:
            r.counted_ends += 1
        first = r.backward_from if r.backward_from is not None else t
        last = r.backward_to if r.backward_to is not None and r.backward_to >= first else first
        row = (record["pid"], t, r.backwards if r.backward_seen else -1, wait, count, how,
               r.backward_ns, first, last, p2p)
        if how == GRAD_READ and not r.reads_judged and r.held is None:
            r.held, r.held_since = [], t
        if r.held is None:
            self._add(row)
        else:
            r.held.append(row)
            if t - r.held_since >= HOLD_NS:
                self._release(r)
        r.backwards, r.pending_ns, r.pending_count, r.backward_ns = 0, 0, 0, 0
        r.backward_from = r.backward_to = None

    def _add(self, row: tuple[Any, ...]) -> None:
        """A row for the next block (its how, a name, made the block's index)."""
        index = self._hows.setdefault(row[5], len(self._hows))
        self._rows.append((*row[:5], index, *row[6:]))

    def _release(self, r: _Rank) -> None:
        """The rank's held rows stand (no optimizer_step came)."""
        if r.held is not None:
            for row in r.held:
                self._add(row)
            r.held, r.reads_judged = None, True

    @property
    def holding(self) -> bool:
        """Whether some rank's rows are held."""
        return any(r.held is not None for r in self._ranks.values())

    def feed_poll(self, records: list[dict[str, Any]], raw_markers: bool
                  ) -> list[dict[str, Any]]:
        """Feed a poll's markers and wait totals (records in log order); the records to
        log besides the rows: all others, raw waits (there only while asked for), and
        every marker when ``raw_markers``."""
        logged = []
        for record in records:
            kind = record["type"]
            if kind in RowSource.INPUTS:
                self.feed(record)
                if kind == "waits" or not (raw_markers or record["kind"] in WAIT_MARKERS):
                    continue
            logged.append(record)
        return logged

    def take(self, final: bool = False) -> StepBlock | None:
        """The rows made since the last call, as one block (None: none); ``final``: the
        window's end, and rows held stand."""
        if final:
            for r in self._ranks.values():
                self._release(r)
        if not self._rows:
            return None
        rows, self._rows = self._rows, []
        hows = sorted(self._hows, key=self._hows.__getitem__)
        self._hows = {}
        return block_of(rows, hows)


class RowSource:
    """Rows from a log's markers and wait totals, for its readers (the summarizer, the
    trace): None for a log that has its rows (``steps`` records, facts ``step_rows``);
    for an older log, rows made here from its markers, taken as one block before the
    next record of another type (as the live session takes them once a poll)."""

    INPUTS = frozenset(("marker", "waits"))

    def __init__(self, start_t_mono_ns: int) -> None:
        self.rows = StepRows(start_t_mono_ns)
        self.pending = False

    def feed(self, record: dict[str, Any]) -> None:
        self.rows.feed(record)
        self.pending = True

    def take_before(self, kind: str) -> StepBlock | None:
        """The block of the rows made so far, to reduce before a record of type ``kind``
        (None: none, or ``kind`` is one rows are made of)."""
        final = kind == "session_end"
        if not (self.pending or (final and self.rows.holding)) or kind in self.INPUTS:
            return None
        self.pending = False
        return self.rows.take(final)


class RecordDispatch:
    """A log's records to their handlers by type, its iteration ends as blocks of step rows:
    a ``steps`` record decoded, or an older log's markers and wait totals made into rows
    here (RowSource) and taken as one block before the next record of another type. The
    one reader of a record stream, the Summarizer's and the trace's alike."""

    def __init__(self, start_t_mono_ns: int, step_rows: bool,
                 handlers: dict[str, Callable[[dict[str, Any]], None]],
                 on_block: Callable[[StepBlock], None]) -> None:
        """``step_rows``: the log holds its rows (its markers are raw ones, which the rows
        count already); ``handlers``: record type -> handler, for every other type."""
        self.on_block = on_block
        self.rows = None if step_rows else RowSource(start_t_mono_ns)
        self.handlers = {**handlers, "steps": lambda r: on_block(decode_steps(r))}
        if self.rows is not None:
            self.handlers["marker"] = self.handlers["waits"] = self.rows.feed

    def feed(self, record: dict[str, Any]) -> None:
        kind = record["type"]
        self.take_rows(kind)
        handler = self.handlers.get(kind)
        if handler is not None:
            handler(record)

    def take_rows(self, kind: str = "") -> None:
        """Hand on the rows made of an older log's markers so far (before a record of type
        ``kind``, or before anything is read)."""
        block = self.rows.take_before(kind) if self.rows is not None else None
        if block is not None:
            self.on_block(block)
