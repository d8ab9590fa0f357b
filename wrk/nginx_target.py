"""nginx (Debian's nginx-light) on 127.0.0.1 from a throwaway config in a temp dir, in one of two roles:

- a fast local HTTP target answering `200 ok`: the generator's own ceiling, and the protocol's backend
  (much faster than the Python identity backend);
- with `proxy_to`, a reverse proxy in front of a backend (HTTP/1.1 keep-alive upstream, as the edge
  pools its connections): the reference the edge is measured against -- the framing differential test,
  and bench/tail_bench.py's "what a C proxy in the edge's place adds" on this machine.

    python -m wrk.nginx_target [--port 0] [--workers 1] [--proxy-to PORT] [--cpu N]
    # prints "listening 127.0.0.1:PORT (nginx)", serves until Ctrl-C / SIGTERM, then cleans up.

From Python:  with nginx_target() as port: ...     with run_nginx(proxy_to=port, cpu=1) as n: n.port, n.proc
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

CONFIG = """\
worker_processes {workers};
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
    {http_extra}
    {upstream}
    server {{
        listen 127.0.0.1:{port} reuseport;
        location / {{ {location} }}
    }}
}}
"""
ANSWER = 'default_type text/plain; return 200 "ok\\n";'
# proxy_http_version 1.1 and an empty Connection: the upstream connections are kept alive and reused
UPSTREAM = "upstream backend {{ server 127.0.0.1:{port}; keepalive 64; keepalive_requests 1000000; }}"
PROXY = 'proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection "";'


@dataclasses.dataclass
class Nginx:
    port: int
    proc: subprocess.Popen     # the master
    dir: str

    def pid_of_worker(self) -> int | None:
        """The worker's pid (the process that serves: for CPU accounting); None until it is forked."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return int(children[0]) if children else None


def find_nginx() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def nginx_target(port: int = 0, workers: int = 1):
    """Start nginx answering 200 on 127.0.0.1:port (0 = a free one), yield the port, stop it."""
    with run_nginx(port, workers) as n:
        yield n.port


@contextlib.contextmanager
def run_nginx(port: int = 0, workers: int = 1, proxy_to: int | None = None, cpu: int | None = None,
              http_extra: str = "", location_extra: str = ""):
    """Start nginx on 127.0.0.1:port (0 = a free one), yield a Nginx, stop it and remove its files.
    proxy_to: proxy every request to that 127.0.0.1 port instead of answering. cpu: pin nginx to that
    CPU. http_extra / location_extra: directives added to the http block / the location."""
    exe = find_nginx()
    if not exe:
        raise RuntimeError("nginx not found (Debian: apt-get install nginx-light)")
    port = port or _free_port()
    d = tempfile.mkdtemp(prefix="nginx-target-")
    conf = Path(d) / "nginx.conf"
    conf.write_text(CONFIG.format(
        dir=d, port=port, workers=workers, http_extra=http_extra,
        upstream=UPSTREAM.format(port=proxy_to) if proxy_to else "",
        location=(PROXY if proxy_to else ANSWER) + " " + location_extra))
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    proc = subprocess.Popen([exe, "-p", d, "-c", str(conf), "-e", f"{d}/error.log"], preexec_fn=pin,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not _listening(port):
            if proc.poll() is not None:
                raise RuntimeError(f"nginx exited ({proc.returncode}): {proc.stderr.read().decode()}"
                                   f"{(Path(d) / 'error.log').read_text() if (Path(d) / 'error.log').exists() else ''}")
            if time.monotonic() > deadline:
                raise RuntimeError("nginx did not start listening within 10 s")
            time.sleep(0.02)
        yield Nginx(port, proc, d)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGQUIT)   # graceful: the master stops its workers
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        shutil.rmtree(d, ignore_errors=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="nginx answering 200 ok on 127.0.0.1, until Ctrl-C")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="nginx worker processes (default 1)")
    p.add_argument("--proxy-to", type=int, help="a reverse proxy to this 127.0.0.1 port")
    p.add_argument("--cpu", type=int, help="pin nginx to this CPU")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    with run_nginx(a.port, a.workers, a.proxy_to, a.cpu) as n:
        port = n.port
        print(f"listening 127.0.0.1:{port} (nginx)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
