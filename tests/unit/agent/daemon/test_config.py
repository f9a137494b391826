"""The service's example config (systemd/config.yaml) read by perfmon.agent.daemon.config."""

from __future__ import annotations

from pathlib import Path

from perfmon.agent.daemon.config import load_config

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE_CONFIG = ROOT / "systemd" / "config.yaml"


def test_the_example_config_is_valid_and_gives_the_defaults() -> None:
    example = load_config(EXAMPLE_CONFIG)
    defaults = load_config(None)
    assert example.__dict__ == {**defaults.__dict__, "metrics_address": "127.0.0.1:9464",
                                "attach": example.attach}
