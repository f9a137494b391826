"""Files another ordinary user plants in a folder it may write (issue 36), against the
real CLI run as root and as the job's user.

A job's nodes' summaries are made cheaply (an event log of ``tests.eventlogs`` rebuilt
as ``summarize`` rebuilds it, relabelled as a node of one job) and laid in a sticky
folder every user may write, as /tmp is; the other user plants copies (chowned to it,
as if it wrote them): a node that computes 10 times slower with goodput 0, a ledger of
10^18 GPUs. ``merge`` (and ``report``, ``top``, ``incidents``) believe only what root
or the job's own user owns; the refused files are one line each and give no figure.
"""

from __future__ import annotations

import copy
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from perfmon.agent.record.replay import rebuild_from_event_log
from perfmon.agent.record.runs import SummaryCache

from tests import eventlogs
from tests.e2e.test_security import as_job_user, job_user, other_user  # noqa: F401

AGENT = Path(sys.executable).parent / "perfmon-agent"
JOB_ID = "job-36"
TIMEOUT_S = 60


def _cli(*args: str, user: pwd.struct_passwd | None = None) -> subprocess.CompletedProcess:
    """The real ``perfmon-agent`` (as ``user`` when given: setpriv)."""
    argv = [str(AGENT), *args]
    return subprocess.run(as_job_user(user, *argv) if user is not None else argv,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                          cwd="/", env={"PATH": os.environ["PATH"]})


def _warnings(done: subprocess.CompletedProcess) -> list[str]:
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return lines


def _node_summary(host: str, step_ms: int, user: pwd.struct_passwd,
                  job_id: str = JOB_ID) -> dict[str, Any]:
    """A real summary (an event log of 4 ranks rebuilt as summarize does) as one node of
    ``job_id`` owned by ``user``."""
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "perf_events_20261201_000000.msgpack"
        with open(log, "wb") as f:
            eventlogs.write(f, (r for r in eventlogs.rows_records(
                12, ranks=4, step_ns=step_ms * 1_000_000, gpus=False) if r is not None))
        summary = rebuild_from_event_log(log).summary
    summary["session_info"]["host"] = host
    summary["session_info"]["job"] = {"id": job_id, "name": job_id,
                                      "id_from": "TORCHELASTIC_RUN_ID", "host": host,
                                      "uid": user.pw_uid, "user": user.pw_name}
    return summary


def _write(path: Path, summary: dict[str, Any], owner: pwd.struct_passwd | None = None) -> Path:
    """``summary`` at ``path``, readable by all, owned by root or ``owner``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary))
    path.chmod(0o644)
    if owner is not None:
        os.chown(path, owner.pw_uid, owner.pw_gid)
    return path


def _slow_copy(summary: dict[str, Any]) -> dict[str, Any]:
    """Another node's summary as a planter makes it: host gpu-node-17, compute x10,
    step x10, goodput 0."""
    planted = copy.deepcopy(summary)
    planted["session_info"]["host"] = planted["session_info"]["job"]["host"] = "gpu-node-17"
    stats = planted["final_statistics"]
    for rank in stats["ranks"]:
        rank["avg_compute_ms"] *= 10
        rank["avg_step_time_ms"] *= 10
    stats["avg_step_time_ms"] *= 10
    for entry in planted["iteration_logs"]:
        entry["step_time_ms"] *= 10
    stats["goodput"].update(ratio=0.0, productive_seconds=0.0, productive_gpu_hours=0.0)
    return planted


def _huge_ledger(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary whose job ledger claims 10^18 GPUs for 0 s."""
    planted = copy.deepcopy(summary)
    goodput = planted["final_statistics"]["goodput"]
    goodput["job"] = {**{k: v for k, v in goodput.items() if k not in (
        "from", "last_job_iteration", "last_end_mono_ns")},
        "gpus": 10**18, "wall_seconds": 0.0, "productive_seconds": 0.0, "ratio": None}
    return planted


@pytest.fixture
def shared() -> Iterator[Path]:
    """A root folder every user may write, sticky (as /tmp), reachable by every user."""
    folder = Path(tempfile.mkdtemp(prefix="perfmon-shared-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def job_nodes(shared: Path, job_user: pwd.struct_passwd) -> dict[str, dict[str, Any]]:  # noqa: F811
    """The job's three nodes in ``shared``: two written by root (the agent), one copied
    there by the job's user."""
    nodes = {"node-a": 50, "node-b": 55, "node-c": 52}
    summaries = {host: _node_summary(host, ms, job_user) for host, ms in nodes.items()}
    for host, summary in summaries.items():
        _write(shared / host / "perf_summary_20261201_000000.json", summary,
               job_user if host == "node-c" else None)
        (shared / host).chmod(0o755)
    return summaries


def test_planted_summaries_are_refused_one_line_each_and_change_no_figure(
        shared: Path, job_nodes: dict[str, dict[str, Any]], job_user: pwd.struct_passwd,  # noqa: F811
        other_user: pwd.struct_passwd) -> None:  # noqa: F811
    # The job's real nodes alone: the figures to keep.
    reference_path = shared / "reference.json"
    done = _cli("merge", str(shared), "-o", str(reference_path))
    assert done.returncode == 0 and not _warnings(done), done.stderr
    reference = json.loads(reference_path.read_text())
    reference_path.unlink()
    assert reference["job_info"]["hosts"] == ["node-a", "node-b", "node-c"]
    assert reference["job_info"]["refused"] == []

    # The other user plants its copies beside them.
    planted = [_write(shared / "perf_summary_20261201_000017.json",
                      _slow_copy(job_nodes["node-b"]), other_user),
               _write(shared / "perf_summary_20261201_000018.json",
                      _huge_ledger(job_nodes["node-a"]), other_user)]

    job_out = Path(tempfile.mkdtemp(prefix="perfmon-jobout-", dir="/tmp"))
    os.chown(job_out, job_user.pw_uid, job_user.pw_gid)
    try:
        for user, out in ((None, shared / "root_out.json"), (job_user, job_out / "out.json")):
            done = _cli("merge", str(shared), "-o", str(out), user=user)
            assert done.returncode == 0, done.stderr
            lines = _warnings(done)
            assert len(lines) == len(planted), lines  # one line each, nothing else
            for path, line in zip(planted, sorted(lines), strict=True):
                assert line.startswith("perfmon-agent: warning: ")
                assert f"summary {path}: owned by uid {other_user.pw_uid}" in line
                assert f"neither root nor the job's user ({job_user.pw_name}" in line
                assert line.endswith("not read")
            merged = json.loads(out.read_text())
            assert len(merged["job_info"].pop("refused")) == len(planted)
            expected = copy.deepcopy(reference)
            expected["job_info"].pop("refused")
            assert merged == expected  # the real nodes' figures, unchanged
            assert "gpu-node-17" not in done.stdout + out.read_text()
            assert merged["final_statistics"]["goodput"]["gpus"] == 12  # 3 nodes x 4 ranks
    finally:
        shutil.rmtree(job_out, ignore_errors=True)


def test_a_ledger_of_1e18_gpus_is_out_of_range_with_one_warning(
        shared: Path, job_nodes: dict[str, dict[str, Any]], job_user: pwd.struct_passwd  # noqa: F811
) -> None:
    # Even in a file the job's own user owns (believed), 10^18 GPUs is no figure.
    huge = _write(shared / "node-b" / "perf_summary_20261201_000000.json",
                  _huge_ledger(job_nodes["node-b"]), job_user)
    out = shared / "out.json"
    done = _cli("merge", str(shared), "-o", str(out))
    assert done.returncode == 0, done.stderr
    [line] = _warnings(done)
    assert f"summary {huge}: 1 value(s)" in line
    assert "final_statistics.goodput.job.gpus: 1000000000000000000 is out of range" in line
    goodput = json.loads(out.read_text())["final_statistics"]["goodput"]
    assert goodput["gpus"] == 8  # node-a and node-c; node-b's ledger is left out
    assert goodput["wall_seconds"] > 10


def test_a_planted_summary_alone_is_refused_and_nothing_is_merged(
        shared: Path, job_user: pwd.struct_passwd, other_user: pwd.struct_passwd  # noqa: F811
) -> None:
    only = _write(shared / "perf_summary_20261201_000017.json",
                  _slow_copy(_node_summary("node-a", 50, job_user)), other_user)
    done = _cli("merge", str(shared), "-o", str(shared / "out.json"))
    assert done.returncode == 2
    refusal, error = _warnings(done)
    assert f"summary {only}: owned by uid {other_user.pw_uid}" in refusal
    assert error == (f"perfmon-agent: error: nothing to merge under {shared}: 1 summary "
                     "refused (named above: owned by neither root nor the job's user)")
    assert not (shared / "out.json").exists()


def test_when_the_job_user_is_unknown_only_root_and_the_callers_files_are_read(
        shared: Path, other_user: pwd.struct_passwd) -> None:  # noqa: F811
    stranger = pwd.struct_passwd(("no-such-user-36", "x", 2**31 - 7, 2**31 - 7, "", "/",
                                  "/bin/sh"))
    _write(shared / "node-a" / "perf_summary_20261201_000000.json",
           _node_summary("node-a", 50, stranger))
    planted = _write(shared / "perf_summary_20261201_000017.json",
                     _node_summary("node-b", 500, stranger), other_user)
    out = shared / "out.json"
    done = _cli("merge", str(shared), "-o", str(out))
    assert done.returncode == 0, done.stderr
    [line] = _warnings(done)
    assert (f"summary {planted}: owned by uid {other_user.pw_uid}; its job names user "
            "'no-such-user-36', unknown here, so only root's and uid 0's files are read: "
            "not read") in line
    assert json.loads(out.read_text())["job_info"]["hosts"] == ["node-a"]


def test_report_and_top_leave_a_planted_summary_out(
        shared: Path, job_nodes: dict[str, dict[str, Any]],
        other_user: pwd.struct_passwd) -> None:  # noqa: F811
    folder = shared / "node-a"
    folder.chmod(0o1777)  # the planter may write beside node-a's summary
    planted = _write(folder / "perf_summary_20261201_000017.json",
                     _slow_copy(job_nodes["node-a"]), other_user)
    page = shared / "page.html"
    done = _cli("report", str(folder), "-o", str(page))
    assert done.returncode == 0, done.stderr
    [line] = _warnings(done)
    assert f"skipped: summary {planted}: owned by uid {other_user.pw_uid}" in line
    assert "gpu-node-17" not in page.read_text()
    cache = SummaryCache([folder])
    assert [r.host for r in cache.runs()] == ["node-a"]
    assert [p for p in cache.problems if str(planted) in p and "not read" in p]


def test_merge_job_names_as_many_jobs_as_it_lists(
        shared: Path, job_user: pwd.struct_passwd, other_user: pwd.struct_passwd  # noqa: F811
) -> None:
    base = _node_summary("node-a", 50, job_user, "j")
    for i, (user, job_id) in enumerate([(job_user, "j"), (other_user, "j")]
                                       + [(job_user, f"k{n}") for n in range(10)]):
        summary = copy.deepcopy(base)
        summary["session_info"]["job"].update(id=job_id, name=job_id, uid=user.pw_uid,
                                              user=user.pw_name)
        _write(shared / f"n{i}" / "perf_summary_20261201_000000.json", summary)
    done = _cli("merge", str(shared), "--job", "j", "-o", str(shared / "out.json"))
    assert done.returncode == 2
    [line] = _warnings(done)
    listed = sorted([f"j (user {job_user.pw_name})", f"j (user {other_user.pw_name})"])
    assert line == (f"perfmon-agent: error: the folders hold 2 jobs ({', '.join(listed)}): "
                    "name one with --user (job 'j' is 2 users' jobs)")
    done = _cli("merge", str(shared), "-o", str(shared / "out.json"))
    [line] = _warnings(done)
    assert "the folders hold 12 jobs (" in line
    assert line.split(" jobs (", 1)[1].split("): name one")[0].count(", ") == 11
    done = _cli("merge", str(shared), "--job", "j", "--user", other_user.pw_name,
                "-o", str(shared / "out.json"))
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("case", ["owned_by_other_user", "world_writable"])
def test_run_into_an_output_dir_another_user_controls_starts_nothing(
        tmp_path: Path, other_user: pwd.struct_passwd, case: str) -> None:  # noqa: F811
    out = Path(tempfile.mkdtemp(prefix="perfmon-runout-", dir="/tmp"))
    try:
        if case == "owned_by_other_user":
            os.chown(out, other_user.pw_uid, other_user.pw_gid)
            needle = f"owned by uid {other_user.pw_uid}"
        else:
            out.chmod(0o777)
            needle = "writable by group or others without the sticky bit"
        marker = tmp_path / "command-ran"
        done = _cli("run", "--output-dir", str(out), "--", "touch", str(marker))
        assert done.returncode == 2
        [line] = _warnings(done)
        assert line.startswith(f"perfmon-agent: error: output dir {out}: ") and needle in line
        assert not marker.exists()  # the command never started
        assert list(out.iterdir()) == []
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _incident(folder: Path, name: str, text: str,
              owner: pwd.struct_passwd | None = None) -> Path:
    bundle = folder / name
    bundle.mkdir()
    record = bundle / "incident.json"
    record.write_text(text)
    if owner is not None:
        os.chown(bundle, owner.pw_uid, owner.pw_gid)
        os.chown(record, owner.pw_uid, owner.pw_gid)
    return record


def _good_incident(what: str) -> str:
    return json.dumps({"agent": "perfmon-agent", "kind": "hang", "what": what,
                       "time": "2026-12-01T00:00:00+00:00", "ranks": [{"pid": 1, "rank": 0}],
                       "files": ["incident.json"]})


def test_a_100000_deep_incident_is_one_warning_and_the_others_are_listed(
        shared: Path, job_nodes: dict[str, dict[str, Any]],
        other_user: pwd.struct_passwd) -> None:  # noqa: F811
    folder = shared / "node-a"
    folder.chmod(0o1777)
    _incident(folder, "incident_20261201_000000_hang", _good_incident("no iteration for 60 s"))
    deep = _incident(folder, "incident_20261201_000001_exit",
                     '{"agent": "perfmon-agent", "kind": "exit", "figures": '
                     + "[" * 100_000 + "]" * 100_000 + "}")
    planted = _incident(folder, "incident_20261201_000002_hang",
                        _good_incident("PLANTED by another user"), other_user)
    done = _cli("incidents", str(shared))
    assert done.returncode == 0, done.stderr
    assert "no iteration for 60 s" in done.stdout and "PLANTED" not in done.stdout
    deep_line, planted_line = _warnings(done)
    assert deep_line == f"perfmon-agent: warning: incident {deep}: nested too deep: not listed"
    assert f"incident {planted}: owned by uid {other_user.pw_uid}" in planted_line
    listed = json.loads(_cli("incidents", "--json", str(shared)).stdout)
    assert [i["what"] for i in listed["incidents"]] == ["no iteration for 60 s"]
    assert len(listed["problems"]) == 2
    # The report of the node's folder: the page, with the good incident beside its run.
    page = shared / "page.html"
    done = _cli("report", str(folder), "-o", str(page))
    assert done.returncode == 0, done.stderr
    assert sorted(_warnings(done)) == sorted([deep_line, planted_line])
    text = page.read_text()
    assert "no iteration for 60 s" in text and "PLANTED" not in text
    assert stat.S_ISREG(page.stat().st_mode)
