"""docs/prometheus/rules.yml against the Python rules it mirrors: every threshold the
PromQL (or a rule's comment) states is the agent's own constant, so a change on one side
fails here until the other follows.

- The slow host (the recording rules job:perfmon_host_compute_seconds:* and the alert
  PerfmonSlowHost) is StragglerRule's cross-host form (``across_hosts``, merge's
  ``slow_host``): 1.4826, k, min_share, min_ms, SPREAD_HOSTS.
- PerfmonRankStraggler's comment: StragglerRule's hold and hold_s.
- PerfmonJobHung's comment: AttachOptions' hang_factor and hang_timeout_s.
- PerfmonPipelineStageBound: StageRule's min_share.
- PerfmonFailSlow reads the agent's own judgement (perfmon_fail_slow_ratio, present
  only while an episode is open); its bound must not hide an episode FailSlowRule opens.

Pure: the file is read, nothing runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from perfmon.agent.options import AttachOptions
from perfmon.agent.reducers.failslow import FailSlowRule
from perfmon.agent.reducers.pipeline import StageRule
from perfmon.agent.reducers.ranks import MAD_TO_SIGMA, SPREAD_HOSTS, StragglerRule

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "docs" / "prometheus" / "rules.yml"
RULE = StragglerRule()

# A numeric literal of PromQL, not a digit inside a name (p50_5m) or a range ([5m]).
_NUMBER = re.compile(r"(?<![\w:.\[])\d+(?:\.\d+)?(?![\w.])")


def _rules() -> dict[str, dict[str, Any]]:
    """Every rule by its record or alert name."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule.get("record") or rule["alert"]: rule
            for group in groups for rule in group["rules"]}


def _numbers(name: str) -> list[float]:
    """The numeric literals of a rule's expression, in order."""
    return [float(n) for n in _NUMBER.findall(_rules()[name]["expr"])]


def _comment_above(alert: str) -> str:
    """The comment lines just above ``- alert: <alert>``, joined into one line."""
    lines = RULES.read_text().splitlines()
    [at] = [i for i, line in enumerate(lines) if line.strip() == f"- alert: {alert}"]
    comment: list[str] = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("#"):
            break
        comment.insert(0, line.strip().removeprefix("#").strip())
    return " ".join(comment)


def test_the_number_pattern_finds_literals_only() -> None:
    expr = ("1.4826 * quantile by (job) (0.5, x:perfmon_a_p50_5m[5m]) >= 3 "
            "or clamp_min(0.1 * y, 0.001)")
    assert [float(n) for n in _NUMBER.findall(expr)] == [1.4826, 0.5, 3, 0.1, 0.001]


def test_the_reference_host_is_the_median_from_spread_hosts_on_else_the_faster() -> None:
    # quantile 0.5 where count >= SPREAD_HOSTS, or min where the count is 2: the two
    # branches cover every count from 2 only while SPREAD_HOSTS is 3.
    assert _numbers("job:perfmon_host_compute_seconds:reference") == [
        0.5, SPREAD_HOSTS, 2]
    assert SPREAD_HOSTS - 1 == 2, "the min branch (== 2) must cover every count below"


def test_the_spread_is_the_rules_robust_spread_over_spread_hosts() -> None:
    assert _numbers("job:perfmon_host_compute_seconds:spread") == [
        MAD_TO_SIGMA, 0.5, SPREAD_HOSTS]


def test_the_bar_is_the_rules_bar() -> None:
    # max(k x spread, min_share x step, min_ms), in seconds: min_ms / 1000.
    floor = [RULE.min_share, RULE.min_ms / 1000]
    assert _numbers("job:perfmon_host_compute_seconds:bar") == pytest.approx(
        [RULE.k, *floor, *floor])


def test_the_step_is_the_ranks_mean_compute_plus_wait() -> None:
    expr = " ".join(_rules()["job:perfmon_rank_step_seconds:avg"]["expr"].split())
    assert expr == ("avg by (job, user) (perfmon_rank_compute_seconds + "
                    "perfmon_rank_wait_seconds)")


def test_a_slow_host_is_one_whose_excess_is_above_the_bar() -> None:
    # Strictly above, as across_hosts (an excess at the bar is no slow host).
    expr = " ".join(_rules()["PerfmonSlowHost"]["expr"].split())
    assert expr == ("job_host:perfmon_host_compute_seconds:excess > on (job, user) "
                    "group_left job:perfmon_host_compute_seconds:bar")
    at_bar = RULE.across_hosts({"a": 100.0, "b": 110.0}, 100.0)  # excess 10 = the floor
    assert at_bar is None
    assert RULE.across_hosts({"a": 100.0, "b": 110.5}, 100.0) is not None


def test_the_straggler_alerts_comment_says_the_rules_hold() -> None:
    comment = _comment_above("PerfmonRankStraggler")
    found = re.search(r"at (\d+) evaluations in a row for (\d+(?:\.\d+)?) s", comment)
    assert found, comment
    assert (int(found[1]), float(found[2])) == (RULE.hold, RULE.hold_s)


def test_the_hang_alerts_comment_says_the_hang_threshold() -> None:
    comment = _comment_above("PerfmonJobHung")
    found = re.search(r"max\((\d+(?:\.\d+)?) x the median step, (\d+(?:\.\d+)?) s\)", comment)
    assert found, comment
    defaults = AttachOptions()
    assert (float(found[1]), float(found[2])) == (defaults.hang_factor,
                                                  defaults.hang_timeout_s)


def test_the_fail_slow_alert_fires_for_every_episode_the_agent_opens() -> None:
    # perfmon_fail_slow_ratio is the open episode's ratio to the healthy pace, a rise of
    # at least FailSlowRule.threshold: a bound above 1 + threshold would hide some.
    [bound] = _numbers("PerfmonFailSlow")
    assert ">" in _rules()["PerfmonFailSlow"]["expr"]
    assert 1 <= bound < 1 + FailSlowRule().threshold


@pytest.mark.parametrize(("compute", "host", "reference", "spread"), [
    ({"a": 100, "b": 101, "c": 130}, "c", 101, MAD_TO_SIGMA * 1),
    ({"a": 100, "b": 130}, "b", 100, 0.0),  # of two: the faster, no spread
    ({"a": 100, "b": 100, "c": 100, "d": 140}, "d", 100, 0.0),
])
def test_across_hosts_is_the_promql_rule(compute: dict[str, float], host: str,
                                         reference: float, spread: float) -> None:
    """across_hosts computed as the recording rules do, step 150 ms."""
    slow = RULE.across_hosts(compute, 150.0)
    assert slow is not None and slow.host == host
    assert slow.reference_ms == reference and slow.spread_ms == pytest.approx(spread)
    assert slow.bar_ms == pytest.approx(max(RULE.k * spread, RULE.min_share * 150, 1.0))
    assert slow.excess_ms == compute[host] - reference


def test_across_hosts_finds_none_among_balanced_or_noisy_hosts_or_one_host() -> None:
    assert RULE.across_hosts({"a": 100, "b": 102, "c": 98}, 150.0) is None
    assert RULE.across_hosts({"a": 100, "b": 120, "c": 80, "d": 140, "e": 60, "f": 150},
                             150.0) is None
    assert RULE.across_hosts({"a": 100}, 150.0) is None
    assert RULE.across_hosts({}, 150.0) is None


def test_the_stage_bound_alert_is_the_stage_rules_share() -> None:
    [bound] = _numbers("PerfmonPipelineStageBound")
    assert ">" in _rules()["PerfmonPipelineStageBound"]["expr"]
    assert bound == StageRule().min_share
