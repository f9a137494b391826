"""Dense peak TFLOPS per accelerator and data type, the denominator of MFU.

The table is this package's ``data/peak_tflops.yaml``; each row names its
source. Device names are matched as NVML (or amd-smi) reports them, e.g.
"NVIDIA H100 80GB HBM3" or "NVIDIA A100-SXM4-80GB".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any

import yaml

DTYPES = ("bf16", "fp16", "fp8", "tf32")
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float8": "fp8"}


@dataclass(frozen=True)
class PeakTflops:
    """One device's dense peak tensor-core throughput, in TFLOPS per data type."""

    device: str
    patterns: tuple[str, ...]  # case-insensitive regular expressions for the device name
    tflops_by_dtype: dict[str, float]  # dtypes without a tensor-core path are absent
    source: str


def peak_table() -> list[PeakTflops]:
    """Every row of the table, in matching order."""
    return list(_table())


@cache
def _table() -> tuple[PeakTflops, ...]:
    text = files("perfmon.parsers").joinpath("data", "peak_tflops.yaml").read_text()
    rows: Any = yaml.safe_load(text)
    return tuple(
        PeakTflops(
            device=row["device"],
            patterns=tuple(row["match"]),
            tflops_by_dtype={k: float(v) for k, v in row["tflops"].items()},
            source=row["source"],
        )
        for row in rows
    )


def peak_tflops_for(device_name: str, dtype: str = "bf16") -> float | None:
    """Dense peak TFLOPS of ``device_name`` for ``dtype`` (bf16, fp16, fp8, tf32 or an alias).

    None when the device is not in the table or has no tensor-core path for the
    dtype. Raises ValueError for a dtype name outside DTYPES and its aliases.
    """
    key = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    for row in _table():
        if any(re.search(p, device_name, re.IGNORECASE) for p in row.patterns):
            return row.tflops_by_dtype.get(key)
    return None
