"""A real Prometheus server for the tests (Debian's prometheus package, set up by `make
test`), bound to 127.0.0.1 with a data folder of its own, and HTTP helpers."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "docs" / "prometheus" / "rules.yml"


def tool(name: str) -> str:
    """Debian's prometheus/promtool binary; a failure (not a skip) when missing."""
    path = f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: `make test` installs Debian's prometheus package "
                    "(TEST_DEB_PACKAGES in the Makefile), which provides prometheus and promtool")
    return path


# No proxies: whatever http_proxy says, these requests stay on this host.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(url: str) -> str:
    with _OPENER.open(url, timeout=5) as response:
        return response.read().decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """A Prometheus server of our own (never the Debian service), on 127.0.0.1."""

    def __init__(self, binary: str, folder: Path, targets: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = folder / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{
                "job_name": "perfmon", "honor_labels": True, "scrape_timeout": "1s",
                "static_configs": [{"targets": targets}]}],
        }))
        self.log = folder / "prometheus.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
                 "--storage.tsdb.retention.time=1h"],
                stdout=log, stderr=subprocess.STDOUT, cwd=folder)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited ({self.proc.returncode}): "
                            f"{self.log.read_text()[-2000:]}")
            try:
                return get(f"{self.url}/-/ready").startswith("Prometheus")
            except OSError:
                return False
        wait_until(ready, timeout_s, "prometheus to get ready")

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of an expression (fails on a query error)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        answer = json.loads(get(url))
        assert answer["status"] == "success", (promql, answer)
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def values(self, promql: str) -> list[float]:
        return [float(r["value"][1]) for r in self.query(promql)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(timeout=15)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.25)


