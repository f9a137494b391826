"""Named model presets: the dimensions of well-known models, one YAML file each.

The files live in this package's ``presets/`` folder and carry model dimensions
and a typical ``seq_length`` but no batch sizes, which belong to the job. Each
file cites where its numbers come from.
"""

from __future__ import annotations

import difflib
from functools import cache
from importlib.resources import files

import yaml
from perfmon.parsers.errors import ModelConfigError


def preset_names() -> list[str]:
    """Names of the available presets, sorted (e.g. "llama3-8b")."""
    return list(_names())


@cache
def _names() -> tuple[str, ...]:
    folder = files("perfmon.parsers").joinpath("presets")
    return tuple(sorted(p.name.removesuffix(".yaml") for p in folder.iterdir()
                        if p.name.endswith(".yaml")))


def preset_fields(name: str) -> dict[str, object]:
    """The ModelConfig fields preset ``name`` sets, as a layer for merge_model_fields.

    Raises ModelConfigError for an unknown name, listing the known ones.
    """
    names = preset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, 1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ModelConfigError(
            f"model preset {name!r}: unknown{hint}; known presets: {', '.join(names)}"
        )
    return dict(_load(name))


@cache
def _load(name: str) -> dict[str, object]:
    text = files("perfmon.parsers").joinpath("presets", f"{name}.yaml").read_text()
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ModelConfigError(f"model preset {name!r}: the file is not a mapping of fields")
    return data
