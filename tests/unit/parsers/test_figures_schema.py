"""The typed figures (perfmon.parsers.figures) and the summary's schema agree field by
field: every shown field names a key of its part of the schema, of the JSON type its
annotation says, in the unit its key's suffix says; every key of those parts is some
field's; and generated records survive render, the schema and parse unchanged."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from perfmon.parsers.figures import (
    AS_IS,
    LOSS_CAUSES,
    Goodput,
    GoodputLedger,
    HangEpisode,
    IntervalFigures,
    RankFigures,
    Statistics,
    parse,
    render,
)

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = json.loads((ROOT / "parsers" / "data" / "perf_summary.schema.json").read_text())
_PROPS = SCHEMA["properties"]
_GOODPUT = _PROPS["final_statistics"]["properties"]["goodput"]


def _with_all_of(part: dict[str, Any]) -> dict[str, Any]:
    """A part of the schema with the properties of what it is ``allOf`` merged in."""
    props: dict[str, Any] = {}
    for sub in part.get("allOf", []):
        props.update(_resolve(sub)["properties"])
    return {**part, "properties": {**props, **part.get("properties", {})}}


def _resolve(prop: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[1]
        prop = {**SCHEMA["$defs"][name], **{k: v for k, v in prop.items() if k != "$ref"}}
    return prop


PARTS: dict[type, dict[str, Any]] = {
    Statistics: _PROPS["final_statistics"],
    IntervalFigures: _PROPS["iteration_logs"]["items"],
    RankFigures: _PROPS["final_statistics"]["properties"]["ranks"]["items"],
    GoodputLedger: SCHEMA["$defs"]["ledger"],
    Goodput: _with_all_of(_GOODPUT),
    HangEpisode: _PROPS["final_statistics"]["properties"]["hangs"]["items"],
}
# Keys of a part the figures do not hold: none today (a key listed here is one the
# summary has that no sink computes).
NOT_FIGURES: dict[type, set[str]] = {cls: set() for cls in PARTS}


def _json_types(prop: dict[str, Any]) -> set[str]:
    prop = _resolve(prop)
    if "enum" in prop:
        return {"null" if v is None else {str: "string", int: "integer", float: "number",
                                          bool: "boolean"}[type(v)] for v in prop["enum"]}
    kind = prop.get("type", [])
    return set(kind if isinstance(kind, list) else [kind])


def _annotation_types(hint: Any) -> set[str]:
    """The JSON types a field's annotation allows (None: null)."""
    out: set[str] = set()
    for arg in typing.get_args(hint) if typing.get_origin(hint) in (
            typing.Union, types.UnionType) else (hint,):
        origin = typing.get_origin(arg) or arg
        if arg is type(None):
            out.add("null")
        elif origin is typing.Literal:
            out |= {"string" if isinstance(v, str) else "null" for v in typing.get_args(arg)}
        elif origin is bool:
            out.add("boolean")
        elif origin is int:
            out.add("integer")
        elif origin is float:
            out |= {"number", "integer"}
        elif origin is str:
            out.add("string")
        elif origin is tuple:
            out.add("array")
        elif isinstance(origin, type) and (issubclass(origin, Mapping)
                                           or dataclasses.is_dataclass(origin)):
            out.add("object")
    return out


def _shown(cls: type) -> list[tuple[dataclasses.Field, str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, f.metadata["key"], hints[f.name]) for f in dataclasses.fields(cls)
            if "key" in f.metadata]


@pytest.mark.parametrize("cls", list(PARTS), ids=lambda c: c.__name__)
def test_every_shown_field_is_its_schema_key_in_type_and_unit(cls: type) -> None:
    props = PARTS[cls]["properties"]
    problems = []
    for f, key, hint in _shown(cls):
        if key not in props:
            problems.append(f"{cls.__name__}.{f.name}: key {key!r} not in the schema")
            continue
        schema_types, field_types = _json_types(props[key]), _annotation_types(hint)
        if f.metadata["unit"] is not AS_IS and "integer" in field_types:
            field_types.add("number")  # (bytes in GiB, seconds in ms: no longer whole)
        # (a float field may hold what the schema calls a number; "integer" alone is int)
        if not schema_types - {"null"} <= field_types | ({"integer"} if "number" in
                                                          field_types else set()):
            problems.append(f"{cls.__name__}.{f.name}: {sorted(field_types)} against the "
                            f"schema's {sorted(schema_types)} for {key!r}")
        if ("null" in field_types and "null" not in schema_types and schema_types
                and not f.metadata["omit"]):
            problems.append(f"{cls.__name__}.{f.name}: may be None, shown as null where the "
                            f"schema allows no null for {key!r}")
        unit = f.metadata["unit"]
        if unit is AS_IS:
            continue
        if not key.endswith(unit.key_suffixes):
            problems.append(f"{cls.__name__}.{f.name}: shown in {unit.name} as {key!r}")
        if not f.name.endswith(unit.field_suffixes):
            problems.append(f"{cls.__name__}.{f.name}: not named in SI for {unit.name}")
    for f, key, _ in _shown(cls):
        if f.metadata["unit"] is AS_IS and key.endswith(("_ms", "_gb", "_GB", "_pct")):
            problems.append(f"{cls.__name__}.{f.name}: {key!r} shown as it is, not converted")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("cls", list(PARTS), ids=lambda c: c.__name__)
def test_every_schema_key_is_a_field(cls: type) -> None:
    keys = {key for _, key, _ in _shown(cls)}
    missing = set(PARTS[cls]["properties"]) - keys - NOT_FIGURES[cls]
    assert not missing, f"{cls.__name__} has no field for {sorted(missing)}"


# -- round trips -------------------------------------------------------------------------

_numbers = st.one_of(st.none(), st.floats(0, 1e6, allow_nan=False))
_ints = st.one_of(st.none(), st.integers(0, 10**6))
_ranks = st.builds(
    RankFigures, pid=st.integers(1, 4_000_000), rank=_ints, iterations=_ints,
    step_s=_numbers, wait_s=_numbers, compute_s=_numbers,
    wait_share=st.one_of(st.none(), st.floats(0, 1)), waits_probed=_ints,
    straggler=st.one_of(st.none(), st.booleans()),
    peak_rss_bytes=_ints, peak_gpu_memory_bytes=_ints,
    gpu_indices=st.one_of(st.none(), st.tuples(st.integers(0, 7))))
_intervals = st.builds(
    IntervalFigures, iteration=st.integers(1, 10**9),
    timestamp=st.just("2026-12-05T10:00:00+00:00"), step_s=st.floats(0, 1e6),
    flops_per_gpu=_numbers, tokens_per_s=_numbers, samples_per_s=_numbers,
    memory_bytes=_numbers, end_ns=st.integers(0, 2**62), kept_one_in=st.one_of(
        st.none(), st.integers(2, 1024)),
    ranks=st.one_of(st.none(), st.lists(_ranks, max_size=3).map(tuple)),
    gpu_utilization=st.one_of(st.none(), st.floats(0, 1)), gpu_power_w=_numbers,
    gpu_throttle_reasons=st.one_of(st.none(), st.tuples(st.sampled_from(["hw_slowdown"]))),
    kernels_per_iter=_numbers, cpu_sync_wait_s=_numbers, cuda=st.booleans()).map(
        # (an interval without the CUDA counters has no CUDA figures)
        lambda f: f if f.cuda else dataclasses.replace(f, kernels_per_iter=None,
                                                       cpu_sync_wait_s=None))


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        return all(_close(getattr(a, f.name), getattr(b, f.name))
                   for f in dataclasses.fields(a) if "key" in f.metadata)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.slow  # (5-8 s: make test runs it; make test-fast stays quick)
@settings(max_examples=200, deadline=None)
@given(_intervals)
def test_an_interval_survives_render_the_schema_and_parse(figures: IntervalFigures) -> None:
    shown = render(figures)
    jsonschema.validate(shown, {**PARTS[IntervalFigures], "$defs": SCHEMA["$defs"]})
    back = parse(IntervalFigures, json.loads(json.dumps(shown)))
    assert _close(back, figures), (figures, back)
    # (the CUDA figures are there, null or not, exactly when the counters were on)
    assert ("kernels_per_iter" in shown) == figures.cuda


_seconds = st.floats(0, 1e7, allow_nan=False)
_by_cause = st.fixed_dictionaries({c: _seconds for c in LOSS_CAUSES})
_ledger_fields = {
    "ratio": st.one_of(st.none(), st.floats(0, 1)), "gpus": st.integers(1, 10**6),
    "wall_s": _seconds, "productive_s": _seconds, "lost_s": _by_cause,
    "gpu_hours": _seconds, "productive_gpu_hours": _seconds, "lost_gpu_hours": _by_cause,
    "unobserved_s": _seconds, "unobserved_gpu_hours": _seconds}
_goodputs = st.builds(
    Goodput, **_ledger_fields,
    window_from=st.sampled_from(["process_start", "attach", "previous_session"]),
    last_job_iteration=_ints, last_end_ns=st.one_of(st.none(), st.integers(0, 2**62)),
    job=st.one_of(st.none(), st.builds(GoodputLedger, **_ledger_fields)))


@pytest.mark.slow  # (5-8 s: make test runs it; make test-fast stays quick)
@settings(max_examples=100, deadline=None)
@given(st.builds(Statistics, step_s=_numbers, flops_per_gpu=_numbers,
                 peak_memory_bytes=_numbers, gpu_utilization=st.one_of(
                     st.none(), st.floats(0, 1)),
                 p99_step_s=_numbers, ranks=st.lists(_ranks, max_size=3).map(tuple),
                 measured_iterations=st.integers(0, 10**6),
                 memory_kind=st.sampled_from(["gpu", "rss"]),
                 goodput=st.one_of(st.none(), _goodputs),
                 hangs=st.lists(st.builds(
                     HangEpisode, t_ns=st.integers(0, 2**62),
                     timestamp=st.just("2026-12-05T10:00:00+00:00"),
                     last_iteration_ns=st.integers(0, 2**62),
                     threshold_s=st.floats(0, 1e4), frame=st.text(max_size=20),
                     report=st.text(max_size=20),
                     phase=st.one_of(st.none(), st.sampled_from(["backward", "other"])),
                     recovered_at=st.one_of(st.none(), st.just(
                         "2026-12-05T10:01:00+00:00")))).map(tuple)))
def test_statistics_survive_render_the_schema_and_parse(stats: Statistics) -> None:
    shown = render(stats)
    jsonschema.validate(shown, {**PARTS[Statistics], "$defs": SCHEMA["$defs"]})
    assert _close(parse(Statistics, json.loads(json.dumps(shown))), stats)


@settings(max_examples=100, deadline=None)
@given(_goodputs)
def test_the_job_ledger_is_the_sessions_without_a_restart(goodput: Goodput) -> None:
    """What the job's next session and Prometheus take: the job's ledger, else the
    session's own figures (no window, no job)."""
    ledger = goodput.of_job
    assert type(ledger) is GoodputLedger
    assert render(ledger) == (render(goodput.job) if goodput.job is not None else
                              {k: v for k, v in render(goodput).items()
                               if k not in ("from", "last_job_iteration", "last_end_mono_ns")})


def test_units_are_converted_as_the_summary_shows_them() -> None:
    shown = render(IntervalFigures(iteration=3, timestamp="t", step_s=0.25,
                                   flops_per_gpu=2.5e13, tokens_per_s=1.0, samples_per_s=2.0,
                                   memory_bytes=3 * (1 << 30), gpu_utilization=0.5))
    assert (shown["step_time_ms"], shown["TFLOPS_per_GPU"], shown["memory_GB"],
            shown["gpu_utilization_pct"]) == (250.0, 25.0, 3.0, 50.0)
