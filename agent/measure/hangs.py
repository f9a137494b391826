"""Hangs: no iteration for too long, every rank's stacks dumped, a report written.

Hung: no iteration for max(hang_factor x the recent median step time,
hang_timeout) after one was seen. The stacks of every rank are then dumped in the
background (a native dump pauses each rank for seconds) and
``hang_report_<stamp>.json`` is written beside the summary once they are in, with
the innermost frame the ranks share (where they wait). Half way to the threshold
the session samples stacks continuously (``suspected``), so the report has them.

A session whose ranks never ended an iteration is not hung: nothing says they
train (a launcher, a process that maps PyTorch and serves or waits, a job still
loading). Past the same threshold it says so once, as a warning ("not training"),
and no hang, report or stack dump follows; a hang is declared only after a first
iteration (a job hung before the attach reads as not training: ``perfmon-agent
stacks`` shows where it waits).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from perfmon.agent.record.layout import hang_report_stem
from perfmon.agent.record.outputs import OutputDir, json_bytes
from perfmon.agent.reducers import Summarizer
from perfmon.parsers.events import Hang, HangRecovered, Record
from perfmon.parsers.pyspy import ThreadStack
from perfmon.parsers.stack_analysis import classify_phase, innermost_common_frame
from perfmon.probes.background import BackgroundCalls
from perfmon.probes.procfs import TargetProcess
from perfmon.probes.stacks import dump_ranks, main_python_stacks


@dataclass(frozen=True)
class _Detected:
    t_mono_ns: int
    last_ns: int  # the last iteration's end (or attach)
    threshold_ns: float
    median_ns: float | None
    at: datetime


class HangWatch:
    """One session's hang detector; every call from the session's thread."""

    def __init__(self, factor: float, timeout_s: float, *, targets: list[TargetProcess],
                 out: OutputDir, dumps: BackgroundCalls, warn: Callable[[str], None]) -> None:
        self.factor, self.timeout_s = factor, timeout_s
        self.targets, self.out, self.dumps, self.warn = targets, out, dumps, warn
        self._since: int | None = None  # iterations_ended when the hang was declared
        self._detected: _Detected | None = None  # while its dump runs
        self._idle_said = False  # "not training" said (no iteration ever seen)

    def _threshold(self, summarizer: Summarizer) -> tuple[int, float]:
        """(last iteration end or attach, the no-iteration time that makes a hang)."""
        last = summarizer.last_end_t_mono_ns or summarizer.start_t_mono_ns
        median = summarizer.recent_median_step_ns()
        return last, max(self.factor * (median or 0), self.timeout_s * 1e9)

    def suspected(self, summarizer: Summarizer, now_ns: int) -> bool:
        """Half way to a hang, or in one: the stacks are then sampled continuously.
        Never before a first iteration (no hang can come)."""
        if self._since is not None:
            return True
        if summarizer.iterations_ended == 0:
            return False
        last, threshold_ns = self._threshold(summarizer)
        return now_ns - last >= threshold_ns / 2

    def check(self, summarizer: Summarizer, now_ns: int) -> Record | None:
        """Declare a hang (its record comes with ``reports`` once the ranks are dumped), or
        its end: the HangRecovered record to log."""
        if self._since is not None:
            # (Recovered only once its hang record is in, after the dump.)
            if summarizer.iterations_ended > self._since and self._detected is None:
                self._since = None
                self.warn("iterations resumed after the hang")
                return HangRecovered(now_ns)
            return None
        last, threshold_ns = self._threshold(summarizer)
        if now_ns - last < threshold_ns:
            return None
        if summarizer.iterations_ended == 0:
            self._not_training((now_ns - last) / 1e9)
            return None
        self._since = summarizer.iterations_ended
        self._detected = _Detected(now_ns, last, threshold_ns,
                                   summarizer.recent_median_step_ns(),
                                   datetime.now().astimezone())
        self.dumps.submit("hang", dump_ranks, self.targets, cancel=self.dumps.cancel)
        return None

    def _not_training(self, for_s: float) -> None:
        """No iteration ever seen, past the threshold: said once, no hang."""
        if not self._idle_said:
            self._idle_said = True
            self.warn(f"not training: no iteration in {for_s:.0f} s since the attach (idle, "
                      "still starting, or not a rank); no hang is reported before a first "
                      "iteration")

    def reports(self) -> list[Record]:
        """The hang record (and its report file) once the background dump is in."""
        records = []
        for _tag, stacks, error in self.dumps.done():
            detected, self._detected = self._detected, None
            if detected is not None:
                records.append(self._report(detected, {} if error else stacks))
        return records

    def unfinished(self) -> Record | None:
        """At the session's end: the record of a hang whose dump is not in (no stacks)."""
        detected, self._detected = self._detected, None
        return self._report(detected, {}) if detected is not None else None

    def _report(self, d: _Detected, stacks: dict[int, list[ThreadStack]]) -> Record:
        mains = main_python_stacks(stacks)
        frame = innermost_common_frame(mains)
        # (what most ranks were doing: data loading makes the stall a data stall)
        phases = Counter(classify_phase(m) for m in mains)
        phase = phases.most_common(1)[0][0] if phases else None
        where = f"{frame.function} ({frame.file}:{frame.line})" if frame else "no common frame"
        report: dict[str, Any] = {
            "detected_at": d.at.isoformat(),
            "no_iteration_for_s": (d.t_mono_ns - d.last_ns) / 1e9,
            "threshold_s": d.threshold_ns / 1e9,
            "median_step_time_ms": d.median_ns / 1e6 if d.median_ns else None,
            "innermost_common_frame": asdict(frame) if frame else None,
            "ranks": {str(pid): [asdict(t) for t in threads] for pid, threads in stacks.items()},
        }
        try:
            name = self.out.publish_unique(*hang_report_stem(d.at), json_bytes(report))
            path = str(self.out.path / name)
        except OSError as err:
            path = f"not written ({err.strerror})"
        self.warn(f"hang: no iteration for {(d.t_mono_ns - d.last_ns) / 1e9:.1f} s "
                  f"(threshold {d.threshold_ns / 1e9:.1f} s); ranks wait in {where}; "
                  f"stacks in {path}")
        return Hang(d.t_mono_ns, d.last_ns, d.threshold_ns / 1e9, where, path, phase)
