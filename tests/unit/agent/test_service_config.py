"""The service's config (perfmon.agent.daemon.config): each setting is one ServiceConfig
field, and the schema, reading a file and the docs follow from it. Pure: parse_config on
text, the docs read; nothing runs (tests/test_service.py runs `serve` on bad files)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from perfmon.agent.daemon.config import (
    DEFAULT_JOBS_ROOT,
    SCHEMA,
    ConfigError,
    ServiceConfig,
    parse_config,
)
from perfmon.agent.options import DEFAULT_METRICS_ADDRESS, config_schema

ROOT = Path(__file__).resolve().parents[3]
SERVICE_DOC = ROOT / "docs" / "service.md"
SETTINGS = {f.name: f for f in dataclasses.fields(ServiceConfig)}


def _error(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "the-file")
    assert caught.value.exit_code == 2
    [line] = str(caught.value).splitlines()
    return line


def test_every_setting_is_in_the_schema_with_its_type_bounds_and_help() -> None:
    properties = SCHEMA["properties"]
    assert SCHEMA["additionalProperties"] is False
    assert set(properties) == set(SETTINGS)
    assert all(f.metadata["help"] for f in SETTINGS.values())
    assert properties["scan_interval_s"] == {"type": "number", "minimum": 0.2, "maximum": 3600}
    assert properties["max_jobs"] == {"type": "integer", "minimum": 1, "maximum": 1024}
    assert properties["cpu_budget_pct"] == {"type": "number", "exclusiveMinimum": 0,
                                            "maximum": 10000}
    assert properties["jobs_root"] == {"type": "string", "minLength": 1, "maxLength": 4096}
    assert properties["host"] == {"type": "string", "minLength": 1, "maxLength": 253}
    assert properties["include"]["type"] == "object"
    assert properties["attach"] == config_schema()


def test_an_empty_file_gives_the_defaults_and_values_are_read_into_their_types() -> None:
    assert parse_config("", "x") == ServiceConfig()
    assert ServiceConfig().jobs_root == DEFAULT_JOBS_ROOT
    config = parse_config("jobs_root: /srv/jobs\nmax_jobs: 3\ninclude: {users: [0]}\n"
                          "exclude: {commands: ['ci-']}\nattach: {log_interval: 5}\n", "x")
    assert config.jobs_root == Path("/srv/jobs") and config.max_jobs == 3
    assert config.include.uids == frozenset({0}) and not config.include.commands
    assert [p.pattern for p in config.exclude.commands] == ["ci-"]
    assert config.attach == {"log_interval": 5}
    assert config.scan_interval_s == ServiceConfig.scan_interval_s


@pytest.mark.parametrize(("text", "says"), [
    ("max_jobs: [1\n", "config the-file (line 2): "),
    ("max_jobs: -1\n", "config the-file: max_jobs: -1 is less than the minimum of 1"),
    ("scan_interval_s: 0.1\n", "scan_interval_s: 0.1 is less than the minimum of 0.2"),
    ("cpu_budget_pct: 0\n", "cpu_budget_pct: 0 is less than or equal to the minimum of 0"),
    ("keep_days: 40000\n", "keep_days: 40000 is greater than the maximum of 36500"),
    ("max_jobs: 1.5\n", "max_jobs: 1.5 is not of type 'integer'"),
    ("jobs_root: 5\n", "jobs_root: 5 is not of type 'string'"),
    ("host: ''\n", "host: '' should be non-empty"),
    ("no_such_key: 1\n", "(top level): Additional properties are not allowed ('no_such_key'"),
    ("include: {commands: ['(']}\n",
     "config the-file: include.commands.0: not a regular expression"),
    ("exclude: {users: [no-such-user-here]}\n",
     "config the-file: exclude.users: no such user: 'no-such-user-here'"),
    ("attach: {probe_backend: ebpf}\n", "attach.probe_backend: 'ebpf' is not one of"),
    ("retry_initial_s: 100\nretry_max_s: 50\n",
     "config the-file: retry_max_s: below retry_initial_s"),
])
def test_a_bad_value_is_one_line_naming_the_file_and_the_key(text: str, says: str) -> None:
    line = _error(text)
    assert line.startswith("config the-file") and says in line, line


def _config_table() -> list[tuple[list[str], list[str], str]]:
    """docs/service.md's Configuration table: (keys, defaults, meaning) per row."""
    section = SERVICE_DOC.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows.append((re.findall(r"`(\w+)`", cells[0]), cells[1].split(", "), cells[2]))
    return rows


def _default(name: str) -> Any:
    value = SETTINGS[name].default
    if name == "jobs_root":
        return f"`{value}`"
    if name == "metrics_address":
        return f"`{DEFAULT_METRICS_ADDRESS}`"
    return value


def test_the_docs_table_has_every_setting_with_its_default_and_bounds() -> None:
    rows = _config_table()
    documented = [k for keys, _, _ in rows for k in keys]
    assert sorted(documented) == sorted(SETTINGS)
    for keys, defaults, meaning in rows:
        if keys[0] in ("host", "include", "attach"):
            continue  # no value: the system's host name, all / none, attach's own
        assert len(defaults) == len(keys), (keys, defaults)
        for key, text in zip(keys, defaults, strict=True):
            want = _default(key)
            assert (float(text) == want if isinstance(want, (int, float)) else text == want), (
                key, text, want)
        if bounds := re.search(r"\(([\d.]+) \.\. ([\d.]+)\)", meaning):
            schema = SCHEMA["properties"][keys[0]]
            assert (float(bounds[1]), float(bounds[2])) == (schema["minimum"],
                                                            schema["maximum"]), keys


def test_the_docs_table_lists_every_attach_setting() -> None:
    [(_, _, meaning)] = [row for row in _config_table() if row[0] == ["attach"]]
    listed = re.findall(r"`(\w+)`", meaning.split(":", 1)[0])
    assert sorted(listed) == sorted(config_schema()["properties"])
