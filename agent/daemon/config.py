"""The node service's configuration: a YAML file, checked against a schema, with defaults.

``perfmon-agent serve --config FILE`` reads it at start and again on SIGHUP. A
file that does not parse or fit the schema is one line naming the file, the
key and the problem: at start an error (exit 2), on reload a warning (the
running configuration stays). Every key is optional; systemd/config.yaml is a
commented example and docs/service.md the reference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from perfmon.agent.options import config_schema
from perfmon.parsers.errors import PerfmonError
from perfmon.probes.files import read_user_file

DEFAULT_CONFIG_PATH = Path("/etc/perfmon-agent/config.yaml")
DEFAULT_JOBS_ROOT = Path("/var/lib/perfmon-agent/jobs")
MAX_CONFIG_BYTES = 1 << 20  # read_user_file's caps are in MiB

_PATTERNS = {"type": "array", "items": {"type": "string", "maxLength": 1024}, "maxItems": 256}
_USERS = {"type": "array", "items": {"type": ["string", "integer"]}, "maxItems": 1024}
_MATCH = {"type": "object", "additionalProperties": False,
          "properties": {"commands": _PATTERNS, "users": _USERS}}

SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "jobs_root": {"type": "string", "minLength": 1, "maxLength": 4096},
        # (a DNS name's length; kept to [A-Za-z0-9._-] where it names a folder or a label)
        "host": {"type": "string", "minLength": 1, "maxLength": 253},
        "metrics_address": {"type": "string", "maxLength": 300},
        "scan_interval_s": {"type": "number", "minimum": 0.2, "maximum": 3600},
        "rank_wait_s": {"type": "number", "minimum": 0, "maximum": 3600},
        "max_jobs": {"type": "integer", "minimum": 1, "maximum": 1024},
        "max_jobs_per_user": {"type": "integer", "minimum": 1, "maximum": 1024},
        "idle_yield_s": {"type": "number", "minimum": 10, "maximum": 604800},
        "restart_interval_s": {"type": "number", "minimum": 0, "maximum": 86400},
        "cpu_budget_pct": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
        "cpu_budget_per_rank_pct": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
        "retry_initial_s": {"type": "number", "minimum": 1, "maximum": 86400},
        "retry_max_s": {"type": "number", "minimum": 1, "maximum": 86400},
        "keep_jobs": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "keep_days": {"type": "number", "exclusiveMinimum": 0, "maximum": 36500},
        "include": _MATCH,
        "exclude": _MATCH,
        "attach": config_schema(),
    },
}


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


@dataclass(frozen=True)
class ServiceConfig:
    jobs_root: Path = DEFAULT_JOBS_ROOT
    # The node's name in folders, records, summaries and metrics (None: the system's host
    # name): a container's is its own, not the node's (Kubernetes: spec.nodeName).
    host: str | None = None
    metrics_address: str | None = None  # None: the default (127.0.0.1:9464)
    scan_interval_s: float = 5.0
    rank_wait_s: float = 30.0  # wait this long for all of a node's ranks before attaching
    max_jobs: int = 16
    # No user takes more than this many of the slots (the others' jobs still get one).
    max_jobs_per_user: int = 8
    # A watched job with no iteration for this long gives its slot to a waiting job and
    # waits for a free one itself; generous, since loading a checkpoint takes minutes.
    idle_yield_s: float = 1800.0
    # A running job's session restarts for ranks that joined it at most this often.
    restart_interval_s: float = 60.0
    cpu_budget_pct: float = 8.0  # of one core, for every job together
    cpu_budget_per_rank_pct: float = 1.0
    retry_initial_s: float = 30.0
    retry_max_s: float = 600.0
    keep_jobs: int = 500  # finished job folders kept per host...
    keep_days: float = 30.0  # ... and for this long at most
    include: Match = Match()  # empty: every training rank
    exclude: Match = Match()
    attach: dict[str, Any] = field(default_factory=dict)  # AttachOptions fields

    def accepts(self, command_line: str, uid: int) -> bool:
        if not self.include.empty and not self.include.matches(command_line, uid):
            return False
        return not self.exclude.matches(command_line, uid)


def _location(err: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in err.absolute_path) or "(top level)"


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
    fields = {k: v for k, v in raw.items() if k not in ("include", "exclude", "jobs_root")}
    config = ServiceConfig(**fields,
                           include=_match(raw.get("include"), f"config {source}: include"),
                           exclude=_match(raw.get("exclude"), f"config {source}: exclude"))
    if "jobs_root" in raw:
        config = ServiceConfig(**{**config.__dict__, "jobs_root": Path(raw["jobs_root"])})
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
