"""The kernel's process-events connector on the wire: its exit events, its requests (pure).

``parse_connector_exits`` reads the ``PROC_EVENT_EXIT`` events out of one
netlink datagram of the connector (``CONFIG_PROC_EVENTS``): each task's pid,
tgid, CLOCK_MONOTONIC time and exit status in wait(2)'s format;
``connector_message`` frames a request to it, ``subscribe_messages`` and
``unsubscribe_message`` are the requests that start and end a subscription to
exit events. Bytes in, data out: the socket is perfmon.probes.exits'.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# linux/netlink.h, linux/connector.h, linux/cn_proc.h
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
PROC_EVENT_EXIT = 0x80000000
_NLMSG_DONE = 3
_NLMSG_HEADER = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT_HEADER = struct.Struct("=IIQ")  # what, cpu, timestamp_ns (aligned(8))
_EXIT_EVENT = struct.Struct("=iiII")  # process_pid, process_tgid, exit_code, exit_signal


@dataclass(frozen=True)
class ConnectorExit:
    """A task's exit as the process-events connector reports it."""

    pid: int  # the task (thread) id
    tgid: int
    t_mono_ns: int
    wait_status: int


def parse_connector_exits(datagram: bytes) -> list[ConnectorExit]:
    """The PROC_EVENT_EXIT events in one datagram of the process-events connector."""
    exits = []
    offset = 0
    while offset + _NLMSG_HEADER.size <= len(datagram):
        length = _NLMSG_HEADER.unpack_from(datagram, offset)[0]
        if length < _NLMSG_HEADER.size or offset + length > len(datagram):
            break
        body = offset + _NLMSG_HEADER.size
        if length >= _NLMSG_HEADER.size + _CN_MSG.size:
            idx, val, _, _, data_len, _ = _CN_MSG.unpack_from(datagram, body)
            event = body + _CN_MSG.size
            size = _EVENT_HEADER.size + _EXIT_EVENT.size
            if (idx, val) == (CN_IDX_PROC, CN_VAL_PROC) and data_len >= size and \
                    event + size <= offset + length:
                what, _, t_ns = _EVENT_HEADER.unpack_from(datagram, event)
                if what == PROC_EVENT_EXIT:
                    pid, tgid, code, _ = _EXIT_EVENT.unpack_from(
                        datagram, event + _EVENT_HEADER.size)
                    exits.append(ConnectorExit(pid, tgid, t_ns, code))
        offset += (length + 3) & ~3  # NLMSG_ALIGN
    return exits


def connector_message(data: bytes, pid: int) -> bytes:
    """A request to the connector (``data``: its operation, and a filter), one netlink
    message whose sender (``nlmsg_pid``) is ``pid``."""
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(data), 0) + data
    return _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(cn), _NLMSG_DONE, 0, 0, pid) + cn


def subscribe_messages(pid: int) -> list[bytes]:
    """The requests, to send in order from ``pid``, that subscribe to exit events."""
    # Linux 6.6+ also takes an event filter (struct proc_input): exits only. Older
    # kernels ignore a message of this length; the reader filters there.
    return [connector_message(struct.pack("=I", PROC_CN_MCAST_LISTEN), pid),
            connector_message(struct.pack("=II", PROC_CN_MCAST_LISTEN, PROC_EVENT_EXIT), pid)]


def unsubscribe_message(pid: int) -> bytes:
    """The request, from ``pid``, that ends its subscription."""
    return connector_message(struct.pack("=I", PROC_CN_MCAST_IGNORE), pid)
