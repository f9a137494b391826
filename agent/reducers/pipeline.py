"""A pipeline-parallel job's stages from its ranks' means (docs/pipeline.md).

Every rank's step splits into compute and wait (perfmon.agent.reducers.ranks), and the
wait into what it spent on point-to-point sends and receives (the pipeline passing
activations forward and gradients back: the stage waiting on its neighbours, the
bubble) and on collectives (data- or tensor-parallel all-reduces and the like). The
layout (perfmon.parsers.parallel_layout) puts each rank in a stage; a stage's figures
are the means of its ranks'.

- The measured bubble is the mean over the stages of bubble over step; the schedule's
  ideal, for GPipe and 1F1B with p stages and m micro-batches, is (p - 1) / (m + p - 1),
  and (p - 1) / (v m + p - 1) with v virtual stages a rank (interleaved schedules).
- The stage that bounds the pipeline is the one with the most compute. Its excess is
  its compute over the median of the other stages', in each data-parallel replica's
  pipeline, the least of the replicas' (a stage is slow when it is slow in every
  replica: one slow replica is a straggler among its stage's replicas,
  perfmon.agent.reducers.ranks). It is ``slow`` beyond ``StageRule``'s bar: a share of
  the others' compute, at least a millisecond a step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from perfmon.parsers.figures import PipelineFigures, RankFigures, StageFigures, mean
from perfmon.parsers.parallel_layout import ParallelLayout


@dataclass(frozen=True)
class StageRule:
    """When the stage that bounds the pipeline is named slow (docs/pipeline.md;
    docs/prometheus/rules.yml's PerfmonPipelineStageBound alerts on the same share)."""

    min_share: float = 0.10  # of the median of the other stages' compute
    min_s: float = 1e-3

    def slow(self, excess_s: float, others_s: float) -> bool:
        return excess_s > max(self.min_share * others_s, self.min_s)


def ideal_bubble(stages: int, microbatches: int | None, virtual: int = 1) -> float | None:
    """The schedule's bubble fraction: (p - 1) / (v m + p - 1)."""
    if not microbatches or stages < 1:
        return None
    return (stages - 1) / (virtual * microbatches + stages - 1)


def pipeline_figures(ranks: Sequence[RankFigures], layout: ParallelLayout | None,
                     microbatches: int | None, rule: StageRule | None = None
                     ) -> PipelineFigures | None:
    """The stages of ``ranks`` (means with their coordinates, their wait measured), or
    None for a job that is no pipeline (no layout of two stages or more)."""
    if layout is None or layout.pp < 2:
        return None
    rule = rule or StageRule()
    seen = [r for r in ranks if r.coords is not None and r.compute_s is not None
            and r.step_s is not None]
    stages = [_stage(s, [r for r in seen if r.coords is not None and r.coords.pp == s])
              for s in range(layout.pp)]
    shares = [s.bubble_share for s in stages if s.bubble_share is not None]
    figures = PipelineFigures(
        stages=layout.pp, virtual_stages=layout.vpp, microbatches=microbatches,
        bubble=mean(shares) if len(shares) == layout.pp else None,
        ideal_bubble=ideal_bubble(layout.pp, microbatches, layout.vpp),
        per_stage=tuple(stages))
    compute = {s.stage: s.compute_s for s in stages if s.compute_s is not None}
    if len(compute) < 2:
        return figures
    bound = max(compute, key=compute.__getitem__)
    others = statistics.median(c for s, c in compute.items() if s != bound)
    excess = _least_excess(seen, bound, layout)
    return replace(figures, bounding_stage=bound, excess_s=excess,
                   excess_per_microbatch_s=excess / microbatches if microbatches else None,
                   excess_share=excess / others if others > 0 else None,
                   slow=rule.slow(excess, others))


def _stage(stage: int, ranks: list[RankFigures]) -> StageFigures:
    step = mean([r.step_s for r in ranks if r.step_s is not None])
    bubble = mean([r.p2p_wait_s or 0.0 for r in ranks])
    collective = mean([max(0.0, (r.wait_s or 0.0) - (r.p2p_wait_s or 0.0)) for r in ranks])
    return StageFigures(
        stage=stage, ranks=tuple(sorted(r.rank for r in ranks if r.rank is not None)),
        step_s=step, compute_s=mean([r.compute_s for r in ranks if r.compute_s is not None]),
        bubble_s=bubble if ranks else None, collective_wait_s=collective if ranks else None,
        bubble_share=bubble / step if step and bubble is not None else None)


def _least_excess(ranks: list[RankFigures], bound: int, layout: ParallelLayout) -> float:
    """The bounding stage's excess over the median of the other stages' compute, in each
    replica's pipeline; the least of the replicas' (those whose every stage was seen)."""
    excesses = []
    for replica in range(layout.dp):
        mine: dict[int, list[float]] = {}
        for r in ranks:
            if r.coords is not None and r.coords.dp == replica and r.compute_s is not None:
                mine.setdefault(r.coords.pp, []).append(r.compute_s)
        if len(mine) == layout.pp:
            by_stage = {s: statistics.fmean(c) for s, c in mine.items()}
            excesses.append(by_stage[bound] - statistics.median(
                c for s, c in by_stage.items() if s != bound))
    return min(excesses) if excesses else 0.0

