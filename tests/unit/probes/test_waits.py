"""WaitAccount (perfmon.probes.waits): the tracefs backend's time blocked on collectives,
per thread, nested waits once, a wait whose return was lost ended at the step."""

from __future__ import annotations

from perfmon.parsers.events import Marker, WaitTotals
from perfmon.probes.waits import WaitAccount

MS = 1_000_000


def test_the_probes_account_each_threads_waits_and_end_a_lost_one_at_the_step():
    # The same stream as the union test of tests/unit/agent/reducers/test_ranks.py,
    # through the probe's account: each thread's waits are summed (nested calls once),
    # counted at their return.
    account = WaitAccount()
    account.enter(1, 10 * MS)
    account.enter(1, 12 * MS)  # nested
    account.enter(2, 15 * MS)  # another thread, overlapping
    account.exit(1, 1, 18 * MS)
    account.exit(1, 2, 25 * MS)  # thread 2: 10 ms
    account.exit(1, 1, 30 * MS)  # thread 1: 20 ms
    account.exit(1, 1, 35 * MS)  # entered before: ignored
    account.enter(1, 40 * MS)  # its return lost: ends at the step
    assert account.step(1, 1, 50 * MS) == (40 * MS, 3, 0, 0)
    assert account.step(1, 1, 60 * MS) == (40 * MS, 3, 0, 0)


def test_a_point_to_point_wait_is_in_the_total_and_its_own_the_outermost_deciding():
    # A pipeline's receive (p2p), then a collective, then a receive inside a collective
    # (the outermost is a collective: the nest counts there, once), then a receive whose
    # return was lost (ended at the step, as a point-to-point one).
    account = WaitAccount()
    stream = [("p2p_wait_enter", 10), ("p2p_wait_exit", 15), ("wait_enter", 20),
              ("wait_exit", 22), ("wait_enter", 30), ("p2p_wait_enter", 31),
              ("p2p_wait_exit", 33), ("wait_exit", 34), ("p2p_wait_enter", 40)]
    for kind, t in stream:
        account.account(Marker(t * MS, 1, 1, kind, ""), probed=True, raw=False)
    totals, marker = account.account(Marker(50 * MS, 1, 1, "optimizer_step", "s"),
                                     probed=True, raw=False)
    assert totals == WaitTotals(50 * MS, 1, 5 * MS + 2 * MS + 4 * MS + 10 * MS, 4,
                                5 * MS + 10 * MS, 2)
    assert marker.kind == "optimizer_step"
