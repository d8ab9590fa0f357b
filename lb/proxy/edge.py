"""The proxy's HTTP/1.1 side: a threaded server (EdgeServer, one thread per client connection) and Edge,
which owns what every request shares (configuration, balancer, limiter, metrics, the drain's state) and
runs each connection's loop: read and check a head, then the stages (lb/proxy/pipeline.py: identify,
limit, choose, forward, record) with its responses going to an H1Downstream (lb/proxy/downstream.py).

The per-request path is budgeted: the request head and a small body leave in one sendall, the response
head and a small body return in one sendall, and nothing is formatted for logging unless something
failed. Connections come from urllib3's pool (limits, connect timeout, idle expiry: lb/upstream/backends.py);
the bytes on them are ours (lb/http/framing.py), so nothing is added or reordered on the way.
"""

from __future__ import annotations

import errno
import logging
import socket
import socketserver
import ssl
import threading
import time
from time import monotonic

from lb import netaddr
from lb.errors import ClientGone, HttpError
from lb.http import gate, tls
from lb.http.framing import Reader, Request, linger, own_response, parse_request, send_timeout
from lb.limiting.identity import Identifier
from lb.limiting.rules import configured_subjects
from lb.limiting.stage import Holds
from lb.logs import client_fault
from lb.proxy import replies
from lb.proxy.conn import ClientConn
from lb.proxy.downstream import H1Downstream
from lb.proxy.exchange import Exchange
from lb.proxy.forward import Forwarder
from lb.proxy.h2stream import StreamDownstream
from lb.proxy.pipeline import Pipeline, new_request_id
from lb.proxy.spool import Budget
from lb.proxy.threadcache import ThreadCache
from lb.upstream.breaker import Breaker
from lb.upstream.outlier import Ejector
from lb.upstream.pools import Pool
from lb.upstream.retrybudget import RetryBudget

log = logging.getLogger("edge")

ACCEPT_BACKOFF = 0.1  # seconds between accepts while out of descriptors or memory
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

# Every connection's thread, in one cache per process: a reload's new configuration resizes it.
connection_threads = ThreadCache()


# ------------------------------------------------------------------------------------------- server

# threading's table of the threads it knows, by ident (private: CPython 3.11-3.13 all have it).
_known: dict = threading._active  # type: ignore[attr-defined]
_known_lock = threading._active_limbo_lock  # type: ignore[attr-defined]


def _forget_this_thread() -> None:
    """Take out of threading's table the record it made for this thread (started by _thread), if it made
    one: threading keeps such a record for good (3.11, 3.12), and every connection thread that asked for its
    own Thread object, however deep inside a library, would leave one behind. HTTP/2's stream pool does:
    ThreadPoolExecutor makes each new worker's Thread without daemon=, which asks for its maker's."""
    me = threading.get_ident()
    t = _known.get(me)
    if type(t) is threading._DummyThread:
        with _known_lock:
            if _known.get(me) is t:
                del _known[me]


def _set_thread_stack(size: int) -> None:
    """The stack of every thread started from now on (the connection threads). 8 MiB each by default
    (ulimit -s): 10,000 connections were 80 GB of address space, though only touched pages are RSS."""
    if size:
        try:
            threading.stack_size(max(size, 32 * 1024))  # (32 KiB: the least pthreads takes)
        except (ValueError, RuntimeError) as e:
            log.warning("thread_stack %d: %s; the system's default stays", size, e)


class EdgeServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """ThreadingHTTPServer's model (thread per connection, daemon threads) without http.server's parsing,
    the threads kept for the next connection when theirs ends and started by _thread (connection_threads).

    Concurrent connections are capped. At the cap a new connection closes the longest-idle keep-alive
    one (between requests: nginx's "reusing connections") and takes its place; only when none is idle
    does it get a 503, closed at once, so an attack costs us a socket for a moment, never a thread.
    """

    daemon_threads = True
    block_on_close = False
    server_address: tuple[str, int]  # an IP listener's (host, port, ...): the host a str, not bytes
    allow_reuse_address = True
    # The listen backlog (the kernel caps it at net.core.somaxconn): a burst of connections waits here for
    # the accept loop. A full queue drops the client's handshake ACK, and its request waits for a resend (1 s+).
    request_queue_size = 4096

    def __init__(self, addr, edge: "Edge"):
        self.edge = edge
        self.active = 0
        self._active_lock = threading.Lock()
        # Connections closed to make room whose threads have not ended yet: their slot is already the
        # new connection's, so the cap counts active - len(evicted) (shutdown_request removes them).
        self.evicted: set = set()
        self.address_family = netaddr.family(addr[0])
        self._fd_warned = 0.0
        # threading knows no thread that _thread started (connection_threads) and would register one for
        # good the first time it is asked for its Thread object: logging asks for every record, unless told
        # not to, and so does a Thread made without daemon= (pass it, always, in code connections run).
        logging.logThreads = False
        self.threads = connection_threads
        self.threads.resize(getattr(edge.cfg, "thread_cache", 0))
        n = getattr(edge.cfg, "running_threads", 0)
        gate.install(gate.Gate(n) if n > 0 else None)
        _set_thread_stack(getattr(edge.cfg, "thread_stack", 0))
        super().__init__(addr, None)  # type: ignore[arg-type]  # no handler class: finish_request() serves

    def server_bind(self):
        netaddr.bind_options(self.socket, self.server_address[0])
        super().server_bind()

    def get_request(self):
        try:
            return self.socket.accept()
        except OSError as e:
            if e.errno in _OUT_OF_RESOURCES:
                # The listener stays readable while the backlog holds connections we cannot take:
                # without a pause serve_forever would spin on accept. Back off; they wait in the backlog.
                now = monotonic()
                if now - self._fd_warned > 10.0:
                    self._fd_warned = now
                    log.error("accept: %s; pausing accepts (%d connections open)", e.strerror, self.active)
                time.sleep(ACCEPT_BACKOFF)
            raise

    def process_request(self, request, client_address):
        with self._active_lock:
            full = self.active - len(self.evicted) >= self.edge.cfg.max_connections
            if full:
                victim = self.edge.evict_idle()
                if victim is not None:
                    self.evicted.add(victim)
                    self.edge.idle_closed += 1
                    full = False
            if not full:
                self.active += 1
        if full:
            self.edge.refused_connections += 1
            # Never block the accept loop: send what fits, half-close, drain what already arrived
            # (closing with unread bytes sends a RST that can overtake the 503), then close.
            try:
                request.setblocking(False)
                request.send(own_response(503, "too many connections", close=True))
                request.shutdown(socket.SHUT_WR)
                while request.recv(65536):
                    pass
            except OSError:
                pass
            request.close()
            return
        # A parked thread, or a new one not waited for (lb/proxy/threadcache.py). A thread that cannot start
        # raises here ("can't start new thread"), and socketserver then calls shutdown_request(), which
        # takes the connection off the count: once, there.
        self.threads.run(self.process_request_thread, request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            _forget_this_thread()

    def finish_request(self, request, client_address):
        g = gate.current  # at most --running-threads connection threads at work at once (lb/http/gate.py)
        if g is not None:
            g.join()
        try:
            self.edge.serve_connection(request, client_address)
        finally:
            if g is not None:
                g.part()

    def shutdown_request(self, request):
        super().shutdown_request(request)
        with self._active_lock:
            self.active -= 1
            self.evicted.discard(request)

    def handle_error(self, request, client_address):
        log.exception("connection from %s: unexpected error", client_address[0])


# ------------------------------------------------------------------------------------------- the edge


class Edge:
    """The request pipeline over one configuration. serve_connection runs on each client's thread."""

    def __init__(
        self,
        cfg,
        balancer,
        metrics,
        limiter=None,
        identifier=None,
        access_log=None,
        ejector=None,
        retry_budget=None,
        breaker=None,
    ):
        self.cfg = cfg
        self.balancer = balancer
        self.metrics = metrics
        self.limiter = limiter  # LimitStage, or None when limiting is off
        self.identifier = identifier or Identifier()
        self.access_log = access_log  # AccessLog, or None
        self.ejector = ejector or Ejector(0)  # passive health (lb/upstream/outlier.py)
        self.retry_budget = retry_budget or RetryBudget()
        self.breaker = breaker or Breaker()  # the pool's circuit breaker (lb/upstream/breaker.py)
        self.pool = Pool("default", balancer, self.ejector, self.breaker)  # where no route sends elsewhere
        self.router = None  # lb/proxy/routes.py Router when [[routes]] are configured
        self.refused_connections = 0
        self.idle_closed = 0  # idle keep-alive connections closed to make room at the cap
        self.draining = False  # set after SIGTERM's grace: finish what is in flight, take nothing new
        self.closing = False  # set on SIGTERM itself: every response says Connection: close
        self.conns: dict[socket.socket, bool] = {}  # client socket -> inside a request (for the drain)
        # Keep-alive connections between requests (after one at least): socket -> (idle since, the
        # accepted socket EdgeServer counts), the ones a new connection at the cap may close.
        self.idle: dict[socket.socket, tuple[float, socket.socket]] = {}
        self.forwarder = Forwarder(self)  # the upstream half: lb/proxy/forward.py
        self.pipeline = Pipeline(self)  # the stages of every request: lb/proxy/pipeline.py
        self.buffers = Budget()  # memory of every request and response buffer (lb/proxy/spool.py)
        self.tls = None  # ssl.SSLContext when the listener speaks HTTPS (swapped on reload)
        self.tunnels: dict = {}  # client socket -> backend socket, while upgraded (for the drain)
        self.holds = Holds()  # requests held by delay mode (--max-delay) now

    # -- the connection loop ------------------------------------------------------------------------

    def serve_connection(self, sock: socket.socket, addr) -> None:
        cfg = self.cfg
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer_ip = netaddr.client_ip(addr[0])
        ctx = self.tls
        if ctx is None:
            return self._serve(sock, peer_ip, False)
        tsock, why = tls.accept(ctx, sock, monotonic() + cfg.header_timeout)
        if tsock is None:
            self.metrics.tls_failed()
            if why == "plain-http":
                # nginx's 497: plain HTTP on the HTTPS port gets a plain-text 400, then the close.
                self._refuse(sock, 400, "plain HTTP request sent to the HTTPS port", peer_ip)
                linger(sock, 1.0)
            else:
                client_fault("client %s: %s", peer_ip, why)
            return
        cert = tls.client_cert(tsock) if ctx.verify_mode != ssl.CERT_NONE else None
        if ctx.verify_mode != ssl.CERT_NONE:
            subject = cert.subject.lower() if cert is not None else None
            self.metrics.tls_client_cert(
                cert is not None, subject if subject in configured_subjects(cfg.rules) else None
            )
        try:
            if tsock.selected_alpn_protocol() == "h2":  # offered only with [server] http2 on
                from lb.http2.server import serve as serve_h2

                serve_h2(self, tsock, peer_ip, True, sock, cert)
            else:
                self._serve(tsock, peer_ip, True, sock, cert)
        finally:
            tls.close(tsock)  # wrapping detached the TCP socket: closing it is ours now

    def _serve(self, sock: socket.socket, peer_ip: str, over_tls: bool, accepted=None, cert=None) -> None:
        send_timeout(sock, self.cfg.send_timeout)
        reader = Reader(sock, self.cfg.send_timeout)  # (the send bound matters to a TLS socket only)
        reader.new_work = True  # (lb/http/gate.py: new requests wait behind those under way)
        conn = ClientConn(sock, peer_ip, over_tls, reader, cert, accepted)
        down = H1Downstream(conn, self)
        conns = self.conns
        # Busy until its first request is answered: a drain waits for a connection it accepted (the last of
        # its accept queue, say) rather than closing it under a client about to send (wake_idle)
        conns[sock] = True
        idle = self.idle
        accepted = conn.accepted
        # A new connection has header_timeout for its whole first head, silence included; a kept-alive
        # one may idle keepalive_timeout between requests.
        first = monotonic() + self.cfg.header_timeout
        check_tls = not over_tls
        try:
            while True:  # from SIGTERM on, handle() says close after each response
                cfg = self.cfg  # a reload applies from the next request on
                reader.deadline = first or None
                try:
                    if not reader.buf:
                        reader.timeout = None if first else cfg.keepalive_timeout
                        if not reader.fill():
                            return
                    if check_tls:
                        check_tls = False
                        if reader.buf[0] == tls.HANDSHAKE:
                            client_fault("client %s: TLS handshake sent to a plain-HTTP port; closed", peer_ip)
                            return
                        if reader.buf[:3] == b"PRI" and cfg.http2 and _h2_preface(reader):  # h2c, prior knowledge
                            from lb.http2.server import serve as serve_h2

                            return serve_h2(self, sock, peer_ip, False, accepted, cert, bytes(reader.buf))
                    conns[sock] = True
                    idle.pop(sock, None)
                    reader.timeout = None
                    reader.deadline = first or monotonic() + cfg.header_timeout
                    first = 0.0
                    reader.mark = reader.got - len(reader.buf)  # where this request's bytes begin
                    head = reader.read_head()
                    if head is None:
                        return
                    req = parse_request(head, reader.memo)  # (the connection's last head: not parsed again)
                    req.client_cert = cert  # the connection's verified certificate (lb/http/tls.py), or None
                except HttpError as e:
                    self._refuse(sock, e.status, e.reason, peer_ip)
                    return
                except socket.timeout:
                    if reader.buf:
                        self._refuse(sock, 408, "request head not received in time", peer_ip)
                    return
                except OSError:
                    return
                try:
                    if not self.handle(req, conn, down):
                        return
                except ClientGone:
                    return
                conns[sock] = False
                idle[sock] = (monotonic(), accepted)
        finally:
            conns.pop(sock, None)
            idle.pop(sock, None)

    def sweep_ejections(self) -> None:
        """Ejected backends whose time is up return to the rotation: one log line and a count each."""
        self.pool.sweep_ejections(self.metrics)

    def wake_idle(self) -> int:
        """Draining: end the connections waiting between requests (a busy one ends after its response)."""
        n = 0
        for sock, busy in list(self.conns.items()):
            if not busy:
                try:
                    # the blocked recv returns b"" and the thread exits; socket.socket's own shutdown,
                    # because an SSLSocket's would drop its TLS state under the reading thread
                    socket.socket.shutdown(sock, socket.SHUT_RD)
                    n += 1
                except OSError:
                    pass
        return n

    def evict_idle(self):
        """At the connection cap: close the keep-alive connection idle longest (its thread, blocked in
        recv, sees EOF and ends, as in wake_idle) and return its accepted socket, or None if none is
        idle. A request that arrived just before is still read and answered, then the connection
        closes: the client sees a clean close, never half a response."""
        idle = self.idle
        while idle:
            try:
                sock, (_, accepted) = min(list(idle.items()), key=_since)
            except ValueError:  # emptied by the connections' own threads meanwhile
                return None
            if idle.pop(sock, None) is None:
                continue  # it went busy (or ended) just now: the next one
            try:
                socket.socket.shutdown(sock, socket.SHUT_RD)
            except OSError:
                continue  # already closed: its slot frees itself
            return accepted
        return None

    def busy(self) -> int:
        return sum(1 for b in list(self.conns.values()) if b)

    def _refuse(self, sock, status: int, reason: str, peer_ip: str) -> None:
        """Answer a request we could not read, then the caller closes: framing is lost."""
        client_fault("client %s: %d %s", peer_ip, status, reason)
        self.metrics.edge_answered(status, 0.0)
        rid = new_request_id()
        access_log = self.access_log  # once: a reload may turn it off between two reads
        if access_log is not None:
            access_log.refusal(peer_ip, status, reason, request_id=rid.decode())
        extra = b"X-Request-Id: " + rid + b"\r\n" if self.cfg.request_id_response else b""
        try:
            sock.sendall(replies.h1(replies.refusal(status, reason, extra)))
        except OSError:
            pass

    # -- one request ----------------------------------------------------------------------------------

    def handle_stream(self, req: Request, codec, reader, peer_ip: str, over_tls: bool, cert, accepted) -> bool:
        """An HTTP/2 stream's request (lb/http2/server.py, which sits below this room), answered through its
        codec as a Downstream (lb/proxy/h2stream.py)."""
        conn = ClientConn(None, peer_ip, over_tls, reader, cert, accepted)
        down = StreamDownstream(conn, self, codec)
        x = Exchange(req, monotonic(), conn.scheme)  # (handle()'s lines, with the stream's reset hook)
        x.reader = reader
        st = codec.stream
        st.on_reset = x.abandon  # the client's RST_STREAM frees the backend (lb/http2/server.py)
        if st.reset:  # a reset before the hook was set (the flag is set before the hook is read)
            x.abandoned = True
        if conn.identifier is not self.identifier:
            conn.trust(self.identifier)
        return self.pipeline.run(x, conn, down, None)

    def handle(self, req: Request, conn: ClientConn, down, body=None) -> bool:
        """Serve one request (lb/proxy/pipeline.py); True when the client connection may carry another.
        body: the request body when the codec has it (HTTP/2), else None: the downstream reads it."""
        x = Exchange(req, monotonic(), conn.scheme)
        x.reader = conn.reader
        if conn.identifier is not self.identifier:
            conn.trust(self.identifier)  # once per connection and per reload
        return self.pipeline.run(x, conn, down, body)

    def record(self, x: "Exchange", status: int) -> None:
        """The request's outcome is known: its protocol counted and the access-log line (once per request)."""
        x.status = status
        self.metrics.answered(x.req.version)
        access_log = self.access_log  # once: a reload may turn it off between two reads
        if access_log is not None:
            r = x.reader
            if r is not None:  # head and body bytes read for this request (nginx's request_length)
                x.bytes_received = r.got - len(r.buf) - r.mark
            access_log.record(x, status, monotonic() - x.start)

    def logged(self, x: "Exchange", status: int) -> None:
        """record() for a request whose protocol is counted already (Metrics.backend_done with its version;
        record's lines but answered(), not a call to each other: once per request)."""
        x.status = status
        access_log = self.access_log
        if access_log is not None:
            r = x.reader
            if r is not None:  # head and body bytes read for this request (nginx's request_length)
                x.bytes_received = r.got - len(r.buf) - r.mark
            access_log.record(x, status, monotonic() - x.start)

    def client_closed(self, x: "Exchange", reached: bool) -> None:
        """The client went away before its answer: not a backend failure. Logged and counted as 499
        (nginx's code), against the backend's requests when the request had reached it."""
        b = x.backend.url if (reached and x.backend is not None) else None
        log.info(
            "client closed the connection before the answer: %s %s -> 499%s",
            x.req.method.decode(),
            x.req.target[:200].decode("latin-1"),
            f" (backend {b})" if b else "",
        )
        self.metrics.client_failed(b, 499, monotonic() - x.start)
        self.record(x, 499)


def _h2_preface(reader: Reader) -> bool:
    """Whether the connection opens with HTTP/2's preface (read on until it is whole or cannot be)."""
    from lb.http2.server import PREFACE

    while len(reader.buf) < len(PREFACE) and PREFACE.startswith(bytes(reader.buf)):
        if not reader.fill():
            return False
    return reader.buf.startswith(PREFACE)


def _since(item) -> float:
    return item[1][0]
