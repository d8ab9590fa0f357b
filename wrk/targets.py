"""The processes the load-test protocol drives, started on 127.0.0.1 free ports and stopped afterwards:
the baseline backend (nginx, else demo.backends), edges, a throwaway redis-server. Each yields a Target that
also says how to start it by hand (the report's Invocations).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from wrk.nginx_target import find_nginx, nginx_target, run_nginx

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
EDGE_PIN: list[str] = []   # --cpu-affinity for every edge started here: set once by the run (wrk/placement.py)


@dataclasses.dataclass
class Target:
    """A process the generator drives: where it listens and how to start it by hand."""
    name: str
    port: int
    start_cmd: str
    admin_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"


class Skip(Exception):
    """A target could not be started (e.g. the Redis store is not implemented yet): rows are skipped."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(name: str, argv: list[str], ready: str, admin: bool = False, timeout: float = 15.0):
    """Start argv, wait for the `ready` regex in its output, yield (ready match, admin port or None).
    A process that exits first raises Skip with its last output line (that is how an edge whose
    --store is not implemented yet is reported). Stopped with SIGTERM (then SIGKILL) on the way out."""
    log = tempfile.NamedTemporaryFile(prefix=f"protocol-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    text = lambda: Path(log.name).read_text(errors="replace")  # noqa: E731
    try:
        deadline = time.monotonic() + timeout
        while True:
            out = text()
            m = re.search(ready, out)
            a = re.search(r"admin on 127\.0\.0\.1:(\d+)", out) if admin else None
            if m and (a or not admin):
                break
            if proc.poll() is not None:
                lines = [ln.strip() for ln in text().splitlines() if ln.strip()]
                raise Skip(f"{name} exited with status {proc.returncode} at start-up: "
                           + (lines[-1] if lines else "(no output)"))
            if time.monotonic() > deadline:
                raise Skip(f"{name} did not report ready within {timeout:g} s")
            time.sleep(0.02)
        yield m, int(a.group(1)) if a else None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.close()
        os.unlink(log.name)


@contextlib.contextmanager
def backend():
    """The baseline backend: nginx (fast, so the edge is what the edge rows measure), else demo.backends."""
    if find_nginx():
        with nginx_target() as port:
            yield Target("nginx", port, f"python -m wrk.nginx_target --port {port}")
    else:
        with process("backend", [PY, "-m", "demo.backends", "--port", "0", "--name", "baseline"],
                     r"listening 127\.0\.0\.1:(\d+)") as (m, _):
            port = int(m.group(1))
            yield Target("demo.backends", port, f"python -m demo.backends --port {port} --name baseline")


@contextlib.contextmanager
def reference_proxy(backend: Target):
    """nginx as a reverse proxy in the edge's place (one worker, keep-alive upstream, on the edges' CPU):
    what any proxy adds here, with no Python in it. Skip if there is no nginx."""
    if not find_nginx():
        raise Skip("nginx is not installed")
    cpu = int(EDGE_PIN[-1]) if EDGE_PIN else None
    with contextlib.ExitStack() as stack:
        try:
            n = stack.enter_context(run_nginx(proxy_to=backend.port, cpu=cpu))
        except RuntimeError as e:        # it would not start: its rows are skipped, the run goes on
            raise Skip(f"nginx as the proxy: {e}") from None
        yield Target("nginx-proxy", n.port, f"python -m wrk.nginx_target --port {n.port} --proxy-to {backend.port}"
                     + ("" if cpu is None else f" --cpu {cpu}"))


@contextlib.contextmanager
def edge(name: str, backend_url: str, *args: str, admin: bool = False, pin: list[str] = EDGE_PIN):
    """`python edge.py` on a free port in front of one backend; raises Skip if it will not start.
    pin: its --cpu-affinity arguments (wrk/placement.py), EDGE_PIN unless given."""
    argv = (["--backends", backend_url.rstrip("/"), *args] + (["--admin", "127.0.0.1:0"] if admin else [])
            + list(pin))
    with process(name, [PY, "edge.py", "--listen", "127.0.0.1:0", *argv],
                 r"listening on 127\.0\.0\.1:(\d+)", admin=admin) as (m, admin_port):
        port = int(m.group(1))
        shown = [f"127.0.0.1:{admin_port}" if x == "127.0.0.1:0" else x for x in argv]
        yield Target(name, port, f"python edge.py --listen 127.0.0.1:{port} {shlex.join(shown)}", admin_port)


@contextlib.contextmanager
def redis_server(spec: str | None):
    """Yields (store URL or a Skip, how it was started). None: no Redis rows. 'auto': our own
    redis-server on a free port, no persistence, stopped afterwards. Otherwise the URL as given."""
    if spec is None:
        yield None, None
    elif spec != "auto":
        yield spec, f"(given) {spec}"
    elif not shutil.which("redis-server"):
        yield Skip("--redis auto: redis-server is not installed"), None
    else:
        port = free_port()
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(process("redis", argv, r"Ready to accept connections"))
            except Skip as why:
                yield why, None
                return
            yield f"redis://127.0.0.1:{port}/0", shlex.join(argv)
