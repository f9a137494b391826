"""The house rules of docs/architecture.md, read off the source: which room may import
which (every import, those inside functions too), one constructor of the reducers, every
recorded file's name from record/layout.py, typed summary records that match the schema,
and the size of modules and functions.
"""

from __future__ import annotations

import ast
import json
import re
from importlib.resources import files
from pathlib import Path

import pytest
from perfmon.agent.record.replay import rebuild_from_event_log
from perfmon.agent.reducers import Summarizer
from perfmon.parsers.schema_types import typed_dicts_source

from tests.eventlogs import write_log

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"agent": "perfmon.agent", "probes": "perfmon.probes", "parsers": "perfmon.parsers"}
# Modules hold one concept each, however long (split by meaning, never by a count);
# a function longer than this is doing several things.
MAX_FUNCTION_LINES = 80

# room -> module prefixes it must not import. A room is a folder of agent/ (its modules
# and sub-folders), probes or parsers; "shared" is agent/'s own modules that every room
# uses (console, argtypes), "options" the attach options (measure and daemon share them).
FORBIDDEN = {
    "parsers": ("perfmon.probes", "perfmon.agent"),
    "probes": ("perfmon.agent",),
    "reducers": ("perfmon.probes", "perfmon.agent.measure", "perfmon.agent.record",
                 "perfmon.agent.views", "perfmon.agent.daemon", "perfmon.agent.tools"),
    "record": ("perfmon.agent.measure", "perfmon.agent.views", "perfmon.agent.daemon",
               "perfmon.agent.tools"),
    "measure": ("perfmon.agent.views", "perfmon.agent.daemon", "perfmon.agent.tools"),
    "views": ("perfmon.probes", "perfmon.agent.measure", "perfmon.agent.daemon",
              "perfmon.agent.tools"),
    "daemon": ("perfmon.agent.views", "perfmon.agent.tools"),
    "tools": ("perfmon.agent.views", "perfmon.agent.daemon"),
    "shared": ("perfmon.probes", "perfmon.agent.measure", "perfmon.agent.record",
               "perfmon.agent.reducers", "perfmon.agent.views", "perfmon.agent.daemon",
               "perfmon.agent.tools", "perfmon.agent.options", "perfmon.agent.cli"),
    "options": ("perfmon.agent.measure", "perfmon.agent.views", "perfmon.agent.daemon",
                "perfmon.agent.tools", "perfmon.agent.cli"),
    "cli": (),
}


def _sources() -> list[Path]:
    return sorted(p for folder in PACKAGES for p in (ROOT / folder).rglob("*.py"))


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _room(module: str) -> str:
    parts = module.split(".")
    if parts[1] in ("probes", "parsers"):
        return parts[1]
    if len(parts) == 2 or parts[2] in ("console", "argtypes"):
        return "shared"
    if parts[2] in ("options", "cli"):
        return parts[2]
    assert (ROOT / "agent" / parts[2]).is_dir(), f"{module}: a module of agent/ in no room"
    return parts[2]


def _is_module(name: str) -> bool:
    top, _, rest = name.partition(".")
    if top != "perfmon" or not rest:
        return False
    folder, _, inner = rest.partition(".")
    base = ROOT / folder / Path(*inner.split(".")) if inner else ROOT / folder
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, anywhere in it: ``from a import b`` is
    a.b when that is a module, else a."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((node.lineno, full if _is_module(full) else base))
    return found


def test_every_import_points_the_allowed_way() -> None:
    broken = []
    for path in _sources():
        room = _room(_module(path))
        for line, name in imports_of(path):
            bad = [p for p in FORBIDDEN[room] if name == p or name.startswith(p + ".")]
            if bad:
                broken.append(f"{path.relative_to(ROOT)}:{line}: {room} imports {name}")
    assert not broken, "\n".join(broken)


def test_the_import_walk_sees_imports_inside_functions(tmp_path: Path) -> None:
    # The walker itself: an import in a function body, and a relative one, are found.
    planted = ROOT / "parsers" / "_planted_for_test.py"
    planted.write_text("def f():\n    from perfmon.probes import files\n    from . import events\n")
    try:
        assert imports_of(planted) == [(2, "perfmon.probes.files"), (3, "perfmon.parsers.events")]
    finally:
        planted.unlink()


def test_the_summarizer_is_built_only_by_its_constructor_from_the_facts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In the source: Summarizer(...) is called nowhere but in Summarizer.from_facts, and
    # the live session and the replay (summarize, report, top's inputs) both call that.
    callers: dict[str, set[str]] = {}
    for path in _sources():
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Call):
                    text = ast.unparse(node.func)
                    if text in ("Summarizer", "Summarizer.from_facts", "cls"):
                        callers.setdefault(text, set()).add(
                            f"{path.relative_to(ROOT)}:{func.name}")
    assert callers.get("Summarizer", set()) == set()
    assert "agent/reducers/__init__.py:from_facts" in callers["cls"]
    assert {"agent/measure/session.py:_begin",
            "agent/record/replay.py:start"} <= callers["Summarizer.from_facts"]
    # At run time: replaying a log builds its Summarizer through from_facts.
    made = []
    original = Summarizer.from_facts.__func__  # type: ignore[attr-defined]

    def spy(cls: type[Summarizer], facts: dict[str, object]) -> Summarizer:
        made.append(facts)
        return original(cls, facts)  # type: ignore[no-any-return]

    monkeypatch.setattr(Summarizer, "from_facts", classmethod(spy))
    log = write_log(tmp_path / "perf_events_20261201_000000.msgpack", 12)
    rebuilt = rebuild_from_event_log(log)
    assert len(made) == 1 and made[0]["primary_pid"] == rebuilt.summary["session_info"]["pid"]


# Pieces of the recorded files' names: written anywhere but record/layout.py, a name
# could drift from what the finders look for.
_NAME_PIECES = re.compile(r"perf_summary_|perf_events_|hang_report_|job\.json|\.msgpack|"
                          r"\.part\d|\.part\{|incident_|incident\.json|stacks\.json|"
                          r"history\.json")
# Who writes or finds recorded files, and what of record.layout each uses for it.
WRITERS_AND_FINDERS = {
    "agent/measure/session.py": {"stamp"},  # a session's pair ...
    "agent/record/summary.py": {"session_names"},  # ... claimed here
    "agent/measure/incidents.py": {"incident_folder", "INCIDENT_RECORD"},  # incident bundles
    "agent/record/incidents.py": {"is_incident", "INCIDENT_RECORD"},  # ... found
    "agent/record/eventlog.py": {"log_part"},  # the log's parts
    "agent/measure/hangs.py": {"hang_report_stem"},  # hang reports
    "agent/daemon/tracker.py": {"job_folder"},  # the service's job folders
    "agent/daemon/records.py": {"JOB_RECORD"},  # their records
    "agent/record/summarize.py": {"summary_beside"},  # a rebuilt summary
    "agent/record/replay.py": {"log_parts"},  # a log's parts, read
    "agent/record/runs.py": {"recorded_files"},  # report, top, merge, trace
    "agent/record/trace.py": {"log_parts"},
}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _examples(tree: ast.AST) -> set[int]:
    """Strings of *_EPILOG constants: example command lines for --help."""
    ids = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and
                                                 t.id.endswith("_EPILOG") for t in node.targets)):
            ids |= {id(n) for n in ast.walk(node.value) if isinstance(n, ast.Constant)}
    return ids


def test_every_recorded_file_name_comes_from_the_layout() -> None:
    stray = []
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        if rel == "agent/record/layout.py":
            continue
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree) | _examples(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in skip and _NAME_PIECES.search(node.value)):
                stray.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not stray, "\n".join(stray)
    for rel, names in WRITERS_AND_FINDERS.items():
        used = {a.name for node in ast.walk(ast.parse((ROOT / rel).read_text()))
                if isinstance(node, ast.ImportFrom) and node.module == "perfmon.agent.record.layout"
                for a in node.names}
        assert names <= used, f"{rel} should name its files through record.layout: {names - used}"


def test_the_typed_summary_records_are_written_from_the_schema() -> None:
    schema = json.loads(files("perfmon.parsers").joinpath("data", "perf_summary.schema.json")
                        .read_text())
    written = (ROOT / "agent" / "record" / "summary_types.py").read_text()
    assert written == typed_dicts_source(schema), (
        "agent/record/summary_types.py is not the schema's: run `make summary-types`")


def test_no_function_is_too_long() -> None:
    long = []
    for path in _sources():
        text = path.read_text()
        rel = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno}: {node.name}() {length} lines")
    assert not long, "\n".join(long)
