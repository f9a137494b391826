"""/proc parsers against files captured from a real training process (tests/data/).

The capture was taken from `env -i ... WORLD_SIZE=8 RANK=3 LOCAL_RANK=3
HF_TOKEN=hf_secret_do_not_store python tests/targets/train_gpt.py ...`.
"""

from __future__ import annotations

from pathlib import Path

from perfmon.parsers import procfs

DATA = Path(__file__).resolve().parents[2] / "data"


def test_maps_finds_libtorch_and_drops_anonymous_mappings():
    maps = procfs.parse_maps((DATA / "proc_maps_train_gpt.txt").read_text())
    assert maps and all(m.path.startswith("/") for m in maps)
    torch_lib = procfs.mapped_library(maps, "libtorch_cpu")
    assert torch_lib is not None and torch_lib.endswith("/torch/lib/libtorch_cpu.so")
    assert any(m.executable and m.path == torch_lib for m in maps)
    assert procfs.mapped_library(maps, "libnot_there") is None


def test_environ_keeps_only_the_wanted_variables():
    data = (DATA / "proc_environ_train_gpt.bin").read_bytes()
    assert b"hf_secret_do_not_store" in data  # the capture does hold a secret ...
    env = procfs.parse_environ(data, ("WORLD_SIZE", "RANK", "MISSING"))
    assert env == {"WORLD_SIZE": "8", "RANK": "3"}  # ... which never leaves the parser


def test_cmdline_splits_on_nul_and_keeps_equals_forms():
    argv = procfs.parse_cmdline((DATA / "proc_cmdline_train_gpt.bin").read_bytes())
    assert argv[1].endswith("train_gpt.py")
    assert argv[2:] == ["--num-layers", "2", "--hidden-size=128"]
    assert procfs.parse_cmdline(b"") == []


def test_status_gives_capabilities_and_memory_in_bytes():
    status = procfs.parse_status((DATA / "proc_status_train_gpt.txt").read_text())
    assert status.name == "python"
    assert status.rss_bytes == 283188 * 1024
    assert status.peak_rss_bytes == 283188 * 1024
    assert status.effective_capabilities == 0x1FFFEFFFFFF
    assert procfs.missing_capabilities(status.effective_capabilities, [procfs.CAP_BPF]) == []
    assert procfs.missing_capabilities(0, [procfs.CAP_BPF, procfs.CAP_SYS_PTRACE]) == [
        "CAP_BPF", "CAP_SYS_PTRACE"]


def test_schedstat_gives_cpu_time_and_run_queue_wait_or_none():
    assert procfs.parse_schedstat("927892 20348 2\n") == (927892, 20348)
    for bad in ("", "12\n", "x 1 2", "-1 2 3"):
        assert procfs.parse_schedstat(bad) is None
