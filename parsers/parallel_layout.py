"""A job's parallel layout (tensor, context, expert, data and pipeline parallel sizes)
from its own command line, and each rank's coordinates in it (pure).

Megatron-LM and FlagScale jobs state the layout on their command line
(``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
``--virtual-pipeline-model-parallel-size`` or ``--num-layers-per-virtual-pipeline-stage``,
``--context-parallel-size``, ``--expert-model-parallel-size``,
``--expert-tensor-parallel-size``), the world is torchrun's (WORLD_SIZE), and the data
parallel size what is left of it. Ranks are laid out as Megatron's RankGenerator lays
them: in the order ``tp-cp-ep-dp-pp`` (the tensor-parallel rank varies fastest, the
pipeline stage slowest), or ``tp-cp-ep-pp-dp`` with ``--use-tp-pp-dp-mapping``; the
expert-parallel rank is ``rank // expert_tp % ep`` (its own generator, the same order).
A job that states none of these has no layout here (``stated`` False): its ranks have no
coordinates, and the summary says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from perfmon.parsers.errors import ModelConfigError
from perfmon.parsers.figures import RankCoords
from perfmon.parsers.megatron_args import int_flag, scan_flags

_SIZE_FLAGS = {
    "--tensor-model-parallel-size": "tp",
    "--pipeline-model-parallel-size": "pp",
    "--context-parallel-size": "cp",
    "--expert-model-parallel-size": "ep",
    "--expert-tensor-parallel-size": "etp",
    "--virtual-pipeline-model-parallel-size": "vpp",
    "--num-layers-per-virtual-pipeline-stage": "layers_per_virtual_stage",
    "--num-layers": "layers",
}
_TP_PP_DP = "--use-tp-pp-dp-mapping"
MAX_SIZE = 1 << 20


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of a job's parallel dimensions (``world_size`` ranks)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor parallel (Megatron's default: tp)
    vpp: int = 1  # virtual stages per pipeline rank (interleaved schedules)
    order: str = "tp-cp-ep-dp-pp"
    stated: bool = True  # False: the job states no layout (none here but the world)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    def coords(self, rank: int | None) -> RankCoords | None:
        """Where ``rank`` sits (None: not a rank of this world, or no layout stated)."""
        if not self.stated or rank is None or not 0 <= rank < self.world_size:
            return None
        tp, cp, pp, dp = self.tp, self.cp, self.pp, self.dp
        inner = rank // (tp * cp)  # (dp and pp, in the order's nesting)
        dp_rank, pp_rank = ((inner % dp, inner // dp) if self.order == "tp-cp-ep-dp-pp"
                            else (inner // pp, inner % pp))
        return RankCoords(dp=dp_rank, pp=pp_rank, tp=rank % tp, cp=rank // tp % cp,
                          ep=rank // self.etp % self.ep)

    def sizes(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "cp": self.cp, "ep": self.ep,
                "vpp": self.vpp}

    def to_facts(self, source: str | None) -> dict[str, object]:
        """session_info.layout: where it was stated (None: nowhere), the sizes, the order."""
        if not self.stated:
            return {"stated": False, "source": None, "world_size": self.world_size}
        return {"stated": True, "source": source, "world_size": self.world_size,
                "sizes": {**self.sizes(), "etp": self.etp}, "order": self.order}

    @classmethod
    def from_facts(cls, facts: object) -> ParallelLayout | None:
        """The layout session_info.layout holds (a log anyone may have written: None for
        one that is not a layout of whole sizes dividing its world)."""
        if not isinstance(facts, dict) or not facts.get("stated"):
            return None
        sizes, world = facts.get("sizes"), facts.get("world_size")
        if not isinstance(sizes, dict) or type(world) is not int or not 0 < world <= 1 << 24:
            return None
        got = {k: sizes.get(k, 1) for k in ("tp", "pp", "cp", "ep", "etp", "vpp")}
        if not all(type(v) is int and 1 <= v <= MAX_SIZE for v in got.values()) \
                or world % (got["tp"] * got["pp"] * got["cp"]):
            return None
        order = facts.get("order")
        return cls(world, **got, order=order if order == "tp-cp-ep-pp-dp" else "tp-cp-ep-dp-pp")


def parse_layout(argv: Sequence[str], world_size: int) -> ParallelLayout:
    """The layout ``argv`` states for a world of ``world_size`` ranks (``stated`` False
    where it states none). Raises ModelConfigError naming the flag for a value that is
    not a size, or sizes the world does not divide into."""
    given: dict[str, int] = {}
    for flag, value in scan_flags(argv, list(_SIZE_FLAGS), [_TP_PP_DP]):
        if value is None:
            given["tp_pp_dp"] = 1
            continue
        size = int_flag(flag, value)
        if not 1 <= size <= MAX_SIZE:
            raise ModelConfigError(f"target command line: {flag} {size} is not a size "
                                   f"(1 to {MAX_SIZE})")
        given[_SIZE_FLAGS[flag]] = size
    layers = given.pop("layers", None)
    order = "tp-cp-ep-pp-dp" if given.pop("tp_pp_dp", 0) else "tp-cp-ep-dp-pp"
    per_virtual = given.pop("layers_per_virtual_stage", None)
    if not given:
        return ParallelLayout(world_size, order=order, stated=False)
    tp, pp, cp = given.get("tp", 1), given.get("pp", 1), given.get("cp", 1)
    vpp = given.get("vpp", 1)
    if per_virtual and "vpp" not in given and layers and layers % (pp * per_virtual) == 0:
        vpp = layers // (pp * per_virtual)
    if world_size % (tp * pp * cp):
        raise ModelConfigError(
            f"target command line: a world of {world_size} ranks is not a multiple of "
            f"tensor x pipeline x context parallel size ({tp} x {pp} x {cp})")
    return ParallelLayout(world_size, tp=tp, pp=pp, cp=cp, ep=given.get("ep", 1),
                          etp=given.get("etp", tp), vpp=vpp, order=order)
