"""systemd's service notification protocol (sd_notify(3)), without libsystemd.

With ``Type=notify`` systemd passes ``NOTIFY_SOCKET`` (a datagram socket path, or
an abstract one starting with ``@``); the service sends ``READY=1`` when it
serves, ``RELOADING=1``/``READY=1`` around a reload, ``STOPPING=1`` when it stops,
``STATUS=...`` lines for ``systemctl status``, and with ``WatchdogSec=`` a
``WATCHDOG=1`` at least every ``WATCHDOG_USEC`` microseconds (half of it here),
or systemd restarts it. Without ``NOTIFY_SOCKET`` every call does nothing.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self.address: str | bytes | None = None
        if address.startswith("@"):
            self.address = b"\0" + address[1:].encode()
        elif address.startswith("/"):
            self.address = address
        self.watchdog_s: float | None = None
        usec, watchdog_pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not watchdog_pid
                                                  or watchdog_pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self._next_ping = 0.0
        self._socket: socket.socket | None = None
        if self.address is not None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def send(self, *lines: str) -> None:
        """One datagram of ``KEY=value`` lines, never blocking: when the receiver's queue
        is full (or systemd went away) the message is dropped, the service goes on."""
        if self._socket is None or self.address is None:
            return
        try:
            self._socket.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, self.address)
        except OSError:
            pass

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def watchdog(self, now_s: float) -> None:
        """Ping the watchdog when half its interval has passed since the last ping."""
        if self.watchdog_s is None or now_s < self._next_ping:
            return
        self._next_ping = now_s + self.watchdog_s / 2
        self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
