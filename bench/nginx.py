"""A throwaway nginx on 127.0.0.1 (Debian's nginx-light) as the fast backend for benchmarks:
`return 200` from memory, no access log, so the proxy in front is what gets measured."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

CONF = """
worker_processes 1;
daemon off;
master_process off;
error_log {dir}/error.log warn;
pid {dir}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  server {{
    listen 127.0.0.1:{port} reuseport backlog=4096;
    location = /health {{ return 200 "ok\\n"; }}
    location / {{ default_type text/plain; return 200 "hello from nginx\\n"; }}
  }}
}}
"""


class Nginx:
    def __init__(self):
        exe = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(exe).exists():
            raise RuntimeError("nginx not found: apt-get install -y nginx-light")
        self.dir = tempfile.mkdtemp(prefix="bench-nginx-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        conf = Path(self.dir) / "nginx.conf"
        conf.write_text(CONF.format(dir=self.dir, port=self.port))
        self.proc = subprocess.Popen([exe, "-c", str(conf), "-p", self.dir, "-e", f"{self.dir}/error.log"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"nginx did not start: {Path(self.dir, 'error.log').read_text()}")
                time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)
