"""The node service's configuration: a YAML file, checked against a schema, with defaults.

``perfmon-agent serve --config FILE`` reads it at start and again on SIGHUP. A
file that does not parse or fit the schema is one line naming the file, the
key and the problem: at start an error (exit 2), on reload a warning (the
running configuration stays). Every key is optional; systemd/config.yaml is a
commented example and docs/service.md the reference.

Each setting is one field of ``ServiceConfig``: its type, default, bounds and help;
the schema (``SCHEMA``) and reading a file into a ServiceConfig are derived from the
fields (the ``attach:`` settings are AttachOptions', perfmon.agent.options).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

import jsonschema
import yaml
from perfmon.agent.options import config_schema
from perfmon.parsers.errors import PerfmonError
from perfmon.probes.files import read_user_file

DEFAULT_CONFIG_PATH = Path("/etc/perfmon-agent/config.yaml")
DEFAULT_JOBS_ROOT = Path("/var/lib/perfmon-agent/jobs")
MAX_CONFIG_BYTES = 1 << 20  # read_user_file's caps are in MiB


class ConfigError(PerfmonError):
    """The configuration file cannot be used."""

    exit_code = 2


@dataclass(frozen=True)
class Match:
    """Which ranks a rule picks: a command-line pattern (regex, searched in the command
    line joined by spaces) or a user (name or uid); empty: nothing."""

    commands: tuple[re.Pattern[str], ...] = ()
    uids: frozenset[int] = frozenset()

    def matches(self, command_line: str, uid: int) -> bool:
        return uid in self.uids or any(p.search(command_line) for p in self.commands)

    @property
    def empty(self) -> bool:
        return not self.commands and not self.uids


def _uids(users: list[str | int], where: str) -> frozenset[int]:
    import pwd

    uids = set()
    for user in users:
        if isinstance(user, int):
            uids.add(user)
            continue
        try:
            uids.add(pwd.getpwnam(user).pw_uid)
        except KeyError:
            raise ConfigError(f"{where}: no such user: {user!r}") from None
    return frozenset(uids)


def _match(raw: dict[str, Any] | None, where: str) -> Match:
    raw = raw or {}
    patterns = []
    for i, text in enumerate(raw.get("commands") or []):
        try:
            patterns.append(re.compile(text))
        except re.error as err:
            raise ConfigError(f"{where}.commands.{i}: not a regular expression: {err}") from None
    return Match(tuple(patterns), _uids(raw.get("users") or [], f"{where}.users"))


_PATTERNS = {"type": "array", "items": {"type": "string", "maxLength": 1024}, "maxItems": 256}
_USERS = {"type": "array", "items": {"type": ["string", "integer"]}, "maxItems": 1024}
_MATCH = {"type": "object", "additionalProperties": False,
          "properties": {"commands": _PATTERNS, "users": _USERS}}


def _setting(help_: str, *, read: Callable[[Any, str], Any] | None = None,
             **schema: Any) -> dict[str, Any]:
    """A ServiceConfig field's metadata: its help, its schema beyond the JSON type its
    annotation gives (JSON Schema keywords: minimum, maximum, exclusiveMinimum, ...), and
    how the checked YAML value becomes the field's (``read(value, where)``; else as is)."""
    return {"help": help_, "schema": schema, "read": read}


@dataclass(frozen=True)
class ServiceConfig:
    """The service's settings, each declared once: its type (the annotation), default,
    bounds and help. The config file's schema (``SCHEMA``) and reading it
    (``parse_config``) are derived from these fields."""

    jobs_root: Path = field(default=DEFAULT_JOBS_ROOT, metadata=_setting(
        "job folders go under <jobs_root>/<host>/",
        read=lambda value, _where: Path(value), minLength=1, maxLength=4096))
    # (a DNS name's length; kept to [A-Za-z0-9._-] where it names a folder or a label)
    host: str | None = field(default=None, metadata=_setting(
        "this node's name in folders, records, summaries and metrics (default: the "
        "system's host name; a container's is its own, not the node's: Kubernetes' "
        "spec.nodeName)",
        minLength=1, maxLength=253))
    metrics_address: str | None = field(default=None, metadata=_setting(
        "the Prometheus endpoint, HOST:PORT or 'off' (default: 127.0.0.1:9464)",
        maxLength=300))
    scan_interval_s: float = field(default=5.0, metadata=_setting(
        "seconds between scans of /proc for new jobs", minimum=0.2, maximum=3600))
    rank_wait_s: float = field(default=30.0, metadata=_setting(
        "wait this long for all of a node's ranks before attaching", minimum=0,
        maximum=3600))
    max_jobs: int = field(default=16, metadata=_setting(
        "jobs watched at once", minimum=1, maximum=1024))
    max_jobs_per_user: int = field(default=8, metadata=_setting(
        "no user takes more than this many of the slots (the others' jobs still get one)",
        minimum=1, maximum=1024))
    idle_yield_s: float = field(default=1800.0, metadata=_setting(
        "a watched job with no iteration for this long gives its slot to a waiting job and "
        "waits for a free one itself; generous, since loading a checkpoint takes minutes",
        minimum=10, maximum=604800))
    restart_interval_s: float = field(default=60.0, metadata=_setting(
        "a running job's session restarts for ranks that joined it at most this often",
        minimum=0, maximum=86400))
    cpu_budget_pct: float = field(default=8.0, metadata=_setting(
        "the agent's CPU for every job together, in % of one core", exclusiveMinimum=0,
        maximum=10000))
    cpu_budget_per_rank_pct: float = field(default=1.0, metadata=_setting(
        "... and at most this per rank", exclusiveMinimum=0, maximum=100))
    retry_initial_s: float = field(default=30.0, metadata=_setting(
        "a job that cannot be attached is retried after this ...", minimum=1, maximum=86400))
    retry_max_s: float = field(default=600.0, metadata=_setting(
        "... doubling up to this (at least retry_initial_s)", minimum=1, maximum=86400))
    keep_jobs: int = field(default=500, metadata=_setting(
        "finished job folders kept per host ...", minimum=1, maximum=1000000))
    keep_days: float = field(default=30.0, metadata=_setting(
        "... and for this long at most", exclusiveMinimum=0, maximum=36500))
    include: Match = field(default=Match(), metadata=_setting(
        "the ranks watched (empty: every training rank)", read=_match, **_MATCH))
    exclude: Match = field(default=Match(), metadata=_setting(
        "the ranks not watched", read=_match, **_MATCH))
    attach: dict[str, Any] = field(default_factory=dict, metadata=_setting(
        "how each job is measured: AttachOptions fields (perfmon.agent.options)",
        **config_schema()))

    def accepts(self, command_line: str, uid: int) -> bool:
        if not self.include.empty and not self.include.matches(command_line, uid):
            return False
        return not self.exclude.matches(command_line, uid)


# The JSON type of each annotation (a setting's schema adds its bounds to it).
_JSON_TYPES: dict[Any, str] = {float: "number", int: "integer", str: "string", Path: "string",
                               bool: "boolean", str | None: "string"}


def _schema() -> dict[str, Any]:
    """The config file's schema, of ServiceConfig's fields."""
    types = get_type_hints(ServiceConfig)
    properties: dict[str, Any] = {}
    for f in fields(ServiceConfig):
        json_type = _JSON_TYPES.get(types[f.name])
        properties[f.name] = {**({"type": json_type} if json_type else {}),
                              **f.metadata["schema"]}
    return {"type": "object", "additionalProperties": False, "properties": properties}


SCHEMA: dict[str, Any] = _schema()


def _location(err: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in err.absolute_path) or "(top level)"


def parse_config(text: str, source: str) -> ServiceConfig:
    """The configuration in ``text`` (YAML); ConfigError names ``source`` and the key."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or "not YAML"
        raise ConfigError(f"config {source}{where}: {problem}") from None
    if raw is None:
        raw = {}
    try:
        jsonschema.validate(raw, SCHEMA)
    except jsonschema.ValidationError as err:
        raise ConfigError(f"config {source}: {_location(err)}: {err.message}") from None
    values: dict[str, Any] = {}
    for f in fields(ServiceConfig):
        if f.name in raw:
            read = f.metadata["read"]
            value = raw[f.name]
            values[f.name] = read(value, f"config {source}: {f.name}") if read else value
    config = ServiceConfig(**values)
    if config.retry_max_s < config.retry_initial_s:
        raise ConfigError(f"config {source}: retry_max_s: below retry_initial_s")
    return config


def load_config(path: Path | None) -> ServiceConfig:
    """The configuration from ``path``; the defaults when ``path`` is None, or is the
    default path and does not exist (a node with no config file)."""
    if path is None:
        return ServiceConfig()
    if path == DEFAULT_CONFIG_PATH and not path.exists():
        return ServiceConfig()
    data = read_user_file(str(path), "config", MAX_CONFIG_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config {path}: not UTF-8 text") from None
    return parse_config(text, str(path))
