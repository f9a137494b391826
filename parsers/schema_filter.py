"""A JSON document kept to what its JSON Schema allows: what it does not becomes unknown.

The views (report, top, merge) read summaries that anyone may have written: a
value of the wrong type, out of its range or not finite must neither crash them
nor pass for a figure. ``SchemaFilter(schema).apply(document)`` walks the
document along the schema and replaces every such value by None (null, which
stands for unknown and is allowed anywhere) (an array item
keeps its place, so ``pids`` and ``ranks`` stay aligned; an object key the
schema forbids is dropped), counting what it changed. Where the schema leaves a
value open, nesting deeper than ``MAX_DEPTH`` is unknown too.

No validator library does this: ``jsonschema`` reports errors (and took 11 s
for a summary of 100,000 entries), it does not repair. The schema is compiled
once into checks, so a document of a million values takes about a second.

Arrays may be lists or tuples (msgpack's decoding); a filtered one is a list. The
subset of JSON Schema read: ``type``, ``$ref`` (``#/$defs/...``),
``properties``, ``patternProperties``, ``additionalProperties``, ``items``,
``minItems``, ``enum``, ``pattern``, ``minimum``, ``maximum``,
``exclusiveMinimum``, ``oneOf`` (of alternatives told apart by type), ``allOf``
(each part applied in turn: the goodput ledger's bounds); the rest
(``required``, ``format``, ``description``) is not a check here. Beyond the
schema every number must be finite, floats within +-1e30 and integers within
+-2^63, so that no sum or product of them overflows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_DEPTH = 32
MAX_FLOAT = 1e30
MAX_INT = 1 << 63
EXAMPLES = 3  # problems named in full; the rest only counted

_UNKNOWN: Any = object()  # a check's answer: replace the value by None

# A value's place in the document, built lazily: (parent place, key) pairs.
Place = tuple[Any, str | int] | None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list | tuple),  # msgpack decodes arrays as tuples
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": _is_number,
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


@dataclass
class Filtered:
    """What ``apply`` changed: how many values became unknown, and the first few."""

    changed: int = 0
    examples: list[str] = field(default_factory=list)

    def note(self, place: Place, why: str) -> None:
        self.changed += 1
        if len(self.examples) < EXAMPLES:
            keys: list[str] = []
            while place is not None:
                place, key = place
                keys.append(str(key))
            self.examples.append(f"{'.'.join(reversed(keys)) or '(top)'}: {why}")


Check = Callable[[Any, Place, Filtered], Any]


def _describe(value: Any) -> str:
    if isinstance(value, dict | list | tuple):
        return f"a {type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__} of {len(text)} characters"


def _number_ok(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value) and abs(value) <= MAX_FLOAT
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) <= MAX_INT
    return True


def _open_problem(value: Any) -> str | None:
    """Why a value the schema leaves open is unfit (too deep, a number out of range)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth >= MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels"
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, depth + 1) for c in children)
        elif not _number_ok(item):
            return f"holds {_describe(item)}, out of range"
    return None


@dataclass
class _Rules:
    """The checks of one schema node, compiled."""

    types: tuple[Callable[[Any], bool], ...] | None = None
    wanted: str = ""
    enum: list[Any] | None = None
    pattern: re.Pattern[str] | None = None
    low: float | None = None
    high: float | None = None
    above: float | None = None
    min_items: int | None = None
    properties: dict[str, Check] | None = None
    patterns: list[tuple[re.Pattern[str], Check]] = field(default_factory=list)
    other: Check | None = None  # additional properties; None: not allowed
    object_rules: bool = False
    items: Check | None = None

    def why_not(self, value: Any) -> str | None:
        """Why ``value`` itself (not what it holds) is not allowed; None when it is."""
        if self.types is not None and not any(t(value) for t in self.types):
            return f"{_describe(value)} is not {self.wanted}"
        if not _number_ok(value):
            return f"{_describe(value)} is out of range"
        if self.enum is not None and value not in self.enum:
            return f"{_describe(value)} is not one of the allowed values"
        if self.pattern is not None and isinstance(value, str) and not self.pattern.search(value):
            return f"{_describe(value)} is not of the expected form"
        if _is_number(value) and ((self.low is not None and value < self.low)
                                  or (self.high is not None and value > self.high)
                                  or (self.above is not None and value <= self.above)):
            return f"{_describe(value)} is out of range"
        if (self.min_items is not None and isinstance(value, list | tuple)
                and len(value) < self.min_items):
            return f"fewer than {self.min_items} items"
        return None


class SchemaFilter:
    """A schema compiled into checks; ``apply`` filters one document with them."""

    def __init__(self, schema: dict[str, Any], at: tuple[str, ...] = ()) -> None:
        """``at``: the keys leading to the part of ``schema`` that documents follow (e.g.
        ``("properties", "session_info")``); its ``$defs`` stay the root's."""
        self._root = schema
        self._refs: dict[str, Check] = {}
        part = schema
        for key in at:
            part = part[key]
        self._check = self._compile(part, depth=0)

    def apply(self, document: Any) -> tuple[Any, Filtered]:
        """The document with every value the schema does not allow replaced by None
        (containers are changed in place; a tuple becomes a list)."""
        filtered = Filtered()
        value = self._check(document, None, filtered)
        return (None if value is _UNKNOWN else value), filtered

    # -- compiling ---------------------------------------------------------------------

    def _definition(self, ref: str) -> dict[str, Any]:
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"unsupported $ref {ref!r}")
        return self._root["$defs"][ref.removeprefix("#/$defs/")]  # type: ignore[no-any-return]

    def _ref(self, ref: str) -> Check:
        if ref not in self._refs:
            def forward(value: Any, place: Place, out: Filtered) -> Any:
                # Looked up at use, so that a definition may refer to itself.
                return self._refs[ref](value, place, out)

            self._refs[ref] = forward
            self._refs[ref] = self._compile(self._definition(ref), depth=1)
        return self._refs[ref]

    def _compile(self, schema: dict[str, Any], depth: int) -> Check:
        if depth > 64:
            raise ValueError("schema nested too deep")
        if "$ref" in schema:
            return self._ref(schema["$ref"])
        if "oneOf" in schema:
            return self._one_of(schema["oneOf"], depth)
        if "allOf" in schema:
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            return _all_of([self._compile(part, depth + 1)
                            for part in [*schema["allOf"], rest]])
        rules = _Rules()
        types = schema.get("type")
        if types is not None:
            names = types if isinstance(types, list) else [types]
            rules.types, rules.wanted = tuple(_TYPES[t] for t in names), " or ".join(names)
        rules.enum = schema.get("enum")
        if "pattern" in schema:
            rules.pattern = re.compile(schema["pattern"])
        rules.low, rules.high = schema.get("minimum"), schema.get("maximum")
        rules.above, rules.min_items = schema.get("exclusiveMinimum"), schema.get("minItems")
        if any(k in schema for k in ("properties", "patternProperties", "additionalProperties")):
            rules.object_rules = True
            rules.properties = {k: self._compile(s, depth + 1)
                                for k, s in (schema.get("properties") or {}).items()}
            rules.patterns = [(re.compile(p), self._compile(s, depth + 1))
                              for p, s in (schema.get("patternProperties") or {}).items()]
            extra = schema.get("additionalProperties", True)
            rules.other = (_open if extra is True else None if extra is False
                           else self._compile(extra, depth + 1))
        if "items" in schema:
            rules.items = self._compile(schema["items"], depth + 1)
        return _node(rules)

    def _one_of(self, alternatives: list[dict[str, Any]], depth: int) -> Check:
        """oneOf of alternatives told apart by their type: the value's is the one."""
        picks: list[tuple[tuple[Callable[[Any], bool], ...] | None, Check]] = []
        for alternative in alternatives:
            typed = alternative
            while "$ref" in typed:
                typed = self._definition(typed["$ref"])
            types = typed.get("type")
            names = types if isinstance(types, list) else [types] if types else None
            picks.append((tuple(_TYPES[t] for t in names) if names else None,
                          self._compile(alternative, depth + 1)))

        def check(value: Any, place: Place, out: Filtered) -> Any:
            if value is None:
                return None
            for tests, alternative in picks:
                if tests is None or any(t(value) for t in tests):
                    return alternative(value, place, out)
            out.note(place, f"{_describe(value)} fits none of the allowed forms")
            return _UNKNOWN
        return check


def _all_of(checks: list[Check]) -> Check:
    """Every check in turn: what one does not allow is unknown for the next."""
    def check(value: Any, place: Place, out: Filtered) -> Any:
        for each in checks:
            value = each(value, place, out)
            if value is None or value is _UNKNOWN:
                break
        return value
    return check


def _node(rules: _Rules) -> Check:
    """The check of one schema node: null passes (it is what unknown is, allowed anywhere);
    else the value's own rules, then what it holds."""
    properties, patterns, other, items = rules.properties, rules.patterns, rules.other, rules.items
    resolved: dict[str, Check | None] = {}  # key -> its check (patterns matched once)

    def check(value: Any, place: Place, out: Filtered) -> Any:
        if value is None:
            return None
        why = rules.why_not(value)
        if why is not None:
            out.note(place, why)
            return _UNKNOWN
        if isinstance(value, dict):
            if not rules.object_rules:
                return _open(value, place, out)
            for key in list(value):
                if key in resolved:
                    sub = resolved[key]
                else:
                    sub = properties.get(key) if properties else None
                    if sub is None:
                        sub = next((c for p, c in patterns if p.search(key)), other)
                    if len(resolved) < 4096:
                        resolved[key] = sub
                if sub is None:
                    out.note((place, key), "not allowed here")
                    del value[key]
                    continue
                kept = sub(value[key], (place, key), out)
                value[key] = None if kept is _UNKNOWN else kept
            return value
        if isinstance(value, list | tuple):
            if items is None:
                return _open(value, place, out)
            value = list(value) if isinstance(value, tuple) else value
            for i, item in enumerate(value):
                kept = items(item, (place, i), out)
                value[i] = None if kept is _UNKNOWN else kept
        return value
    return check


def _open(value: Any, place: Place, out: Filtered) -> Any:
    """A value the schema leaves open: any JSON, its numbers in range, nested at most
    MAX_DEPTH levels."""
    why = _open_problem(value)
    if why is not None:
        out.note(place, why)
        return _UNKNOWN
    return value
