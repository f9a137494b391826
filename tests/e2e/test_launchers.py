"""A launcher pid (torchrun, a shell wrapper) expands to the training processes behind it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import TRAIN_GPT, Target, load_summary

pytestmark = pytest.mark.usefixtures("ebpf")


def test_torchrun_pid_expands_to_its_ranks_and_rank0_sets_the_pace(agent, out_dir, tmp_path):
    stamps = tmp_path / "rank_stamps.txt"
    # Two CPU ranks under the real torchrun; each writes its own timestamps file.
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", "29533", str(TRAIN_GPT), "--timestamps", str(stamps)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    agent.procs.append(launcher)  # reaped (with its group) by the agent fixture
    Target(launcher, stamps).wait_for_iterations(4, timeout_s=90)
    run = agent.run("attach", "--pid", str(launcher.pid), "--duration", "4",
                    "--output-dir", str(out_dir))
    assert run.returncode == 0, run.stderr
    info = load_summary(out_dir)["session_info"]
    assert len(info["pids"]) == 2 and launcher.pid not in info["pids"]
    assert info["ranks"] == [0, 1]
    assert info["primary_pid"] == info["pids"][0]
    assert info["model"]["source"] == "none"
    assert info["total_iterations"] > 20


def test_shell_wrapper_pid_expands_to_the_python_child(agent, out_dir, tmp_path):
    stamps = tmp_path / "stamps.txt"
    wrapper = subprocess.Popen(
        ["sh", "-c", f'"{sys.executable}" "{TRAIN_GPT}" --timestamps "{stamps}"; true'],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    agent.procs.append(wrapper)
    Target(wrapper, stamps).wait_for_iterations(2)
    run = agent.run("attach", "--pid", str(wrapper.pid), "--duration", "3",
                    "--output-dir", str(out_dir))
    assert run.returncode == 0, run.stderr
    info = load_summary(out_dir)["session_info"]
    (child,) = info["pids"]
    assert child != wrapper.pid and info["total_iterations"] > 10


def test_megatron_style_command_line_gives_the_model_with_no_config_file(
    agent, start_target, out_dir
):
    target = start_target("--num-layers", "3", "--hidden-size=96", "--num-attention-heads", "4",
                          "--seq-length", "32", "--vocab-size", "256", "--micro-batch-size", "2",
                          "--grad-accum", "2")
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "3",
                    "--output-dir", str(out_dir))
    assert run.returncode == 0, run.stderr
    summary = load_summary(out_dir)
    model = summary["session_info"]["model"]
    assert model["source"] == "cmdline"
    dims = model["dimensions"]
    assert (dims["num_layers"], dims["hidden_size"], dims["seq_length"]) == (3, 96, 32)
    stats = summary["final_statistics"]
    # Global batch derived: micro batch 2 x 2 micro-batches x DP 1.
    assert stats["avg_tokens_per_sec"] == pytest.approx(
        4 * 32 / (stats["avg_step_time_ms"] / 1e3), rel=0.01)
    assert stats["avg_tflops_per_gpu"] > 0


def test_hugging_face_config_named_on_the_command_line_gives_the_model(
    agent, start_target, out_dir, tmp_path
):
    model_dir = tmp_path / "job" / "tiny-gpt2"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 3, "n_embd": 96, "n_head": 4, "vocab_size": 256,
         "n_positions": 64}))
    # A relative path: the agent resolves it against the job's own working directory.
    target = start_target("--model_name_or_path", "tiny-gpt2", "--per_device_train_batch_size",
                          "2", "--max_seq_length", "32", cwd=tmp_path / "job")
    run = agent.run("attach", "--pid", str(target.pid), "--duration", "3",
                    "--output-dir", str(out_dir))
    assert run.returncode == 0, run.stderr
    model = load_summary(out_dir)["session_info"]["model"]
    assert model["source"] == "cmdline+hf_config:tiny-gpt2"
    dims = model["dimensions"]
    assert (dims["num_layers"], dims["hidden_size"], dims["num_attention_heads"]) == (3, 96, 4)
    assert dims["seq_length"] == 32 and dims["micro_batch_size"] == 2
    assert model["field_sources"]["hidden_size"] == "hf_config:tiny-gpt2"
    assert model["field_sources"]["seq_length"] == "cmdline"
    assert model["global_batch_size"].startswith("derived")
