"""attach against real PyTorch training processes with real bcc uprobes.

The target writes time.monotonic_ns() just before each optimizer.step(); the
agent's uprobe fires on Optimizer.step's record_function entry, on the same
clock, so the two are compared directly.
"""

from __future__ import annotations

import itertools
import json
import signal
import statistics
import subprocess
import sys
import time

import pytest

from tests import eventlogs
from tests.conftest import load_summary, summary_so_far, wait_for

pytestmark = pytest.mark.usefixtures("ebpf")

MODEL_YAML = """\
num_layers: 2
hidden_size: 128
num_attention_heads: 4
seq_length: 64
vocab_size: 512
micro_batch_size: 4
"""


def in_window(stamps: list[tuple[int, int]], info: dict) -> list[int]:
    lo, hi = info["attach_monotonic_ns"], info["detach_monotonic_ns"]
    return [t for _, t in stamps if lo <= t <= hi]


def test_step_time_and_iteration_count_match_the_targets_own_timestamps(
    steady_target, agent, out_dir, tmp_path
):
    target = steady_target
    (tmp_path / "model.yaml").write_text(MODEL_YAML + "global_batch_size: 4\n")
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "6",
                    "--log-interval", "10", "--output-dir", str(out_dir),
                    "--model-config", str(tmp_path / "model.yaml"))
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    info, stats = summary["session_info"], summary["final_statistics"]
    truth = in_window(target.timestamps(), info)
    assert len(truth) > 50
    assert abs(info["total_iterations"] - len(truth)) <= 1
    true_mean_ms = statistics.fmean((b - a) / 1e6 for a, b in itertools.pairwise(truth))
    assert stats["avg_step_time_ms"] == pytest.approx(true_mean_ms, rel=0.005)
    assert stats["measured_iterations"] == info["total_iterations"] - 1
    assert info["iteration_source"] == "uprobe" and info["end_reason"] == "duration"
    assert info["pids"] == [target.pid]
    # Throughput follows from the step time and the model: 4 samples x 64 tokens a step.
    assert stats["avg_tokens_per_sec"] == pytest.approx(4 * 64 / (true_mean_ms / 1e3), rel=0.01)
    assert stats["avg_samples_per_sec"] == pytest.approx(4 / (true_mean_ms / 1e3), rel=0.01)
    flops = info["model"]["flops_per_iteration"]
    assert stats["avg_tflops_per_gpu"] == pytest.approx(
        flops / (true_mean_ms / 1e3) / 1e12, rel=0.01)
    assert stats["peak_memory_gb"] > 0.05
    assert stats["mfu"] is None  # a CPU job has no known peak
    logs = summary["iteration_logs"]
    assert len(logs) == stats["measured_iterations"] // 10
    # Numbered as the job numbers them (its local `iteration`): each entry ends at the
    # Optimizer.step entry of the iteration that the target stamped with that number.
    assert info["iteration_numbering"] == "job_counter"
    assert info["iteration_counter"] == "iteration"
    stamps = dict(target.timestamps())
    for entry in logs:
        n = entry["iteration"]
        assert stamps[n] <= entry["end_monotonic_ns"] < stamps[n + 1]
    assert [b["iteration"] - a["iteration"] for a, b in itertools.pairwise(logs)] == [10] * (
        len(logs) - 1)
    assert all(e["memory_GB"] > 0.05 for e in logs)
    # One progress line per log interval, then the table.
    assert run.stdout.count("iter ") == len(logs)
    assert "avg step time" in run.stdout


def test_gradient_accumulation_four_gives_four_microbatches_per_step_and_derived_batch(
    start_target, agent, out_dir, tmp_path
):
    target = start_target("--grad-accum", "4")
    (tmp_path / "model.yaml").write_text(MODEL_YAML)  # micro batch only: global is derived
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "4",
                    "--output-dir", str(out_dir), "--model-config", str(tmp_path / "model.yaml"))
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    stats = summary["final_statistics"]
    assert stats["microbatches_per_step"] == 4
    # global batch = micro batch 4 x 4 micro-batches x DP 1 = 16 samples a step
    assert stats["avg_samples_per_sec"] == pytest.approx(
        16 / (stats["avg_step_time_ms"] / 1e3), rel=0.01)
    assert summary["session_info"]["model"]["global_batch_size"].startswith("derived")


def test_target_that_exits_mid_run_leaves_a_complete_summary(
    start_target, agent, out_dir
):
    target = start_target("--train-iters", "150")
    run = agent.run("attach", "--pid", str(target.pid), "--output-dir", str(out_dir), "--json")
    assert run.returncode == 0, run.stderr
    printed = json.loads(run.stdout)
    summary = load_summary(out_dir)  # schema-checked by the out_dir fixture
    assert printed == summary
    info = summary["session_info"]
    assert info["end_reason"] == "target_exited" and info["end_time"] is not None
    truth = in_window(target.timestamps(), info)
    assert abs(info["total_iterations"] - len(truth)) <= 1
    assert target.timestamps()[-1][0] == 150
    assert summary["final_statistics"]["avg_tokens_per_sec"] is None  # no model: unknown


def test_summarize_rebuilds_the_summary_of_a_sigkilled_agent(
    start_target, agent, out_dir
):
    target = start_target("--train-iters", "300", "--after-train", "sleep")
    proc = agent.start("attach", "--pid", str(target.pid), "--output-dir", str(out_dir),
                       "--log-interval", "7")
    target.wait_for_iterations(300)
    # The live summary is refreshed at least every 5 s: wait until it holds every step.
    live = wait_for(
        lambda: (s := summary_so_far(out_dir)) and _all_done(s, target) and s,
        timeout_s=30, what="the live summary to count every iteration")
    assert live["final_statistics"]["measured_iterations"] > 50
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    (events,) = out_dir.glob("perf_events_*.msgpack")
    rebuilt_path = out_dir / "rebuilt.json"
    run = subprocess.run(
        [sys.executable, "-m", "perfmon.agent.cli", "summarize", str(events), "--output",
         str(rebuilt_path), "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    rebuilt = json.loads(rebuilt_path.read_text())
    assert rebuilt["final_statistics"] == live["final_statistics"]
    assert rebuilt["iteration_logs"] == live["iteration_logs"]
    assert rebuilt["session_info"]["total_iterations"] == live["session_info"]["total_iterations"]
    assert rebuilt["session_info"]["end_reason"] == "log_truncated"
    assert json.loads(run.stdout) == rebuilt
    # Every record in the log decodes; the live one never held a session_end.
    records = eventlogs.read_records(events)
    assert records[0]["type"] == "session_start"
    assert all(r["type"] != "session_end" for r in records)



def _all_done(summary, target) -> bool:
    info = summary["session_info"]
    truth = [t for _, t in target.timestamps() if t >= info["attach_monotonic_ns"]]
    # ... and every complete log interval is in (entries wait for their stack samples).
    intervals = summary["final_statistics"]["measured_iterations"] // 7
    return (len(truth) > 0 and info["total_iterations"] == len(truth)
            and len(summary["iteration_logs"]) == intervals)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_ends_the_session_cleanly(steady_target, agent, out_dir, signum):
    target = steady_target
    proc = agent.start("attach", "--pid", str(target.pid), "--output-dir", str(out_dir))
    wait_for(lambda: (s := summary_so_far(out_dir)) and s["session_info"]["total_iterations"] > 20,
             timeout_s=30, what="iterations in the live summary")
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    info = load_summary(out_dir)["session_info"]
    assert info["end_reason"] == signum.name and info["end_time"] is not None
    assert target.proc.poll() is None  # the job goes on
    assert "summary:" in out


def test_tokens_and_samples_per_second_need_only_the_batch_and_sequence_length(
    start_target, agent, out_dir
):
    # The job's command line gives the batch and the sequence length, not the model.
    target = start_target("--global-batch-size", "8", "--micro-batch-size", "4",
                          "--seq-length", "64")
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "4",
                    "--output-dir", str(out_dir), "--no-stack-sampling")
    assert run.returncode == 0, run.stderr
    assert "model dimensions unknown, no FLOPs" in run.stderr
    summary = load_summary(out_dir)
    stats = summary["final_statistics"]
    seconds = stats["avg_step_time_ms"] / 1e3
    assert stats["avg_tokens_per_sec"] == pytest.approx(8 * 64 / seconds, rel=1e-6)
    assert stats["avg_samples_per_sec"] == pytest.approx(8 / seconds, rel=1e-6)
    assert stats["avg_tflops_per_gpu"] is None and stats["mfu"] is None
    assert all(e["tokens_per_sec"] > 0 for e in summary["iteration_logs"])
    assert summary["session_info"]["model"]["global_batch_size"] == "given"


def test_probing_writes_nothing_into_the_target(steady_target):
    """bcc 0.26's Python passes no ref_ctr_offset to libbcc, whose 7th argument then takes
    whatever the stack holds, and the kernel increments a counter at that offset of the
    library in the target's memory. The agent passes 0: the mapped library stays as on disk."""
    from perfmon.probes.procfs import inspect_process
    from perfmon.probes.uprobes import MarkerProbe

    target = steady_target
    process = inspect_process(target.pid)
    mapping = process.torch_mapping
    span = 1 << 20  # the ELF headers and the first code pages

    def mapped() -> bytes:
        with open(f"/proc/{target.pid}/mem", "rb") as mem:
            mem.seek(mapping.start_address)
            return mem.read(span)

    on_disk = open(process.torch_library, "rb").read(span)
    assert mapped() == on_disk
    probe = MarkerProbe([process])
    probe.start()
    try:
        from bcc import libbcc

        assert getattr(libbcc.lib.bpf_attach_uprobe, "perfmon_zero_ref_ctr", False) or len(
            libbcc.lib.bpf_attach_uprobe.argtypes) == 7
        target.wait_for_iterations(len(target.timestamps()) + 5)
        assert mapped() == on_disk
        assert probe.poll()  # and the probes work
    finally:
        probe.close()


def test_data_quality_counts_the_events_a_tiny_ring_buffer_dropped(start_target, agent, out_dir):
    # 32 micro-batches a step: ~100 markers a step into a one-page (4 KiB, ~46 events)
    # ring buffer, while the agent, stopped for 1.5 s, does not drain it.
    target = start_target("--grad-accum", "32")
    proc = agent.start("attach", "--pid", str(target.pid), "--duration", "8",
                       "--ring-buffer-pages", "1", "--no-stack-sampling",
                       "--output-dir", str(out_dir))
    # Measuring (the first summary is written when the session starts), and two more
    # steps of the target's own: the agent is stopped mid-session, well before its end.
    # (A later summary may not come before the 8 s are over: the live summary is
    # rewritten when a log interval completes, ~4 s at this job's steps, at most every 5 s.)
    wait_for(lambda: summary_so_far(out_dir), timeout_s=30, what="the session to start")
    target.wait_for_iterations(len(target.timestamps()) + 2)
    proc.send_signal(signal.SIGSTOP)
    # (1.5 s, and two of the job's steps at least: ~200 markers, however slow a busy
    # machine makes its steps; 1.5 s alone held none of them there)
    time.sleep(1.5)
    target.wait_for_iterations(len(target.timestamps()) + 2)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    stats = load_summary(out_dir)["final_statistics"]
    quality = stats["data_quality"]
    dropped = quality["sources"]["uprobes"]["events_dropped"]
    assert dropped > 0 and stats["lost_events"] == dropped
    assert quality["sources"]["uprobes"]["events"] > 100
    (loss,) = [li for li in quality["losses"] if li.startswith("uprobes: events_dropped")]
    assert f"events_dropped {dropped} (the ring buffer overflowed" in loss
    assert f"perfmon-agent: warning: data quality: {loss}" in err
    assert "1 loss(es): see the warnings" in out
    # Sources that missed nothing say what they saw, without a loss.
    assert quality["sources"]["memory"]["samples"] > 0
