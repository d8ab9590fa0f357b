"""The access log: one line per request, written by its own thread.

The request thread only puts a tuple on a queue (no formatting, no I/O, no lock of ours), so a slow
disk never slows a request. Line format (space separated, like nginx's combined log in spirit):
    2026-11-29T14:51:09.123Z key:#5d41402abc4b GET /path 200 http://127.0.0.1:9001 0.83ms -
The client is "ip:ADDR", a known key's "key:NAME", or any other key's "key:#" + a keyed hash: never
the key itself. The last field is limited_by: the rules that rejected the request, and dry-run rules
that would have ("NAME:dry_run"), comma-separated; "-" when none.
"""

from __future__ import annotations

import queue
import sys
import threading
import time


class AccessLog:
    def __init__(self, path: str):
        self.file = sys.stderr if path == "-" else open(path, "a", buffering=1, encoding="utf-8")
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._writer, name="access-log", daemon=True).start()

    def record(self, x, status: int, seconds: float) -> None:
        self.q.put((time.time(), x.key, x.req.method, x.req.target, status,
                    x.backend.url if x.backend else "-", seconds, x.limited_by, x.tunnel))

    def _writer(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                break
            ts, key, method, target, status, backend, secs, limited_by, tunnel = item
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts * 1000) % 1000:03d}Z"
            # Escape what a client controls, so a crafted path cannot forge a log line.
            path = target[:2048].decode("latin-1").encode("unicode_escape").decode("ascii").replace(" ", "%20")
            # a tunnel (101) is logged when it closes: its whole duration, bytes each way, why it ended
            extra = f" up={tunnel[0]} down={tunnel[1]} ({tunnel[2]})" if tunnel else ""
            self.file.write(f"{stamp} {key or '-'} {method.decode('latin-1')} {path} {status} "
                            f"{backend} {secs * 1000:.2f}ms {limited_by or '-'}{extra}\n")

    def close(self) -> None:
        self.q.put(None)
