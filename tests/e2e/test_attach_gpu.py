"""attach on a "GPU" job: the real agent, real uprobes and the real nvidia-ml-py, with the
NVIDIA driver replaced by the fake libnvidia-ml.so.1 (tests/fakes/fake_nvml.c)."""

from __future__ import annotations

import statistics
import time

import pytest

from tests.conftest import ROOT, load_summary, wait_for
from tests.fakes.build import write_scenario

pytestmark = pytest.mark.usefixtures("ebpf")

TRAIN_FAKE_CUDA = ROOT / "tests" / "targets" / "train_fake_cuda.py"

MODEL = ("num_layers: 2\nhidden_size: 128\nnum_attention_heads: 4\nseq_length: 64\n"
         "vocab_size: 512\nglobal_batch_size: 4\n")


def test_gpu_memory_per_rank_mfu_and_a_gpu_lost_mid_session(
    fake_nvml, steady_target, agent, out_dir, tmp_path
):
    target = steady_target
    scenario = tmp_path / "scenario"
    healthy = (
        "count=2\n"
        "gpu0.name=NVIDIA H100 80GB HBM3\ngpu1.name=NVIDIA H100 80GB HBM3\n"
        f"gpu0.proc.{target.pid}.used_bytes={4 << 30}\n"
        "gpu0.utilization_gpu_pct=87\ngpu0.power_mw=650000\n"
        "gpu1.utilization_gpu_pct=3\ngpu1.power_mw=90000\n"
        "gpu0.clocks_event_reasons=0x4\n"  # SW power cap
    )
    write_scenario(scenario, healthy)
    (tmp_path / "model.yaml").write_text(MODEL)
    proc = agent.start("attach", "--pid", str(target.pid), "--duration", "7", "--health-check",
                       "--model-config", str(tmp_path / "model.yaml"), "--log-interval", "20",
                       "--output-dir", str(out_dir), env=fake_nvml.env(scenario))
    wait_for(lambda: list(out_dir.glob("perf_summary_*.json")), 30, "the session to start")
    time.sleep(2)
    # GPU 1 falls off the bus; GPU 0 reports an XID 79 ("fallen off the bus" on its side).
    write_scenario(scenario, healthy + "gpu1.lost=1\ngpu0.xid=79\n")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    summary = load_summary(out_dir)
    info, stats = summary["session_info"], summary["final_statistics"]
    assert info["gpu"]["available"] and info["gpu"]["device"] == "NVIDIA H100 80GB HBM3"
    assert info["gpu"]["peak_tflops"] == pytest.approx(989.4)
    assert info["health"]["status"] in ("pass", "warn")
    # The rank's driver-side GPU memory, not its RSS, is the memory figure.
    assert stats["memory_kind"] == "gpu"
    # 4 GiB held on the GPU is 4.0 "GB": bytes / 1024^3, as FlagScale's monitor computes it.
    assert stats["peak_memory_gb"] == 4.0
    assert all(e["memory_GB"] == 4.0 for e in summary["iteration_logs"])
    assert stats["ranks"][0]["pid"] == target.pid
    assert stats["ranks"][0]["gpu_indices"] == [0]
    assert stats["ranks"][0]["peak_gpu_memory_gb"] == 4.0
    assert stats["gpu_attribution"] == "processes"
    # Only the job's GPU counts for utilization and power.
    assert stats["avg_gpu_utilization_pct"] == pytest.approx(87)
    assert stats["avg_gpu_power_w"] == pytest.approx(650)
    assert "sw_power_cap" in stats["gpu_throttle_reasons"]
    assert all(e["gpu_utilization_pct"] == pytest.approx(87) for e in summary["iteration_logs"])
    # MFU against the H100's bf16 dense peak.
    assert stats["mfu"] == pytest.approx(stats["avg_tflops_per_gpu"] / 989.4)
    # The lost GPU is recorded with its time, and the session went on to its end.
    (lost,) = [e for e in stats["gpu_events"] if e["type"] == "gpu_lost"]
    assert lost["gpu_index"] == 1
    assert info["attach_monotonic_ns"] < lost["t_mono_ns"] < info["detach_monotonic_ns"]
    (xid,) = [e for e in stats["gpu_events"] if e["type"] == "xid"]
    assert (xid["gpu_index"], xid["xid"]) == (0, 79)
    assert info["end_reason"] == "duration"


def test_without_a_driver_the_summary_says_so_and_cpu_mode_goes_on(
    steady_target, agent, out_dir
):
    target = steady_target
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "3",
                    "--output-dir", str(out_dir))
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    gpu = summary["session_info"]["gpu"]
    assert gpu["available"] is False and "NVML" in gpu["reason"]
    assert summary["final_statistics"]["memory_kind"] == "rss"


def test_cpu_job_on_a_busy_gpu_host_gets_no_gpu_figures_and_no_mfu(
    fake_nvml, steady_target, agent, out_dir, tmp_path
):
    # Another user's process holds GPU 0; this job (a CPU job) is on no GPU.
    target = steady_target
    scenario = tmp_path / "scenario"
    write_scenario(scenario, "count=1\ngpu0.name=NVIDIA H100 80GB HBM3\n"
                             "gpu0.proc.4000000.used_bytes=1000000\n"
                             "gpu0.utilization_gpu_pct=99\ngpu0.power_mw=600000\n")
    (tmp_path / "model.yaml").write_text(MODEL)
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "3",
                    "--model-config", str(tmp_path / "model.yaml"),
                    "--output-dir", str(out_dir), env=fake_nvml.env(scenario))
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    stats = summary["final_statistics"]
    assert stats["gpu_attribution"] == "none"
    assert stats["avg_tflops_per_gpu"] > 0 and stats["mfu"] is None
    assert summary["session_info"]["gpu"]["peak_tflops"] is None
    assert stats["avg_gpu_utilization_pct"] is None and stats["memory_kind"] == "rss"


def test_cuda_and_nccl_activity_per_iteration_equals_what_the_job_called(
    fake_cuda, start_target, agent, out_dir
):
    # Per iteration: 3 runtime + 2 driver launches, 2 stream syncs of 1 ms each,
    # an all-reduce of 1024 float32 (4096 B) and an all-gather of 256 bf16 (512 B);
    # each NCCL call launches its kernel through the (fake) driver, as NCCL does: 7 launches.
    syncs = out_dir.parent / "syncs.txt"
    target = start_target(
        "--cuda-lib-dir", str(fake_cuda.lib_dir), "--idle-ms", "10", "--sync-log", str(syncs),
        "--runtime-launches", "3", "--driver-launches", "2", "--stream-syncs", "2",
        "--sync-us", "1000", "--nccl", "all_reduce:1024:float32",
        "--nccl", "all_gather:256:bfloat16",
        script=TRAIN_FAKE_CUDA, warm_iterations=3)
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "5",
                    "--log-interval", "10", "--no-stack-sampling", "--cuda-launches", "always",
                    "--output-dir", str(out_dir))
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    assert summary["session_info"]["cuda"]["available"], summary["session_info"]["cuda"]
    logs = summary["iteration_logs"]
    assert len(logs) >= 3
    info = summary["session_info"]
    stamped = dict(target.timestamps())
    own_ms = [int(ns) / 1e6 for i, ns in (line.split() for line in syncs.read_text().splitlines())
              if info["attach_monotonic_ns"] <= stamped.get(int(i), 0)
              <= info["detach_monotonic_ns"]]
    for entry in [*logs, summary["final_statistics"]]:
        assert entry["kernels_per_iter"] == 7
        assert entry["nccl_calls_per_iter"] == 2
        assert entry["nccl_bytes_per_iter"] == 4096 + 512
        # Two 1 ms waits: never less; more when a busy host is slow to wake them, as long
        # as the job's own clock says its waits took at most (its slowest iteration's).
        assert 2.0 <= entry["cpu_sync_wait_ms"] <= max(own_ms) + 0.1, own_ms
    # The mean over the session: the job's own over the iterations the agent saw.
    assert summary["final_statistics"]["cpu_sync_wait_ms"] == pytest.approx(
        statistics.mean(own_ms), rel=0.1), own_ms
    by_kind = summary["final_statistics"]["nccl_per_iter_by_collective"]
    assert by_kind["all_reduce"] == {"calls": 1, "bytes": 4096}
    assert by_kind["all_gather"] == {"calls": 1, "bytes": 512}


def test_sampled_launch_counting_is_exact_on_the_iterations_it_probes(
    fake_cuda, start_target, agent, out_dir
):
    # 300 launches a step: the launch probes are attached for one iteration in every
    # N and detached between; the iterations they cover count their launches exactly.
    target = start_target(
        "--cuda-lib-dir", str(fake_cuda.lib_dir), "--idle-ms", "10",
        "--runtime-launches", "200", "--driver-launches", "100", "--stream-syncs", "1",
        "--sync-us", "500", "--nccl", "all_reduce:1024:float32",
        script=TRAIN_FAKE_CUDA, warm_iterations=3)
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "10",
                    "--log-interval", "10", "--no-stack-sampling", "--output-dir", str(out_dir))
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    assert summary["session_info"]["cuda"]["launches"] == "sampled"
    stats = summary["final_statistics"]
    sampled = stats["kernel_launches_sampled_iterations"]
    assert 1 <= sampled < stats["measured_iterations"] / 5
    assert stats["kernels_per_iter"] == 301  # 300 by the job, 1 by its NCCL call
    logs = summary["iteration_logs"]
    with_launches = [e for e in logs if e["kernels_per_iter"] is not None]
    assert with_launches and all(e["kernels_per_iter"] == 301 for e in with_launches)
    assert len(with_launches) < len(logs)
    # Everything else is counted on every iteration.
    assert all(e["nccl_calls_per_iter"] == 1 for e in logs)
    cuda = stats["data_quality"]["sources"]["cuda"]
    # Each sample lasts until the agent's next poll: one or more whole iterations.
    assert 1 <= cuda["launch_samples"] <= sampled and cuda["launch_sample_every"] >= 10
