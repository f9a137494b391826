"""When the gradient-read probe is on, for ranks whose updates it finds (no
torch.optim marker: perfmon.agent.reducers.steps).

Each gradient read costs the job a uprobe trap (~10 µs on a virtual machine, a few
per parameter an update: 28% of a 4 ms step of 97 parameters, benchmarks/
uprobe_overhead.py), where the marker costs one an update. So the probe finds the
rank's updates until LEARN_UPDATES of them in a row had the same K backward passes;
then the rank's iterations are counted (an end at every K-th backward pass's return)
and the probe is detached. Every RECHECK_S it is attached again until CONFIRM reads
have confirmed K (each came right after a counted end) and detached again; a read
that comes after some backward passes of an update says K changed, and the rank is
back on gradient reads until K is learnt again. Between two checks a change of K goes
unseen: at most RECHECK_S of wrong ends (and the job's own counter, read by py-spy,
still cross-checks the count: data_quality ``counter_disagrees``).
"""

from __future__ import annotations

from typing import Any, Protocol

from perfmon.agent.reducers.steps import StepRows
from perfmon.probes.sampler import monotonic_ns

RECHECK_S = 10.0
CONFIRM = 3  # reads right after a counted end that confirm K


class GradReadProbe(Protocol):
    """What of the marker probe this needs (perfmon.probes.uprobes.MarkerProbe)."""

    @property
    def grad_read_pids(self) -> set[int]: ...

    @property
    def grad_reads_on(self) -> set[int]: ...

    def set_grad_reads(self, pid: int, on: bool) -> None: ...


class UpdateSampling:
    """Decides, once a poll (``schedule``), which ranks' gradient reads are probed."""

    def __init__(self, rows: StepRows, probe: GradReadProbe) -> None:
        self.rows, self.probe = rows, probe
        self._recheck_at: dict[int, int] = {}  # pid -> when its K is checked again
        self.counted = 0  # times a rank's updates went over to counting
        self.rechecks = 0  # times K was checked again
        self.changes = 0  # times a check found K changed

    def schedule(self, now_ns: int | None = None) -> None:
        now = monotonic_ns() if now_ns is None else now_ns
        on = self.probe.grad_reads_on
        for pid in self.probe.grad_read_pids:
            counted, confirmed = self.rows.counted(pid)
            if pid in on:
                k = None if counted else self.rows.learnt(pid)
                if k is not None:
                    self.rows.count_by(pid, k)
                    self.counted += 1
                if k is not None or (counted and confirmed >= CONFIRM):
                    self.probe.set_grad_reads(pid, False)
                    self._recheck_at[pid] = now + int(RECHECK_S * 1e9)
                elif not counted and pid in self._recheck_at:
                    del self._recheck_at[pid]  # (a check found K changed: learn it again)
                    self.changes += 1
            elif not counted:  # (K changed while detached cannot happen: only reads say so)
                self.probe.set_grad_reads(pid, True)
            elif now >= self._recheck_at.get(pid, now):
                self.rows.recheck(pid)
                self.probe.set_grad_reads(pid, True)
                self.rechecks += 1

    def quality(self) -> dict[str, Any]:
        """For data_quality (source ``update_probes``)."""
        return {"counted": self.counted, "rechecks": self.rechecks,
                "k_changes": self.changes}
