"""The access log: one line per request (refusals included), written by its own thread.

The request thread only puts a tuple on a queue (no formatting, no I/O, no lock of ours), so a slow
disk never slows a request. Two formats (`access_log_format`):

text (default; every client-controlled field escaped, the request line quoted, so no input can make a
line read as two or shift a field):
    2026-11-29T14:51:09.123Z 10.0.0.5 "GET /path" 200 512 http://127.0.0.1:9001 0.000712 0.000830 rid=6f1c.. key=k-3a9c01d2 tries=1 limited_by=-
json: one object per line with the same fields, named: time, request_id, client_ip, key, method, path,
    status, bytes_sent, upstream, upstream_seconds, seconds, tries, limited_by.

`key` is never the API key itself: a known key's name, or "#" and a keyed hash of it (lb/keys.py's
label; stable across restarts with EDGE_KEY_HASH_SECRET); null when the client is known by its address
only. `limited_by`: the rules that rejected the request, and dry-run rules that would have
("NAME:dry_run"), comma-separated. Absent values are `-` in text and null in JSON. SIGUSR1/SIGHUP reopen
the file (logrotate).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time

_REOPEN = object()


def escape(raw: bytes | str, limit: int = 2048) -> str:
    """Printable ASCII minus space, quote and backslash stay; everything else becomes \\xHH."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogateescape")
    out = []
    for b in raw[:limit]:
        out.append(chr(b) if 0x21 <= b <= 0x7E and b not in (0x22, 0x5C) else f"\\x{b:02x}")
    return "".join(out) + ("..." if len(raw) > limit else "")


def _stamp(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts * 1000) % 1000:03d}Z"


class Entry:
    """What is logged about one request; built by the writer thread from the queued tuple."""

    FIELDS = ("time", "request_id", "client_ip", "key", "method", "path", "status", "bytes_sent",
              "upstream", "upstream_seconds", "seconds", "tries", "limited_by")
    __slots__ = FIELDS + ("tunnel",)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.FIELDS}
        if self.tunnel:
            d["tunnel"] = {"up": self.tunnel[0], "down": self.tunnel[1], "end": self.tunnel[2]}
        return d


class AccessLog:
    def __init__(self, path: str, fmt: str = "text"):
        self.path, self.fmt = path, fmt
        self.file = self._open()
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._writer, name="access-log", daemon=True)
        self.thread.start()

    def _open(self):
        return sys.stderr if self.path == "-" else open(self.path, "a", buffering=1, encoding="utf-8")

    # -- request threads ------------------------------------------------------------------------------

    def record(self, x, status: int, seconds: float) -> None:
        """x: the request's Exchange (lb/proxy.py). Optional fields are read with defaults, so a stage
        that learns something new (tries, limited_by, key_name) only has to set it on the Exchange."""
        req = x.req
        backend = x.backend
        self.q.put((time.time(), getattr(x, "request_id", None), getattr(x, "client_ip", None), x.key,
                    req.method, req.target, status, getattr(x, "bytes_sent", None),
                    backend.url if backend is not None else None, getattr(x, "upstream_seconds", None), seconds,
                    getattr(x, "tries", 1), getattr(x, "limited_by", None), getattr(x, "tunnel", None)))

    def refusal(self, client_ip: str, status: int, reason: str, seconds: float = 0.0,
                request_id: str | None = None) -> None:
        """A request the edge could not read (400, 408, 413, 414, 431, 499, 505): no method or path known,
        the reason stands in the path's place."""
        self.q.put((time.time(), request_id, client_ip, "", b"-", ("<" + reason + ">").encode(), status,
                    None, None, None, seconds, 0, None, None))

    def reopen(self) -> None:
        self.q.put(_REOPEN)

    def close(self) -> None:
        self.q.put(None)

    # -- the writer thread ----------------------------------------------------------------------------

    def entry(self, item) -> Entry:
        (ts, rid, ip, key, method, target, status, sent, upstream, up_s, secs, tries, limited_by, tunnel) = item
        e = Entry()
        e.time, e.client_ip = _stamp(ts), ip
        e.request_id = rid.decode("latin-1") if isinstance(rid, bytes) else rid
        # the client's label (lb/keys.py): "key:NAME" or "key:#HASH" -- never the key -- or "ip:ADDR"
        e.key = key[4:] if key and key.startswith("key:") else None
        e.method = method.decode("latin-1")
        e.path = target[:2048].decode("latin-1")
        e.status, e.bytes_sent, e.upstream = status, sent, upstream
        e.upstream_seconds = None if up_s is None else round(up_s, 6)
        e.seconds, e.tries, e.limited_by = round(secs, 6), tries, limited_by or None
        e.tunnel = tunnel        # a 101: (bytes up, bytes down, why it ended), logged when it closes
        return e

    def format(self, e: Entry) -> str:
        if self.fmt == "json":
            return json.dumps(e.as_dict(), separators=(",", ":"))   # ensure_ascii: one line, always

        def f(v):
            return "-" if v is None else escape(str(v)) if isinstance(v, str) else str(v)

        up_s = "-" if e.upstream_seconds is None else f"{e.upstream_seconds:.6f}"
        return (f"{e.time} {f(e.client_ip)} \"{escape(e.method, 32)} {escape(e.path)}\" {e.status} "
                f"{f(e.bytes_sent)} {f(e.upstream)} {up_s} {e.seconds:.6f} rid={f(e.request_id)} "
                f"key={f(e.key)} tries={e.tries} limited_by={f(e.limited_by)}"
                + (f" up={e.tunnel[0]} down={e.tunnel[1]} ({e.tunnel[2]})" if e.tunnel else ""))

    def _writer(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                break
            try:
                if item is _REOPEN:
                    if self.file is not sys.stderr:
                        new = self._open()
                        self.file.close()
                        self.file = new
                    continue
                self.file.write(self.format(self.entry(item)) + "\n")
            except Exception as ex:   # a full disk or a bad entry costs a line, never the writer
                import logging
                logging.getLogger("edge").error("access log %s: %s", self.path, ex)
        if self.file is not sys.stderr:
            self.file.close()
