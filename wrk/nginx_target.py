"""A fast local HTTP target: nginx (Debian's nginx-light) answering `200 ok` on 127.0.0.1, from a
throwaway config in a temp dir. Used to measure the generator's own ceiling, and a candidate baseline
backend for the protocol (much faster than the Python identity backend).

    python -m wrk.nginx_target [--port 0] [--workers 1]
    # prints "listening 127.0.0.1:PORT (nginx pid N)", serves until Ctrl-C / SIGTERM, then cleans up.

From Python:  with nginx_target() as port: ...
"""

from __future__ import annotations

import argparse
import contextlib
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
    server {{
        listen 127.0.0.1:{port} reuseport;
        location / {{ default_type text/plain; return 200 "ok\\n"; }}
    }}
}}
"""


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
    """Start nginx on 127.0.0.1:port (0 = a free one), yield the port, stop it and remove its files."""
    exe = find_nginx()
    if not exe:
        raise RuntimeError("nginx not found (Debian: apt-get install nginx-light)")
    port = port or _free_port()
    d = tempfile.mkdtemp(prefix="nginx-target-")
    conf = Path(d) / "nginx.conf"
    conf.write_text(CONFIG.format(dir=d, port=port, workers=workers))
    proc = subprocess.Popen([exe, "-p", d, "-c", str(conf), "-e", f"{d}/error.log"],
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
        yield port
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
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    with nginx_target(a.port, a.workers) as port:
        print(f"listening 127.0.0.1:{port} (nginx)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
