"""The columns of a ``steps`` record (perfmon.parsers.events.Steps): one row per rank
and iteration end, as int64 arrays (pure).

A row's times are relative to its record's ``t_mono_ns``; the columns lie one
after another (column-major, little-endian), so similar values sit together and
the log's zstd stream packs them into a few bytes a row, and a reader takes each
column as an array without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# The int64 columns of a ``steps`` record, in this order (a newer agent may add more).
# ``waits`` -1: the wait probes were off for that iteration (sampled; ``wait_ns`` 0).
# ``p2p_wait_ns``: of ``wait_ns``, the wait on point-to-point sends and receives (a
# pipeline's); an older agent's log lacks it (OPTIONAL_COLUMNS: zeros).
STEP_COLUMNS = ("pid", "end_ns", "micro", "wait_ns", "waits", "how", "backward_ns",
                "backward_from_ns", "backward_to_ns", "p2p_wait_ns")
OPTIONAL_COLUMNS = ("p2p_wait_ns",)
_TIMES = ("end_ns", "backward_from_ns", "backward_to_ns")
MAX_STEP_HOWS = 16


@dataclass(frozen=True)
class StepBlock:
    """A ``steps`` record's columns as arrays (absolute times), checked."""

    pid: np.ndarray
    end_ns: np.ndarray
    micro: np.ndarray
    wait_ns: np.ndarray
    waits: np.ndarray
    how: np.ndarray
    backward_ns: np.ndarray
    backward_from_ns: np.ndarray
    backward_to_ns: np.ndarray
    p2p_wait_ns: np.ndarray
    hows: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.end_ns)

    @property
    def probed(self) -> np.ndarray:
        """Rows whose wait was measured (the wait probes were on for the whole iteration)."""
        return self.waits >= 0


def block_of(rows: list[tuple[int, ...]], hows: list[str]) -> StepBlock:
    """The block of ``rows`` (tuples in STEP_COLUMNS order, absolute times) and ``hows``."""
    table = np.array(rows, dtype=np.int64).T.copy()
    return StepBlock(**dict(zip(STEP_COLUMNS, table, strict=True)), hows=tuple(hows))


def encode_block(t_mono_ns: int, block: StepBlock) -> tuple[list[str], bytes]:
    """The ``columns`` and ``rows`` of the ``steps`` record of ``block`` (times relative
    to ``t_mono_ns``); an optional column that is all zeros is left out (most jobs have
    no point-to-point waits: their log stays as small as before)."""
    columns = [name for name in STEP_COLUMNS
               if name not in OPTIONAL_COLUMNS or getattr(block, name).any()]
    return columns, np.stack([getattr(block, name) - t_mono_ns if name in _TIMES
                              else getattr(block, name) for name in columns]
                             ).astype("<i8").tobytes()


def decode_steps(record: dict[str, Any]) -> StepBlock:
    """The columns of a well-formed ``steps`` record (record_problem said None)."""
    columns = list(record["columns"])
    table = np.frombuffer(record["rows"], dtype="<i8").reshape(len(columns), -1)
    zeros = np.zeros(table.shape[1], dtype=np.int64)
    named = {name: table[columns.index(name)] if name in columns else zeros
             for name in STEP_COLUMNS}
    t = record["t_mono_ns"]
    for name in _TIMES:
        named[name] = named[name] + t
    return StepBlock(**named, hows=tuple(record["hows"]))


def steps_problem(record: dict[str, Any]) -> str | None:
    """Why a ``steps`` record's columns are not as STEP_COLUMNS says, or None."""
    columns, rows, hows = record["columns"], record["rows"], record["hows"]
    if (not all(type(c) is str for c in columns) or len(set(columns)) != len(columns)
            or not set(STEP_COLUMNS) - set(OPTIONAL_COLUMNS) <= set(columns)):
        return "steps record without its columns"
    if not rows or len(rows) % (8 * len(columns)):
        return "steps record whose rows do not fill its columns"
    if len(hows) > MAX_STEP_HOWS or not all(type(h) is str and len(h) <= 64 for h in hows):
        return "steps record with a wrong 'hows'"
    table = np.frombuffer(rows, dtype="<i8").reshape(len(columns), -1)
    # (two reductions for all columns: this runs for every block of a replayed week)
    low = dict(zip(columns, table.min(axis=1).tolist(), strict=True))
    high = dict(zip(columns, table.max(axis=1).tolist(), strict=True))
    t = record["t_mono_ns"]
    # (times stay within int64 once made absolute)
    if (low["micro"] < -1 or low["wait_ns"] < 0 or low["waits"] < -1
            or low.get("p2p_wait_ns", 0) < 0
            or low["backward_ns"] < 0 or low["how"] < 0 or high["how"] >= len(hows)
            or not all(-(1 << 62) < low[name] + t and high[name] + t < 1 << 62
                       for name in _TIMES)):
        return "steps record with a value out of its range"
    return None
