"""A real redis-server for the tests: started on a free port with persistence off, stopped afterwards.

No fakes: the Lua scripts, EVALSHA/NOSCRIPT, expiry and timeouts are what production sees.  When
redis-server is missing the tests FAIL with a clear message (./run-tests installs it), never skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
import redis

from tests.support import free_port


class RedisServer:
    """`redis-server --port P --save '' --appendonly no` (and a unix socket: .socket, .unix_url);
    start(), stop(), kill(), pause()/resume().

    extra: more redis-server arguments (TLS, a password, cluster mode...); ping: redis.Redis keyword
    arguments the readiness PING needs to get through them (ssl=..., password=...).
    """

    def __init__(self, port: int | None = None, extra: tuple = (), ping: dict | None = None):
        exe = shutil.which("redis-server") or next(
            (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.path.exists(p)), None)
        if exe is None:
            pytest.fail("redis-server not found on PATH: install it (Debian: apt-get install redis-server; "
                        "./run-tests does this) -- the Redis store is tested against a real server", pytrace=False)
        self.exe = exe
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.dir = tempfile.mkdtemp(prefix="redis-test-")
        self.extra = [str(a) for a in extra]
        self.ping_kwargs = ping or {}
        self.socket = os.path.join(self.dir, "redis.sock")  # the same server on a unix socket too
        self.unix_url = f"redis+unix://{self.socket}?db=0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--loglevel", "warning", "--unixsocket", self.socket, "--unixsocketperm", "700",
             *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        c = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5, **self.ping_kwargs)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if c.ping():
                    break
            except redis.RedisError:
                pass
            if self.proc.poll() is not None:
                raise AssertionError(f"redis-server exited with {self.proc.returncode} on port {self.port}")
            if time.monotonic() > deadline:
                raise AssertionError(f"redis-server on port {self.port} did not answer PING within {timeout}s")
            time.sleep(0.02)
        c.close()
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, **self.ping_kwargs)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-traffic (connections reset, then refused)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections (kernel backlog) but never answers -- a slow Redis."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server():
    """One redis-server for the whole session (tests isolate themselves by key prefix)."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def own_redis():
    """A redis-server of this test's own, for tests that kill, pause or restart it."""
    server = RedisServer().start()
    yield server
    server.stop()
