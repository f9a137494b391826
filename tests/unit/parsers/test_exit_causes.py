"""Exit statuses and the causes in a rank's last lines, from text as PyTorch prints it."""

from __future__ import annotations

from pathlib import Path

import pytest
from perfmon.parsers.exit_causes import (
    CAUSES,
    LINE_CHARS,
    MESSAGE_CHARS,
    classify_log_tail,
    describe_cause,
    describe_exit,
    describe_status,
    signal_name,
)

DATA = Path(__file__).resolve().parents[2] / "data"


def tail(name: str) -> str:
    """A rank's last lines in the formats PyTorch, NCCL and torchrun print them
    (tests/data/exit_tail_*.log)."""
    return (DATA / f"exit_tail_{name}.log").read_text()


def test_a_cuda_out_of_memory_traceback_is_named_with_its_type_and_message():
    cause = classify_log_tail(tail("cuda_oom"))
    assert cause is not None
    assert cause["cause"] == "cuda_out_of_memory"
    assert cause["exception_type"] == "torch.OutOfMemoryError"
    assert cause["message"].startswith("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0")
    assert cause["line"].startswith("torch.OutOfMemoryError: CUDA out of memory.")  # no "[rank0]: "
    assert describe_cause(cause).startswith("CUDA out of memory. Tried to allocate 20.00 GiB")


@pytest.mark.parametrize("line", [
    # PyTorch 1.x (RuntimeError) and 1.13-2.4 (torch.cuda.OutOfMemoryError) wordings.
    "RuntimeError: CUDA out of memory. Tried to allocate 2.00 MiB (GPU 0; 15.78 GiB total "
    "capacity; 14.65 GiB already allocated; 3.12 MiB free; 14.72 GiB reserved in total by PyTorch)",
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 MiB (GPU 3; "
    "79.15 GiB total capacity; 77.40 GiB already allocated; 19.62 MiB free; 78.13 GiB reserved "
    "in total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb",
    "RuntimeError: CUDA error: out of memory",
])
def test_older_cuda_out_of_memory_wordings_are_recognised(line):
    cause = classify_log_tail("Traceback (most recent call last):\n  File \"t.py\", line 1\n"
                              + line + "\n")
    assert cause is not None and cause["cause"] == "cuda_out_of_memory"
    assert cause["exception_type"] in ("RuntimeError", "torch.cuda.OutOfMemoryError")


def test_the_watchdog_timeout_wins_over_the_nccl_error_and_the_cpp_abort_it_caused():
    cause = classify_log_tail(tail("nccl_watchdog"))
    assert cause is not None
    assert cause["cause"] == "nccl_watchdog_timeout"
    # The last line of that cause: the what() of the C++ exception that ended the process.
    assert cause["exception_type"] == "c10::DistBackendError"
    assert "Watchdog caught collective operation timeout" in cause["message"]
    assert "ran for 600088 milliseconds" in cause["message"]


def test_an_nccl_error_names_the_dist_backend_error():
    cause = classify_log_tail(tail("nccl_error"))
    assert cause is not None
    assert cause["cause"] == "nccl_error"
    # "ncclSystemError: ..." comes later, but the line that ends the traceback names
    # the exception.
    assert cause["exception_type"] == "torch.distributed.DistBackendError"
    assert cause["message"].startswith("NCCL error in: /pytorch/torch/csrc/distributed/c10d/")
    assert describe_cause(cause).startswith("NCCL error in: ")


def test_a_chained_python_exception_is_the_last_one_raised():
    cause = classify_log_tail(tail("chained_exception"))
    assert cause == {"cause": "python_exception", "exception_type": "ValueError",
                     "message": "dataset shard 17 is empty",
                     "line": "ValueError: dataset shard 17 is empty"}
    assert describe_cause(cause) == "ValueError: dataset shard 17 is empty"


def test_torchrun_child_failed_error_is_an_elastic_error():
    cause = classify_log_tail(tail("torchrun_child_failed"))
    assert cause is not None and cause["cause"] == "elastic_error"
    assert cause["exception_type"] == (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError")


def test_a_store_timeout_is_a_distributed_error():
    cause = classify_log_tail(tail("store_timeout"))
    assert cause is not None and cause["cause"] == "distributed_error"
    assert cause["message"].startswith("Timed out after 1801 seconds waiting for clients")


def test_the_most_specific_cause_wins_whatever_comes_last():
    # A CUDA OOM early in the tail, a generic RuntimeError at the end.
    text = (tail("cuda_oom")
            + "Traceback (most recent call last):\n  File \"x.py\"\nRuntimeError: boom\n")
    assert classify_log_tail(text)["cause"] == "cuda_out_of_memory"  # type: ignore[index]


def test_fatal_python_errors_and_cpp_exceptions():
    fatal = classify_log_tail("Fatal Python error: Segmentation fault\n\nCurrent thread "
                              "0x00007f (most recent call first):\n  File \"t.py\", line 3\n")
    assert fatal is not None and fatal["cause"] == "fatal_python_error"
    assert fatal["message"] == "Segmentation fault"
    cpp = classify_log_tail("terminate called after throwing an instance of 'c10::Error'\n"
                            "  what():  invalid device pointer: 0x7f00\n")
    assert cpp is not None and cpp["cause"] == "cpp_exception"
    assert (cpp["exception_type"], cpp["message"]) == (
        "c10::Error", "invalid device pointer: 0x7f00")


def test_host_out_of_memory():
    cause = classify_log_tail("RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. "
                              "DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                              "85899345920 bytes. Error code 12 (Cannot allocate memory)\n")
    assert cause is not None and cause["cause"] == "cpu_out_of_memory"
    assert cause["exception_type"] == "RuntimeError"


def test_quiet_logs_have_no_cause():
    assert classify_log_tail("") is None
    assert classify_log_tail("epoch 1 loss 2.3\nINFO: saving checkpoint\nERROR: disk slow\n"
                             ) is None


def test_what_a_job_prints_is_escaped_and_bounded():
    hostile = "ValueError: \x1b[2J\x1b]0;owned\x07" + "A" * 5000 + "\n"
    cause = classify_log_tail("Traceback (most recent call last):\n  File \"x\"\n" + hostile)
    assert cause is not None
    for value in cause.values():
        assert value is None or ("\x1b" not in value and "\x07" not in value)
    assert len(cause["message"]) <= MESSAGE_CHARS and len(cause["line"]) <= LINE_CHARS
    assert cause["message"].endswith("...")
    # Colour codes (CSI) are dropped before matching; other escapes are shown as \x1b.
    assert cause["message"].startswith("\\x1b]0;owned\\x07")


def test_every_cause_has_a_label_and_patterns():
    for cause in CAUSES:
        assert describe_cause({"cause": cause, "exception_type": "T", "message": "m"})


@pytest.mark.parametrize("status, fields", [
    (0, {"exit_code": 0, "signal": None, "core_dumped": False}),
    (3 << 8, {"exit_code": 3, "signal": None, "core_dumped": False}),
    (255 << 8, {"exit_code": 255, "signal": None, "core_dumped": False}),
    (9, {"exit_code": None, "signal": "SIGKILL", "core_dumped": False}),
    (15, {"exit_code": None, "signal": "SIGTERM", "core_dumped": False}),
    (11 | 0x80, {"exit_code": None, "signal": "SIGSEGV", "core_dumped": True}),
    (6 | 0x80, {"exit_code": None, "signal": "SIGABRT", "core_dumped": True}),
])
def test_wait_statuses_as_the_kernel_gives_them(status, fields):
    assert describe_status(status) == fields


def test_signal_names():
    assert signal_name(9) == "SIGKILL"
    assert signal_name(36) == "SIGRTMIN+2"
    assert signal_name(99) == "signal 99"


def test_exits_in_one_line():
    assert describe_exit(3, None, False, False) == "exit code 3"
    assert describe_exit(None, "SIGKILL", False, True) == (
        "killed by SIGKILL (the kernel's OOM killer)")
    assert describe_exit(None, "SIGSEGV", True, None) == "killed by SIGSEGV (core dumped)"
    assert describe_exit(None, None, None, None) == "exit status unknown"
