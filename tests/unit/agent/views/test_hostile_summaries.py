"""Documents generated from the summary schema itself, with every field at its edges or
unknown, go through every view in-process (report, top, merge, the summary table): never
a crash. (The CLI on crafted files: tests/e2e/test_hostile_summaries.py.)"""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from perfmon.agent import console
from perfmon.agent.record.runs import read_summary_run
from perfmon.agent.record.summary import read_summary
from perfmon.agent.views import merge, report, series, top
from perfmon.parsers.figures import Statistics, parse
from rich.console import Console

from tests.conftest import SUMMARY_SCHEMA

START = "2026-12-01T00:00:00+00:00"


def _generate(schema: dict[str, Any], value_for: Callable[[str, dict[str, Any]], Any]) -> Any:
    while "$ref" in schema:
        schema = SUMMARY_SCHEMA["$defs"][schema["$ref"].removeprefix("#/$defs/")]
    if "oneOf" in schema:
        typed = [a for a in schema["oneOf"] if a.get("type") != "null"]
        return _generate((typed or schema["oneOf"])[0], value_for)
    if "enum" in schema:
        return next((e for e in schema["enum"] if e is not None), None)
    types = schema.get("type")
    kind = next((t for t in (types if isinstance(types, list) else [types])
                 if t not in (None, "null")), None)
    if kind == "object" or "properties" in schema or "patternProperties" in schema:
        out = {k: _generate(s, value_for) for k, s in (schema.get("properties") or {}).items()}
        for pattern, s in (schema.get("patternProperties") or {}).items():
            for name in pattern.strip("^$()").split("|"):
                out[name] = _generate(s, value_for)
        return out
    if kind == "array":
        return [_generate(schema.get("items") or {}, value_for) for _ in range(3)]
    return value_for(kind or "null", schema)


def _edge(which: str) -> Callable[[str, dict[str, Any]], Any]:
    def value_for(kind: str, schema: dict[str, Any]) -> Any:
        if kind == "string":
            return START if "pattern" in schema else "x"
        if kind == "boolean":
            return True
        if kind in ("integer", "number"):
            big = 1e15 if kind == "number" else 1 << 62
            low, high = schema.get("minimum", -big), schema.get("maximum", big)
            value = {"max": high, "min": low, "zero": max(low, 0),
                     "one": max(low, min(high, 1))}[which]
            return int(value) if kind == "integer" else float(value)
        return None
    return value_for


def _nulled(value: Any, from_depth: int, depth: int = 0, *, leaves: bool = False) -> Any:
    """``value`` with every container from ``from_depth`` down (or, with ``leaves``, every
    value that is no container) replaced by null."""
    if isinstance(value, dict | list):
        if depth >= from_depth and depth > 1 and not leaves:
            return None
        items = value.items() if isinstance(value, dict) else enumerate(value)
        done = {k: _nulled(v, from_depth, depth + 1, leaves=leaves) for k, v in items}
        return done if isinstance(value, dict) else list(done.values())
    return None if leaves else value


def _documents() -> dict[str, dict[str, Any]]:
    docs = {which: _generate(SUMMARY_SCHEMA, _edge(which)) for which in ("one", "zero", "max",
                                                                         "min")}
    base = docs["one"]
    docs["leaves_unknown"] = _nulled(base, 0, leaves=True)
    for depth in (2, 3, 4):
        docs[f"containers_unknown_from_{depth}"] = _nulled(base, depth)
    docs["items_unknown"] = copy.deepcopy(base)
    for section in ("session_info", "final_statistics"):
        for key, value in docs["items_unknown"][section].items():
            if isinstance(value, list):
                docs["items_unknown"][section][key] = [None] * len(value)
    docs["items_unknown"]["iteration_logs"] = [None, {}, 5]
    docs["empty"] = {"session_info": {}, "final_statistics": {}, "iteration_logs": []}
    for doc in docs.values():
        doc["session_info"]["attach_monotonic_ns"] = 10**9  # what report needs
    return docs


@pytest.mark.slow  # (5-8 s: make test runs it; make test-fast stays quick)
def test_documents_with_every_field_at_its_edges_or_unknown_render_in_every_view(
        tmp_path: Path) -> None:
    failures = []
    for name, doc in _documents().items():
        folder = tmp_path / name
        folder.mkdir()
        path = folder / "perf_summary_20261201_000000.json"
        path.write_text(json.dumps(doc))
        summary, _ = read_summary(path)
        views: dict[str, Callable[[], object]] = {
            "report": lambda p=path: report.render_report(series.load_report_runs(p)),
            "top": lambda f=folder: Console(file=io.StringIO(), width=200).print(
                top.frame(top.newest_jobs(top.SummaryCache([f])), [f], [])),
            "merge": lambda p=path: merge.merge([read_summary_run(p)], "j"),
            "table": lambda p=path, s=summary: console.print_summary_table(
                Console(file=io.StringIO(), width=200),
                parse(Statistics, s["final_statistics"]), s["session_info"], p),
        }
        for view, draw in views.items():
            try:
                draw()
            except Exception as err:  # every failure is listed
                failures.append(f"{name} in {view}: {type(err).__name__}: {err}")
    assert not failures, "\n".join(failures)
