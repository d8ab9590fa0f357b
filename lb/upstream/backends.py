"""A backend: its address and weight, its health state, and its pool of keep-alive connections.

The pool is urllib3's HTTPConnectionPool, deliberately configured: a hard cap on connections
(maxsize + block=True, waiting at most pool_timeout, then the caller answers 503), connect timeout,
no retries, no redirects, and the idle expiry urllib3 lacks (a connection idle longer than
idle_timeout is closed on checkout instead of reused: the backend may have dropped it by then). On
every checkout a connection with anything to read on it (the backend's close, or bytes it sent after
its last response) is closed instead of reused: those bytes would be read as the next response.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import select
import socket
import ssl
import threading
from collections import deque
from dataclasses import dataclass
from time import monotonic
from typing import TYPE_CHECKING, Any

import urllib3
from urllib3.exceptions import ClosedPoolError, EmptyPoolError

from lb.errors import PoolExhausted
from lb.http.gate import step_aside

if TYPE_CHECKING:
    from lb.upstream.h2pool import H2Upstream

log = logging.getLogger("edge")


@dataclass(frozen=True)
class BackendSpec:
    """One backend as configured (--backends, [[backends]]), or one address a DNS-named one resolved to."""

    url: str  # http://host:port or http://[v6]:port, normalised (no path, no trailing slash)
    weight: int = 1
    host: str = ""  # without brackets
    port: int = 80
    scheme: str = "http"  # or https: TLS to the backend, verified
    address: str = ""  # one address a DNS name resolved to (lb/upstream/resolve.py): connect there, host stays the name


def readable(conn, sock) -> bool:
    """Whether anything waits on an idle pooled connection: bytes, EOF or an error (a non-blocking
    poll of the socket, nginx's read event on a kept-alive upstream connection). One poll() on a poll
    object kept with the connection: a third of a MSG_PEEK recv's CPU, which raises BlockingIOError
    in the common case. TLS: a record OpenSSL already decrypted is invisible to poll(), so pending()
    first; the raw socket shows the rest (a record not read yet, a close_notify, the FIN)."""
    if type(sock) is not socket.socket and isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    watch = conn.watch
    if watch is None or watch[0] is not sock:
        watch = _watch(conn, sock)
    return bool(watch[1].poll(0))


def _watch(conn, sock) -> tuple:
    """(sock, a poll object watching it for input), kept with the connection."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    watch = conn.watch = (sock, poller)
    return watch


def _sent_bytes(sock) -> bool:
    """After readable(): bytes of the backend's (worth a log line) rather than its close (its keep-alive
    timeout: nothing to say). Over TLS only a decrypted record counts: raw bytes there are as likely a
    close_notify as data, and reading them means decrypting what is not ours."""
    if isinstance(sock, ssl.SSLSocket):
        return sock.pending() > 0
    try:
        return socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except OSError:  # reset (as good as closed), or readable no more
        return False


class LifoSlots:
    """queue.LifoQueue's get/put as urllib3's pool uses them: last in, first out while slots are free,
    first come, first served once callers wait, and no Condition on the fast path.

    LifoQueue takes a lock and a Condition on every get and every put (a request does both); here a
    list's append/pop (atomic under the GIL) is the fast path, taken only while nobody waits. Once the
    pool is exhausted, callers queue: a put hands its slot straight to the longest waiter, and a newcomer
    queues behind the waiters instead of taking a slot that comes back. (Taking it -- a thread that
    releases and asks again at once wins the race against the waiter it just woke -- can starve a waiter
    for its whole pool_timeout and answer 503 with a healthy backend: the Redis pool's defect of issue
    18, in the backend pool.) A getter counts itself as waiting under the lock before its last look, and
    a put appends before it looks for waiters, so no slot is left unseen while someone waits."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.items: list = []
        self.lock = threading.Lock()
        self.waiters: deque = deque()  # (gate, box) per waiting getter, the longest-waiting first
        self.waiting = 0
        self.breaker = None  # the pool's Breaker (lb/upstream/breaker.py): its cap on waiters, pool-wide

    def qsize(self) -> int:
        return len(self.items)

    def put(self, item, block: bool = True, timeout=None) -> None:
        if len(self.items) >= self.maxsize:
            raise queue.Full
        self.items.append(item)
        if self.waiting:
            self.hand_over()

    def hand_over(self) -> None:
        """After a put's append, with callers waiting: the slot to the longest waiter."""
        with self.lock:
            if self.waiters:
                try:
                    item = self.items.pop()
                except IndexError:  # a getter on the lock-free path took it between our looks
                    return
                gate, box = self.waiters.popleft()
                box.append(item)
                gate.release()

    def get(self, block: bool = True, timeout=None):
        if not self.waiting or not block:
            try:
                return self.items.pop()
            except IndexError:
                if not block:
                    raise queue.Empty from None
        with self.lock:
            self.waiting += 1
            if not self.waiters:  # nobody ahead: a slot that came back is ours
                try:
                    item = self.items.pop()  # (unless a getter on the lock-free path took it)
                except IndexError:
                    pass
                else:
                    self.waiting -= 1
                    return item
            breaker = self.breaker
            if breaker is not None and not breaker.wait():
                self.waiting -= 1
                raise PendingFull
            gate = threading.Lock()
            box: list = []  # the connection put() hands over
            gate.acquire()
            self.waiters.append((gate, box))
        aside = step_aside()  # (a connection thread waiting here gives its running slot up: lb/http/gate.py)
        try:
            gate.acquire(timeout=-1 if timeout is None else max(0.0, timeout))
        finally:
            if aside is not None:
                aside.enter()
            if breaker is not None:
                breaker.unwait()
            with self.lock:
                self.waiting -= 1
                if not box:
                    self.waiters.remove((gate, box))
        if box:
            return box[0]
        raise queue.Empty


class PendingFull(queue.Empty):
    """The pool's line for a connection is at its cap (max_pending): shed at once, not queued."""


class BackendPool(urllib3.HTTPConnectionPool):
    # urllib3 uses its queue's get/put/qsize only; its stubs say LifoQueue (LifoSlots is none, on purpose)
    QueueCls = LifoSlots  # type: ignore[assignment]
    pool: LifoSlots | None  # type: ignore[assignment]

    def __init__(
        self,
        host: str,
        port: int,
        *,
        maxsize: int,
        pool_timeout: float,
        connect_timeout: float,
        read_timeout: float,
        idle_timeout: float,
        reuse: bool = True,
        **tls,
    ):
        super().__init__(
            host,
            port,
            maxsize=maxsize,
            block=True,
            retries=False,
            timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout),
            **tls,
        )
        self.pool_timeout = pool_timeout
        self.idle_timeout = idle_timeout
        self.reuse = reuse
        self.url = f"{self.scheme}://{host}:{port}"  # make_backend sets the backend's own spelling

    def _get_conn(self, timeout=None):
        # urllib3's _get_conn, with our own check of a pooled connection (_checked) and the idle expiry.
        if self.pool is None:
            raise ClosedPoolError(self, "Pool is closed.")
        try:
            conn = self.pool.get(block=True, timeout=timeout)
        except PendingFull:
            raise PoolExhausted(
                f"overflow: {self.pool.breaker.max_pending} requests already wait for a connection (max_pending)"
            ) from None
        except queue.Empty:
            raise EmptyPoolError(
                self, "Pool is empty and a new connection can't be opened due to blocking mode."
            ) from None
        return self._checked(conn)

    def _checked(self, conn):
        """A slot taken from the pool, as a connection safe to use: new if the slot was empty, closed (so
        the caller connects anew) if it was idle too long or has anything to read on it."""
        if conn is None:
            return self._new_conn()
        sock = conn.sock
        if sock is not None:
            if monotonic() - conn.idle_since > self.idle_timeout:
                conn.close()
            elif (
                watch[1].poll(0)  # readable()'s common case inline: a plain socket whose poll object is made
                if (watch := conn.watch) is not None and watch[0] is sock and type(sock) is socket.socket
                else readable(conn, sock)
            ):
                # Anything on an idle connection is its close or bytes no request of ours asked for (a
                # second response, a body after a HEAD or a 204, a Content-Length too short): read as
                # the next response, it would answer the next user with another's. Never reused.
                if _sent_bytes(sock):
                    log.warning(
                        "backend %s sent bytes on an idle connection (after a complete response): closed, not reused",
                        self.url,
                    )
                conn.close()
        return conn

    def _new_conn(self):
        conn = super()._new_conn()
        conn.slot_of = self  # release() gives the slot back here, even if a reload replaced this pool
        conn.watch = None  # readable()'s poll object, made at the socket's first check
        conn.reader = None  # the connection's Reader (lb/proxy/tries.py), made at its first try
        return conn

    def _put_conn(self, conn):
        if conn is not None:
            conn.idle_since = monotonic()
        super()._put_conn(conn)

    def acquire(self):
        """A connection (connected or not: check .sock), never one with anything to read on it.
        Raises PoolExhausted."""
        slots = self.pool
        if slots is not None and not slots.waiting:
            # LifoSlots.get's lock-free path (nobody waits: the last slot put back), without the layers of
            # urllib3's _get_conn between; an empty list takes the general path, which queues.
            try:
                conn = slots.items.pop()  # list.pop: atomic under the GIL
            except IndexError:
                pass
            else:
                # _checked's common case inline: a plain socket, idle not too long, whose poll object
                # (made at its first check) sees nothing on it
                if (
                    conn is not None
                    and type(sock := conn.sock) is socket.socket
                    and (watch := conn.watch) is not None
                    and watch[0] is sock
                    and monotonic() - conn.idle_since <= self.idle_timeout
                    and not watch[1].poll(0)
                ):
                    return conn
                return self._checked(conn)
        try:
            return self._get_conn(timeout=self.pool_timeout)
        except EmptyPoolError:
            raise PoolExhausted(f"all {self.pool.maxsize if self.pool else 0} connections busy") from None

    def acquire_fresh(self):
        """A slot with a new connection: for the one retry after a reused connection proved dead."""
        conn = self.acquire()
        conn.close()
        return conn

    def release(self, conn, reusable: bool) -> None:
        """Give the slot back; the socket is kept only when the exchange ended cleanly. The slot goes to
        the pool it came from: a reload may have given the backend a new pool since (the old one, closed,
        closes the connection; put in the new one, it would overfill it)."""
        pool = conn.slot_of
        if not (reusable and pool.reuse):
            conn.close()
        slots = pool.pool
        if slots is not None:
            items = slots.items
            if len(items) < slots.maxsize:
                # LifoSlots.put without urllib3's _put_conn layers: appended first, then a look for
                # waiters (that order is what leaves no slot unseen while someone waits). A full pool
                # (it cannot be: a slot is taken before its put) goes urllib3's way below.
                conn.idle_since = monotonic()
                items.append(conn)
                if slots.waiting:
                    slots.hand_over()
                return
        pool._put_conn(conn)


class TLSBackendPool(BackendPool, urllib3.HTTPSConnectionPool):
    """An https:// backend: the same pool, each connection's certificate verified (system CAs, or
    [upstream] ca_file) against the backend's host name or address."""


class Backend:
    """One upstream. `up` is the active checks' verdict (written by the health thread only); `ejected`
    is passive health (lb/upstream/outlier.py); `drained` is the operator's (admin API). Pickers read only
    `in_rotation`, recomputed by refresh() whenever one of the three changes."""

    cluster: Any = None  # the Pool it belongs to (lb/upstream/pools.py); None: the default pool
    h2: H2Upstream | None = None  # an h2c:// backend's HTTP/2 calls (lb/upstream/h2pool.py), else None

    def __init__(self, spec: BackendSpec, pool: BackendPool):
        self.spec = spec
        self.url = spec.url
        self.weight = spec.weight
        # Sticky-session id: stable across restarts and edges, reveals nothing of the address.
        self.route = hashlib.sha1(spec.url.encode()).hexdigest()[:10]
        self.current: float = 0  # smooth weighted round robin's running weight
        self.up = True  # a backend starts UP; health checks take it out
        self.ejected = False  # passive health: too many consecutive failures (lb/upstream/outlier.py)
        self.ejected_until = 0.0  # monotonic time the ejection ends
        self.times_ejected = 0  # the ejection time's multiplier (decays while it behaves)
        self.returned_at = 0.0  # when its last ejection ended
        self.fail_run = 0  # consecutive failed requests (connect failures, timeouts, 5xx)
        self.drained = False  # the operator took it out (POST /backends/<route>/drain)
        self.in_rotation = True
        self.joined_at: float | None = None  # when it last (re)joined the rotation: slow start ramps from here
        self.fail_streak = 0
        self.pass_streak = 0
        self.last_probe = ""  # why the last probe passed or failed
        self.pool = pool
        self.inflight = 0
        self.lock = threading.Lock()
        self.shown = "UP"  # the state last reported to on_state
        self.on_state = None  # called with (backend, new state) when `state` changes (metrics)

    def refresh(self, now: float | None = None) -> bool:
        """Recompute in_rotation; a backend that (re)joins starts its slow start at `now`. True on a change."""
        with self.lock:
            state = self.state
            if state != self.shown:
                self.shown = state
                if self.on_state is not None:
                    self.on_state(self, state)
            was = self.in_rotation
            self.in_rotation = self.up and not self.ejected and not self.drained
            if self.in_rotation and not was:
                self.joined_at = monotonic() if now is None else now
                self.current = 0  # no running credit or debt carried over from before it left
            return self.in_rotation != was

    def pool_full(self) -> bool:
        """Every connection to it is busy (its pool's cap reached, or callers already waiting in line)."""
        slots = self.pool.pool
        return slots is not None and not slots.items

    @property
    def state(self) -> str:
        """What /status shows: the most specific reason it is out, else UP."""
        return "DRAINED" if self.drained else "DOWN" if not self.up else "EJECTED" if self.ejected else "UP"

    def __repr__(self):
        return f"<Backend {self.url} w={self.weight} {self.state}>"


def make_backend(spec: BackendSpec, cfg, joined_at: float | None = None, breaker=None) -> Backend:
    cls, tls = BackendPool, {}
    if spec.scheme == "https":
        cls, tls = TLSBackendPool, {"cert_reqs": "CERT_REQUIRED", "ca_certs": cfg.ca_file}
        if spec.address:  # one address of a DNS name: the certificate is still the name's
            tls.update(server_hostname=spec.host, assert_hostname=spec.host)
    pool = cls(
        spec.address or spec.host,
        spec.port,
        maxsize=cfg.pool_maxsize,
        pool_timeout=cfg.pool_timeout,
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        idle_timeout=cfg.pool_idle_timeout,
        reuse=not cfg.no_pool,
        **tls,
    )
    pool.url = spec.url
    slots = pool.pool
    assert slots is not None  # urllib3 made it (None only once closed)
    slots.breaker = breaker
    b = Backend(spec, pool)
    if spec.scheme == "h2c":  # HTTP/2 by prior knowledge: calls multiplexed (lb/upstream/h2pool.py)
        from lb.upstream.h2pool import H2Upstream

        b.h2 = H2Upstream(spec.address or spec.host, spec.port, cfg.connect_timeout, spec.url)
    b.joined_at = joined_at  # None at start: the whole pool starts together, nobody ramps
    return b
