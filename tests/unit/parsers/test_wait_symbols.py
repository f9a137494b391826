"""perfmon.parsers.wait_symbols: the wait points are told from the mangled names, every
backend's work classes included, and nothing else is one (stores, other methods)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from perfmon.parsers.wait_symbols import nested_name, wait_point, wait_points

CHRONO = "NSt6chrono8durationIlSt5ratioILl1ELl1000EEEE"


def mangle(*parts: str, suffix: str = CHRONO) -> str:
    return "_ZN" + "".join(f"{len(p)}{p}" for p in parts) + "E" + suffix


@pytest.mark.parametrize(("parts", "backend", "kind"), [
    (("c10d", "Work", "wait"), "any", "collective"),
    (("c10d", "ProcessGroupGloo", "SendWork", "wait"), "gloo", "p2p"),
    (("c10d", "ProcessGroupGloo", "RecvWork", "wait"), "gloo", "p2p"),
    (("c10d", "ProcessGroupGloo", "AsyncWork", "wait"), "gloo", "collective"),
    (("c10d", "ProcessGroupNCCL", "WorkNCCL", "wait"), "nccl", "collective"),
    (("c10d", "ProcessGroupMPI", "WorkMPI", "wait"), "mpi", "collective"),
    (("c10d", "ProcessGroupUCC", "WorkUCC", "wait"), "ucc", "collective"),
    (("c10d", "ProcessGroup", "Work", "wait"), "any", "collective"),  # (PyTorch < 1.10)
    # A backend a later release adds, and a work class of no process group's.
    (("c10d", "ProcessGroupXCCL", "WorkXCCL", "wait"), "xccl", "collective"),
    (("c10d", "ProcessGroupXCCL", "RecvWorkXCCL", "wait"), "xccl", "p2p"),
    (("c10d", "FakeWork", "wait"), "fake", "collective"),
])
def test_every_work_objects_wait_is_a_wait_point(parts, backend, kind):
    point = wait_point(mangle(*parts))
    assert point is not None and (point.backend, point.kind) == (backend, kind)
    assert point.name == "::".join(parts[1:])


def test_ddps_reducer_is_one_and_so_is_a_const_or_argument_free_wait():
    assert wait_point("_ZN4c10d7Reducer17finalize_backwardEv").backend == "ddp"
    assert wait_point(mangle("c10d", "Work", "wait", suffix="v")) is not None
    assert wait_point("_ZNK4c10d4Work4waitEv") is not None


@pytest.mark.parametrize("name", [
    mangle("c10d", "TCPStore", "wait"),  # the rendezvous, not a work object
    mangle("c10d", "PrefixStore", "wait"),
    mangle("c10d", "Work", "synchronize", suffix="v"),
    mangle("c10d", "Work", "isCompleted", suffix="v"),
    mangle("c10", "ivalue", "Future", "wait", suffix="v"),  # not c10d
    mangle("c10d", "wait", suffix="v"),  # a free function
    "_ZN4c10d4WorkC2Ev",  # a constructor
    "_ZN4c10d16ProcessGroupGloo8RecvWork4waitB5cxx11E",  # an ABI tag: not read
    "_ZN4c10d99Work4waitE",  # a length past the name
    "wait", "", "_ZN", "_ZN4c10dE",
])
def test_nothing_else_is(name):
    assert wait_point(name) is None


@given(st.text(max_size=80))
def test_any_name_is_read_without_error(name):
    nested_name("_ZN" + name)
    wait_point("_ZN" + name)
    wait_point(name)


def test_each_name_once_in_the_order_given():
    names = [mangle("c10d", "Work", "wait"), "x", mangle("c10d", "Work", "wait"),
             "_ZN4c10d7Reducer17finalize_backwardEv"]
    assert [p.name for p in wait_points(names)] == ["Work::wait", "Reducer::finalize_backward"]
