"""systemd's sd_notify protocol in a few lines of stdlib: READY=1, RELOADING=1, STOPPING=1, STATUS=...

A no-op unless systemd started us with Type=notify (then $NOTIFY_SOCKET names a unix datagram socket;
a leading '@' means the abstract namespace).
"""

from __future__ import annotations

import os
import socket
import time


def notify(*lines: str) -> bool:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(path)
            s.sendall("\n".join(lines).encode())
        return True
    except OSError:
        return False


def reloading() -> bool:
    # Type=notify-reload (systemd 253+) wants MONOTONIC_USEC with RELOADING=1; older systemd ignores it.
    return notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
