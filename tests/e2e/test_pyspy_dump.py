"""dump_stacks' retries (perfmon.probes.pyspy) through a py-spy that fails as a dump racing
its target does, then is the real py-spy, reading this process."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from perfmon.probes.errors import ProbeError
from perfmon.probes.pyspy import dump_stacks, find_pyspy


def _flaky_pyspy(tmp_path: Path, failures: int) -> tuple[Path, Path]:
    """A py-spy that fails its first ``failures`` runs as a dump racing the target does,
    then is the real one; and the file its start times (s, /proc/uptime) are written to.
    (A shell script: it starts in milliseconds on a busy machine, where a Python one took
    most of a second.)"""
    starts = tmp_path / "starts"
    script = tmp_path / "py-spy"
    script.write_text(f"""#!/bin/sh
read -r now _ < /proc/uptime
echo "$now" >> '{starts}'
if [ "$(wc -l < '{starts}')" -le {failures} ]; then
    echo "Error: Failed to get stack traces" >&2
    exit 1
fi
exec '{find_pyspy()}' "$@"
""")
    script.chmod(0o755)
    return script, starts


def test_a_dump_that_races_its_target_is_tried_again_spread_over_seconds(tmp_path: Path):
    # Failures in a row are what a job rewriting deep stacks gives (tries back to back
    # all failed): the fourth try, ~1.7 s after the first, reads the stacks.
    script, starts = _flaky_pyspy(tmp_path, failures=3)
    threads = dump_stacks(os.getpid(), executable=str(script))
    assert any(t.tid == threading.get_native_id() for t in threads)
    times = [float(t) for t in starts.read_text().split()]
    assert len(times) == 4 and times[-1] - times[0] >= 1.5


def test_a_dump_that_keeps_failing_ends_within_its_timeout_with_pyspys_reason(
        tmp_path: Path):
    script, starts = _flaky_pyspy(tmp_path, failures=100)
    began = time.monotonic()
    with pytest.raises(ProbeError, match="Failed to get stack traces"):
        dump_stacks(os.getpid(), executable=str(script), timeout_s=1.0)
    assert time.monotonic() - began < 1.5
    # Tried again (at 0, 0.2 and 0.7 s on an idle machine; a busy one starts each later).
    assert len(starts.read_text().split()) >= 2
