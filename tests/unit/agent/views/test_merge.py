"""`merge`'s rules on exact figures (perfmon.agent.views.merge; two real sessions merged:
tests/e2e/test_merge.py)."""

from __future__ import annotations

import pytest
from perfmon.agent.views import merge


def _hosts(**compute: float) -> list[dict]:
    return [{"host": h, "median_compute_ms": c} for h, c in compute.items()]


def test_a_slow_host_stands_out_by_the_rank_rule_and_balanced_hosts_do_not():
    steps = [150.0] * 8  # the ranks' mean step
    # Three hosts, one 30 ms slower: against the median host, above 10% of the step.
    slow = merge.slow_host(_hosts(a=100, b=101, c=130), steps)
    assert slow is not None and slow["host"] == "c"
    assert slow["reference_ms"] == 101 and slow["excess_ms"] == 29
    assert slow["spread_ms"] == pytest.approx(1.4826) and slow["bar_ms"] == 15
    # Balanced (within 2%), of two hosts and of three: none.
    assert merge.slow_host(_hosts(a=100, b=102), steps) is None
    assert merge.slow_host(_hosts(a=100, b=102, c=98), steps) is None
    # Under the minimum effect: none; a noisy set of hosts raises the bar.
    assert merge.slow_host(_hosts(a=100, b=100, c=110), steps) is None
    noisy = _hosts(a=100, b=120, c=80, d=140, e=60, f=150)
    assert merge.slow_host(noisy, steps) is None
    # Of two hosts, against the faster one; one host or no step: nothing to compare.
    assert merge.slow_host(_hosts(a=100, b=130), steps)["excess_ms"] == 30
    assert merge.slow_host(_hosts(a=100), steps) is None
    assert merge.slow_host(_hosts(a=100, b=130), []) is None
