"""Collective waits accounted where they happen: in the kernel (bcc) or in the probe
(tracefs), one ``waits`` record a step instead of two markers a collective.

The real test runs a tensor-parallel-style job (torchrun, gloo, 2 ranks, a hundred
small all-reduces per forward) and checks, on a run that also logs every wait's
entry and return (``--raw-markers``), that each step's totals are exactly the sum
of the per-collective waits before it; and that by default no per-collective
record reaches the log, and the waits, too costly to probe every step, are probed
on sampled iterations.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from perfmon.agent.measure.wait_sampling import WAIT_PROBE_NS, WaitSampling
from perfmon.agent.reducers.ranks import RankTimes
from perfmon.agent.reducers.steps import StepRows
from perfmon.parsers.events import Steps
from perfmon.parsers.step_rows import decode_steps
from perfmon.probes.waits import WaitAccount

from tests import eventlogs
from tests.conftest import TRAIN_GPT, Target, load_summary

MS = 1_000_000
TP_COLLECTIVES = 100


def _marker(t: int, pid: int, kind: str, tid: int | None = None) -> dict:
    return {"type": "marker", "t_mono_ns": t, "pid": pid, "tid": tid or pid, "kind": kind,
            "name": ""}


def test_the_probes_account_each_threads_waits_and_end_a_lost_one_at_the_step():
    # The same stream as the union test of test_stragglers, through the probe's account:
    # each thread's waits are summed (nested calls once), counted at their return.
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


def test_the_reducer_takes_each_iterations_wait_from_the_totals_and_ignores_raw_beside_them():
    ranks = RankTimes({1: 0}, 1, 0, str)
    feed = eventlogs.rank_feed(ranks)

    def step(t: int, total_ms: int) -> None:
        feed({"type": "waits", "t_mono_ns": t, "pid": 1, "wait_ns": total_ms * MS, "waits": 0})
        feed(_marker(t, 1, "optimizer_step"))

    step(0, 5)
    feed(_marker(10 * MS, 1, "wait_enter"))  # raw, beside the totals
    feed(_marker(40 * MS, 1, "wait_exit"))
    step(50 * MS, 35)
    step(100 * MS, 35)
    step(150 * MS, 500)  # more than the step: at most the step
    assert list(ranks.all()[0].recent) == [(50 * MS, 50 * MS, 30 * MS),
                                           (100 * MS, 50 * MS, 0),
                                           (150 * MS, 50 * MS, 50 * MS)]


def _tp_job(agent, tmp_path: Path, port: int) -> subprocess.Popen:
    stamps, output = tmp_path / "stamps.txt", tmp_path / "torchrun.log"
    with open(output, "wb") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(port), str(TRAIN_GPT), "--optimizer", "sgd",
             "--tp-collectives", str(TP_COLLECTIVES), "--timestamps", str(stamps)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    agent.procs.append(launcher)  # reaped with its ranks by the agent fixture
    try:
        Target(launcher, stamps).wait_for_iterations(4, timeout_s=90)
    except AssertionError as err:
        raise AssertionError(f"{err}: {output.read_text()[-2000:]}") from None
    return launcher


@pytest.mark.usefixtures("ebpf")
@pytest.mark.parametrize("backend", ["bcc", "tracefs"])
def test_each_steps_wait_totals_are_the_sum_of_its_collectives_waits(
        agent, tmp_path, backend):
    launcher = _tp_job(agent, tmp_path, 29581 if backend == "bcc" else 29582)
    raw, default = tmp_path / "raw", tmp_path / "default"
    # (the budget below the default 0.5%: a hundred waits cost an estimated 1.4-2.8% of
    # a ~60-120 ms step, but a busy machine stretches the step towards where they would
    # not; and not far below, so that the probes come back at least once in the window:
    # after the first sample they are off for (N - 1) x up to 4 iterations, which at
    # 0.2% (an estimated 2.8%: N = 15, 56 iterations of ~120 ms) outlasted a 6 s window)
    for out, extra, seconds in ((raw, ["--raw-markers"], "6"),
                                (default, ["--wait-probe-budget", "0.4"], "10")):
        out.mkdir()
        run = agent.run("attach", "--pid", str(launcher.pid), "--duration", seconds,
                        "--probe-backend", backend, "--output-dir", str(out), *extra,
                        timeout_s=120)
        assert run.returncode == 0, run.stderr

    # Raw: replay every wait's entry and return through the probe's own rule; between
    # two steps a rank's row holds exactly those sums (the kernel's own totals, taken at
    # the same instants). (Compared from a rank's second row on: waits from before the
    # raw markers were switched on are in the kernel's totals only.)
    (log,) = raw.glob("perf_events_*.msgpack")
    records = eventlogs.read_records(log)
    rows = {(row["pid"], row["end_ns"]): row for row in eventlogs.step_rows(records)}
    attach_ns = records[0]["session"]["attach_monotonic_ns"]
    account = WaitAccount()
    last: dict[int, tuple[int, int]] = {}  # pid -> replayed (total, count) at its last step
    compared = 0
    for record in records:
        kind, pid = record.get("kind"), record.get("pid")
        if kind == "wait_enter":
            account.enter(record["tid"], record["t_mono_ns"])
        elif kind == "wait_exit":
            account.exit(pid, record["tid"], record["t_mono_ns"])
        elif kind == "optimizer_step" and record["t_mono_ns"] >= attach_ns:  # (in the window)
            row = rows.pop((pid, record["t_mono_ns"]))  # one optimizer: every step ends one
            replayed = account.step(pid, record["tid"], record["t_mono_ns"])
            if pid in last:
                assert (row["wait_ns"], row["waits"]) == (replayed[0] - last[pid][0],
                                                          replayed[1] - last[pid][1])
                compared += 1
            last[pid] = replayed
    wait_markers = sum(1 for r in records if r.get("kind") == "wait_exit")
    assert compared >= 8 and wait_markers >= TP_COLLECTIVES * compared
    assert not rows  # (every row is an Optimizer.step's)
    # (raw waits asked for: the probes stay on, every row has its wait)
    assert min(row["waits"] for row in eventlogs.step_rows(records)) >= 0

    # Without raw markers: no per-collective record and no per-step marker: one row a rank
    # and step.
    # A hundred waits a step cost more than the budget (at an estimated 16 µs a wait), so
    # the waits are probed on sampled iterations only and the rows say which (waits -1:
    # not probed).
    (log,) = default.glob("perf_events_*.msgpack")
    records = eventlogs.read_records(log)
    assert not {r["type"] for r in records} & {"waits", "marker"}
    rows = eventlogs.step_rows(records)
    later = [row for pid in {row["pid"] for row in rows}
             for row in [r for r in rows if r["pid"] == pid][1:]]
    probed = [row for row in later if row["waits"] >= 0]
    assert len(probed) >= 8 and min(row["waits"] for row in probed) >= TP_COLLECTIVES
    assert all(row["wait_ns"] == 0 for row in later if row["waits"] == -1)
    summary = load_summary(default)
    stats = summary["final_statistics"]
    sampling = stats["data_quality"]["sources"]["wait_probes"]
    assert sampling["estimated_cost_pct"] > sampling["budget_pct"] == 0.4, sampling
    assert sampling["probed_one_in"] > 1 and sampling["samples"] >= 1, sampling
    assert len(probed) < len(later)
    for rank in stats["ranks"]:
        assert rank["avg_wait_ms"] > 0.5, rank
        assert 0 < rank["waits_probed"] < rank["iterations"], rank
        assert rank["wait_share"] == pytest.approx(
            rank["avg_wait_ms"] / (rank["avg_wait_ms"] + rank["avg_compute_ms"]))


def test_rows_outside_the_probed_windows_have_their_wait_unmeasured_and_the_means_skip_them():
    # The probes on from attach, off from 150 ms, on again from 250 ms: only rows whose
    # whole iteration lies inside a window have a wait; the totals carry on across.
    rows = StepRows(0)

    def step(t_ms: int, total_ms: int) -> None:
        rows.feed({"type": "waits", "t_mono_ns": t_ms * MS, "pid": 1,
                   "wait_ns": total_ms * MS, "waits": total_ms})
        rows.feed(_marker(t_ms * MS, 1, "optimizer_step"))

    step(0, 0)
    step(100, 10)
    rows.waits_probed(False, 150 * MS)
    step(200, 20)  # partly off
    rows.waits_probed(True, 250 * MS)
    step(300, 20)  # its start before the probes were back
    step(400, 30)
    steps = rows.take()
    assert steps is not None
    block = decode_steps(steps.to_record())
    assert block.waits.tolist() == [0, 10, -1, -1, 10]
    assert block.wait_ns.tolist() == [0, 10 * MS, 0, 0, 10 * MS]
    assert rows.probed_rows == 2 and list(rows.recent) == [(100 * MS, 10), (100 * MS, 10)]

    # The ranks' means of wait and compute are over the probed rows; steps over all.
    ranks = RankTimes({1: 0}, 1, 0, str)
    ranks.on_rows(block)
    (means,) = ranks.interval(400 * MS)
    assert means["iterations"] == 4 and means["waits_probed"] == 2
    assert means["avg_step_time_ms"] == 100 and means["avg_wait_ms"] == 10
    assert means["avg_compute_ms"] == 90 and means["wait_share"] == 0.1
    assert ranks.all()[0].recent == [(100 * MS, 100 * MS, 10 * MS), (400 * MS, 100 * MS, 10 * MS)]


def test_a_straggler_is_named_from_sampled_waits_alone():
    # Three ranks at 100 ms steps; rank 2 computes 30 ms longer, so the others wait for
    # it. Only one iteration in 8 has its wait probed (fewer than `least` in a window of
    # 50): the rule compares the last 10 probed rows of each rank.
    ranks = RankTimes({1: 0, 2: 1, 3: 2}, 1, 0, str)
    for block in range(40):  # 40 s, a block a second
        rows = []
        for k in range(10):
            i = block * 10 + k
            for pid in (1, 2, 3):
                probed = i % 8 == 0
                wait = (10 if pid == 3 else 40) * MS if probed else 0
                rows.append((pid, i * 100 * MS, 1, wait, 5 if probed else -1, 0, 0,
                             i * 100 * MS, i * 100 * MS))
        ranks.on_rows(decode_steps(Steps.encode(rows[0][1], rows, ["uprobe"]).to_record()))
        for k in range(10):
            ranks.on_primary_iteration((block * 10 + k) * 100 * MS)
    (episode,) = ranks.stragglers()
    assert episode["pid"] == 3 and episode["delay_ms_per_step"] == pytest.approx(30)
    assert ranks.summary()[3]["waits_probed"] == 50 - 1  # (its first row opens the window)


def test_costly_waits_are_probed_one_whole_iteration_in_every_n_and_cheap_ones_always():
    def job(waits_per_step: int, steps: int, budget: float = 0.005) -> tuple[WaitSampling, list]:
        rows, switches = StepRows(0), []
        sampling = WaitSampling(rows, switches.append, [1, 2], 1, budget)
        total = 0
        for i in range(steps):
            for pid in (1, 2):
                t = i * 100 * MS + pid
                rows.feed({"type": "waits", "t_mono_ns": t, "pid": pid, "wait_ns": total,
                           "waits": i * waits_per_step})
                rows.feed(_marker(t, pid, "optimizer_step"))
            total += MS
            sampling.schedule(keep_on=False)  # (a poll an iteration)
        return sampling, switches

    # 100 waits a 100 ms step: an estimated 1.6% > 0.5%, so one in 4.
    sampling, switches = job(100, 200)
    assert sampling.estimated_share == pytest.approx(100 * WAIT_PROBE_NS / (100 * MS))
    assert sampling.every == 4 and sampling.samples >= 10
    assert switches[:2] == [False, True] and len(switches) >= 20
    # 10 waits a step (0.16%), or a budget of 0: never detached.
    assert job(10, 100)[1] == [] and job(100, 100, budget=0)[1] == []
