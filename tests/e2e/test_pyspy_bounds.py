"""py-spy output is bounded, with real processes (security issue 36): a child's output
is read up to its cap and the child killed, every py-spy the agent starts is the OOM
killer's first choice, and the real agent on a real deep-stack job run by an ordinary
user (tests/targets/deep_stacks.py) stays small. (Generated documents through the
parsers: tests/unit/parsers/test_pyspy_bounds.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from perfmon.parsers.pyspy import KEEP_FRAMES
from perfmon.probes.pyspy_process import run_pyspy

from tests.conftest import summary_so_far
from tests.e2e.test_security import ordinary_user

DEEP_STACKS = Path(__file__).resolve().parents[1] / "targets" / "deep_stacks.py"


def test_a_child_writing_without_end_is_read_up_to_the_cap_and_killed():
    script = "import sys\nwhile True: sys.stdout.write('x' * 65536)"
    started = time.monotonic()
    done = run_pyspy([sys.executable, "-c", script], timeout_s=20, cancel=None,
                     max_stdout=1_000_000)
    assert done.cut and len(done.stdout) == 1_000_000 and done.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 10


def test_every_pyspy_the_agent_starts_is_the_oom_killers_first_choice():
    script = "import time; time.sleep(0.3); print(open('/proc/self/oom_score_adj').read())"
    done = run_pyspy([sys.executable, "-c", script], timeout_s=20, cancel=None)
    assert not done.cut and done.stdout.strip() == b"1000"


CUT = ("windows_cut", "dumps_cut", "stacks_cut", "names_cut")


def _all_cut(out: Path) -> bool:
    """Whether the summary so far says py-spy's windows, dumps, stacks and names were cut."""
    summary = summary_so_far(out)
    pyspy = (summary or {}).get("final_statistics", {}).get("data_quality", {}).get(
        "sources", {}).get("pyspy", {})
    return all(pyspy.get(c) for c in CUT)


def _peak_rss_kib(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(status.split("VmHWM:")[1].split()[0])


def _pyspy_oom_scores(pid: int) -> set[int]:
    """oom_score_adj of the py-spy children of ``pid`` that have been running 0.1 s (the
    agent sets it just after starting one)."""
    scores = set()
    try:
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        for child in psutil.Process(pid).children(recursive=True):
            # Its age from its start ticks: psutil's create_time adds the boot time,
            # which moves by a second with the wall clock.
            started_s = int(Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1]
                            .split()[19]) / os.sysconf("SC_CLK_TCK")
            if child.name() == "py-spy" and uptime_s - started_s > 0.1:
                scores.add(int(Path(f"/proc/{child.pid}/oom_score_adj").read_text()))
    except (OSError, ValueError, IndexError, psutil.Error):
        pass
    return scores


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the agent reads another user's job")
@pytest.mark.long(reason="py-spy on a job of 950-frame stacks until its summary says what it cut")
def test_the_agent_on_a_job_of_65_threads_950_frames_deep_stays_small_and_says_what_it_cut():
    agent_bin = shutil.which("perfmon-agent", path=os.path.dirname(sys.executable))
    assert agent_bin is not None
    out = Path(tempfile.mkdtemp(prefix="perfmon-bounds-"))
    with ordinary_user("perfmon-deep") as user:
        # Function names of 600 characters, a file name of 300: the job.
        job = subprocess.Popen(
            [sys.executable, str(DEEP_STACKS), "--threads", "65", "--depth", "950",
             "--name-length", "600", "--file-length", "300"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, user=user.pw_uid,
            group=user.pw_gid, extra_groups=[], cwd="/", start_new_session=True)
        agent = None
        try:
            assert job.stdout is not None and job.stdout.readline() == b"ready\n"
            console = (out / "console.txt").open("w+b")
            agent = subprocess.Popen(
                [agent_bin, "attach", "--pid", str(job.pid), "--iteration-source", "pyspy",
                 "--output-dir", str(out)],
                stdout=console, stderr=subprocess.STDOUT)
            peak_kib, scores = 0, set()
            # Until its summary (rewritten every 5-15 s) has cut each of what it cuts, at
            # least 10 s, then SIGTERM: a busy machine takes longer to dump such a job.
            started, deadline = time.monotonic(), time.monotonic() + 120
            while agent.poll() is None and time.monotonic() < deadline:
                peak_kib = max(peak_kib, _peak_rss_kib(agent.pid))  # the agent's own
                scores |= _pyspy_oom_scores(agent.pid)
                if time.monotonic() - started >= 10 and _all_cut(out):
                    break
                time.sleep(0.1)
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=120)
            console.seek(0)
            assert agent.returncode == 0, console.read().decode()[-3000:]
        finally:
            if agent is not None and agent.poll() is None:
                agent.kill()
                agent.wait()
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    try:
        (summary,) = out.glob("perf_summary_*.json")
        quality = json.loads(summary.read_text())["final_statistics"]["data_quality"]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    # Before the bounds: 440 MB on this job (1.93 GB and OOM-killed on the node).
    assert 0 < peak_kib < 400 * 1024, peak_kib
    assert scores == {1000}, scores  # every py-spy seen: the OOM killer's first choice
    pyspy = quality["sources"]["pyspy"]
    # Its windows are 77 MB each: not read (or py-spy killed past its memory cap). Its
    # dumps (the job's counter is read with dump --locals) are cut at 8 MiB; the threads
    # within keep 256 of their 950 frames and shortened names.
    assert pyspy["windows_cut"] >= 1, pyspy
    assert pyspy["dumps_cut"] >= 1 and pyspy["stacks_cut"] >= 1, pyspy
    assert pyspy["frames_cut"] >= pyspy["stacks_cut"] * (950 - KEEP_FRAMES), pyspy
    assert pyspy["names_cut"] >= 1, pyspy
    for counter in CUT:
        assert any(line.startswith(f"pyspy: {counter} ") for line in quality["losses"])
