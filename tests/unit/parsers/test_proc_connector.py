"""The exit parsers on bytes as the kernel writes them: the process-events connector's
datagrams (perfmon.parsers.proc_connector) and oom:mark_victim lines
(perfmon.parsers.trace_pipe.oom_victim). Real exits: tests/e2e/test_exits.py."""

from __future__ import annotations

import struct

from perfmon.parsers.proc_connector import (
    PROC_EVENT_EXIT,
    ConnectorExit,
    parse_connector_exits,
    subscribe_messages,
)
from perfmon.parsers.trace_pipe import oom_victim, parse_event_line


def test_connector_datagrams_and_mark_victim_lines_give_exits_and_victims():
    # An exit as do_exit sends it: nlmsghdr, cn_msg, proc_event (its header, then the exit).
    event = struct.pack("=IIQ", PROC_EVENT_EXIT, 1, 5_000) + struct.pack("=iiII", 42, 40, 768, 9)
    cn = struct.pack("=IIIIHH", 1, 1, 0, 0, len(event), 0) + event
    datagram = struct.pack("=IHHII", 16 + len(cn), 3, 0, 0, 0) + cn
    assert parse_connector_exits(datagram * 2) == [ConnectorExit(42, 40, 5_000, 768)] * 2
    assert parse_connector_exits(datagram[:-1]) == []  # cut short: nothing read past the end
    # The subscription requests are connector messages too, and hold no exit event.
    assert [parse_connector_exits(m) for m in subscribe_messages(7)] == [[], []]
    line = parse_event_line(b"      oom_reaper-55      [000] .....   120.000001: mark_victim: "
                            b"pid=1973 uid=0 comm=python")
    assert line is not None and oom_victim(line) == 1973
    other = parse_event_line(b"          python-1       [000] .....     1.000000: other: pid=5")
    assert other is not None and oom_victim(other) is None
