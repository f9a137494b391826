"""Incident bundles' bounds: at most MAX_PER_SESSION a session, at most MAX_KEPT in a
folder (only this agent's removed), each with its files (real bundles on real jobs:
tests/e2e/test_goodput_jobs.py and tests/e2e/test_stragglers.py)."""

from __future__ import annotations

import json
from pathlib import Path

from perfmon.agent.measure.incidents import MAX_KEPT, MAX_PER_SESSION, Incidents
from perfmon.agent.record.incidents import find_incidents
from perfmon.agent.record.outputs import OutputDir
from perfmon.agent.reducers import Summarizer
from perfmon.parsers.events import GpuSamples

from tests.traces import trace_events

S = 1_000_000_000
FACTS = {"workload": {}, "primary_pid": 4242, "pids": [4242], "ranks": [0],
         "attach_monotonic_ns": 0, "start_time": "2026-12-02T00:00:00+00:00",
         "log_interval": 10, "host": "node-a"}


def test_at_most_max_per_session_bundles_and_max_kept_in_the_folder(tmp_path: Path) -> None:
    out = OutputDir.open(tmp_path / "out")
    # A folder of older bundles of this agent's, and one that is not its.
    for i in range(MAX_KEPT + 5):
        old = tmp_path / "out" / f"incident_20250101_0000{i:02d}_hang"
        old.mkdir()
        (old / "incident.json").write_text(json.dumps({"agent": "perfmon-agent",
                                                       "kind": "hang", "time": f"2025 {i}"}))
    (tmp_path / "out" / "incident_planted").mkdir()
    warnings: list[str] = []
    incidents = Incidents(out, [], FACTS, warnings.append)
    summarizer = Summarizer.from_facts(FACTS)
    for i in range(MAX_PER_SESSION + 3):
        incidents.begin("fail_slow", i * S, i * S, f"step time rose ({i})", pids=[4242],
                        figures={"change_pct": 30.0})
    incidents.close(30 * S, summarizer)
    assert incidents.written == MAX_PER_SESSION
    assert [w for w in warnings if "no more" in w] == [
        f"incidents: {MAX_PER_SESSION} bundles written this session; no more"]
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    ours = [n for n in names if n != "incident_planted"]
    assert len(ours) == MAX_KEPT and "incident_planted" in names
    # The newest are this session's, each with its files and a trace that opens.
    found = find_incidents(tmp_path / "out")
    new = [i for i in found if i.kind == "fail_slow"]
    assert len(new) == MAX_PER_SESSION
    for incident in new:
        assert set(incident.files) == {"incident.json", "gpus.json", "stacks.json",
                                       "history.json", "trace.json"}
        trace_events(incident.folder / "trace.json")


def test_a_bundle_holds_the_latest_nvml_sample_of_the_jobs_gpus(tmp_path: Path) -> None:
    # A gpu record as the NVML source logs it: every GPU of the host in one sample.
    out = OutputDir.open(tmp_path / "out")
    incidents = Incidents(out, [], FACTS, lambda _line: None)
    for t, used in ((1 * S, 1 << 30), (2 * S, 2 << 30)):
        incidents.on_record(GpuSamples(t, gpus=[
            {"index": 0, "utilization_gpu_pct": 90, "process_memory_bytes": {4242: used}},
            {"index": 1, "utilization_gpu_pct": 0, "process_memory_bytes": {777: 1 << 30}},
        ]).to_record())
    incidents.begin("hang", 2 * S, 3 * S, "no iteration", pids=[4242], figures={})
    incidents.close(4 * S, Summarizer.from_facts(FACTS))
    (incident,) = find_incidents(tmp_path / "out")
    gpus = json.loads((incident.folder / "gpus.json").read_text())
    assert gpus["available"] and gpus["t_mono_ns"] == 2 * S and gpus["job_processes_seen"]
    assert gpus["gpus"] == [{"index": 0, "utilization_gpu_pct": 90,
                             "process_memory_bytes": {"4242": 2 << 30}}]


def test_a_rank_that_exits_while_its_stacks_are_read_is_an_exited_rank(monkeypatch) -> None:
    # (a launcher stops the other ranks when one fails: seen on torchrun's restart, the
    # rank alive when the bundle began and gone when py-spy read it)
    import os

    from perfmon.agent.measure import incidents
    from perfmon.probes.errors import NoSuchProcess
    from perfmon.probes.procfs import TargetProcess

    def gone(pid: int, **_: object) -> list:
        raise NoSuchProcess(f"pid {pid}: no such process (py-spy dump)")

    me = TargetProcess(os.getpid(), "python", [], {}, "", 0.0)  # (alive: this process)
    monkeypatch.setattr(incidents, "dump_stacks", gone)
    assert incidents._dump_live([me]) == {str(me.pid): {"exited": True}}
