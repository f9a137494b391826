"""The tracefs toolkit (perfmon.probes.ftrace): what needs no tracefs (on real tracefs:
tests/e2e/test_tracefs.py)."""

from __future__ import annotations

from perfmon.probes.ftrace import buffer_size_kb


def test_buffer_size_is_bounded_on_big_hosts():
    assert buffer_size_kb(2) == 1024
    assert buffer_size_kb(512) == 64
    assert buffer_size_kb(128) * 128 <= 16384
