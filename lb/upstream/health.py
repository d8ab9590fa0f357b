"""Active health checks: a daemon thread per backend probes its health path every interval.

`fall` consecutive failures take a backend out of rotation, `rise` consecutive passes bring it back
(HAProxy's names); one lost probe never flaps it. Each transition is one log line. A thread per backend
means a hung backend delays only its own probes, and each probe's timeout is shorter than the interval.
The first probe runs at once -- at start and when a reload adds a backend -- not an interval later.
`rise` passes in a row also end a passive ejection early (lb/upstream/outlier.py probe_passed): one log line and
a return counted, as when the ejection's time is up.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from time import monotonic

from lb.errors import HttpError, UpstreamError
from lb.http.framing import Reader, parse_response
from lb.netaddr import hostport
from lb.upstream.backends import Backend

log = logging.getLogger("edge")


def probe(b: Backend, path: str, timeout: float, protocol: str = "http") -> tuple[bool, str]:
    """One GET on a fresh connection (not from the request pool): (passed, why). An h2c:// backend is
    probed over HTTP/2, with gRPC's health check when protocol is "grpc" (lb/upstream/h2health.py).

    `timeout` bounds the whole probe (connect, send, the response head), not each read, and nothing of
    the body is waited for (at most one 64 KiB read past the head is buffered, then the connection is
    closed): a backend that trickles or streams cannot hold the probe.
    """
    if b.spec.scheme == "h2c":
        from lb.upstream.h2health import probe as probe_h2

        return probe_h2(b, path, timeout, protocol == "grpc")
    deadline = monotonic() + timeout
    s = None
    try:
        s = socket.create_connection((b.spec.address or b.spec.host, b.spec.port), timeout=timeout)
        if b.spec.scheme == "https":  # verified as the request pool verifies it
            ctx = ssl.create_default_context(cafile=getattr(b.pool, "ca_certs", None))
            s.settimeout(max(deadline - monotonic(), 0.001))  # the handshake is inside the deadline
            s = ctx.wrap_socket(s, server_hostname=b.spec.host)
        s.settimeout(max(deadline - monotonic(), 0.001))
        s.sendall(
            b"GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\nUser-Agent: edge-health\r\n\r\n"
            % (path.encode(), hostport(b.spec.host, b.spec.port).encode())
        )
        r = Reader(s)
        r.deadline = deadline
        head = r.read_head(max_first_line=8192, what="response")
        if head is None:
            return False, "closed without a response"
        rh = parse_response(head)  # the body is not waited for: what came with the head is dropped
    except socket.timeout:
        return False, f"timeout after {timeout:g}s"
    except (HttpError, UpstreamError) as e:
        return False, f"invalid response: {e}"
    except OSError as e:
        return False, e.strerror or str(e) or type(e).__name__
    finally:
        if s is not None:
            s.close()
    return 200 <= rh.status < 300, f"HTTP {rh.status}"


def record(b: Backend, ok: bool, why: str, rise: int, fall: int) -> str | None:
    """Apply one probe result to the backend's streaks; the transition ('UP'/'DOWN') if one happened."""
    b.last_probe = why
    if ok:
        b.pass_streak += 1
        b.fail_streak = 0
        if not b.up and b.pass_streak >= rise:
            b.up = True
            b.refresh()  # back in rotation (unless ejected or drained): slow start begins
            return "UP"
    else:
        b.fail_streak += 1
        b.pass_streak = 0
        if b.up and b.fail_streak >= fall:
            b.up = False
            b.refresh()
            return "DOWN"
    return None


class HealthChecker:
    def __init__(
        self,
        path: str,
        interval: float,
        timeout: float,
        rise: int,
        fall: int,
        ejector=None,
        metrics=None,
        protocol: str = "http",
    ):
        self.path, self.interval, self.timeout, self.rise, self.fall = path, interval, timeout, rise, fall
        self.protocol = protocol  # "grpc": h2c:// backends answer grpc.health.v1.Health/Check
        self.ejector = ejector  # lb/upstream/outlier.py: passed probes end its ejections
        self.metrics = metrics  # counts each probe (lb_health_probes_total) and the returns probes cause
        self._stops: dict[Backend, threading.Event] = {}

    def watch(self, b: Backend) -> None:
        stop = threading.Event()
        self._stops[b] = stop
        threading.Thread(target=self._loop, args=(b, stop), name=f"health {b.url}", daemon=True).start()

    def unwatch(self, b: Backend) -> None:
        stop = self._stops.pop(b, None)
        if stop:
            stop.set()

    def stop(self) -> None:
        for b in list(self._stops):
            self.unwatch(b)

    def _loop(self, b: Backend, stop: threading.Event) -> None:
        while True:
            ok, why = probe(b, self.path, self.timeout, self.protocol)
            if stop.is_set():
                return
            if self.metrics is not None:
                self.metrics.probe(b.url, ok)
            change = record(b, ok, why, self.rise, self.fall)
            if change == "DOWN":
                log.warning(
                    "backend %s DOWN: %d consecutive failed probes of %s (last: %s)",
                    b.url,
                    b.fail_streak,
                    self.path,
                    why,
                )
            elif change == "UP":
                log.warning(
                    "backend %s UP: %d consecutive passed probes of %s (last: %s)", b.url, b.pass_streak, self.path, why
                )
            ej = self.ejector
            if ok and b.ejected and ej is not None and ej.probe_passed(b, self.rise, monotonic()):
                log.warning(
                    "backend %s returns from ejection: active health check passed (%d consecutive "
                    "passed probes of %s; ejected %d times)%s",
                    b.url,
                    b.pass_streak,
                    self.path,
                    b.times_ejected,
                    "" if b.in_rotation else f"; still out: {b.state}",
                )
                if self.metrics is not None:
                    self.metrics.ejection(b.url, returned=True)
            if stop.wait(self.interval):
                return
