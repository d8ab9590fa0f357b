"""An identity backend: answers with its own name, for `edge.py --demo`, the tests and the benchmarks.

    python -m demo.backends --port 9001 --name a

Routes (everything else answers 200 with the name, so any path can be balanced):
  GET  /health               200 "ok", or 503 after POST /_ctl/down (until POST /_ctl/up)
  GET  /_ctl/stats           JSON: requests served (health and /_ctl excluded), by method, the last paths
  POST /_ctl/fail            every other request answers 500 (its /health still passes) until /_ctl/ok
  POST /_ctl/delay?ms=N      every other request waits N ms first (also: --delay-ms N)
  ANY  /echo...              JSON of what arrived: method, raw target, headers in order, body sha256/len
  GET  /slow?ms=N            answers after N ms
  GET  /hold                 answers once POST /_ctl/release is sent (a test decides when, not a clock);
                             POST /_ctl/hold holds the next ones again
  GET  /big?bytes=N          N bytes, Content-Length, streamed
  GET  /chunked?parts=N      N chunks, Transfer-Encoding: chunked
  GET  /cookies              two Set-Cookie headers
  GET  /reset?promise=N&send=M   promises N bytes (default 1000), sends M (10), then resets
  GET  /garbage              answers bytes that are not HTTP
  GET  /hang                 reads the request and never answers (until the server stops)
  ANY  /close-after          200, then closes the connection without announcing it (a keep-alive
                             timeout firing just after a response)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from lb.netaddr import family


class IdentityHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: "IdentityServer"

    def log_message(self, format, *args):  # quiet: tests read the edge's log, not ours
        pass

    # One method for every verb: the edge must forward them all alike.
    def handle_one_request(self):
        try:
            super().handle_one_request()
        except (ConnectionError, socket.timeout):
            self.close_connection = True

    def __getattr__(self, name):
        if name.startswith("do_"):
            return self._serve
        raise AttributeError(name)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: bytes, ctype: str = "text/plain", extra=()):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Backend", self.server.name)
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _serve(self):
        body = self._read_body()
        url = urlsplit(self.path)
        path, q = url.path, parse_qs(url.query)
        srv = self.server
        if path == "/health":
            return self._send(200 if srv.healthy else 503, b"ok\n" if srv.healthy else b"down\n")
        if path.startswith("/_ctl/"):
            if path == "/_ctl/down":
                srv.healthy = False
            elif path == "/_ctl/up":
                srv.healthy = True
            elif path == "/_ctl/fail":
                srv.failing = True
            elif path == "/_ctl/ok":
                srv.failing = False
            elif path == "/_ctl/delay":
                srv.delay = int(q.get("ms", ["0"])[0]) / 1000
            elif path == "/_ctl/release":
                srv.released.set()
            elif path == "/_ctl/hold":
                srv.released.clear()
            with srv.lock:
                stats = {"name": srv.name, "count": srv.count, "last": list(srv.last),
                         "methods": dict(srv.methods)}
            return self._send(200, json.dumps(stats).encode(), "application/json")
        with srv.lock:
            srv.count += 1
            srv.methods[self.command] = srv.methods.get(self.command, 0) + 1
            srv.last.append(self.path)
            del srv.last[:-20]
        if srv.delay:
            time.sleep(srv.delay)
        if srv.failing:
            return self._send(500, f"{srv.name} failing\n".encode())
        if path.startswith("/echo"):
            info = {
                "name": srv.name,
                "method": self.command,
                # the raw request line: http.server itself rewrites a leading "//" in self.path
                "target": self.requestline.split(" ")[1],
                "version": self.request_version,
                "headers": list(self.headers.items()),
                "body_len": len(body),
                "body_sha256": hashlib.sha256(body).hexdigest(),
            }
            return self._send(200, json.dumps(info).encode(), "application/json")
        if path == "/slow":
            time.sleep(int(q.get("ms", ["100"])[0]) / 1000)
        elif path == "/big":
            n = int(q.get("bytes", ["1048576"])[0])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.send_header("X-Backend", srv.name)
            self.end_headers()
            block = b"x" * 65536
            while n > 0:
                self.wfile.write(block[: min(n, len(block))])
                n -= len(block)
            return
        elif path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("X-Backend", srv.name)
            self.end_headers()
            for i in range(int(q.get("parts", ["3"])[0])):
                part = f"part {i} from {srv.name}\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        elif path == "/cookies":
            return self._send(200, b"cookies\n", extra=[("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")])
        elif path == "/reset":
            self.send_response(200)
            self.send_header("Content-Length", q.get("promise", ["1000"])[0])
            self.end_headers()
            self.wfile.write(b"x" * int(q.get("send", ["10"])[0]))
            # SO_LINGER 0: close() sends RST instead of FIN, as a crashing process would.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        elif path == "/garbage":
            self.wfile.write(b"this is not http\r\n\r\n")
            self.close_connection = True
            return
        elif path == "/close-after":
            self._send(200, f"{srv.name}\n".encode())
            self.close_connection = True
            return
        elif path == "/hold":
            while not (srv.released.wait(0.5) or srv.stopping.is_set()):
                pass
        elif path == "/hang":
            srv.stopping.wait()
            self.close_connection = True
            return
        self._send(200, f"{srv.name}\n".encode())


class IdentityServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024

    def __init__(self, addr, name: str):
        self.address_family = family(addr[0])      # ::1 as well as 127.0.0.1
        self.stopping = threading.Event()
        self.released = threading.Event()    # GET /hold answers from POST /_ctl/release on
        super().__init__(addr, IdentityHandler)
        self.name = name
        self.healthy = True
        self.count = 0
        self.methods: dict[str, int] = {}
        self.failing = False      # answer 500 to everything but /health and /_ctl
        self.delay = 0.0          # seconds before every answer but /health and /_ctl
        self.last: list[str] = []
        self.lock = threading.Lock()

    def server_close(self):
        self.stopping.set()
        super().server_close()


def start_in_thread(host: str = "127.0.0.1", port: int = 0, name: str = "") -> IdentityServer:
    """Start a backend on a daemon thread (for --demo); port 0 picks a free one."""
    srv = IdentityServer((host, port), name)
    if not name:
        srv.name = f"backend-{srv.server_address[1]}"
    threading.Thread(target=srv.serve_forever, name=f"demo-{srv.name}", daemon=True).start()
    return srv


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="identity backend for tests and demos")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--name", default="")
    p.add_argument("--delay-ms", type=float, default=0, help="wait this long before every answer")
    a = p.parse_args(argv)
    srv = IdentityServer((a.host, a.port), a.name)
    srv.delay = a.delay_ms / 1000
    if not a.name:
        srv.name = f"backend-{srv.server_address[1]}"
    # The one line a parent process waits for: which port we really got.
    print(f"listening {srv.server_address[0]}:{srv.server_address[1]} name={srv.name}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()


if __name__ == "__main__":
    main()
