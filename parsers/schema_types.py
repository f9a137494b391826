"""The summary's typed parts, written from its JSON Schema (pure: schema in, Python source
out): the schema is the one declaration of the summary's keys and types, and
agent/record/summary_types.py is this module's output for it, checked equal by a test
(regenerate with ``make summary-types``)."""

from __future__ import annotations

from typing import Any

# (class name, the path of its part in the schema, its docstring)
PARTS = (
    ("SessionInfo", ("properties", "session_info"),
     "``session_info``: what was watched, how, and why it ended."),
    ("FinalStatistics", ("properties", "final_statistics"),
     "``final_statistics``: the session's figures."),
    ("IterationEntry", ("properties", "iteration_logs", "items"),
     "One ``iteration_logs`` entry: a logged iteration's figures."),
)
_SCALARS = {"integer": "int", "number": "float", "string": "str", "boolean": "bool",
            "array": "list[Any]", "object": "dict[str, Any]"}
_HEADER = '''"""The summary's three parts as typed records, for the views that read them back.

Written by perfmon.parsers.schema_types from parsers/data/perf_summary.schema.json (do not
edit: ``make summary-types``). Every value may be None: a view reads summaries anyone may
have written, kept to the schema by read_summary, which turns a wrong value into None.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict
'''


def python_type(schema: dict[str, Any], prop: dict[str, Any]) -> str:
    """The annotation of a property (``$ref`` followed; None always allowed)."""
    while "$ref" in prop:
        prop = {**schema["$defs"][prop["$ref"].rsplit("/", 1)[1]],
                **{k: v for k, v in prop.items() if k != "$ref"}}
    if "enum" in prop and all(isinstance(v, str) or v is None for v in prop["enum"]):
        names = ", ".join(f'"{v}"' for v in prop["enum"] if v is not None)
        return f"Literal[{names}] | None"
    kinds = prop.get("type", [])
    kinds = [k for k in (kinds if isinstance(kinds, list) else [kinds]) if k != "null"]
    if len(kinds) != 1:  # (several types, or one given by allOf/oneOf: any)
        return "Any"
    return f"{_SCALARS[kinds[0]]} | None"


def typed_dicts_source(schema: dict[str, Any]) -> str:
    """The module of the summary's TypedDicts for ``schema``."""
    out = [_HEADER.rstrip("\n")]
    for name, path, doc in PARTS:
        part: Any = schema
        for key in path:
            part = part[key]
        out += ["", "", f"class {name}(TypedDict, total=False):", f'    """{doc}"""', ""]
        out += [f"    {key}: {python_type(schema, prop)}"
                for key, prop in part["properties"].items()]
    return "\n".join(out) + "\n"
