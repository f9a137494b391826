"""Every job that trains is measured, whatever steps its parameters: real jobs of other
shapes than torch.optim's eager step (tests/targets/train_variants.py), attached with
real bcc uprobes and compared with the job's own clock.

The job stamps each update just before its parameters change; the agent ends it at the
Optimizer.step marker (torch.optim) or at the update's first gradient read (a compiled
or hand-written update), microseconds later, so each logged end falls between the
stamp of its update and the next one's. And where no probe can see an update, the
summary says so: never "nothing missed".
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from tests.conftest import load_summary

pytestmark = pytest.mark.usefixtures("ebpf")

VARIANTS = Path(__file__).resolve().parents[1] / "targets" / "train_variants.py"

# name: (the job's arguments, backward passes per update, how the agent ends an update)
SHAPES = {
    # (a) model and optimizer step compiled (PyTorch's "compiling the optimizer" recipe)
    "compiled_optimizer": (("--update", "compiled_opt"), 1, "grad_read"),
    # (b) the whole train step (forward, backward, step, zero_grad) in one compiled function
    "compiled_train_step": (("--update", "compiled_step", "--backwards", "3"), 3, "grad_read"),
    # (c) hand-written SGD, no torch.optim, 1 and 3 backward passes an update
    "hand_written_1": (("--update", "manual"), 1, "grad_read"),
    "hand_written_3": (("--update", "manual", "--backwards", "3"), 3, "grad_read"),
    # (d) torch.optim with foreach and fused kernels, zero_grad(set_to_none=True)
    "optim_foreach_2": (("--update", "optim", "--foreach", "--backwards", "2"), 2, "uprobe"),
    "optim_fused": (("--update", "optim", "--fused"), 1, "uprobe"),
}


def _attach(start_target, agent, out_dir: Path, job_args: tuple[str, ...], seconds: str = "5",
            *agent_args: str) -> tuple[dict, object, object]:
    # A compiled job takes tens of seconds to compile on two cores before it steps.
    target = start_target(*job_args, script=VARIANTS, warm_iterations=0)
    target.wait_for_iterations(20, timeout_s=240)
    run = agent.run("attach", "--pid", str(target.pid), "--duration", seconds,
                    "--output-dir", str(out_dir), *agent_args)
    assert run.returncode == 0, run.stderr
    return load_summary(out_dir), target, run


@pytest.mark.long(reason="a compiled optimizer's first steps compile for tens of seconds on CPU")
@pytest.mark.parametrize("shape", SHAPES)
def test_each_update_is_one_iteration_exact_to_the_jobs_own_clock(
        shape, start_target, agent, out_dir):
    job_args, backwards, estimator = SHAPES[shape]
    summary, target, run = _attach(start_target, agent, out_dir, job_args, "5",
                                   "--log-interval", "10", "--no-stack-sampling")
    stats = summary["final_statistics"]
    logs = summary["iteration_logs"]
    assert len(logs) >= 10, (stats["data_quality"], run.stderr)
    # Every logged end falls inside the update the job stamped with that number.
    stamps = [t for _, t in target.timestamps()]
    ends = [e["end_monotonic_ns"] for e in logs]
    for a, b in itertools.pairwise(ends):
        assert sum(1 for t in stamps if a < t <= b) == 10  # one end an update, none missed
    # Step time over the logged span, against the job's clock over the same updates.
    first = max(i for i, t in enumerate(stamps) if t <= ends[0])
    last = max(i for i, t in enumerate(stamps) if t <= ends[-1])
    truth_ms = (stamps[last] - stamps[first]) / (last - first) / 1e6
    ours_ms = (ends[-1] - ends[0]) / (len(ends) - 1) / 10 / 1e6
    assert ours_ms == pytest.approx(truth_ms, rel=0.005)
    job_median = statistics.median(
        (b - a) / 1e6 for a, b in itertools.pairwise(stamps[first:last + 1]))
    assert stats["p50_step_time_ms"] == pytest.approx(job_median, rel=0.05)
    assert stats["microbatches_per_step"] == backwards
    # (a job found by gradient reads is counted once its K backward passes are learnt)
    assert stats["iteration_estimators"].keys() == (
        {"grad_read", "counted"} if estimator == "grad_read" else {estimator})
    assert stats["iteration_clock"] == "exact"
    quality = stats["data_quality"]
    assert quality["losses"] == [], quality
    assert quality["sources"]["iterations"]["microbatches_varied"] == 0
    assert quality["sources"]["uprobes"]["backward_passes_unmeasured"] == 0
    # The gradient-read probe stays only where no Optimizer.step ever came, and is
    # detached while the updates are counted.
    assert quality["sources"]["uprobes"]["grad_read_ranks"] == (estimator == "grad_read")
    if estimator == "grad_read":
        assert quality["sources"]["update_probes"]["counted"] == 1
        assert quality["sources"]["update_probes"]["k_changes"] == 0
    assert "nothing missed" in run.stdout
    assert summary["final_statistics"]["hangs"] == []


def test_updates_no_probe_sees_are_a_loss_never_nothing_missed(start_target, agent, out_dir):
    """A job that steps on the gradients torch.autograd.grad returns reads no .grad and
    calls no torch.optim: its backward passes run, no update is seen."""
    summary, _target, run = _attach(start_target, agent, out_dir,
                                    ("--update", "autograd_grad"), "4", "--no-stack-sampling")
    info, stats = summary["session_info"], summary["final_statistics"]
    assert info["total_iterations"] == 0 and stats["iteration_clock"] is None
    sources = stats["data_quality"]["sources"]
    assert sources["uprobes"]["backward_passes_unmeasured"] > 100
    assert sources["iterations"]["none_measured"] == 1
    losses = stats["data_quality"]["losses"]
    assert any(line.startswith("uprobes: backward_passes_unmeasured") for line in losses)
    assert any(line.startswith("iterations: none_measured") for line in losses)
    assert "nothing missed" not in run.stdout
    assert "data quality: uprobes: backward_passes_unmeasured" in run.stderr
    assert "2 loss(es)" in run.stdout
    # Nothing seen is not start-up, and the session is not hung.
    assert stats["goodput"]["ratio"] is None and stats["hangs"] == []


def test_gradients_read_between_micro_batches_are_a_loss(start_target, agent, out_dir):
    """A gradient norm logged after the first of 3 backward passes of every 4th update
    splits those updates: the varying count of backward passes per update and the
    job's own counter (read by py-spy) both say so."""
    summary, _target, run = _attach(
        start_target, agent, out_dir,
        ("--update", "manual", "--backwards", "3", "--peek-grads-every", "4"), "8")
    quality = summary["final_statistics"]["data_quality"]
    counters = quality["sources"]["iterations"]
    assert counters["microbatches_varied"] > 10
    assert counters["counter_disagrees"] > 10
    assert any(line.startswith("iterations: microbatches_varied") for line in quality["losses"])
    assert "nothing missed" not in run.stdout


def test_an_estimated_clock_is_a_loss(steady_target, agent, out_dir):
    """Iterations from py-spy's stack samples are estimates: said in data_quality, with
    the micro-batches it cannot count."""
    run = agent.run("attach", "--pid", str(steady_target.pid), "--duration", "5",
                    "--iteration-source", "pyspy", "--output-dir", str(out_dir))
    assert run.returncode == 0, run.stderr
    stats = load_summary(out_dir)["final_statistics"]
    assert stats["measured_iterations"] > 5
    assert stats["iteration_clock"] == "estimated"
    counters = stats["data_quality"]["sources"]["iterations"]
    assert counters["ends_estimated"] == stats["measured_iterations"]
    assert counters["microbatches_unknown"] == stats["measured_iterations"]
    losses = stats["data_quality"]["losses"]
    assert any(line.startswith("iterations: ends_estimated") for line in losses)
    assert "nothing missed" not in run.stdout


def test_a_declared_count_of_backward_passes_measures_updates_no_probe_sees(
        start_target, agent, out_dir):
    """--microbatches 2 on a job stepping on torch.autograd.grad's gradients (2 backward
    passes an update): an end at every second backward pass's return, one an update."""
    summary, target, run = _attach(start_target, agent, out_dir,
                                   ("--update", "autograd_grad", "--backwards", "2"), "4",
                                   "--microbatches", "2", "--no-stack-sampling")
    info, stats = summary["session_info"], summary["final_statistics"]
    assert info["microbatches_declared"] == 2
    assert stats["iteration_clock"] == "declared"
    assert stats["iteration_estimators"].keys() == {"backward"}
    assert stats["microbatches_per_step"] == 2
    stamps = [t for _, t in target.timestamps()]
    ends = [e["end_monotonic_ns"] for e in summary["iteration_logs"]]
    assert len(ends) >= 10
    for a, b in itertools.pairwise(ends):
        assert sum(1 for t in stamps if a < t <= b) == 10
    assert stats["data_quality"]["losses"] == []
    assert "nothing missed" in run.stdout

