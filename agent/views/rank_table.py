"""Which ranks a view draws one by one: all of a small job, the extremes of a large one.

A summary may list 100,000 ranks (a big job merged, or a file anyone wrote); a
table or a terminal of that many rows says nothing and takes minutes. Views draw
every rank up to ``2 * each_way``, else the ``each_way`` slowest and fastest by
the rank's compute per step (else its step time), and the rest as a distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from perfmon.agent.reducers.iterations import percentile

ORDER_KEYS = ("avg_compute_ms", "avg_step_time_ms")


@dataclass(frozen=True)
class RankSelection:
    """The ranks to draw (slowest first when ordered) and what the others look like."""

    shown: list[dict[str, Any]]
    rest: int  # ranks not drawn
    by: str | None  # the figure the ranks are ordered by (None: not ordered)
    # min, p10, p50, p90, max of ``by`` over the ranks not drawn (ms); None without
    rest_ms: dict[str, float] | None = None

    @property
    def rest_at(self) -> int:
        """Where the row of the ranks not drawn goes among ``shown``: between the slowest
        and the fastest, or last when the ranks are not ordered."""
        return len(self.shown) // 2 if self.by is not None else len(self.shown)


def _figure(rank: dict[str, Any], key: str) -> float | None:
    value = rank.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def select_ranks(ranks: list[dict[str, Any]], each_way: int) -> RankSelection:
    """All of ``ranks`` when they are at most ``2 * each_way``; else the slowest and the
    fastest ``each_way`` by compute (else step) time, and the distribution of the rest."""
    if len(ranks) <= 2 * each_way:
        return RankSelection(list(ranks), 0, None)
    by = next((k for k in ORDER_KEYS if any(_figure(r, k) is not None for r in ranks)), None)
    if by is None:
        return RankSelection(list(ranks[:2 * each_way]), len(ranks) - 2 * each_way, None)
    known = sorted((r for r in ranks if _figure(r, by) is not None),
                   key=lambda r: _figure(r, by) or 0.0, reverse=True)
    unknown = len(ranks) - len(known)
    shown = known[:each_way] + known[max(each_way, len(known) - each_way):]
    middle = sorted(_figure(r, by) or 0.0 for r in known[each_way:len(known) - each_way])
    rest_ms = ({"min": middle[0], "p10": percentile(middle, 0.1) or 0.0,
                "p50": percentile(middle, 0.5) or 0.0, "p90": percentile(middle, 0.9) or 0.0,
                "max": middle[-1]} if middle else None)
    return RankSelection(shown, len(middle) + unknown, by, rest_ms)


def describe_rest(selection: RankSelection) -> str:
    """One line for the ranks not drawn."""
    if not selection.rest:
        return ""
    text = f"{selection.rest:,} more ranks"
    if selection.rest_ms is not None and selection.by is not None:
        d = selection.rest_ms
        text += (f": {selection.by.removeprefix('avg_').removesuffix('_ms')} min "
                 f"{d['min']:.1f}, p10 {d['p10']:.1f}, median {d['p50']:.1f}, p90 "
                 f"{d['p90']:.1f}, max {d['max']:.1f} ms")
    return text
