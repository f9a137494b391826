"""`merge`: the summaries of one job's nodes as one job summary. Two real attach sessions
stand in for two nodes (their summaries relabelled as two hosts of one job). (The
slow-host rule on exact figures: tests/unit/agent/views/test_merge.py.)"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import ROOT, load_summary

pytestmark = pytest.mark.usefixtures("ebpf")
JOB_SCHEMA = json.loads((ROOT / "docs" / "job_summary.schema.json").read_text())


def relabel(summary_dir: Path, into: Path, host: str, job_id: str) -> dict:
    """One session's summary as one node of a job. The two stand-in jobs started apart
    (and the agent may or may not have read a job's own counter), so their iteration
    numbers are shifted to start together, as one job's nodes do; the shift is a whole
    number of log intervals, which keeps each entry on the grid."""
    summary = load_summary(summary_dir)
    logs, grid = summary["iteration_logs"], summary["session_info"]["log_interval"]
    shift = 1000 - logs[0]["iteration"] // grid * grid
    for entry in logs:
        entry["iteration"] += shift
    summary["session_info"]["host"] = host
    summary["session_info"]["job"] = {"id": job_id, "name": job_id,
                                      "id_from": "TORCHELASTIC_RUN_ID",
                                      "host": host}
    into.mkdir(parents=True)
    (into / "perf_summary_20261201_000000.json").write_text(json.dumps(summary))
    return summary


def _own_mean_step_ms(target, summary: dict) -> float:
    """The target's mean step by its own clock while its agent watched it."""
    info = summary["session_info"]
    times = [t for _, t in target.timestamps()
             if info["attach_monotonic_ns"] <= t <= info["detach_monotonic_ns"]]
    return (times[-1] - times[0]) / (len(times) - 1) / 1e6


def test_two_nodes_merge_into_the_documented_job_summary(agent, start_target, tmp_path):
    # Megatron-style dimensions on the command line give the agent the model.
    model = ("--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
             "--seq-length", "64", "--vocab-size", "512", "--micro-batch-size", "4")
    fast = start_target(*model)
    slow = start_target(*model, "--slow-ranks", "all", "--slow-ms", "15")
    outs = [tmp_path / "out_a", tmp_path / "out_b"]
    batch = tmp_path / "batch.yaml"  # the dimensions come from the command line
    batch.write_text("global_batch_size: 4\n")
    procs = []
    for target, out in zip((fast, slow), outs, strict=True):
        out.mkdir()
        procs.append(agent.start("attach", "--pid", str(target.pid), "--duration", "7",
                                 "--log-interval", "5", "--model-config", str(batch),
                                 "--output-dir", str(out)))
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    a = relabel(outs[0], tmp_path / "nodes" / "node-a" / "job", "node-a", "job-7")
    b = relabel(outs[1], tmp_path / "nodes" / "node-b" / "job", "node-b", "job-7")
    result_path = tmp_path / "job_summary.json"
    run = agent.run("merge", str(tmp_path / "nodes"), "-o", str(result_path))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == f"job summary: {result_path}"
    merged = json.loads(result_path.read_text())
    jsonschema.validate(merged, JOB_SCHEMA)

    info, stats = merged["job_info"], merged["final_statistics"]
    assert info["job_id"] == "job-7" and info["nodes"] == 2
    assert info["hosts"] == ["node-a", "node-b"] and info["ranks"] == 2
    # The per-node table: each node's own figures.
    rows = {r["host"]: r for r in stats["nodes"]}
    for host, s in (("node-a", a), ("node-b", b)):
        assert rows[host]["avg_step_time_ms"] == pytest.approx(
            s["final_statistics"]["avg_step_time_ms"])
        (rank,) = s["final_statistics"]["ranks"]
        assert rows[host]["avg_compute_ms"] == pytest.approx(rank["avg_compute_ms"])
    # The slowest node: the slowed one, by its ranks' compute, by ~15 ms a step.
    slowest = stats["slowest_node"]
    assert slowest["host"] == "node-b" and slowest["by"] == "avg_compute_ms"
    assert slowest["excess_ms"] == pytest.approx(
        rows["node-b"]["avg_compute_ms"] - rows["node-a"]["avg_compute_ms"])
    # ~15 ms injected; on the 2-core VM the two jobs and their agents contend, so the
    # truth is the difference of the jobs' own mean steps while they were watched.
    own_ms = [_own_mean_step_ms(t, s) for t, s in ((fast, a), (slow, b))]
    assert slowest["excess_ms"] >= 10
    assert slowest["excess_ms"] == pytest.approx(own_ms[1] - own_ms[0],
                                                 abs=max(3.0, 0.2 * (own_ms[1] - own_ms[0])))
    # And it stands out (the rank rule with hosts for ranks: of two hosts, against the
    # faster, above 10% of the ranks' mean step).
    slow_host = stats["slow_host"]
    assert slow_host["host"] == "node-b" and slow_host["reference_ms"] == pytest.approx(
        rows["node-a"]["median_compute_ms"])
    assert slow_host["excess_ms"] == pytest.approx(slowest["excess_ms"])
    assert slow_host["bar_ms"] == pytest.approx(max(1.0, 0.1 * statistics.fmean(
        s["final_statistics"]["ranks"][0]["avg_step_time_ms"] for s in (a, b))))
    assert "slow host node-b" in run.stdout
    # Per interval, on the log-interval grid: the job's step is the slowest node's, and
    # throughput is each node's figure over the job's step.
    grid = 5
    slots: dict[int, dict[str, dict]] = {}
    for host, s in (("node-a", a), ("node-b", b)):
        for e in s["iteration_logs"]:
            slots.setdefault(math.ceil(e["iteration"] / grid) * grid, {})[host] = e
    assert [e["iteration"] for e in merged["iteration_logs"]] == sorted(slots)
    both = [e for e in merged["iteration_logs"] if e["nodes"] == 2]
    assert both, "the two sessions overlap in iteration numbers"
    for e in merged["iteration_logs"]:
        nodes = slots[e["iteration"]]
        steps = {h: n["step_time_ms"] for h, n in nodes.items()}
        assert e["step_time_ms"] == max(steps.values())
        assert e["node_step_time_ms"] == steps
        assert e["slowest_node"] == max(steps, key=steps.__getitem__)
        tokens = [n["tokens_per_sec"] * steps[h] / e["step_time_ms"] for h, n in nodes.items()]
        assert e["tokens_per_sec"] == pytest.approx(statistics.fmean(tokens))
    job_steps = [e["step_time_ms"] for e in merged["iteration_logs"]]
    assert stats["avg_step_time_ms"] == pytest.approx(statistics.fmean(job_steps))
    assert stats["intervals"] == len(job_steps)
    # The run's throughput: each node's over the job's step (the global batch, not a sum).
    assert stats["avg_tokens_per_sec"] == pytest.approx(statistics.fmean(
        rows[h]["avg_tokens_per_sec"] * rows[h]["avg_step_time_ms"] / stats["avg_step_time_ms"]
        for h in rows))
    assert stats["total_iterations"] == max(a["session_info"]["total_iterations"],
                                            b["session_info"]["total_iterations"])

    # Folders that hold two jobs: one line naming them, unless --job picks one.
    relabel(outs[1], tmp_path / "nodes" / "node-c" / "job", "node-c", "job-8")
    run = agent.run("merge", str(tmp_path / "nodes"), "-o", str(tmp_path / "x.json"))
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert "2 jobs (job-7, job-8): name one with --job" in run.stderr
    run = agent.run("merge", str(tmp_path / "nodes"), "--job", "job-8", "--json",
                    "-o", str(tmp_path / "x.json"))
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["job_info"]["hosts"] == ["node-c"]


def test_merge_of_nothing_or_not_a_folder_is_one_line(agent, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for args, text in ((["merge", str(empty)], "no perf_summary_*.json under"),
                       (["merge", str(tmp_path / "missing")], "not a folder")):
        run = agent.run(*args)
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
        assert text in run.stderr and "Traceback" not in run.stderr
