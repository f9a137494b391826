"""Collective waits accounted where they happen: in the kernel (bcc) or in the probe
(tracefs), one ``waits`` record a step instead of two markers a collective.

The real test runs a tensor-parallel-style job (torchrun, gloo, 2 ranks, a hundred
small all-reduces per forward) and checks, on a run that also logs every wait's
entry and return (``--raw-markers``), that each step's totals are exactly the sum
of the per-collective waits before it; and that by default no per-collective
record reaches the log.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from perfmon.agent.reducers.ranks import RankTimes
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

    def step(t: int, total_ms: int) -> None:
        ranks.on_waits({"type": "waits", "t_mono_ns": t, "pid": 1, "wait_ns": total_ms * MS,
                        "waits": 0})
        ranks.on_marker(_marker(t, 1, "optimizer_step"))

    step(0, 5)
    ranks.on_marker(_marker(10 * MS, 1, "wait_enter"))  # raw, beside the totals
    ranks.on_marker(_marker(40 * MS, 1, "wait_exit"))
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
    for out, extra in ((raw, ["--raw-markers"]), (default, [])):
        out.mkdir()
        run = agent.run("attach", "--pid", str(launcher.pid), "--duration", "6",
                        "--probe-backend", backend, "--output-dir", str(out), *extra,
                        timeout_s=120)
        assert run.returncode == 0, run.stderr

    # Raw: replay every wait's entry and return through the probe's own rule; between
    # two steps the logged totals grow exactly by those sums (the same kernel times).
    # (Compared from a rank's second step on: waits from before the raw markers were
    # switched on are in the kernel's totals only.)
    (log,) = raw.glob("perf_events_*.msgpack")
    records = eventlogs.read_records(log)
    account = WaitAccount()
    totals: dict[int, dict] = {}
    last: dict[int, tuple[int, int]] = {}  # pid -> (logged total, replayed total)
    compared = 0
    for record in records:
        kind, pid = record.get("kind"), record.get("pid")
        if kind == "wait_enter":
            account.enter(record["tid"], record["t_mono_ns"])
        elif kind == "wait_exit":
            account.exit(pid, record["tid"], record["t_mono_ns"])
        elif record["type"] == "waits":
            totals[pid] = record
        elif kind == "optimizer_step":
            logged = totals.pop(pid)
            assert logged["t_mono_ns"] == record["t_mono_ns"]
            replayed, _ = account.step(pid, record["tid"], record["t_mono_ns"])
            if pid in last:
                assert (logged["wait_ns"] - last[pid][0]) == (replayed - last[pid][1])
                compared += 1
            last[pid] = (logged["wait_ns"], replayed)
    wait_markers = sum(1 for r in records if r.get("kind") == "wait_exit")
    assert compared >= 8 and wait_markers >= TP_COLLECTIVES * compared

    # Default: no per-collective record; the ranks still wait and compute.
    (log,) = default.glob("perf_events_*.msgpack")
    records = eventlogs.read_records(log)
    kinds = {r.get("kind") for r in records if r["type"] == "marker"}
    assert not kinds & {"wait_enter", "wait_exit"}
    steps = sum(1 for r in records if r["type"] == "marker" and r["kind"] == "optimizer_step")
    assert sum(1 for r in records if r["type"] == "waits") == steps
    stats = load_summary(default)["final_statistics"]
    for rank in stats["ranks"]:
        assert rank["avg_wait_ms"] > 0.5, rank
        assert rank["avg_wait_ms"] + rank["avg_compute_ms"] == pytest.approx(
            rank["avg_step_time_ms"])
