"""Reading a Chrome/Perfetto trace the agent wrote, checked against the trace-event
format's rules (the trace tests, the incident bundles')."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def trace_events(path: Path) -> list[dict[str, Any]]:
    """The trace's events, checked against the trace-event format's rules."""
    doc = json.loads(path.read_text())
    assert doc["otherData"]["clock"] == "CLOCK_MONOTONIC"
    events = doc["traceEvents"]
    for e in events:
        assert e["ph"] in ("X", "C", "i", "M") and isinstance(e["pid"], int)
        if e["ph"] != "M":
            assert isinstance(e["ts"], float | int)
        if e["ph"] in ("X", "i"):
            assert isinstance(e["tid"], int) and 0 < e["tid"] < 2**31
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, float | int) for v in e["args"].values())
    return events
