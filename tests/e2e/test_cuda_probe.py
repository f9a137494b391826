"""CudaActivityProbe against a real PyTorch process driving fake CUDA/NCCL libraries.

The fakes (tests/fakes/fake_cuda.c, fake_nccl.c) have the real C ABI and the
real libraries' habits that matter to the probe: the runtime forwards launches
to the driver, _ptsz entry points call the legacy ones, cudaDeviceSynchronize
waits inside cudaStreamSynchronize, NCCL launches its kernels through the
driver and exports each ncclX with a pncclX alias. The target writes its own
CLOCK_MONOTONIC stamp before each optimizer.step(); the counters read between
two stamps must differ by exactly one iteration's scripted calls, and so must
the snapshots the kernel takes at each Optimizer.step entry, with no quiet
gaps around the steps.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import astuple, dataclass
from pathlib import Path

import pytest
from perfmon.probes.cuda import CudaActivityProbe
from perfmon.probes.cuda_counters import CudaCounters
from perfmon.probes.cuda_libraries import NCCL_COLLECTIVES
from perfmon.probes.procfs import inspect_process
from perfmon.probes.torch_symbols import RECORD_FUNCTION_SYMBOLS

from tests.fakes.build_cuda import FakeCudaLibraries

TRAIN_FAKE_CUDA = Path(__file__).resolve().parents[1] / "targets" / "train_fake_cuda.py"
DTYPE_BYTES = {"int8": 1, "uint8": 1, "int32": 4, "float16": 2, "bfloat16": 2, "float32": 4,
               "int64": 8, "float64": 8, "float8e4m3": 1}

# One iteration's calls, as train_fake_cuda.py flags.
SCRIPT = {
    "runtime_launches": 3,  # cudaLaunchKernel: forwarded to cuLaunchKernel
    "runtime_ptsz_launches": 2,  # -> cudaLaunchKernel -> cuLaunchKernel
    "runtime_ex_launches": 1,  # cudaLaunchKernelExC -> cuLaunchKernelEx
    "driver_launches": 4,  # cuLaunchKernel, as cuBLAS and Triton call it
    "driver_ptsz_launches": 1,  # -> cuLaunchKernel
    "driver_ex_launches": 1,
    "graph_launches": 2,  # cudaGraphLaunch -> cuGraphLaunch
    "stream_syncs": 2,
    "device_syncs": 1,  # waits inside cudaStreamSynchronize: one blocking call
    "event_syncs": 1,
    "memcpys": 1,
    "sync_us": 2000,
}
NCCL_SCRIPT = [
    ("all_reduce", 4096, "float32"),
    ("all_reduce", 1000, "bfloat16"),
    ("all_reduce_config", 64, "float16"),  # ncclAllReduceConfig: counted as all_reduce
    ("reduce_scatter", 512, "float16"),
    ("all_gather", 300, "float8e4m3"),
    ("broadcast", 100, "int64"),
    ("reduce", 10, "float64"),
    ("all_to_all", 128, "int32"),
    ("gather", 7, "uint8"),
    ("scatter", 9, "float32"),
    ("send", 333, "int8"),  # send and recv go in one ncclGroupStart/End
    ("recv", 333, "uint8"),
]


@dataclass(frozen=True)
class Expected:
    kernel_launches: int
    runtime_launches: int
    driver_launches: int
    forwarded_launches: int
    graph_launches: int
    sync_calls: int
    sync_wait_ns: int
    nccl_calls: dict[str, int]
    nccl_bytes: dict[str, int]


def expected_per_iteration(script: dict[str, int], nccl: list[tuple[str, int, str]]) -> Expected:
    """What one iteration of train_fake_cuda.py calls, counted as the probe defines it."""
    s = script
    p2p = [c for c in nccl if c[0] in ("send", "recv")]
    # The fake NCCL launches one kernel per ungrouped call and one per group.
    nccl_kernels = len(nccl) - len(p2p) + (1 if p2p else 0)
    runtime = s["runtime_launches"] + s["runtime_ptsz_launches"] + s["runtime_ex_launches"]
    driver = (s["driver_launches"] + s["driver_ptsz_launches"] + s["driver_ex_launches"]
              + nccl_kernels)
    forwarded = (s["runtime_launches"] + 2 * s["runtime_ptsz_launches"]
                 + s["runtime_ex_launches"] + s["driver_ptsz_launches"])
    syncs = s["stream_syncs"] + s["device_syncs"] + s["event_syncs"] + s["memcpys"]
    calls = dict.fromkeys(NCCL_COLLECTIVES, 0)
    nbytes = dict.fromkeys(NCCL_COLLECTIVES, 0)
    for op, count, dtype in nccl:
        key = op.removesuffix("_config")
        calls[key] += 1
        nbytes[key] += count * DTYPE_BYTES[dtype]
    return Expected(runtime + driver, runtime, driver, forwarded, s["graph_launches"], syncs,
                    syncs * s["sync_us"] * 1000, calls, nbytes)


def script_args(libs: FakeCudaLibraries, script: dict[str, int],
                nccl: list[tuple[str, int, str]]) -> list[str]:
    args = ["--cuda-lib-dir", str(libs.lib_dir)]
    for key, value in script.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    for op, count, dtype in nccl:
        args += ["--nccl", f"{op}:{count}:{dtype}"]
    return args


@dataclass(frozen=True)
class Snapshot:
    before_ns: int  # the test's clock just before poll() ...
    after_ns: int  # ... and just after: the map was read in between
    counters: CudaCounters

    def values(self) -> tuple:
        return astuple(self.counters)[2:]  # everything but t_mono_ns and pid


def poll_for(probe: CudaActivityProbe, seconds: float,
             interval_s: float = 0.002) -> tuple[list[Snapshot], list[CudaCounters]]:
    """The periodic snapshots (one per poll), and the at_step ones, in time order."""
    snapshots, at_step = [], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        before = time.monotonic_ns()
        records = probe.poll()
        after = time.monotonic_ns()
        (counters,) = [r for r in records if not r.at_step]
        snapshots.append(Snapshot(before, after, counters))
        at_step += [r for r in records if r.at_step]
        time.sleep(interval_s)
    return snapshots, at_step


def counters_at(snapshots: list[Snapshot], t_ns: int) -> CudaCounters | None:
    """The counters at an instant, when two polls around it read the same values.

    Counters only grow, so equal reads before and after mean nothing happened
    in between; polls that straddle activity are no answer (None).
    """
    i = bisect.bisect_left([s.after_ns for s in snapshots], t_ns) - 1
    if i < 0 or i + 1 >= len(snapshots):
        return None
    before, after = snapshots[i], snapshots[i + 1]
    if not before.after_ns < t_ns < after.before_ns or before.values() != after.values():
        return None
    return before.counters


def per_iteration_deltas(snapshots: list[Snapshot], stamps: list[tuple[int, int]]):
    """(iteration, counters at the stamp before its calls, at its own stamp after them)."""
    at = {n: counters_at(snapshots, t) for n, t in stamps}
    return [(n + 1, at[n], at[n + 1]) for n, _ in stamps if at.get(n) and at.get(n + 1)]


def own_waits(path: Path) -> dict[int, int]:
    """The time the job's blocking calls took in each iteration, by its own clock."""
    return {int(n): int(ns) for n, ns in (line.split() for line in path.read_text().splitlines()
                                          if line)}


def assert_each_is_one_iteration(pairs: list[tuple[int, CudaCounters, CudaCounters]],
                                 want: Expected, own_waits_ns: dict[int, int]) -> None:
    """Every pair differs by exactly its iteration's calls; its waits as long as the calls
    took by the job's own clock (``own_waits_ns``: around its blocking calls, each
    iteration), never less than they sleep."""
    waits_ns = []
    for n, a, b in pairs:
        assert b.kernel_launches - a.kernel_launches == want.kernel_launches
        assert b.runtime_launches - a.runtime_launches == want.runtime_launches
        assert b.driver_launches - a.driver_launches == want.driver_launches
        assert b.forwarded_launches - a.forwarded_launches == want.forwarded_launches
        assert b.graph_launches - a.graph_launches == want.graph_launches
        assert b.sync_calls - a.sync_calls == want.sync_calls
        assert {k: b.nccl_calls[k] - a.nccl_calls[k] for k in NCCL_COLLECTIVES} == want.nccl_calls
        assert {k: b.nccl_bytes[k] - a.nccl_bytes[k] for k in NCCL_COLLECTIVES} == want.nccl_bytes
        assert b.nccl_unknown_dtype_calls == b.sync_untracked == 0
        waits_ns.append(b.sync_wait_ns - a.sync_wait_ns)
        # Each blocking call sleeps sync_us on CLOCK_MONOTONIC (never less); the rest is
        # timer slack, the probes' own cost and, on a busy machine, the thread descheduled
        # in the call: the job's own clock around its calls holds all of it, and its Python
        # besides (a probe's clock reads may come 50 us a call after the job's).
        if n in own_waits_ns:
            assert waits_ns[-1] <= own_waits_ns[n] + 50_000 * want.sync_calls, (
                n, waits_ns[-1], own_waits_ns[n])
    assert min(waits_ns) >= want.sync_wait_ns


@pytest.mark.long(reason="the fake CUDA job's scripted calls over enough steps to compare each")
@pytest.mark.usefixtures("ebpf")
def test_counter_deltas_between_the_targets_step_stamps_equal_its_scripted_calls(
    start_target, fake_cuda, tmp_path
):
    syncs = tmp_path / "syncs.txt"
    target = start_target("--sync-log", str(syncs), *script_args(fake_cuda, SCRIPT, NCCL_SCRIPT),
                          script=TRAIN_FAKE_CUDA)
    want = expected_per_iteration(SCRIPT, NCCL_SCRIPT)
    with CudaActivityProbe([inspect_process(target.pid)]) as probe:
        assert probe.available, probe.reason
        assert probe.warnings == []
        attached = {Path(path).name: names for path, names in probe.attached.items()}
        assert set(attached["libcudart.so.12"]) == {
            "cudaLaunchKernel", "cudaLaunchKernel_ptsz", "cudaLaunchKernelExC",
            "cudaGraphLaunch", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "cudaEventSynchronize", "cudaMemcpy"}
        assert set(attached["libcuda.so.1"]) == {
            "cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuGraphLaunch"}
        # Each ncclX once, never its pncclX alias at the same address.
        assert sorted(attached["libnccl.so.2"]) == sorted(
            [*NCCL_COLLECTIVES.values(), "ncclAllReduceConfig"])
        snapshots, _ = poll_for(probe, seconds=3.0)
    assert probe.poll() == []  # closed

    pairs = per_iteration_deltas(snapshots, target.timestamps())
    assert len(pairs) >= 20, f"only {len(pairs)} iterations had quiet polls around both stamps"
    assert_each_is_one_iteration(pairs, want, own_waits(syncs))


@pytest.mark.usefixtures("ebpf")
def test_snapshots_taken_in_the_kernel_at_each_optimizer_step_differ_by_exactly_one_iteration(
    start_target, fake_cuda, tmp_path
):
    # No idle time around the steps: CUDA calls run right up to the stamp and
    # resume right after the step, so only an in-kernel snapshot can split them.
    returns, syncs = tmp_path / "step_returns.txt", tmp_path / "syncs.txt"
    target = start_target("--idle-ms", "0", "--step-returns", str(returns),
                          "--sync-log", str(syncs), *script_args(fake_cuda, SCRIPT, NCCL_SCRIPT),
                          script=TRAIN_FAKE_CUDA)
    want = expected_per_iteration(SCRIPT, NCCL_SCRIPT)
    process = inspect_process(target.pid)
    with CudaActivityProbe([process]) as probe:
        assert probe.warnings == []
        # Optimizer.step found as the iteration probe finds it, in libtorch_cpu.
        (symbol,) = probe.attached[process.torch_library]
        assert symbol.startswith(RECORD_FUNCTION_SYMBOLS[0])
        _, steps = poll_for(probe, seconds=2.0, interval_s=0.1)  # the agent's cadence
        assert probe.dropped == 0

    assert len(steps) >= 50
    assert all(s.at_step and s.pid == target.pid for s in steps)
    # One snapshot per iteration, each just after the target's own stamp.
    stamps = target.timestamps()
    stamp_times = [t for _, t in stamps]
    matched = [stamps[bisect.bisect_right(stamp_times, s.t_mono_ns) - 1] for s in steps]
    lags_ns = [s.t_mono_ns - t for s, (_, t) in zip(steps, matched, strict=True)]
    # Each snapshot lies after its iteration's stamp and before its optimizer step returned,
    # by the job's own clock (the time between is the job's: on a busy machine its thread
    # can be descheduled there for milliseconds).
    returned = {int(n): int(t) for n, t in (line.split() for line in
                                             returns.read_text().splitlines())}
    assert all(lag >= 0 for lag in lags_ns), min(lags_ns)
    late = [(n, s.t_mono_ns - returned[n]) for s, (n, _) in zip(steps, matched, strict=True)
            if n in returned and s.t_mono_ns > returned[n]]
    assert late == [], late
    iterations = [n for n, _ in matched]
    assert iterations == list(range(iterations[0], iterations[0] + len(steps)))
    assert_each_is_one_iteration(
        [(m[0], a, b) for m, (a, b) in zip(matched[1:], itertools.pairwise(steps), strict=True)],
        want, own_waits(syncs))


@pytest.mark.usefixtures("ebpf")
def test_a_job_without_nccl_is_probed_for_cuda_and_says_nccl_is_not_counted(
    start_target, fake_cuda
):
    script = {**SCRIPT, "sync_us": 0}
    target = start_target("--no-nccl", *script_args(fake_cuda, script, []),
                          script=TRAIN_FAKE_CUDA)
    with CudaActivityProbe([inspect_process(target.pid)]) as probe:
        assert probe.available
        assert not any("libnccl" in path for path in probe.attached)
        (warning,) = probe.warnings
        assert f"pid {target.pid}" in warning and "libnccl.so* is not loaded" in warning
        (first,) = [c for c in probe.poll() if not c.at_step]
        target.wait_for_iterations(len(target.timestamps()) + 3)
        (last,) = [c for c in probe.poll() if not c.at_step]
    assert last.kernel_launches - first.kernel_launches >= 2 * (
        expected_per_iteration(script, []).kernel_launches)
    assert set(last.nccl_calls) == set(NCCL_COLLECTIVES)
    assert sum(last.nccl_calls.values()) == sum(last.nccl_bytes.values()) == 0


def test_a_cpu_only_job_is_reported_unavailable_without_error(steady_target):
    target = steady_target  # train_gpt.py: PyTorch on CPU, no CUDA library mapped
    probe = CudaActivityProbe([inspect_process(target.pid)])
    probe.start()
    assert probe.available is False
    assert f"pid {target.pid}" in (probe.reason or "")
    assert "libcudart" in (probe.reason or "")
    assert probe.attached == {}
    assert probe.poll() == []
    probe.close()
    probe.close()  # idempotent
