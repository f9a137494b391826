"""Pipeline-parallel jobs measured from outside (docs/pipeline.md): torchrun, gloo on
CPU, torch.distributed.pipelining's GPipe and 1F1B schedules over 2 stages
(tests/targets/train_pipeline.py, with Megatron-style arguments), attached with no
code change. The job writes its own truth per rank and step (its step's end, the time
its main thread spent in the schedule's point-to-point waits and in the replicas'
all-reduce); the agent's figures are checked against it: iterations, each rank's
wait, the bubble, the slow stage and its excess, the slow replica as its stage's
straggler. (The rules on generated pipelines: tests/unit/agent/reducers/test_pipeline.py.)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest
from perfmon.agent.reducers.pipeline import StageRule
from perfmon.agent.reducers.ranks import StragglerRule

from tests.conftest import ROOT, Target, load_summary

TRAIN_PIPELINE = ROOT / "tests" / "targets" / "train_pipeline.py"
SLOW_MS = 30.0

pytestmark = pytest.mark.long(reason=("real torchrun pipelines, each long enough for its stages' "
                                      "medians and a straggler episode"))


@dataclass
class Truth:
    """A rank's means over the iterations the agent saw, by the job's own stamps (ms)."""

    rank: int
    stage: int
    replica: int
    iterations: int
    step_ms: float
    p2p_ms: float
    allreduce_ms: float

    @property
    def wait_ms(self) -> float:
        return self.p2p_ms + self.allreduce_ms

    @property
    def compute_ms(self) -> float:
        return self.step_ms - self.wait_ms


def _job(agent, tmp_path: Path, port: int, ranks: int, *args: str
         ) -> tuple[subprocess.Popen, Path]:
    stamps_dir, output = tmp_path / "stamps", tmp_path / "torchrun.log"
    stamps_dir.mkdir()
    with open(output, "wb") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
             "--master-port", str(port), str(TRAIN_PIPELINE),
             "--pipeline-model-parallel-size", "2", "--num-layers", "4",
             "--timestamps", str(tmp_path / "stamps.txt"), "--stamps-dir", str(stamps_dir),
             *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    agent.procs.append(launcher)  # reaped with its ranks by the agent fixture
    try:
        Target(launcher, tmp_path / "stamps.txt").wait_for_iterations(3, timeout_s=120)
    except AssertionError as err:
        raise AssertionError(f"{err}: {output.read_text()[-2000:]}") from None
    return launcher, stamps_dir


def _attach(agent, launcher: subprocess.Popen, out_dir: Path, seconds: int) -> dict:
    run = agent.run("attach", "--pid", str(launcher.pid), "--duration", str(seconds),
                    "--output-dir", str(out_dir), timeout_s=seconds + 90)
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    summary["stderr"] = run.stderr
    return summary


def _truth(stamps_dir: Path, attach_ns: int, detach_ns: int) -> dict[int, Truth]:
    """Each rank's means over its steps that began and ended in the window."""
    out = {}
    for path in sorted(stamps_dir.glob("rank*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        steps = [(b["end_ns"] - a["end_ns"], b) for a, b in pairwise(rows)
                 if a["end_ns"] >= attach_ns and b["end_ns"] <= detach_ns]
        rank = int(path.stem.removeprefix("rank"))
        out[rank] = Truth(rank, rows[0]["stage"], rows[0]["replica"], len(steps),
                          statistics.fmean(s for s, _ in steps) / 1e6,
                          statistics.fmean(r["p2p_wait_ns"] for _, r in steps) / 1e6,
                          statistics.fmean(r["allreduce_ns"] for _, r in steps) / 1e6)
    return out


def _check_ranks(summary: dict, truth: dict[int, Truth], stamps: Path) -> None:
    """Iterations exact against rank 0's clock; every rank's wait as its own stamps say."""
    info, stats = summary["session_info"], summary["final_statistics"]
    attach, detach = info["attach_monotonic_ns"], info["detach_monotonic_ns"]
    ends = [int(line.split()[1]) for line in stamps.read_text().splitlines() if line]
    assert info["total_iterations"] == sum(1 for t in ends if attach < t <= detach)
    assert info["layout"]["stated"] and info["layout"]["sizes"]["pp"] == 2
    assert info["wait_probes"]["gloo"], info["wait_probes"]  # (SendWork's, RecvWork's)
    for rank in stats["ranks"]:
        mine = truth[rank["rank"]]
        assert rank["coords"]["pp"] == mine.stage and rank["coords"]["dp"] == mine.replica
        assert rank["avg_wait_ms"] > 0, rank
        # (10%, or 2 ms: what is left of a step besides the stamped waits, scheduling)
        assert rank["avg_wait_ms"] == pytest.approx(mine.wait_ms, rel=0.10, abs=2.0), (
            rank, mine)
        assert rank["avg_p2p_wait_ms"] == pytest.approx(mine.p2p_ms, rel=0.10, abs=2.0), (
            rank, mine)
    assert not stats["data_quality"]["losses"], stats["data_quality"]


def _stamped_bubble(truth: dict[int, Truth]) -> float:
    """The mean over the stages of their ranks' point-to-point wait over their step."""
    stages = sorted({t.stage for t in truth.values()})
    return statistics.fmean(
        statistics.fmean(t.p2p_ms for t in truth.values() if t.stage == s)
        / statistics.fmean(t.step_ms for t in truth.values() if t.stage == s)
        for s in stages)


def _own_outlier(stamps_dir: Path, rank: int, mate: int, info: dict) -> bool | None:
    """Whether ``rank``'s compute stands out of ``mate``'s by StragglerRule's bar, by the
    job's own stamps in the session (each step's time less its waits): its median excess
    over the rule's bar (k spreads of the mate's compute, at least a share of its step).
    None within half the bar to twice it, where the agent's windows of the same steps may
    judge either way."""
    def steps(r: int) -> list[tuple[float, float]]:
        """(step, compute) ms of each of ``r``'s steps in the session."""
        rows = [json.loads(line) for line in (stamps_dir / f"rank{r}.jsonl").read_text()
                .splitlines() if line]
        return [((b["end_ns"] - a["end_ns"]) / 1e6,
                 (b["end_ns"] - a["end_ns"] - b["p2p_wait_ns"] - b["allreduce_ns"]) / 1e6)
                for a, b in pairwise(rows) if a["end_ns"] >= info["attach_monotonic_ns"]
                and b["end_ns"] <= info["detach_monotonic_ns"]]
    mine, theirs = [c for _, c in steps(rank)], steps(mate)
    centre = statistics.median(c for _, c in theirs)
    spread = 1.4826 * statistics.median(abs(c - centre) for _, c in theirs)
    bar = StragglerRule().bar(spread, statistics.median(s for s, _ in theirs))
    excess = statistics.median(mine) - centre
    return True if excess > 2 * bar else False if excess < bar / 2 else None


def _own_slow_stage(truth: dict[int, Truth]) -> bool | None:
    """Whether a stage bounds the pipeline by StageRule's share, by the job's own stamps:
    the slowest stage (by its replicas' mean compute) over the others' median, in each
    replica's pipeline, the least of those (docs/pipeline.md). None within 3 points of the
    share, where the agent's figures of the same question may go either way: on a busy
    machine one stage's process gets less CPU than the other's, and a balanced job is then
    bounded by a stage, as its own clock shows."""
    stages = sorted({t.stage for t in truth.values()})
    compute = {s: statistics.fmean(t.compute_ms for t in truth.values() if t.stage == s)
               for s in stages}
    bound = max(stages, key=compute.__getitem__)
    others = statistics.median(c for s, c in compute.items() if s != bound)
    excess = min(
        next(t.compute_ms for t in truth.values() if t.stage == bound and t.replica == r)
        - statistics.median(t.compute_ms for t in truth.values()
                            if t.stage != bound and t.replica == r)
        for r in {t.replica for t in truth.values()})
    rule = StageRule()
    if abs(excess / others - rule.min_share) < 0.03:
        return None
    return rule.slow(excess / 1e3, others / 1e3)


@pytest.mark.usefixtures("ebpf")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("slow", [False, True], ids=["balanced", "slow_stage"])
def test_a_two_stage_pipelines_bubble_and_slow_stage_as_its_own_stamps_say(
        agent, out_dir, tmp_path, schedule, slow):
    port = 29611 + 2 * (schedule == "1f1b") + slow
    extra = ["--slow-stage", "1", "--slow-ms", str(SLOW_MS)] if slow else []
    launcher, stamps_dir = _job(agent, tmp_path, port, 2, "--schedule", schedule, *extra)
    summary = _attach(agent, launcher, out_dir, 10)
    info, stats = summary["session_info"], summary["final_statistics"]
    truth = _truth(stamps_dir, info["attach_monotonic_ns"], info["detach_monotonic_ns"])
    _check_ranks(summary, truth, tmp_path / "stamps.txt")
    pipeline = stats["pipeline"]
    assert (pipeline["stages"], pipeline["microbatches"]) == (2, 8)
    assert pipeline["ideal_bubble_fraction"] == pytest.approx(1 / 9)
    assert pipeline["bubble_fraction"] == pytest.approx(_stamped_bubble(truth), abs=0.05), (
        pipeline, truth)
    # The slow stage named, with its excess as the job's own clock has it (its compute
    # over the other stage's); on the balanced job, only where its own clock says a stage
    # bounds it (the machine's load, not the job).
    stamped_excess = truth[1].compute_ms - truth[0].compute_ms
    own = _own_slow_stage(truth)
    assert own is None or pipeline["slow_stage"] is own, (pipeline, truth)
    assert not slow or pipeline["slow_stage"], pipeline
    if slow:
        assert pipeline["bounding_stage"] == 1
        assert pipeline["bounding_excess_ms"] == pytest.approx(stamped_excess, rel=0.2)
        # (the injected 30 ms a micro-batch: CPU time, a wall time at least as long)
        assert pipeline["bounding_excess_per_microbatch_ms"] == pytest.approx(
            stamped_excess / 8, rel=0.2)
        assert pipeline["bounding_excess_per_microbatch_ms"] >= 0.8 * SLOW_MS
    # Ranks are compared within their stage only: one rank a stage, no straggler.
    assert stats["stragglers"] == []
    # A fail-slow event, if any, never blames the stage that waits.
    for event in stats["fail_slow"]:
        assert all(r["stage"] == 1 for r in event["ranks"] if r["moved"]), event


@pytest.mark.usefixtures("ebpf")
def test_a_slow_replica_of_a_stage_is_its_stages_straggler_not_a_slow_stage(
        agent, out_dir, tmp_path):
    # PP 2 x DP 2 (rank = replica + 2 x stage), 4 micro-batches a replica; replica 1 of
    # stage 1 (rank 3) computes 30 ms more a micro-batch.
    launcher, stamps_dir = _job(agent, tmp_path, 29621, 4, "--global-batch-size", "32",
                                "--slow-stage", "1", "--slow-replica", "1",
                                "--slow-ms", str(SLOW_MS))
    summary = _attach(agent, launcher, out_dir, 25)
    info, stats = summary["session_info"], summary["final_statistics"]
    truth = _truth(stamps_dir, info["attach_monotonic_ns"], info["detach_monotonic_ns"])
    _check_ranks(summary, truth, tmp_path / "stamps.txt")
    pipeline = stats["pipeline"]
    assert pipeline["microbatches"] == 4, pipeline
    # (its slow replica makes its stage no slow stage unless the stage's mean compute is
    # over the share, as the job's own clock says)
    own = _own_slow_stage(truth)
    assert own is None or pipeline["slow_stage"] is own, (pipeline, truth)
    assert pipeline["bubble_fraction"] == pytest.approx(_stamped_bubble(truth), abs=0.05)
    # Rank 3 named its stage's straggler where the job's own clock shows it stands out of
    # its stage by the rule's bar (on a busy machine its stage-mate's steps can spread
    # that far too: then it may not be), and never another rank.
    assert all((e["rank"], e["stage"]) == (3, 1) for e in stats["stragglers"]), stats
    own = _own_outlier(stamps_dir, 3, 2, info)
    if own is False or (own is None and not stats["stragglers"]):
        return
    (episode,) = stats["stragglers"]
    # Its delay: its compute over its stage's other replica's, by the job's own clock.
    assert episode["delay_ms_per_step"] == pytest.approx(
        truth[3].compute_ms - truth[2].compute_ms, rel=0.2), (episode, truth)
    assert "straggler: pipeline stage 1: rank 3" in summary["stderr"]
