"""The admin listener: / (the dashboard, lb/ops/dashboard.py), /metrics (Prometheus text), /status (JSON), /limits/KEY,
/healthz and /readyz, on a port of its own so that no backend path is ever shadowed, and the deploy actions POST /backends/<route>/drain and
.../enable (<route> is the backend's id in /status, or its HOST:PORT). Off unless --admin is given; it
binds only where configured.

/healthz: 200 while the process runs (liveness). /readyz: 200 once the edge serves (and, with
on_store_error = fail-closed, its store answered), 503 from the moment a drain starts (SIGTERM), before
the listener closes (see `grace`), so a load balancer in front stops sending first.

Reads are open; writes (drain, enable) take orders only with a token (env EDGE_ADMIN_TOKEN or [admin]
token_file) sent as `Authorization: Bearer TOKEN`: without a token configured they are 403 (and say how
to turn them on), with a missing or wrong one 401. A web page the operator has open must not reach them
either: a write with a cross-site Origin or Sec-Fetch-Site is 403, and any request whose Host is not
this listener (a DNS-rebinding page's own name) is 421. HAProxy's stats page is read-only unless
`stats admin` is granted; Envoy's docs call its admin interface destructive and localhost-only.

The connection handling is the proxy's (lb/http/framing.py Reader + parse_request: strict framing, a bounded
head, no `Content-Length: -1` read to EOF), a thread per connection capped at MAX_CONNECTIONS (past it
a 503 and a close, never a thread), the head within --header-timeout and an idle keep-alive connection
closed after IDLE_TIMEOUT.

With --workers N, a drain/enable on any worker's admin port acts on every worker (lb/ops/fanout.py, over a
private unix socket that needs no token): 200 once all applied it, else 502 naming the workers that did
not (a restarting one), so the operator retries.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import socketserver
import threading
from time import monotonic
from urllib.parse import unquote, urlsplit

from lb.errors import ClientGone, HttpError
from lb.http.framing import Reader, http_date, iter_chunked, own_response, parse_request, send, send_timeout
from lb.netaddr import bind_options, family, ip
from lb.ops import dashboard
from lb.ops.accesslog import escape

log = logging.getLogger("edge")

MAX_ROUTE = 64  # a route is a backend id or HOST:PORT: what a 404 may echo of one
MAX_CONNECTIONS = 64  # a scraper, a dashboard, an operator's curl: never 500 threads
MAX_BODY = 65536  # a write carries nothing; a body is read (to keep the connection in step) up to this
IDLE_TIMEOUT = 30.0  # a kept-alive connection silent this long is closed (at most --keepalive-timeout)
SEND_TIMEOUT = 10.0

ENABLE_WRITES = (
    "admin writes are off: set a token in the environment variable EDGE_ADMIN_TOKEN or in a "
    "file named by [admin] token_file, then send it as 'Authorization: Bearer TOKEN'"
)


def host_allowed(host: bytes, extra: tuple[str, ...] = ()) -> bool:
    """A Host this listener answers to: an IP literal, localhost (or *.localhost), the machine's name,
    or a name in [admin] allowed_hosts. A DNS-rebinding page sends its own domain here, and is refused."""
    if not host:
        return True  # HTTP/1.0 without Host: not what a browser sends
    name = host.decode("ascii", "replace").lower()
    if name.startswith("["):
        return "]" in name  # an IPv6 literal (the parser checked the bytes)
    name = name.rpartition(":")[0] if ":" in name else name
    name = name.rstrip(".")
    try:
        ip(name)
        return True
    except ValueError:
        pass
    if name == "localhost" or name.endswith(".localhost"):
        return True
    return name in _own_names() or name in {h.lower().rstrip(".") for h in extra}


_NAMES: set[str] = set()


def _own_names() -> set[str]:
    if not _NAMES:
        n = socket.gethostname().lower()
        _NAMES.update({n, n.split(".", 1)[0]})
    return _NAMES


def _header(req, lname: bytes) -> bytes | None:
    for _, n, v in req.headers:
        if n == lname:
            return v
    return None


def cross_site(req) -> str | None:
    """Why a write comes from another site (a page the operator's browser has open), or None."""
    site = _header(req, b"sec-fetch-site")
    if site is not None and site.lower() in (b"cross-site", b"same-site"):
        return f"Sec-Fetch-Site: {site.decode('ascii', 'replace')}"
    origin = _header(req, b"origin")
    if origin is not None:
        try:
            netloc = urlsplit(origin.decode("ascii")).netloc.lower()
        except (UnicodeDecodeError, ValueError):
            netloc = ""
        if not netloc or netloc != (req.host or b"").decode("ascii", "replace").lower():
            return f"Origin {escape(origin, MAX_ROUTE)} is not this admin listener"
    return None


def authorized(req, token: bytes) -> bool:
    """Authorization: Bearer TOKEN, compared in constant time."""
    value = _header(req, b"authorization") or b""
    scheme, _, given = value.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token)


class AdminServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128  # socketserver's 5 would pace a burst by SYN retransmits, not refuse it
    reuse_port = False
    server_address: tuple[str, int]  # an IP listener's (host, port, ...): the host a str, not bytes

    def __init__(self, addr, app):
        self.app = app
        self.active = 0
        self._lock = threading.Lock()
        self.address_family = family(addr[0])
        super().__init__(addr, None)

    def server_bind(self):
        bind_options(self.socket, self.server_address[0])
        if self.reuse_port:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

    def process_request(self, request, client_address):
        with self._lock:
            full = self.active >= MAX_CONNECTIONS
            if not full:
                self.active += 1
        if full:
            try:
                request.setblocking(False)
                request.send(own_response(503, "too many admin connections", close=True))
            except OSError:
                pass
            request.close()
            return
        # A thread that cannot start raises here, and socketserver then calls shutdown_request(), which
        # takes the connection off the count: once, there.
        super().process_request(request, client_address)

    def finish_request(self, request, client_address):
        Connection(self.app, request, client_address[0]).serve()

    def shutdown_request(self, request):
        super().shutdown_request(request)
        with self._lock:
            self.active -= 1

    def handle_error(self, request, client_address):
        log.exception("admin connection from %s: unexpected error", client_address[0])


class Connection:
    """One admin client connection: requests in turn, each answered in full."""

    def __init__(self, app, sock: socket.socket, peer: str):
        self.app, self.sock, self.peer = app, sock, peer

    def serve(self) -> None:
        sock = self.sock
        send_timeout(sock, SEND_TIMEOUT)
        reader = Reader(sock)
        first = True
        while True:
            cfg = self.app.cfg
            try:
                # A new connection has header_timeout for its whole first head, silence included.
                reader.deadline = monotonic() + cfg.header_timeout if first else None
                if not reader.buf:
                    reader.timeout = None if first else min(IDLE_TIMEOUT, cfg.keepalive_timeout)
                    if not reader.fill():
                        return
                reader.timeout = None
                reader.deadline = monotonic() + cfg.header_timeout
                first = False
                head = reader.read_head()
                if head is None:
                    return
                req = parse_request(head)
                self._read_body(req, reader)
                keep = self.answer(req)
            except HttpError as e:
                return self._close_with(e.status, e.reason)
            except socket.timeout:
                if reader.buf:
                    self._close_with(408, "request not received in time")
                return
            except (ClientGone, EOFError, OSError):
                return
            if not keep:
                return

    @staticmethod
    def _read_body(req, reader: Reader) -> None:
        """Nothing the admin API takes is in a body: read it (bounded) so the next request starts in step."""
        if req.chunked:
            for _ in iter_chunked(reader, MAX_BODY):
                pass
        elif req.content_length:
            if req.content_length > MAX_BODY:
                raise HttpError(413, "request body too large")
            reader.read_exact(req.content_length)

    def _close_with(self, status: int, reason: str) -> None:
        try:
            self.sock.sendall(own_response(status, reason, close=True))
        except OSError:
            pass

    def reply(
        self, req, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8", extra: bytes = b""
    ) -> bool:
        keep = req.keep_alive
        head = (
            b"HTTP/1.1 %d %s\r\nDate: %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
            b"Cache-Control: no-store\r\n%s%s\r\n"
            % (
                status,
                _PHRASES.get(status, b"Error"),
                http_date(),
                ctype.encode(),
                len(body),
                extra,
                b"" if keep else b"Connection: close\r\n",
            )
        )
        send(self.sock, head if req.method == b"HEAD" else head + body)
        return keep

    def answer(self, req) -> bool:
        app = self.app
        if not host_allowed(req.host, app.cfg.admin_allowed_hosts):
            log.warning(
                "admin: %s from %s refused: Host %s is not this listener (DNS rebinding?); allowed: an "
                "IP address, localhost, this machine's name, [admin] allowed_hosts",
                req.method.decode(),
                self.peer,
                escape(req.host, MAX_ROUTE),
            )
            return self.reply(
                req,
                421,
                b"Host is not this admin listener: use its IP address or localhost, or "
                b"add the name to [admin] allowed_hosts\n",
            )
        path = req.target.split(b"?", 1)[0].decode("latin-1")
        if req.method in (b"GET", b"HEAD"):
            return self.read(req, path)
        if req.method != b"POST":
            return self.reply(
                req, 405, b"the admin API takes GET, HEAD and POST\n", extra=b"Allow: GET, HEAD, POST\r\n"
            )
        return self.write(req, path)

    def read(self, req, path: str) -> bool:
        app = self.app
        if path == "/metrics":
            return self.reply(req, 200, app.render_metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
        if path == "/status":
            return self.reply(req, 200, json.dumps(app.status(), indent=2).encode(), "application/json")
        if path == "/healthz":
            return self.reply(req, 200, b"ok\n")
        if path == "/readyz":
            why = app.not_ready()
            return self.reply(req, 503, f"not ready: {why}\n".encode()) if why else self.reply(req, 200, b"ready\n")
        if path == "/":
            return self.reply(req, 200, dashboard.page(), dashboard.CONTENT_TYPE)
        if path.startswith("/limits/"):
            # A raw API key only in a header (req.api_key), never in the URL: URLs end up in logs
            st, body = app.peek_limits(unquote(path[8:]), req.api_key)
            return self.reply(req, st, json.dumps(body, indent=2).encode(), "application/json")
        if path.startswith("/backends/"):
            return self.reply(req, 405, b"use POST /backends/<route>/drain or /enable\n", extra=b"Allow: POST\r\n")
        return self.reply(req, 404, b"not found: try /, /metrics, /status, /limits/KEY, /healthz or /readyz\n")

    def write(self, req, path: str) -> bool:
        app = self.app
        parts = path.strip("/").split("/")
        if len(parts) != 3 or parts[0] != "backends" or parts[2] not in ("drain", "enable"):
            return self.reply(req, 404, b"not found: POST /backends/<route>/drain or /backends/<route>/enable\n")
        why = cross_site(req)
        if why:
            log.warning("admin: POST %s from %s refused: %s", escape(path.encode("latin-1"), 200), self.peer, why)
            return self.reply(req, 403, f"refused: a cross-site request ({why})\n".encode())
        token = app.admin_token
        if token is None:
            return self.reply(req, 403, (ENABLE_WRITES + "\n").encode())
        if not authorized(req, token):
            log.warning(
                "admin: POST %s from %s refused: missing or wrong token", escape(path.encode("latin-1"), 200), self.peer
            )
            return self.reply(
                req,
                401,
                b"a token is needed: Authorization: Bearer TOKEN\n",
                extra=b'WWW-Authenticate: Bearer realm="edge admin"\r\n',
            )
        b = app.find_backend(parts[1])
        if b is None:
            # Reflected, attacker-chosen: bounded and escaped as the access log writes a path.
            name = escape(parts[1].encode("latin-1"), MAX_ROUTE)
            return self.reply(req, 404, f"no backend '{name}': see /status for the routes\n".encode())
        st, failed = app.drain_everywhere(b, parts[2] == "drain")
        if failed:  # applied here (and by the others not named), not everywhere: retry the call
            st["workers_failed"] = {str(i): why for i, why in sorted(failed.items())}
        return self.reply(req, 502 if failed else 200, json.dumps(st, indent=2).encode(), "application/json")


_PHRASES = {
    200: b"OK",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    421: b"Misdirected Request",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
}


def start_admin(addr, app, reuse_port: bool = False) -> AdminServer:
    cls = type("AdminServer", (AdminServer,), {"reuse_port": reuse_port})
    srv = cls(addr, app)
    threading.Thread(target=srv.serve_forever, name="admin", daemon=True).start()
    return srv
