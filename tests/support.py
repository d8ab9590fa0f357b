"""Real processes on 127.0.0.1 for the integration tests: start, wait (with a deadline), read logs, stop.

Every wait here polls with a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll predicate() until it returns something truthy; fail loudly at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process whose stdout+stderr go to a file we can search."""

    def __init__(self, args: list[str], name: str, env: dict | None = None, cwd=ROOT):
        self.name = name
        self.args = args
        fd, self.log_path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        self._log = os.fdopen(fd, "wb")
        self.popen = subprocess.Popen(
            args, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float = 10.0) -> re.Match:
        rx = re.compile(pattern)

        def found():
            if self.popen.poll() is not None and not rx.search(self.log()):
                raise AssertionError(f"{self.name} exited ({self.popen.returncode}):\n{self.log()}")
            return rx.search(self.log())

        return wait_until(found, timeout, what=f"{self.name} log /{pattern}/")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 5.0) -> int | None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        self._log.close()
        return self.popen.returncode

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(5)


class Backend(Proc):
    """`python -m demo.backends` on a port of its own choosing (or the one given, to restart in place)."""

    def __init__(self, name: str, port: int = 0, *args: str, host: str = "127.0.0.1"):
        super().__init__([PY, "-m", "demo.backends", "--host", host, "--port", str(port), "--name", name, *args],
                         f"backend-{name}")
        m = self.wait_log(r"listening \S+:(\d+) ")
        self.port = int(m.group(1))
        self.url = f"http://{'[%s]' % host if ':' in host else host}:{self.port}"

    def stats(self) -> dict:
        import json
        return json.loads(request(self.port, "GET", "/_ctl/stats").body)


class Edge(Proc):
    """`python edge.py` listening on a port it picks; extra args are passed through. cwd: another
    checkout's edge.py (the benchmarks' before/after)."""

    def __init__(self, *args: str, name: str = "edge", env: dict | None = None, cwd=ROOT):
        super().__init__([PY, "edge.py", "--listen", "127.0.0.1:0", *args], name, env, cwd)
        m = self.wait_log(r"listening on (\S+):(\d+)")   # 127.0.0.1:P, [::1]:P
        self.port = int(m.group(2))
        self.admin_port = None
        if "--admin" in args:
            self.admin_port = int(self.wait_log(r"admin on (\S+):(\d+)").group(2))


# Admin writes (drain, enable) need a token: the tests that make them start the edge with ADMIN_ENV and
# send ADMIN_AUTH.
ADMIN_TOKEN = "test-admin-token-0123456789"
ADMIN_ENV = {"EDGE_ADMIN_TOKEN": ADMIN_TOKEN}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class Response:
    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    def __repr__(self):
        return f"<Response {self.status} {self.body[:60]!r}>"


def request(port: int, method: str = "GET", path: str = "/", headers: dict | list | None = None,
            body: bytes | None = None, timeout: float = 10.0, conn: http.client.HTTPConnection | None = None
            ) -> Response:
    """One request with http.client (a new connection unless one is given)."""
    own = conn is None
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        hdrs = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
        if not any(k.lower() == "host" for k, _ in hdrs):
            hdrs.insert(0, ("Host", f"127.0.0.1:{port}"))
        if body is not None and not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in hdrs):
            hdrs.append(("Content-Length", str(len(body))))
        for k, v in hdrs:
            c.putheader(k, v)
        c.endheaders(body)
        r = c.getresponse()
        return Response(r.status, r.getheaders(), r.read())
    finally:
        if own:
            c.close()


def config_error(*args: str) -> str:
    """edge.py with a bad configuration: it must exit 2 with one line on stderr and no traceback; that line."""
    import subprocess
    p = subprocess.run([PY, "edge.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=20)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    return lines[0]


def raw(port: int, data: bytes, timeout: float = 5.0, read_all: bool = True) -> bytes:
    """Send raw bytes, return what came back until the peer closes (or the timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
                if not read_all and b"\r\n\r\n" in out:
                    break
        except socket.timeout:
            pass
        return out
