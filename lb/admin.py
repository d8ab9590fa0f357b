"""The admin listener: /metrics (Prometheus text) and /status (JSON), on a port of its own so that no
backend path is ever shadowed. http.server is fine here: this is not the per-request path."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .netaddr import bind_options, family


def start_admin(addr, app) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype = app.metrics.render(app.balancer.backends).encode(), "text/plain; version=0.0.4"
            elif path == "/status":
                body, ctype = json.dumps(app.status(), indent=2).encode(), "application/json"
            else:
                body, ctype = b"not found: try /metrics or /status\n", "text/plain"
                self.send_response(404)
            if path in ("/metrics", "/status"):
                self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    class Server(ThreadingHTTPServer):
        address_family = family(addr[0])

        def server_bind(self):
            bind_options(self.socket, addr[0])
            super().server_bind()

    srv = Server(addr, Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="admin", daemon=True).start()
    return srv
