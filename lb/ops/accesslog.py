"""The access log: one line per request (refusals included), written by its own thread.

The request thread only puts a tuple on a queue (no formatting, no I/O, no lock of ours), so a slow
disk never slows a request. The writer takes what has queued up and writes it in one system call, then
lets the next lines gather for GATHER seconds (nginx's `access_log ... buffer= flush=`, on by default
here): under load one wake-up and one write per batch instead of per request; an idle edge still writes a
lone line at once. To a pipe (stderr under systemd or a container, shared by the workers) the batch goes
in writes of whole lines of at most PIPE_BUF bytes, so no other writer lands inside a line. close()
writes out everything queued before it returns. Two formats (`access_log_format`):

text (default; every client-controlled field escaped, the request line quoted, so no input can make a
line read as two or shift a field):
    2026-11-29T14:51:09.123Z 10.0.0.5 "GET /path" 200 512 http://127.0.0.1:9001 0.000712 0.000830 rid=6f1c.. key=k-3a9c01d2 tries=1 limited_by=- host=api.example.com ua="curl/8.0" bytes_received=78 upstream_status=200
json: one object per line with the same fields, named: time, request_id, client_ip, key, method, path,
    status, bytes_sent, upstream, upstream_seconds, seconds, tries, limited_by, host, user_agent,
    bytes_received, upstream_status.

`tries` is the number of backends tried (0: the edge answered itself -- 429, 413, 503 -- or refused the
request). `bytes_received` counts the request's head and body bytes as read from the connection
(nginx's $request_length). The values of the query parameters named in `[server] log_redact_params`
(case-insensitive, percent-decoded names) are written `***`; the rest of the target is kept byte for byte.

`key` is never the API key itself: a known key's name, or "#" and a keyed hash of it (lb/limiting/keys.py's
label; stable across restarts with EDGE_KEY_HASH_SECRET); null when the client is known by its address
only. `limited_by`: the rules that rejected the request, and dry-run rules that would have
("NAME:dry_run"), comma-separated. Over mutual TLS, a request with a client certificate ends with its
subject, `cert=CN=partner-a,O=Example` (escaped like the path; JSON: "client_cert"). A hedged request
(lb/proxy/hedge.py) ends with `hedge=won|lost|failed other=URL` (JSON: "hedge"); one that came over
HTTP/2 ends with `proto=HTTP/2` (JSON: "protocol"). With [[routes]], a request one of them matched has
`route=NAME` after upstream_status (JSON: "route"; absent: no route matched, the default pool served it,
or the edge refused the request before routing). Absent values are
`-` in text and null in JSON. SIGUSR1/SIGHUP reopen
the file (logrotate).
"""

from __future__ import annotations

import json
import os
import queue
import re
import select
import stat
import sys
import threading
import time
from urllib.parse import unquote_to_bytes

_REOPEN = object()
GATHER = 0.02  # seconds the writer lets lines gather after a write
BATCH = 1024  # lines per write at most
_KEPT = bytes(b for b in range(0x21, 0x7F) if b not in (0x22, 0x5C))  # what escape() leaves as it is


def escape(raw: bytes | str, limit: int = 2048) -> str:
    """Printable ASCII minus space, quote and backslash stay; everything else becomes \\xHH."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogateescape")
    if len(raw) <= limit and not raw.translate(None, _KEPT):  # the common case: nothing to escape
        return raw.decode("ascii")
    out = []
    for b in raw[:limit]:
        out.append(chr(b) if 0x21 <= b <= 0x7E and b not in (0x22, 0x5C) else f"\\x{b:02x}")
    return "".join(out) + ("..." if len(raw) > limit else "")


_second = (-1, "")  # the last second formatted and its text (one tuple: read whole by any writer)


def _stamp(ts: float) -> str:
    global _second
    sec, text = _second
    if sec != int(ts):  # one strftime per second, not per line
        sec = int(ts)
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        _second = (sec, text)
    return text + f".{int(ts * 1000) % 1000:03d}Z"


# the JSON object's names, in the order of the queued tuple (the text line has the same fields)
FIELDS = (
    "time",
    "request_id",
    "client_ip",
    "key",
    "method",
    "path",
    "status",
    "bytes_sent",
    "upstream",
    "upstream_seconds",
    "seconds",
    "tries",
    "limited_by",
    "host",
    "user_agent",
    "bytes_received",
    "upstream_status",
)

REDACT_DEFAULT = ("token", "access_token", "api_key", "key", "password", "secret", "signature")


def redact_query(target: bytes, names: frozenset) -> bytes:
    """target with the value of every query parameter named in `names` (lowercase bytes) written ***.
    Names are compared percent-decoded and case-insensitively (so ?Tok%65n= is a token too); every other
    byte, the separators and the order are kept as sent."""
    q = target.find(b"?")
    if q < 0 or not names:
        return target
    parts = target[q + 1 :].split(b"&")
    changed = False
    for i, part in enumerate(parts):
        name, eq, value = part.partition(b"=")
        if 37 in name or 43 in name:  # "%" or "+" (a byte value's `in` is a memchr: framing's not_relayed)
            name = unquote_to_bytes(name.replace(b"+", b" "))
        if name.lower() in names:
            parts[i] = part[: len(part) - len(value)] + b"***" if eq else part
            changed = changed or bool(eq)
    return target[: q + 1] + b"&".join(parts) if changed else target


# A canonical head's first User-Agent line (framing's fast path: every line `Name: value`, no blank around
# the value, no CR inside one), read where it is: what req.headers would give, without splitting the head.
_UA_LINE = re.compile(rb"\r\n(?i:user-agent): ([^\r]*)")


def _user_agent(req) -> bytes | None:
    if getattr(req, "spans", None) is not None:  # (spans set: raw is the canonical head as it came)
        m = _UA_LINE.search(req.raw)
        return None if m is None else m[1]
    for _, lname, value in req.headers:
        if lname == b"user-agent":
            return value
    return None


def _extras(route, tunnel, cert, hedge, req) -> list[tuple[str, object, str]]:
    """The fields a line has only when they apply, in their order: (JSON name, JSON value, text), so a
    line without them reads as it did before they were added."""
    out: list[tuple[str, object, str]] = []
    if route is not None:
        out.append(("route", route, f" route={escape(route, 256)}"))
    if tunnel:  # a 101's tunnel: (bytes up, bytes down, why it ended), logged when it closes
        out.append(
            (
                "tunnel",
                {"up": tunnel[0], "down": tunnel[1], "end": tunnel[2]},
                f" up={tunnel[0]} down={tunnel[1]} ({tunnel[2]})",
            )
        )
    if cert is not None:
        out.append(("client_cert", cert.subject, f" cert={escape(cert.subject, 512)}"))
    if hedge is not None:
        out.append(("hedge", {"result": hedge[0], "other": hedge[1]}, f" hedge={hedge[0]} other={hedge[1]}"))
    if req is not None and req.version == b"HTTP/2":
        out.append(("protocol", "HTTP/2", " proto=HTTP/2"))
    return out


def _text(v) -> str:
    return "-" if v is None else escape(v) if isinstance(v, str) else str(v)


def _escaped(ip, upstream, rid, key, limited_by, method: bytes, target: bytes, host, ua) -> tuple[str, ...]:
    """The text line's escaped fields: _text() of the first five, escape() of the others (host and ua "-"
    when absent, ua quoted). The common line has nothing to escape and nothing too long: one check of all
    of them together (their bytes, translated, leave nothing), then each as it is."""
    joined = f"{ip}{upstream}{rid}{key}{limited_by}"  # (None reads "None" here: nothing to escape either)
    try:
        plain = (
            len(joined) <= 2048
            and len(method) <= 32
            and len(target) <= 2048
            and (host is None or len(host) <= 256)
            and (ua is None or len(ua) <= 512)
            and joined.isascii()
            and not (joined.encode() + method + target + (host or b"") + (ua or b"")).translate(None, _KEPT)
        )
    except TypeError:  # a str where bytes are expected: escape() takes either
        plain = False
    if plain:
        return (
            "-" if ip is None else str(ip),
            "-" if upstream is None else str(upstream),
            "-" if rid is None else str(rid),
            "-" if key is None else str(key),
            "-" if limited_by is None else str(limited_by),
            method.decode("ascii"),
            target.decode("ascii"),
            "-" if host is None else host.decode("ascii"),
            "-" if ua is None else '"' + ua.decode("ascii") + '"',
        )
    return (
        _text(ip),
        _text(upstream),
        _text(rid),
        _text(key),
        _text(limited_by),
        escape(method, 32),
        escape(target),
        "-" if host is None else escape(host, 256),
        "-" if ua is None else '"' + escape(ua, 512) + '"',
    )


class AccessLog:
    def __init__(self, path: str, fmt: str = "text", redact=REDACT_DEFAULT):
        self.path, self.fmt = path, fmt
        self.set_redact(redact)
        self.file = self._open()
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._writer, name="access-log", daemon=True)
        self.thread.start()

    def _open(self):
        # atomic: a regular file opened for appending takes a whole batch in one write and never
        # interleaves it with another process's; a pipe only writes of at most PIPE_BUF (see _write)
        f = sys.stderr if self.path == "-" else open(self.path, "a", buffering=1, encoding="utf-8")
        try:
            self.atomic = stat.S_ISREG(os.fstat(f.fileno()).st_mode)
        except (OSError, ValueError, AttributeError):
            self.atomic = False
        return f

    def set_redact(self, names) -> None:
        """The query parameters whose values are logged as *** (a reload may change them)."""
        self.redact = frozenset(n.lower().encode("utf-8") for n in names)

    # -- request threads ------------------------------------------------------------------------------

    def record(self, x, status: int, seconds: float) -> None:
        """x: the request's Exchange (lb/proxy/edge.py), whose every field its __init__ sets: a stage that
        learns something new (tries, limited_by, key_name) only has to set it there."""
        req = x.req
        backend = x.backend
        route = x.route
        self.q.put(
            (
                time.time(),
                x.request_id,
                x.client_ip,
                x.key,
                req.method,
                req.target,
                status,
                x.bytes_sent,
                backend.url if backend is not None else None,
                x.upstream_seconds,
                seconds,
                x.tries,
                x.limited_by,
                x.tunnel,
                req,
                x.bytes_received,
                x.upstream_status,
                x.hedge,
                route.name if route is not None else None,
            )
        )

    def refusal(
        self, client_ip: str, status: int, reason: str, seconds: float = 0.0, request_id: str | None = None
    ) -> None:
        """A request the edge could not read (400, 408, 413, 414, 431, 499, 505): no method or path known,
        the reason stands in the path's place."""
        self.q.put(
            (
                time.time(),
                request_id,
                client_ip,
                "",
                b"-",
                ("<" + reason + ">").encode(),
                status,
                None,
                None,
                None,
                seconds,
                0,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
            )
        )

    def reopen(self) -> None:
        self.q.put(_REOPEN)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the writer once it has written everything queued before this call (at most `timeout`
        seconds: a file that blocks does not hold up a shutdown or a reload for ever; said if so)."""
        self.q.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
            if self.thread.is_alive():
                self._error(f"still writing after {timeout:g} s; lines queued now may be lost")

    # -- the writer thread ----------------------------------------------------------------------------

    def line(self, item) -> str:
        """One line from a queued tuple (in the writer thread: the request thread never formats)."""
        (
            ts,
            rid,
            ip,
            key,
            method,
            target,
            status,
            sent,
            upstream,
            up_s,
            secs,
            tries,
            limited_by,
            tunnel,
            req,
            received,
            up_status,
            hedge,
            route,
        ) = item
        rid = rid.decode("latin-1") if isinstance(rid, bytes) else rid
        host = ua = cert = None
        if req is not None:
            host, ua, cert = req.host, _user_agent(req), getattr(req, "client_cert", None)
            if self.redact and 63 in target:  # "?"
                target = redact_query(target, self.redact)
        # the client's label (lb/limiting/keys.py): "key:NAME" or "key:#HASH" -- never the key -- or "ip:ADDR"
        key = key[4:] if key and key.startswith("key:") else None
        up_s = None if up_s is None else round(up_s, 6)
        secs, limited_by = round(secs, 6), limited_by or None
        extras = _extras(route, tunnel, cert, hedge, req)
        if self.fmt == "json":  # ensure_ascii: one line, always
            d = dict(
                zip(
                    FIELDS,
                    (
                        _stamp(ts),
                        rid,
                        ip,
                        key,
                        method.decode("latin-1"),
                        target[:2048].decode("latin-1"),
                        status,
                        sent,
                        upstream,
                        up_s,
                        secs,
                        tries,
                        limited_by,
                        host and host[:256].decode("latin-1"),
                        ua and ua[:512].decode("latin-1"),
                        received,
                        up_status,
                    ),
                )
            )
            d.update((name, value) for name, value, _ in extras)
            return json.dumps(d, separators=(",", ":"))
        # text: the method and path escaped as the bytes the client sent
        t_ip, t_up, t_rid, t_key, t_lim, t_method, t_target, t_host, t_ua = _escaped(
            ip, upstream, rid, key, limited_by, method, target, host, ua
        )
        return (
            f'{_stamp(ts)} {t_ip} "{t_method} {t_target}" {status} {_text(sent)} '
            f"{t_up} {'-' if up_s is None else f'{up_s:.6f}'} {secs:.6f} rid={t_rid} "
            f"key={t_key} tries={tries} limited_by={t_lim} host={t_host} ua={t_ua} "
            f"bytes_received={_text(received)} upstream_status={_text(up_status)}"
            + "".join(text for _, _, text in extras)
        )

    def _writer(self) -> None:
        while True:
            items = self._take(self.q.get())  # idle: block until a line comes
            if self._handle(items):
                break
            if len(items) < BATCH:  # a full batch: more are waiting, no pause
                time.sleep(GATHER)  # let the next lines gather: one write for them
        # A request that took this log just before a reload swapped it out can queue its line after the
        # sentinel: give such stragglers one more gathering period rather than drop them.
        time.sleep(GATHER)
        try:
            self._handle(self._take(self.q.get_nowait()))
        except queue.Empty:
            pass
        if self.file is not sys.stderr:
            self.file.close()

    def _take(self, first) -> list:
        """first, and what else has queued behind it (up to BATCH)."""
        items = [first]
        try:
            while len(items) < BATCH:
                items.append(self.q.get_nowait())
        except queue.Empty:
            pass
        return items

    def _handle(self, items: list) -> bool:
        """Write items' lines (the ones before a reopen to the old file); True when the stop sentinel is
        among them (the lines queued behind it are still written)."""
        stop = False
        lines: list[str] = []
        for item in items:
            if item is None:
                stop = True
            elif item is _REOPEN:
                self._write(lines)
                self._reopen()
            else:
                try:
                    lines.append(self.line(item))
                except Exception as ex:  # a bad entry costs its line, never the writer
                    self._error(ex)
        self._write(lines)
        return stop

    def _write(self, lines: list[str]) -> None:
        if not lines:
            return
        try:
            if self.atomic:  # a regular file (O_APPEND): one write, whole lines
                self.file.write("\n".join(lines) + "\n")
            else:  # a pipe or socket others write to (workers, "-"):
                chunk: list[str]
                chunk, size = [], 0  # only a write of <= PIPE_BUF is never cut into
                for line in lines:
                    n = len(line) + 1
                    if chunk and size + n > select.PIPE_BUF:
                        self.file.write("".join(chunk))
                        chunk, size = [], 0
                    chunk.append(line + "\n")
                    size += n
                self.file.write("".join(chunk))
        except Exception as ex:  # a full disk costs these lines, never the writer
            self._error(ex)
        lines.clear()

    def _reopen(self) -> None:
        if self.file is sys.stderr:
            return
        try:
            new = self._open()
        except Exception as ex:  # keep writing to the old file
            self._error(ex)
            return
        try:
            self.file.close()  # may raise: a line still buffered on a full disk
        except Exception as ex:
            self._error(ex)
        self.file = new

    def _error(self, ex: Exception | str) -> None:
        import logging

        logging.getLogger("edge").error("access log %s: %s", self.path, ex)
