"""The systemd unit and `make install`: systemd-analyze verifies the unit as installed, rates
its sandbox at most MEDIUM exposure, and install/uninstall leave what they say. (The unit's
capabilities against docs/service.md: tests/unit/test_systemd.py; the example config:
tests/unit/agent/daemon/test_config.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "perfmon-agent.service"
EXAMPLE_CONFIG = ROOT / "systemd" / "config.yaml"
SERVICE_DOC = ROOT / "docs" / "service.md"
# systemd-analyze security's levels (src/analyze/analyze-security.c): exposure < level.
LEVELS = (("SAFE", 0.6), ("OK", 2.0), ("MEDIUM", 5.0), ("EXPOSED", 7.5), ("UNSAFE", 9.0))


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.fail("systemd-analyze is missing: `make test` installs Debian's systemd package")
    return path


def exposure(unit: Path) -> tuple[float, str]:
    done = subprocess.run([systemd_analyze(), "security", "--offline=true", str(unit)],
                          capture_output=True, text=True, check=False)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", done.stdout)
    assert match, done.stdout[-2000:] + done.stderr
    return float(match.group(1)), match.group(2)


pytestmark = pytest.mark.long(reason="make install into a folder: a virtualenv and the "
                                     "package built, once for the file")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory):
    """`make install` into a temporary PREFIX, SYSCONFDIR and UNITDIR (then uninstall)."""
    base = tmp_path_factory.mktemp("install")
    places = {"PREFIX": base / "opt", "SYSCONFDIR": base / "etc", "UNITDIR": base / "units"}
    args = [f"{k}={v}" for k, v in places.items()]
    done = subprocess.run(["make", "-C", str(ROOT), "install", *args], capture_output=True,
                          text=True, check=False, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    yield places
    done = subprocess.run(["make", "-C", str(ROOT), "uninstall", *args], capture_output=True,
                          text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr


def test_the_installed_unit_verifies_and_its_exposure_is_at_most_medium(installed) -> None:
    unit = installed["UNITDIR"] / "perfmon-agent.service"
    text = unit.read_text()
    agent = installed["PREFIX"] / "venv" / "bin" / "perfmon-agent"
    assert f"ExecStart={agent} serve --config {installed['SYSCONFDIR']}/config.yaml" in text
    done = subprocess.run([systemd_analyze(), "verify", "--man=no", str(unit)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    score, level = exposure(unit)
    assert level in ("SAFE", "OK", "MEDIUM") and score < 5.0, (score, level)
    # The figure the docs give is the one systemd-analyze gives.
    assert f"**{score} {level}**" in SERVICE_DOC.read_text()
    # The installed agent runs (from its own venv) and the example config is in place.
    help_text = subprocess.run([str(agent), "serve", "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "--config" in help_text
    assert (installed["SYSCONFDIR"] / "config.yaml").read_text() == EXAMPLE_CONFIG.read_text()


def test_the_unit_as_shipped_is_the_installed_one_with_the_default_paths(installed) -> None:
    shipped = UNIT.read_text()
    installed_text = (installed["UNITDIR"] / "perfmon-agent.service").read_text()
    assert shipped.replace("/opt/perfmon-agent", str(installed["PREFIX"])).replace(
        "/etc/perfmon-agent", str(installed["SYSCONFDIR"])) == installed_text


def test_uninstall_removes_the_venv_and_the_unit_but_keeps_the_config(tmp_path: Path) -> None:
    places = {"PREFIX": tmp_path / "opt", "SYSCONFDIR": tmp_path / "etc",
              "UNITDIR": tmp_path / "units"}
    places["PREFIX"].joinpath("venv", "bin").mkdir(parents=True)
    places["UNITDIR"].mkdir()
    (places["UNITDIR"] / "perfmon-agent.service").write_text("[Unit]\n")
    places["SYSCONFDIR"].mkdir()
    (places["SYSCONFDIR"] / "config.yaml").write_text("max_jobs: 2\n")
    done = subprocess.run(["make", "-C", str(ROOT), "uninstall",
                           *(f"{k}={v}" for k, v in places.items())],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert not places["PREFIX"].exists()
    assert not (places["UNITDIR"] / "perfmon-agent.service").exists()
    assert (places["SYSCONFDIR"] / "config.yaml").read_text() == "max_jobs: 2\n"
