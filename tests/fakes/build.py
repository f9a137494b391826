"""Build the fake ``libnvidia-ml.so.1`` (fake_nvml.c) and run Python against it.

pynvml dlopens "libnvidia-ml.so.1" by soname and the dynamic loader reads
LD_LIBRARY_PATH only when a process starts, so the code under test runs in a
child process whose LD_LIBRARY_PATH starts with the fake's directory (ahead of a
real driver's library on a GPU host). The scenario format is described at the
top of fake_nvml.c.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAKE_SOURCE = Path(__file__).with_name("fake_nvml.c")
SONAME = "libnvidia-ml.so.1"


def build_fake_nvml(out_dir: Path) -> Path:
    """Compile fake_nvml.c to ``out_dir/libnvidia-ml.so.1``; return ``out_dir``."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH to build the fake NVML")
    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [cc, "-std=c11", "-D_GNU_SOURCE", "-O1", "-Wall", "-Wextra", "-Werror", "-shared",
         "-fPIC", "-pthread", f"-Wl,-soname,{SONAME}", "-o", str(out_dir / SONAME),
         str(FAKE_SOURCE)],
        check=True, capture_output=True, text=True,
    )
    return out_dir


def write_scenario(path: Path, text: str) -> Path:
    """Write a scenario atomically (write + rename) so the fake never reads half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class FakeNvml:
    """A built fake library and a way to run Python processes that load it."""

    lib_dir: Path

    def env(self, scenario: Path | None) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(self.lib_dir), env.get("LD_LIBRARY_PATH", "")) if p)
        env.pop("FAKE_NVML_SCENARIO", None)
        if scenario is not None:
            env["FAKE_NVML_SCENARIO"] = str(scenario)
        return env

    def run(self, args: list[str], scenario: Path | None,
            timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """``python *args`` with the fake loaded; never raises on a non-zero exit."""
        return subprocess.run([sys.executable, *args], check=False, env=self.env(scenario),
                              capture_output=True, text=True, timeout=timeout_s)

    def run_json(self, code: str, scenario: Path | None) -> Any:
        """Run ``code`` (which prints one JSON document) and return it decoded."""
        done = self.run(["-c", code], scenario)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)
