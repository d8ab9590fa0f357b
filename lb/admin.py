"""The admin listener: /metrics (Prometheus text), /status (JSON), /healthz and /readyz, on a port of its
own so that no backend path is ever shadowed, and the deploy actions POST /backends/<route>/drain and
.../enable (<route> is the backend's id in /status, or its HOST:PORT). http.server is fine here: this is
not the per-request path. Off unless --admin is given; it binds only where configured.

/healthz: 200 while the process runs (liveness). /readyz: 200 once the edge serves (and, with
on_store_error = fail-closed, its store answered), 503 from the moment a drain starts (SIGTERM), before
the listener closes (see `grace`), so a load balancer in front stops sending first.

With --workers N, a drain/enable on any worker's admin port acts on every worker (lb/fanout.py): 200 once
all applied it, else 502 naming the workers that did not (a restarting one), so the operator retries.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from urllib.parse import unquote

from . import dashboard
from .accesslog import escape
from .netaddr import bind_options, family

MAX_ROUTE = 64          # a route is a backend id or HOST:PORT: what a 404 may echo of one


def start_admin(addr, app) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _reply(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, app.render_metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/status":
                self._reply(200, json.dumps(app.status(), indent=2).encode(), "application/json")
            elif path == "/healthz":
                self._reply(200, b"ok\n")
            elif path == "/readyz":
                why = app.not_ready()
                self._reply(503, f"not ready: {why}\n".encode()) if why else self._reply(200, b"ready\n")
            elif path == "/":
                self._reply(200, dashboard.page(), dashboard.CONTENT_TYPE)
            elif path.startswith("/limits/"):
                st, body = app.peek_limits(unquote(path[8:]), self.headers.get("X-Api-Key", "").encode("latin-1") or None)
                self._reply(st, json.dumps(body, indent=2).encode(), "application/json")
            elif path.startswith("/backends/"):
                self._reply(405, b"use POST /backends/<route>/drain or /enable\n")
            else:
                self._reply(404, b"not found: try /, /metrics, /status, /limits/KEY, /healthz or /readyz\n")

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(min(n, 65536))          # nothing to read in it; keep the connection sane
            parts = self.path.split("?", 1)[0].strip("/").split("/")
            if len(parts) != 3 or parts[0] != "backends" or parts[2] not in ("drain", "enable"):
                return self._reply(404, b"not found: POST /backends/<route>/drain or /backends/<route>/enable\n")
            b = app.find_backend(parts[1])
            if b is None:
                # Reflected, attacker-chosen: bounded and escaped as the access log writes a path.
                return self._reply(404, f"no backend '{escape(parts[1], MAX_ROUTE)}': see /status for the "
                                        f"routes\n".encode())
            st, failed = app.drain_everywhere(b, parts[2] == "drain")
            if failed:      # applied here (and by the others not named), not everywhere: retry the call
                st["workers_failed"] = {str(i): why for i, why in sorted(failed.items())}
            self._reply(502 if failed else 200, json.dumps(st, indent=2).encode(), "application/json")

    class Server(ThreadingHTTPServer):
        address_family = family(addr[0])

        def server_bind(self):
            bind_options(self.socket, addr[0])
            super().server_bind()

    srv = Server(addr, Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="admin", daemon=True).start()
    return srv
