"""perfmon.parsers.parallel_layout: a job's layout from its command line, and each rank's
coordinates laid out as Megatron's RankGenerator lays them (the rank is the sum of each
coordinate times the product of the sizes before it, in the order)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from perfmon.parsers.errors import ModelConfigError
from perfmon.parsers.parallel_layout import parse_layout


def _argv(**sizes: int) -> list[str]:
    flags = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
             "cp": "--context-parallel-size", "ep": "--expert-model-parallel-size"}
    return [x for k, v in sizes.items() for x in (flags[k], str(v))]


@given(tp=st.integers(1, 4), cp=st.integers(1, 3), pp=st.integers(1, 4), dp=st.integers(1, 4),
       mapping=st.booleans())
def test_the_coordinates_compose_back_into_the_rank_in_megatrons_order(tp, cp, pp, dp,
                                                                       mapping):
    world = tp * cp * pp * dp
    layout = parse_layout(_argv(tp=tp, cp=cp, pp=pp) + (["--use-tp-pp-dp-mapping"]
                                                        if mapping else []), world)
    assert layout.dp == dp
    seen = set()
    for rank in range(world):
        c = layout.coords(rank)
        assert c is not None
        assert 0 <= c.tp < tp and 0 <= c.cp < cp and 0 <= c.pp < pp and 0 <= c.dp < dp
        # tp-cp-dp-pp (default) or tp-cp-pp-dp: each coordinate's stride the product of
        # the sizes before it.
        order = [(c.tp, tp), (c.cp, cp)] + ([(c.pp, pp), (c.dp, dp)] if mapping
                                            else [(c.dp, dp), (c.pp, pp)])
        composed, stride = 0, 1
        for coordinate, size in order:
            composed += coordinate * stride
            stride *= size
        assert composed == rank
        seen.add((c.tp, c.cp, c.pp, c.dp))
    assert len(seen) == world


def test_a_pipeline_of_two_stages_of_two_replicas():
    layout = parse_layout(["train.py", "--pipeline-model-parallel-size=2"], 4)
    assert [(c.pp, c.dp) for c in map(layout.coords, range(4))] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert layout.sizes() == {"dp": 2, "pp": 2, "tp": 1, "cp": 1, "ep": 1, "vpp": 1}


def test_virtual_stages_and_expert_ranks():
    layout = parse_layout([*_argv(pp=2, ep=2), "--num-layers", "16",
                           "--num-layers-per-virtual-pipeline-stage", "2"], 8)
    assert layout.vpp == 4
    assert [layout.coords(r).ep for r in range(4)] == [0, 1, 0, 1]
    assert parse_layout(["--virtual-pipeline-model-parallel-size", "3", *_argv(pp=2)], 2).vpp == 3


def test_no_layout_stated_is_said_and_gives_no_coordinates():
    layout = parse_layout(["train.py", "--lr", "3"], 8)
    assert not layout.stated and layout.coords(0) is None
    assert parse_layout(_argv(pp=2), 4).coords(4) is None  # (not a rank of this world)


@pytest.mark.parametrize(("argv", "world", "message"), [
    (_argv(pp=3), 4, "not a multiple of"),
    (["--tensor-model-parallel-size", "two"], 4, "expects an integer"),
    (["--pipeline-model-parallel-size", "0"], 4, "is not a size"),
    (["--pipeline-model-parallel-size"], 4, "has no value"),
])
def test_a_layout_the_world_cannot_hold_is_one_clear_error(argv, world, message):
    with pytest.raises(ModelConfigError, match=message):
        parse_layout(argv, world)
