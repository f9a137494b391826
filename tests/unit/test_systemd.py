"""The systemd unit as shipped (systemd/perfmon-agent.service): every capability it keeps is
explained in docs/service.md. (`make install` and systemd-analyze:
tests/e2e/test_systemd.py.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "perfmon-agent.service"
SERVICE_DOC = ROOT / "docs" / "service.md"


def test_every_capability_of_the_unit_is_explained_in_the_docs() -> None:
    text = UNIT.read_text()
    [bounding] = re.findall(r"^CapabilityBoundingSet=(.*)$", text, re.M)
    [ambient] = re.findall(r"^AmbientCapabilities=(.*)$", text, re.M)
    assert bounding.split() == ambient.split()
    doc = SERVICE_DOC.read_text()
    for capability in bounding.split():
        assert re.search(rf"^\|[^\n]*`{capability}`[^\n]*\|", doc, re.M), capability
