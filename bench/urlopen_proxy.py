"""The yardstick: the plain proxy everybody writes first (ThreadingHTTPServer + urlopen), TCP_NODELAY on.

    python bench/urlopen_proxy.py LISTEN_PORT BACKEND_URL

Kept only so bench/edge_bench.py can measure the edge against it in the same run.
"""

import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BACKEND = sys.argv[2].rstrip("/")


class Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *a):
        pass

    def do_GET(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        req = urllib.request.Request(BACKEND + self.path, data=body, method=self.command,
                                     headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
        try:
            resp = urllib.request.urlopen(req, timeout=30)
        except urllib.error.HTTPError as e:
            resp = e
        except OSError:
            self.send_error(502)
            return
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.headers.items():
            if k.lower() not in ("connection", "transfer-encoding", "content-length", "date", "server"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_POST = do_PUT = do_DELETE = do_HEAD = do_GET


if __name__ == "__main__":
    srv = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Proxy)
    srv.daemon_threads = True
    print(f"listening 127.0.0.1:{srv.server_address[1]}", flush=True)
    srv.serve_forever()
