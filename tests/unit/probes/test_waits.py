"""WaitAccount (perfmon.probes.waits): the tracefs backend's time blocked on collectives,
per thread, nested waits once, a wait whose return was lost ended at the step."""

from __future__ import annotations

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
    assert account.step(1, 1, 50 * MS) == (40 * MS, 3)
    assert account.step(1, 1, 60 * MS) == (40 * MS, 3)
