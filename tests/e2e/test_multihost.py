"""One job on two hosts: a real `torchrun --nnodes 2` job (c10d rendezvous on the
loopback), one `perfmon-agent serve` per host writing into one shared jobs root, and one
real Prometheus scraping both.

Two hosts on one machine: each "host" is a service with a host name of its own (its
`host` setting) that watches only its node's processes (its `include` filter matches
the node's tag in their command lines), as each node's service watches only the ranks
on its node. Node b's ranks wait 30 ms longer in each forward (a slower device), so
b is the slow host. The ranks stand for GPU ranks (train_gpt --device-ms).
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import TRAIN_GPT, Target, _reap, wait_for
from tests.e2e.test_service import Service
from tests.prom import Prometheus, free_port, get, tool, wait_until

pytestmark = pytest.mark.usefixtures("ebpf")

TAG = f"mh-{uuid.uuid4().hex[:8]}"
RUN_ID = f"two-hosts-{uuid.uuid4().hex[:6]}"  # torchrun's --rdzv-id: the job's id
MICRO_BATCH, SEQ = 4, 32
MODEL = ("--num-layers", "1", "--hidden-size", "64", "--seq-length", str(SEQ),
         "--micro-batch-size", str(MICRO_BATCH), "--device-ms", "60", "--ddp")
HOSTS = ("node-a", "node-b")
SLOW_MS = 30


def _torchrun(folder: Path, host: str, port: int, *args: str) -> subprocess.Popen:
    with (folder / f"{host}.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN_ID, str(TRAIN_GPT),
             *MODEL, "--tag", f"{TAG}-{host}", "--timestamps", str(folder / f"{host}.stamps"),
             *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The running job, its two services and Prometheus, for the module's tests."""
    root = tmp_path_factory.mktemp("two_hosts")
    jobs_root = root / "jobs"
    services, procs = {}, []
    prometheus = None
    try:
        for host in HOSTS:
            (root / host).mkdir()
            services[host] = Service(
                root / host, host=host, jobs_root=str(jobs_root), rank_wait_s=60,
                include={"commands": [re.escape(f"{TAG}-{host}")]},
                attach={"log_interval": 10, "iteration_source": "uprobe",
                        "stack_sampling": False})
            services[host].jobs_root = jobs_root
        prometheus = Prometheus(tool("prometheus"), root,
                                [f"127.0.0.1:{s.port}" for s in services.values()])
        port = free_port()
        procs.append(_torchrun(root, "node-a", port))
        procs.append(_torchrun(root, "node-b", port, "--slow-ranks", "all", "--slow-ms",
                               str(SLOW_MS), "--slow-wait"))
        stamps = [Target(p, root / f"{h}.stamps") for p, h in zip(procs, HOSTS, strict=True)]
        for target in stamps:
            try:
                target.wait_for_iterations(5, timeout_s=120)
            except AssertionError as err:
                logs = "\n".join((root / f"{h}.log").read_text()[-1500:] for h in HOSTS)
                raise AssertionError(f"{err}: {logs}") from None
        prometheus.wait_ready()
        yield {"root": root, "jobs_root": jobs_root, "services": services,
               "prometheus": prometheus, "stamps": stamps, "procs": procs}
    finally:
        for proc in procs:
            _reap(proc)
        if prometheus is not None:
            prometheus.stop()
        for service in services.values():
            service.close()


def _own_step_s(targets: list[Target], since_ns: float, until_ns: float) -> float:
    """The job's median step by its own clock (the first of its 4 ranks to stamp each
    iteration, on either node) between two CLOCK_MONOTONIC instants."""
    first: dict[int, int] = {}
    for target in targets:
        for iteration, t in target.timestamps():
            first[iteration] = min(t, first.get(iteration, t))
    times = [first[i] for i in sorted(first)]
    return statistics.median(b - a for a, b in itertools.pairwise(times)
                             if since_ns <= a < until_ns) / 1e9


def test_both_hosts_name_the_job_alike_and_prometheus_has_its_figures_from_both(
        two_hosts: dict[str, Any]) -> None:
    prometheus: Prometheus = two_hosts["prometheus"]
    # Both services found their node's two ranks and named the job alike: its id.
    folders = {h: s.job_folder(_rank_pids(two_hosts, h)[0], timeout_s=90)
               for h, s in two_hosts["services"].items()}
    records = {h: json.loads((f / "job.json").read_text()) for h, f in folders.items()}
    assert {r["job_id"] for r in records.values()} == {RUN_ID}, records
    assert {h: r["host"] for h, r in records.items()} == {h: h for h in HOSTS}
    assert {f.parent.name for f in folders.values()} == set(HOSTS)  # jobs_root/<host>/
    job = records["node-a"]["name"]
    assert records["node-b"]["name"] == job
    # Prometheus, over both hosts: the job's step times, its world size, tokens/s.
    selector = f'job="{job}"'
    wait_until(lambda: len(prometheus.values(
        f'perfmon_step_time_seconds_count{{{selector}}} > 20')) == 2, 90,
        "both hosts' step times in Prometheus")
    assert sorted(r["metric"]["host"] for r in prometheus.query(
        f"perfmon_job_world_size{{{selector}}} == 4")) == list(HOSTS)
    p50 = prometheus.values(f"histogram_quantile(0.5, sum by (host, le) "
                            f"(perfmon_step_time_seconds_bucket{{{selector}}}))")
    assert len(p50) == 2
    # tokens/s of the whole job, over the last 20 s, against its own clock: 4 ranks of
    # MICRO_BATCH sequences of SEQ tokens a step.
    wait_until(lambda: len(prometheus.values(f"perfmon_tokens_per_second{{{selector}}}")) == 2,
               60, "tokens/s from both hosts")
    time.sleep(20)
    now_ns = time.monotonic_ns()
    values = prometheus.values(f"avg_over_time(perfmon_tokens_per_second{{{selector}}}[20s])")
    # (the gauge follows the job a log interval and a scrape behind: its 20 s are the job's
    # 20 s ending up to 10 s ago, and on a busy machine the job's pace moves within that)
    truths = [4 * MICRO_BATCH * SEQ / _own_step_s(two_hosts["stamps"], end - 20e9, end)
              for end in (now_ns - lag * 1e9 for lag in range(11))]
    print(f"tokens/s: {values} from the hosts, {truths[0]:.1f} by the job's own clock")
    for value in values:
        assert min(abs(value / truth - 1) for truth in truths) <= 0.02, (value, truths)
    # Each host's compute; b's ranks compute 30 ms longer, and the rules name it.
    compute = {r["metric"]["host"]: float(r["value"][1]) for r in prometheus.query(
        f"perfmon_host_compute_seconds{{{selector}}}")}
    print(f"host compute: {compute}")
    assert compute["node-b"] - compute["node-a"] == pytest.approx(SLOW_MS / 1000, rel=0.3)
    wait_until(lambda: _alerts(prometheus, "PerfmonSlowHost", job) == ["node-b"], 30,
               "the slow host's alert (pending for its 2 minutes)")


def _alerts(prometheus: Prometheus, name: str, job: str) -> list[str]:
    answer = json.loads(get(f"{prometheus.url}/api/v1/alerts"))
    return sorted(a["labels"].get("host", "") for a in answer["data"]["alerts"]
                  if a["labels"].get("alertname") == name and a["labels"].get("job") == job)


def _rank_pids(two_hosts: dict[str, Any], host: str) -> list[int]:
    """The node's rank processes (the children of its torchrun with its tag)."""
    launcher = two_hosts["procs"][HOSTS.index(host)]
    return wait_for(lambda: sorted(
        c.pid for c in psutil.Process(launcher.pid).children(recursive=True)
        if f"{TAG}-{host}" in " ".join(c.cmdline()) and "torch.distributed.run" not in
        " ".join(c.cmdline())), 60, f"{host}'s ranks")


def test_merge_of_the_shared_root_gives_one_job_of_two_hosts_and_names_the_slow_one(
        two_hosts: dict[str, Any], tmp_path: Path) -> None:
    # (once each host's summary, rewritten at least every 5 s, has each of its ranks'
    # compute: the figure the slow host is named by; a busy machine's first summary may
    # come before it)
    def summaries() -> list[Path]:
        found = list(two_hosts["jobs_root"].glob("*/*/perf_summary_*.json"))
        if len({p.parent.parent.name for p in found}) != 2:
            return []
        for path in found:
            try:
                ranks = json.loads(path.read_text())["final_statistics"].get("ranks") or []
            except (OSError, ValueError):
                return []
            if len(ranks) != 2 or any(r.get("avg_compute_ms") is None for r in ranks):
                return []
        return found

    wait_for(summaries, 90, "both hosts' summaries with their ranks' compute")
    out = tmp_path / "job_summary.json"
    done = subprocess.run([sys.executable, "-m", "perfmon.agent.cli", "merge",
                           str(two_hosts["jobs_root"]), "-o", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    merged = json.loads(out.read_text())
    info, stats = merged["job_info"], merged["final_statistics"]
    assert info["job_id"] == RUN_ID and info["hosts"] == list(HOSTS), info
    assert info["nodes"] == 2 and info["ranks"] == 4
    # (c10d numbers the nodes in the order they joined: either host may hold ranks 0-1)
    by_host = {n["host"]: sorted(n["ranks"]) for n in stats["nodes"]}
    assert sorted(by_host.values()) == [[0, 1], [2, 3]], stats["nodes"]
    assert stats["slow_host"] and stats["slow_host"]["host"] == "node-b", stats["nodes"]
    assert stats["slow_host"]["excess_ms"] == pytest.approx(SLOW_MS, rel=0.3)
