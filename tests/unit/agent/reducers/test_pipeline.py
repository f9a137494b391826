"""A pipeline's stages (perfmon.agent.reducers.pipeline) and the layout-aware straggler
rule (perfmon.agent.reducers.ranks) on generated jobs with a stated truth: the bubble
is the stages' point-to-point share of their step, the slow stage is the one slow in
every data-parallel replica (with its excess), a slow replica is a straggler of its own
stage and never a stage, a stage that waits is never blamed (on real torchrun jobs:
tests/e2e/test_pipeline.py)."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from perfmon.agent.console import describe_event
from perfmon.agent.reducers.pipeline import StageRule, ideal_bubble, pipeline_figures
from perfmon.agent.reducers.ranks import RankTimes
from perfmon.parsers.events import Steps
from perfmon.parsers.figures import RankFigures, render
from perfmon.parsers.parallel_layout import ParallelLayout
from perfmon.parsers.step_rows import decode_steps

MS = 1_000_000


def test_the_ideal_bubble_is_the_schedules():
    assert ideal_bubble(2, 8) == pytest.approx(1 / 9)
    assert ideal_bubble(4, 8, virtual=2) == pytest.approx(3 / 19)
    assert ideal_bubble(4, None) is None


def test_a_job_with_no_stages_has_no_pipeline():
    ranks = [RankFigures(pid=1, rank=0, step_s=0.1, wait_s=0.0, compute_s=0.1)]
    assert pipeline_figures(ranks, None, 8) is None
    assert pipeline_figures(ranks, ParallelLayout(4, tp=2), 8) is None


# -- generated pipelines -----------------------------------------------------------------

@st.composite
def pipelines(draw: st.DrawFn) -> tuple[list[RankFigures], ParallelLayout, int, dict]:
    """A synchronous pipeline's rank means with their truth: ``kind`` balanced, a slow
    stage (slow in every replica, by ``excess_s``) or one slow replica of one stage."""
    pp, dp = draw(st.integers(2, 6)), draw(st.integers(1, 3))
    micro = draw(st.integers(1, 32))
    kind = draw(st.sampled_from(["balanced", "slow_stage", "slow_replica"]))
    if kind == "slow_replica" and dp == 1:
        kind = "slow_stage"
    base = draw(st.floats(0.005, 0.2))
    rng = random.Random(draw(st.integers(0, 1 << 30)))
    compute = {(s, r): base * (1 + rng.uniform(-0.02, 0.02)) for s in range(pp)
               for r in range(dp)}
    slow = draw(st.integers(0, pp - 1))
    excess = base * draw(st.floats(0.3, 3.0))
    if kind == "slow_stage":
        for r in range(dp):
            compute[slow, r] += excess
    elif kind == "slow_replica":
        compute[slow, draw(st.integers(0, dp - 1))] += excess
    layout = ParallelLayout(pp * dp, pp=pp)
    step = max(compute.values()) * (1 + 0.5 / micro)  # (the fill and the drain)
    ranks = []
    for rank in range(pp * dp):
        coords = layout.coords(rank)
        assert coords is not None
        c = compute[coords.pp, coords.dp]
        collective = rng.uniform(0, 0.1) * (step - c)  # the replicas' all-reduce
        wait = step - c
        ranks.append(RankFigures(pid=1000 + rank, rank=rank, iterations=50, step_s=step,
                                 wait_s=wait, p2p_wait_s=wait - collective, compute_s=c,
                                 coords=coords))
    by_stage = [statistics.fmean(r.p2p_wait_s for r in ranks if r.coords.pp == s) / step
                for s in range(pp)]
    return ranks, layout, micro, {"kind": kind, "slow": slow, "excess_s": excess,
                                  "bubble": statistics.fmean(by_stage), "base": base}


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_every_generated_pipeline_names_its_slow_stage_and_only_it(case) -> None:
    ranks, layout, micro, truth = case
    figures = pipeline_figures(ranks, layout, micro)
    assert figures is not None and figures.stages == layout.pp
    assert figures.bubble == pytest.approx(truth["bubble"], abs=1e-9)
    assert figures.ideal_bubble == pytest.approx((layout.pp - 1) / (micro + layout.pp - 1))
    assert [s.stage for s in figures.per_stage] == list(range(layout.pp))
    if truth["kind"] == "slow_stage":
        assert figures.slow and figures.bounding_stage == truth["slow"]
        # (the others' compute within +-2%: the excess within 5% of the base)
        assert figures.excess_s == pytest.approx(truth["excess_s"], abs=0.05 * truth["base"])
        assert figures.excess_per_microbatch_s == pytest.approx(figures.excess_s / micro)
    else:  # balanced, or one replica slow: a straggler of its stage, not a slow stage
        assert not figures.slow, render(figures)


def test_the_rule_bar_is_a_share_of_the_others_and_a_millisecond():
    rule = StageRule()
    assert not rule.slow(0.009, 0.1) and rule.slow(0.011, 0.1)
    assert not rule.slow(0.0009, 0.001)


# -- stragglers among a stage's replicas ---------------------------------------------------

def _pipeline_job(ranks: RankTimes, layout: ParallelLayout, compute_ms: dict[int, float],
                  steps: int, noise: float = 0.03) -> None:
    """Feed a synchronous pipeline job: every rank ends its step together; each waits
    the rest of it, on its neighbours (point-to-point) but for a tenth (its replicas)."""
    rng = random.Random(11)
    t = 0
    for _ in range(steps // 10):
        rows = []
        for _ in range(10):
            computed = {r: ms * (1 + rng.uniform(-noise, noise))
                        for r, ms in compute_ms.items()}
            step = max(computed.values()) * 1.2
            t += int(step * MS)
            for rank, c in computed.items():
                wait = int((step - c) * MS)
                rows.append((1000 + rank, t, 8, wait, 16, 0, 0, t, t, int(wait * 0.9)))
        ranks.on_rows(decode_steps(Steps.encode(rows[0][1], rows, ["uprobe"]).to_record()))
        for k in range(10):
            ranks.on_primary_iteration(rows[k * len(compute_ms)][1])


def _ranks(layout: ParallelLayout, staged: bool = True) -> RankTimes:
    pids = {1000 + r: r for r in range(layout.world_size)}
    coords = {pid: layout.coords(r) for pid, r in pids.items()}
    return RankTimes(pids, 1000, 0, str, coords=coords if staged else None, staged=staged)


def test_a_slow_replica_is_its_stages_straggler_and_named_with_its_stage():
    layout = ParallelLayout(4, pp=2)  # ranks 0, 1: stage 0; 2, 3: stage 1
    ranks = _ranks(layout)
    _pipeline_job(ranks, layout, {0: 40, 1: 40, 2: 60, 3: 80}, 300)
    (episode,) = ranks.stragglers()
    assert (episode.rank, episode.stage) == (3, 1)
    # Against its own stage's other replica (60 ms), not the whole job's median.
    assert episode.delay_per_step_s == pytest.approx(0.020, rel=0.25)
    line = describe_event(episode)
    assert "pipeline stage 1: rank 3" in line and "its stage's other replicas" in line
    # The ranks' means carry their coordinates.
    assert [f.coords.pp for f in ranks.summary().values()] == [0, 0, 1, 1]


def test_a_stage_that_computes_more_is_no_straggler_among_stages():
    # Two stages, one rank each: stage 1 computes twice stage 0's, stage 0 waits for it.
    # Without the layout, the rule would compare the two (and name rank 1).
    layout = ParallelLayout(2, pp=2)
    staged = _ranks(layout)
    _pipeline_job(staged, layout, {0: 40, 1: 80}, 300)
    assert staged.stragglers() == []
    flat = _ranks(layout, staged=False)
    _pipeline_job(flat, layout, {0: 40, 1: 80}, 300)
    assert [e.rank for e in flat.stragglers()] == [1]
    # ... and it is the pipeline's slow stage.
    figures = pipeline_figures(tuple(staged.summary().values()), layout, 8)
    assert figures is not None and figures.slow and figures.bounding_stage == 1
    assert figures.excess_s == pytest.approx(0.040, rel=0.1)
