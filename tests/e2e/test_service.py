"""The node service: the real `perfmon-agent serve` process, run as systemd runs it (a
NOTIFY_SOCKET the test listens on, a watchdog), finding real training jobs by itself.

One service runs for the whole module (its tests share it, in order; the last one
stops it); it only watches processes whose command line carries this run's tag, so
nothing else on the machine is touched.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import psutil
import pytest

from tests.conftest import SUMMARY_SCHEMA, TRAIN_GPT, _reap, wait_for
from tests.prom import Prometheus, free_port, get, tool, wait_until

pytestmark = pytest.mark.usefixtures("ebpf")

TAG = f"svc-test-{uuid.uuid4().hex[:8]}"  # in every job's command line: what serve watches
SCAN_S = 1.5


class Service:
    """`perfmon-agent serve` with a config, a NOTIFY_SOCKET and a watchdog."""

    def __init__(self, folder: Path, **config: Any) -> None:
        self.folder = folder
        self.jobs_root = folder / "jobs"
        self.port = free_port()
        self.config_path = folder / "config.yaml"
        self.config: dict[str, Any] = {
            "jobs_root": str(self.jobs_root), "scan_interval_s": SCAN_S,
            "metrics_address": f"127.0.0.1:{self.port}", "rank_wait_s": 20,
            "retry_initial_s": 1, "retry_max_s": 2,
            "include": {"commands": [re.escape(TAG)]},
            "attach": {"log_interval": 5, "iteration_source": "uprobe",
                       "stack_sampling": False},
            **config,
        }
        self.write_config(self.config)
        self.notify_path = folder / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.notify.settimeout(0.2)
        self.messages: list[str] = []
        # Read as systemd does, all the time: the service never waits for us.
        self._listening = True
        self._listener = threading.Thread(target=self._listen, daemon=True)
        self._listener.start()
        self.log_path = folder / "serve.log"
        env = {**os.environ, "NOTIFY_SOCKET": str(self.notify_path),
               "WATCHDOG_USEC": "2000000"}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "perfmon.agent.cli", "serve", "--config",
                 str(self.config_path)], stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)

    def write_config(self, config: dict[str, Any]) -> None:
        self.config_path.write_text(json.dumps(config))  # YAML is a superset of JSON

    def _listen(self) -> None:
        while self._listening:
            try:
                data = self.notify.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages += data.decode().splitlines()

    def wait_ready(self) -> None:
        """Until it said READY=1 (it serves its metrics then); a failure if it exited."""
        wait_for(lambda: "READY=1" in self.received() or self.proc.poll() is not None, 30,
                 "READY=1")
        assert self.proc.poll() is None, self.log()

    def received(self) -> list[str]:
        """Every notification so far, one ``KEY=value`` line each."""
        return list(self.messages)

    def log(self) -> str:
        return self.log_path.read_text()

    def metrics(self) -> str:
        return get(f"http://127.0.0.1:{self.port}/metrics")

    def job_folder(self, pid: int, timeout_s: float = 60) -> Path:
        """The folder of the job whose record lists ``pid`` among its ranks."""
        def find() -> Path | None:
            for record in self.jobs_root.glob("*/*/job.json"):
                try:
                    ranks = json.loads(record.read_text()).get("ranks") or []
                except ValueError:
                    continue  # being replaced
                if pid in [r["pid"] for r in ranks]:
                    return record.parent
            return None
        return wait_for(find, timeout_s, f"a job folder with pid {pid}")

    def close(self) -> None:
        _reap(self.proc)
        self._listening = False
        self._listener.join()
        self.notify.close()
        print(self.log()[-5000:])  # shown with a failing test


def record(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "job.json").read_text())


def ended(folder: Path) -> dict[str, Any] | None:
    try:
        job = record(folder)
    except ValueError:
        return None
    return job if job["status"] != "running" else None


def summaries(folder: Path) -> list[dict[str, Any]]:
    found = [json.loads(p.read_text()) for p in sorted(folder.glob("perf_summary_*.json"))]
    for summary in found:
        jsonschema.validate(summary, SUMMARY_SCHEMA)
    return found


def rank_pids(launcher: subprocess.Popen, n: int, timeout_s: float = 60) -> list[int]:
    """The pids of a torchrun's ranks, once all ``n`` have PyTorch loaded."""
    def ready() -> list[int] | None:
        ranks = [c for c in psutil.Process(launcher.pid).children()
                 if "train_gpt" in " ".join(c.cmdline())]
        if len(ranks) < n:
            return None
        for c in ranks:
            try:
                with open(f"/proc/{c.pid}/maps") as f:
                    if "libtorch_cpu" not in f.read():
                        return None
            except OSError:
                return None
        return sorted(c.pid for c in ranks)
    return wait_for(ready, timeout_s, "the ranks to load PyTorch", interval_s=0.05)


class Jobs:
    """Training jobs started by a test (tagged), always reaped."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True,
                                cwd=self.folder)
        self.procs.append(proc)
        return proc

    def torchrun(self, *args: str, ranks: int = 2) -> subprocess.Popen:
        return self.start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(ranks), str(TRAIN_GPT), "--ddp",
                           "--tag", TAG, *args])

    def python(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        return self.start([sys.executable, str(TRAIN_GPT), "--tag", TAG, *args], env)

    def reap(self) -> None:
        for proc in self.procs:
            _reap(proc)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service(tmp_path_factory.mktemp("serve"))
    try:
        svc.wait_ready()
        yield svc
    finally:
        svc.close()


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    started = Jobs(tmp_path)
    yield started
    started.reap()


@pytest.mark.long(reason=("two torchrun jobs found, measured and finalized by the node service, "
                          "one after the other"))
def test_a_torchrun_job_and_a_second_one_are_found_attached_measured_and_finalized(
        service: Service, jobs: Jobs, tmp_path: Path) -> None:
    prometheus = Prometheus(tool("prometheus"), tmp_path, [f"127.0.0.1:{service.port}"])
    try:
        first = jobs.torchrun("--train-iters", "300")
        pids = rank_pids(first, 2)
        ready_s = time.monotonic()
        # Found within one scan interval of both ranks having PyTorch loaded (the log
        # line is written when the scan that found the job starts attaching).
        wait_for(lambda: f"pids {pids[0]},{pids[1]})" in service.log(), SCAN_S + 3,
                 "the job to be found", interval_s=0.05)
        found_after_s = time.monotonic() - ready_s
        assert found_after_s <= SCAN_S + 1.0, found_after_s
        folder_a = service.job_folder(pids[0])
        # A second job, started while the first runs, is tracked separately.
        second = jobs.python("--train-iters", "250")
        folder_b = service.job_folder(second.pid)
        assert folder_b != folder_a
        name_a, name_b = record(folder_a)["name"], record(folder_b)["name"]
        assert name_a != name_b

        def step_count(text: str, name: str) -> float:
            match = re.search(rf'perfmon_step_time_seconds_count{{host="[^"]+",job="{name}",'
                              r'user="[^"]+"} (\S+)', text)
            return float(match.group(1)) if match else 0.0

        wait_for(lambda: step_count(service.metrics(), name_a) > 10
                 and step_count(service.metrics(), name_b) > 10, 60,
                 "both jobs' step times in /metrics")
        # The real Prometheus scrapes the service and answers for the running job.
        prometheus.wait_ready()
        # (A first scrape may come before any step was observed: its buckets are 0.)
        wait_until(lambda: sum(prometheus.values(
            f'perfmon_step_time_seconds_count{{job="{name_a}"}}')) > 10, 30,
            "Prometheus to scrape the job's step times")
        [p90] = prometheus.values(
            f'histogram_quantile(0.9, perfmon_step_time_seconds_bucket{{job="{name_a}"}})')
        assert 0.001 < p90 < 10
    finally:
        prometheus.stop()

    job_a = wait_for(lambda: ended(folder_a), 120, "the first job to end")
    job_b = wait_for(lambda: ended(folder_b), 60, "the second job to end")
    assert job_a["status"] == job_b["status"] == "ended"
    assert job_a["id_from"] == "TORCHELASTIC_RUN_ID" and job_a["host"] == socket.gethostname()
    [segment] = job_a["segments"]
    assert segment["pids"] == pids and segment["ranks"] == [0, 1]
    assert segment["end_reason"] == "target_exited"
    [summary] = summaries(folder_a)
    info = summary["session_info"]
    assert info["pids"] == pids and info["ranks"] == [0, 1]
    assert info["job"]["id"] == job_a["job_id"] and info["job"]["name"] == name_a
    assert info["total_iterations"] > 100
    [summary_b] = summaries(folder_b)
    assert summary_b["session_info"]["pids"] == [second.pid]
    # Finished jobs leave no series behind.
    text = service.metrics()
    assert f'job="{name_a}"' not in text and f'job="{name_b}"' not in text


def test_ranks_that_exit_one_by_one_end_one_session_when_the_last_is_gone(
        service: Service, jobs: Jobs) -> None:
    # Two ranks of one job (same MASTER_ADDR:MASTER_PORT), no launcher: rank 1 stops early.
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    rank0 = jobs.python("--train-iters", "250", env={**env, "RANK": "0"})
    rank1 = jobs.python("--train-iters", "60", env={**env, "RANK": "1"})
    folder = service.job_folder(rank0.pid)
    assert sorted(r["pid"] for r in record(folder)["ranks"]) == sorted([rank0.pid, rank1.pid])
    assert rank1.wait(timeout=60) == 0
    assert rank0.poll() is None  # one rank gone, the other still training
    time.sleep(2 * SCAN_S)
    assert record(folder)["status"] == "running"
    job = wait_for(lambda: ended(folder), 90, "the job to end")
    [segment] = job["segments"]  # no new session when a rank left
    assert job["id_from"] == "MASTER_ADDR:MASTER_PORT"
    [summary] = summaries(folder)
    assert sorted(summary["session_info"]["pids"]) == sorted([rank0.pid, rank1.pid])
    assert segment["end_reason"] == "target_exited"


def test_a_sigkilled_job_is_finalized(service: Service, jobs: Jobs) -> None:
    launcher = jobs.torchrun()
    pids = rank_pids(launcher, 2)
    folder = service.job_folder(pids[0])
    wait_for(lambda: list(folder.glob("perf_summary_*.json")), 30, "the first summary")
    time.sleep(2)
    for pid in [launcher.pid, *pids]:
        os.kill(pid, signal.SIGKILL)
    job = wait_for(lambda: ended(folder), 2 * SCAN_S + 10, "the killed job to be finalized")
    assert job["status"] == "ended"
    [summary] = summaries(folder)
    assert summary["session_info"]["end_reason"] == "target_exited"
    assert summary["session_info"]["end_time"] is not None


def test_a_job_that_cannot_be_attached_is_logged_once(
        service: Service, jobs: Jobs, tmp_path: Path) -> None:
    # A Python process with a "libtorch_cpu.so" that has none of PyTorch's symbols.
    source = tmp_path / "fake.c"
    source.write_text("int perfmon_not_torch = 1;\n")
    library = tmp_path / "libtorch_cpu.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    fake = jobs.start([sys.executable, "-c", "import ctypes, sys, time; "
                       "ctypes.CDLL(sys.argv[1]); time.sleep(600)", str(library), TAG])
    folder = service.job_folder(fake.pid)
    # Retried with back-off (1 s, then 2 s): several failures, one line.
    wait_for(lambda: record(folder).get("attach_failures", 0) >= 3, 30, "three attempts")
    lines = [line for line in service.log().splitlines()
             if f"pid {fake.pid}" in line and "cannot attach" in line]
    assert len(lines) == 1, lines
    assert "libtorch" in lines[0] or "symbol" in lines[0].lower(), lines[0]
    fake.kill()
    fake.wait()
    job = wait_for(lambda: ended(folder), 2 * SCAN_S + 5, "the job to be closed")
    assert job["segments"] == [] and job["last_attach_error"]


def test_sighup_reloads_the_config_and_sigterm_finalizes_within_10_s(
        service: Service, jobs: Jobs) -> None:
    before = len(service.received())
    service.write_config({**service.config, "max_jobs": 8})
    service.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "configuration reloaded" in service.log(), 10, "the reload")
    assert {"RELOADING=1", "READY=1"} <= set(service.received()[before:])
    service.config_path.write_text("max_jobs: [not a number\n")
    service.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reload failed, configuration unchanged" in service.log(), 10,
             "the refused reload")
    assert service.proc.poll() is None
    assert "WATCHDOG=1" in service.received()

    job = jobs.python()
    folder = service.job_folder(job.pid)
    name = record(folder)["name"]
    wait_for(lambda: re.search(rf'perfmon_iterations_total{{[^}}]*job="{name}"[^}}]*}} [1-9]',
                               service.metrics()), 60, "iterations")
    start = time.monotonic()
    service.proc.send_signal(signal.SIGTERM)
    assert service.proc.wait(timeout=15) == 0
    assert time.monotonic() - start <= 10
    assert "STOPPING=1" in service.received()
    assert job.poll() is None  # the job goes on: only its monitoring stopped
    assert record(folder)["status"] == "monitoring_stopped"
    [summary] = summaries(folder)
    assert summary["session_info"]["end_reason"] == "SIGTERM"
    assert summary["session_info"]["total_iterations"] > 0


def test_a_job_in_another_pid_namespace_is_found_with_host_pids(
        tmp_path: Path, jobs: Jobs) -> None:
    # A service of its own: the module's is stopped by the SIGTERM test before this.
    (tmp_path / "serve").mkdir()
    service = Service(tmp_path / "serve")
    try:
        _pid_namespace_job(service, jobs)
    finally:
        service.close()


def _pid_namespace_job(service: Service, jobs: Jobs) -> None:
    # As a container runtime would start it: a pid namespace of its own (pid 1 inside).
    # Long enough (400 iterations) to be found and attached on a busy machine.
    outer = jobs.start(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                        str(TRAIN_GPT), "--train-iters", "400", "--tag", TAG])
    job_pid = wait_for(lambda: next((c.pid for c in psutil.Process(outer.pid).children(True)
                                     if "train_gpt" in " ".join(c.cmdline())), None), 30,
                       "the job inside its namespace")
    folder = service.job_folder(job_pid)  # the host's pid, not 1
    job = wait_for(lambda: ended(folder), 90, "the job to end")
    assert job["pid_namespace"] and job["pid_namespace"].startswith("pid:[")
    [summary] = summaries(folder)
    assert summary["session_info"]["pids"] == [job_pid]
    assert summary["session_info"]["job"]["pid_namespace"] == job["pid_namespace"]
    assert summary["session_info"]["total_iterations"] > 50


@pytest.mark.parametrize(("config", "says"), [
    ("max_jobs: [1\n", "(line 2)"),
    ("max_jobs: -1\n", "max_jobs: -1 is less than the minimum of 1"),
    ("no_such_key: 1\n", "Additional properties are not allowed ('no_such_key'"),
    ("include: {commands: ['(']}\n", "include.commands.0: not a regular expression"),
    ("exclude: {users: [no-such-user-here]}\n", "no such user: 'no-such-user-here'"),
    ("attach: {probe_backend: ebpf}\n", "attach.probe_backend: 'ebpf' is not one of"),
])
def test_a_bad_config_is_one_line_and_exit_2(agent, tmp_path: Path, config: str,
                                             says: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(config)
    done = agent.run("serve", "--config", str(path), "--metrics-address", "off")
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"perfmon-agent: error: config {path}") and says in line, line


def test_a_missing_config_named_is_an_error(agent, tmp_path: Path) -> None:
    done = agent.run("serve", "--config", str(tmp_path / "none.yaml"))
    assert done.returncode == 2
    assert done.stderr.strip() == (f"perfmon-agent: error: config {tmp_path / 'none.yaml'}: "
                                   "no such file")


def test_old_job_folders_are_pruned_and_nothing_else(tmp_path: Path) -> None:
    host = tmp_path / "jobs" / re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())
    host.mkdir(parents=True)
    now = time.time()
    for i in range(5):  # finished jobs, the oldest first
        folder = host / f"job{i}.20261101-00000{i}"
        folder.mkdir()
        (folder / "job.json").write_text(json.dumps({"agent": "perfmon-agent",
                                                     "status": "ended"}))
        os.utime(folder / "job.json", (now - 3600 * (10 - i), now - 3600 * (10 - i)))
    foreign = host / "not-ours"
    foreign.mkdir()
    (foreign / "job.json").write_text("{}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "job.json").write_text(json.dumps({"agent": "perfmon-agent"}))
    (host / "link").symlink_to(elsewhere)
    svc = Service(tmp_path, keep_jobs=2)
    try:
        wait_for(lambda: "READY=1" in svc.received() or svc.proc.poll() is not None, 30,
                 "READY=1")
        wait_for(lambda: not (host / "job2.20261101-000002").exists(), 10, "pruning")
        assert sorted(p.name for p in host.iterdir()) == [
            "job3.20261101-000003", "job4.20261101-000004", "link", "not-ours"]
        assert (elsewhere / "job.json").exists()
    finally:
        svc.close()
