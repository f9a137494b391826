"""Peak TFLOPS lookup by NVML device name and dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
from perfmon.parsers.peak_tflops import DTYPES, peak_table, peak_tflops_for


@pytest.mark.parametrize(("device_name", "bf16"), [
    ("NVIDIA H100 80GB HBM3", 989.4),  # H100 SXM5 as NVML names it
    ("NVIDIA H100 PCIe", 756),
    ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", 989.4),
    ("NVIDIA H200 NVL", 835.5),
    ("NVIDIA H800", 989.4),
    ("NVIDIA H20", 148),
    ("NVIDIA GH200 480GB", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312),
    ("NVIDIA A100-PCIE-40GB", 312),
    ("NVIDIA A800 80GB PCIe", 312),
    ("NVIDIA B200", 2250),
    ("NVIDIA L40S", 362.05),
    ("AMD Instinct MI300X", 1307.4),
])
def test_nvml_names_find_their_row(device_name: str, bf16: float) -> None:
    assert peak_tflops_for(device_name) == bf16


def test_other_dtypes_and_aliases() -> None:
    h100 = "NVIDIA H100 80GB HBM3"
    assert peak_tflops_for(h100, "fp16") == 989.4
    assert peak_tflops_for(h100, "fp8") == 1978.9
    assert peak_tflops_for(h100, "tf32") == 494.7
    assert peak_tflops_for(h100, "bfloat16") == 989.4
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB", "fp8") is None  # no FP8 tensor cores


def test_unknown_device_is_none_and_unknown_dtype_raises() -> None:
    assert peak_tflops_for("Tesla V100-SXM2-32GB") is None
    assert peak_tflops_for("") is None
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        peak_tflops_for("NVIDIA H100 80GB HBM3", "int4")


def test_table_rows_are_well_formed() -> None:
    rows = peak_table()
    assert len({row.device for row in rows}) == len(rows)
    for row in rows:
        assert row.patterns and row.source
        assert set(row.tflops_by_dtype) <= set(DTYPES)
        assert all(value > 0 for value in row.tflops_by_dtype.values())
        # bf16 and fp16 share the tensor-core rate on every listed device
        assert row.tflops_by_dtype["bf16"] == row.tflops_by_dtype["fp16"]
        # each row's own name must select that row, not an earlier one
        assert peak_tflops_for(f"NVIDIA {row.device}") == row.tflops_by_dtype["bf16"]


def test_docs_list_every_row() -> None:
    docs = (Path(__file__).parents[3] / "docs" / "flops.md").read_text()
    for row in peak_table():
        assert f"| {row.device} | {row.tflops_by_dtype['bf16']:g} |" in docs
