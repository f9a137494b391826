"""The event log's records and their decoding (pure).

The log is a stream of msgpack maps, each with a ``type``. It is appended as
events arrive, so a killed agent leaves a log whose last record may be cut
short; decoding stops cleanly there and says so.

Record types (fields beyond ``type``):
- ``session_start``: ``t_mono_ns``, ``wall_time`` (ISO 8601), ``session`` (the
  static session facts: pids, command line, host, model, batch, world size, ...)
- ``marker``: ``t_mono_ns``, ``pid``, ``tid``, ``kind`` (one of MARKER_KINDS), ``name``
- ``process``: ``t_mono_ns``, ``pid``, ``rss_bytes``, ``peak_rss_bytes``
- ``lost``: ``t_mono_ns``, ``count`` (events the kernel could not deliver)
- ``session_end``: ``t_mono_ns``, ``wall_time``, ``reason``
"""

from __future__ import annotations

from typing import Any

import msgpack
from perfmon.parsers.errors import EventLogError

MARKER_KINDS = (
    "optimizer_step",
    "zero_grad",
    "dataloader_next",
    "backward_enter",
    "backward_exit",
)


def decode_event_log(data: bytes, source: str) -> tuple[list[dict[str, Any]], bool]:
    """Records of an event log, and whether its tail was cut short.

    Raises :class:`EventLogError` when the data is not an event log at all.
    """
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    records: list[dict[str, Any]] = []
    consumed = 0  # bytes up to the end of the last whole record
    try:
        for record in unpacker:
            if not isinstance(record, dict) or "type" not in record:
                raise EventLogError(f"{source}: not a perfmon event log (record {len(records)})")
            records.append(record)
            consumed = unpacker.tell()
    except (msgpack.UnpackException, ValueError) as err:
        raise EventLogError(
            f"{source}: corrupt event log after record {len(records)}: {err}"
        ) from err
    if not records or records[0]["type"] != "session_start":
        raise EventLogError(f"{source}: not a perfmon event log (no session_start record)")
    return records, consumed < len(data)
