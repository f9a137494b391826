"""DataQuality (perfmon.agent.reducers.quality): what each source missed, a minor miss told
apart from a loss."""

from __future__ import annotations

from perfmon.agent.reducers.quality import DataQuality


def test_sampling_errors_within_5pct_of_the_samples_are_minor_and_beyond_a_loss():
    quality = DataQuality()
    quality.on_quality({"source": "pyspy", "counters": {"samples": 100, "sampling_errors": 5,
                                                        "lost_windows": 0}})
    quality.on_quality({"source": "uprobes", "counters": {"events": 10, "events_dropped": 1}})
    summary, _ = quality.summary()
    assert [line.split(" (")[0] for line in summary["losses"]] == ["uprobes: events_dropped 1"]
    assert [line.split(" (")[0] for line in summary["minor"]] == ["pyspy: sampling_errors 5"]
    quality.on_quality({"source": "pyspy", "counters": {"samples": 100, "sampling_errors": 6}})
    assert [line.split(" (")[0] for line in quality.summary()[0]["losses"]] == [
        "pyspy: sampling_errors 6", "uprobes: events_dropped 1"]
    assert quality.summary()[0]["minor"] == []
