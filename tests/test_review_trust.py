"""Defects a reviewer found in issue 23/24/29's new pieces by trying to break them against real edges
over real sockets (the delay, response-timeout and 204 ones sit in their areas' test files)."""

import re
import resource
import socket
import time

from tests.support import Backend, Edge, request, wait_until


def _gauge(e: Edge) -> float:
    text = request(e.admin_port, "GET", "/metrics").body.decode()
    return float(re.search(r"^lb_client_connections (\S+)$", text, re.M).group(1))


def _thread_failures(e: Edge) -> int:
    return e.log().count("can't start new thread")


def wait_until_or_not(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_connection_whose_thread_cannot_start_is_counted_off_once():
    # socketserver already calls shutdown_request() when process_request() raises (a thread that cannot
    # start: RLIMIT_AS, RLIMIT_NPROC, systemd's TasksMax); the edge's and the admin's own except clause
    # took the connection off the count a second time, so each failure raised --max-connections (and
    # the admin cap) by one for good, and lb_client_connections went negative.
    b = Backend("threads")
    e = Edge("--backends", b.url, "--health-interval", "30", "--max-connections", "16", "--admin", "127.0.0.1:0")
    held = []
    try:
        wait_until(lambda: _gauge(e) == 0, what="no client connection yet")
        pid = e.popen.pid
        vm = int(re.search(r"VmSize:\s+(\d+)", open(f"/proc/{pid}/status").read()).group(1)) * 1024
        resource.prlimit(pid, resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))   # room for the heap, not for a thread stack (8 MiB)
        try:
            for _ in range(15):                # kept open: a thread that did start keeps its stack
                held.append(socket.create_connection(("127.0.0.1", e.port), timeout=5))
                if wait_until_or_not(lambda: _thread_failures(e) >= 1, 0.3):
                    break
            assert _thread_failures(e) >= 1, "every thread started: the scenario did not happen" + e.log()[-1500:]
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        for s in held:
            s.close()
        held = []
        wait_until(lambda: _gauge(e) == 0, timeout=10, what="the count back to 0 (not below)")
        # ... and the cap is still 16: a 17th idle connection is refused
        for _ in range(16):
            held.append(socket.create_connection(("127.0.0.1", e.port), timeout=5))
        wait_until(lambda: _gauge(e) == 16, timeout=10, what="sixteen connections counted")
        s = socket.create_connection(("127.0.0.1", e.port), timeout=5)
        held.append(s)
        assert s.recv(64).startswith(b"HTTP/1.1 503 "), "a 17th connection past --max-connections 16"
        assert e.alive()
    finally:
        for s in held:
            s.close()
        e.stop()
        b.stop()
