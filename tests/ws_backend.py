"""A real WebSocket backend for the tunnel tests (the `websockets` library's threaded server).

    python -m tests.ws_backend --port 0 [--host ::1]

  ws  /echo      echoes every message; a text "close:CODE" makes the server close with that code
  ws  /hello     sends "hello" first, unasked, then echoes
  GET anything without Upgrade: 200 "plain NAME" (the same process answers plain HTTP)
  GET /refuse with Upgrade: 403 (a backend that declines the upgrade)
"""

from __future__ import annotations

import argparse
import threading

from websockets.exceptions import ConnectionClosed
from websockets.sync.server import serve


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    stats = {"opened": 0, "closed": 0, "plain": 0}
    lock = threading.Lock()

    def process_request(conn, request):
        if "upgrade" not in request.headers.get("Connection", "").lower():
            with lock:
                stats["plain"] += 1
            body = f"plain opened={stats['opened']} closed={stats['closed']} plain={stats['plain']}\n"
            return conn.respond(200, body)
        if request.path == "/refuse":
            return conn.respond(403, "no upgrade here\n")
        return None

    def handler(ws):
        with lock:
            stats["opened"] += 1
        try:
            if ws.request.path == "/hello":
                ws.send("hello")
            for msg in ws:
                if isinstance(msg, str) and msg.startswith("close:"):
                    ws.close(int(msg[6:]), "server closes")
                    break
                ws.send(msg)
        except ConnectionClosed:
            pass
        finally:
            with lock:
                stats["closed"] += 1

    with serve(handler, a.host, a.port, process_request=process_request, compression=None,
               ping_interval=None, max_size=None) as server:
        host, port = server.socket.getsockname()[:2]
        print(f"listening {host}:{port}", flush=True)
        server.serve_forever()


if __name__ == "__main__":
    main()
