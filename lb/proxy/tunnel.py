"""Upgrades (WebSocket and the other allowed protocols): the handshake through the pipeline, then a tunnel.

A request with `Connection: Upgrade` and an allowed `Upgrade` protocol (config `upgrades`, default
websocket) is forwarded with those two headers, the only hop-by-hop headers the edge ever forwards.
It has already been identified, limited (one token per handshake) and given a backend, like any
request, and Forwarder.forward sends it (connect failures retried elsewhere, passive health observed).
A backend that answers 101 gets a byte tunnel to the client until either side closes, or
nothing moved either way for `tunnel_idle_timeout`, or the drain's deadline passed; anything else is
relayed as a normal response. The upgraded backend connection is taken out of the pool at the 101:
its slot goes back at once (the pool's cap counts requests in flight, not open tunnels) and the
socket is closed with the tunnel, never reused.

One thread per connection already exists; the tunnel keeps it and polls both sockets (a second
thread could not safely read a TLS socket while this one writes it).
"""

from __future__ import annotations

import base64
import hashlib
import select
import socket
import ssl
from time import monotonic

from lb.http.framing import Reader, not_relayed
from lb.upstream.failures import Failure

PIECE = 65536
_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 1.3


def requested(req, allowed: frozenset) -> bytes | None:
    """The Upgrade value to forward (only the allowed protocols), or None when this is no upgrade."""
    if b"upgrade" not in req.conn_tokens or req.version != b"HTTP/1.1" or not allowed:
        return None
    for _, lname, value in req.headers:
        if lname == b"upgrade":
            keep = [
                t.strip() for t in value.split(b",") if t.strip().split(b"/")[0].lower().decode("latin-1") in allowed
            ]
            return b", ".join(keep) or None
    return None


def take(edge, x, uc, rh, ur: Reader, conn, down) -> bool:
    """The backend said 101 to an allowed upgrade (Forwarder.forward, after its retries and passive
    health): tunnel until the end, then False (the client connection is done). Its backend counts the
    tunnel as in flight while it lasts. uc, ur: the backend connection and its reader; conn: the client's
    (lb/proxy/conn.py: its socket, and its reader with any bytes it sent early)."""
    backend = x.backend
    answer = switching_head(x, rh)
    if answer is None:
        backend.pool.release(uc, False)
        return edge.forwarder.failed(down, x, Failure.PROTOCOL, "101 without an Upgrade header", False)
    wrong = unasked(x.upgrade, rh) or wrong_accept(x.req, rh)
    if wrong:
        # Not the handshake this client asked for (a cached or replayed 101, a backend that skipped the
        # check): a client would refuse it; the edge does not open a tunnel on it.
        backend.pool.release(uc, False)
        return edge.forwarder.failed(down, x, Failure.PROTOCOL, wrong, False)
    up = uc.sock
    uc.sock = None  # the socket is the tunnel's now
    backend.pool.release(uc, False)  # the slot goes back; nothing to reuse in it
    reader = conn.reader
    try:
        return _run(edge, x, conn.sock, up, answer, bytes(ur.buf), bytes(reader.buf))
    finally:
        reader.buf.clear()
        up.close()


def unasked(offered: bytes, rh) -> str | None:
    """Why the 101 switches to a protocol the edge did not forward in its Upgrade (RFC 9110 7.8: a server
    MUST NOT switch to one the client did not indicate; the allowlist is what was offered), or None."""
    asked = {t.strip().split(b"/")[0].lower() for t in offered.split(b",")}
    for _, lname, value in rh.headers:
        if lname == b"upgrade":
            if any(t.strip().split(b"/")[0].lower() not in asked for t in value.split(b",")):
                return "101 to a protocol the client did not ask for"
    return None


def wrong_accept(req, rh) -> str | None:
    """Why the backend's 101 does not answer this WebSocket handshake (RFC 6455 4.1: its
    Sec-WebSocket-Accept is base64(SHA-1(the client's Sec-WebSocket-Key + the GUID))), or None when it
    does -- or when the switch is to another protocol, which has no such proof."""
    proto = key = accept = None
    for _, lname, value in rh.headers:
        if lname == b"upgrade":
            proto = value
        elif lname == b"sec-websocket-accept":
            if accept is not None:
                return "101 with two Sec-WebSocket-Accept headers"
            accept = value
    if proto is None or proto.strip().lower() != b"websocket":
        return None
    for _, lname, value in req.headers:
        if lname == b"sec-websocket-key":
            key = value
    if key is None:
        return "101 to a WebSocket handshake without a Sec-WebSocket-Key"
    if accept is None:
        return "101 without Sec-WebSocket-Accept"
    if accept != base64.b64encode(hashlib.sha1(key + _WS_GUID).digest()):
        return "101 with a wrong Sec-WebSocket-Accept"
    return None


def switching_head(x, rh) -> bytearray | None:
    """The 101 for the client: the backend's headers with its Upgrade, Connection: Upgrade, ours."""
    out = bytearray(b"HTTP/1.1" + rh.status_line[8:] + b"\r\n")
    proto = None
    tokens = rh.conn_tokens
    skip = not_relayed(x.rl, x.rid_header)  # as relay() skips them (Upgrade, hop-by-hop, is ours to write)
    for name, lname, value in rh.headers:
        if lname == b"upgrade":
            proto = value
        elif lname in skip or (tokens and lname in tokens) or (x.rl and lname[:12] == b"x-ratelimit-"):
            continue
        else:
            out += name + b": " + value + b"\r\n"
    if not proto:
        return None
    out += b"Upgrade: " + proto + b"\r\nConnection: Upgrade\r\n" + x.rid_header + x.rl + x.set_cookie + b"\r\n"
    return out


def _run(
    edge, x, client: socket.socket, up: socket.socket, answer: bytes | bytearray, to_client: bytes, to_up: bytes
) -> bool:
    """Relay the 101 and whatever either side sent early, then pump; record the tunnel when it ends."""
    cfg = edge.cfg
    backend = x.backend
    try:
        if to_up:  # the client spoke before it saw the 101 (allowed): that goes first
            up.sendall(to_up)
        client.sendall(answer + to_client)
    except OSError:
        pass  # the pump below sees the closed side at once
    edge.metrics.backend_done(backend.url, 101, monotonic() - x.start)  # the handshake, as a request
    edge.metrics.tunnel_opened()
    edge.tunnels[client] = up
    moved, why = [len(to_up), len(to_client)], "?"
    try:
        moved, why = pump(client, up, cfg.tunnel_idle_timeout, moved)
    finally:
        edge.tunnels.pop(client, None)
        x.tunnel = (moved[0], moved[1], why)
        edge.metrics.tunnel_closed(moved[0], moved[1])
        edge.record(x, 101)  # the access log line: the tunnel's duration and bytes
    return False


def pump(a: socket.socket, b: socket.socket, idle: float, moved: list[int] | None = None) -> tuple[list[int], str]:
    """Copy bytes both ways between a (client) and b (backend) until one closes or nothing moved for
    `idle` seconds: ([bytes a->b, bytes b->a], why it ended)."""
    moved = moved if moved is not None else [0, 0]
    a.setblocking(False)
    b.setblocking(False)
    poller = select.poll()
    poller.register(a, select.POLLIN)
    poller.register(b, select.POLLIN)
    side = {a.fileno(): (a, b, 0, "client closed"), b.fileno(): (b, a, 1, "backend closed")}
    last = monotonic()
    while True:
        # TLS: bytes already decrypted inside the SSL object are invisible to poll
        ready = [side[s.fileno()] for s in (a, b) if isinstance(s, ssl.SSLSocket) and s.pending()]
        if not ready:
            left = last + idle - monotonic()
            if left <= 0:
                return moved, "idle timeout"
            ready = [side[fd] for fd, _ in poller.poll(left * 1000)]
        for src, dst, i, closed in ready:
            try:
                data = src.recv(PIECE)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                continue  # woke for a partial TLS record: wait for the rest
            except OSError:
                return moved, closed.replace("closed", "reset")
            if not data:
                return moved, closed
            try:
                _send_all(dst, data, idle)
            except socket.timeout:
                return moved, ("backend" if i == 0 else "client") + " stopped reading"
            except OSError:
                return moved, ("backend" if i == 0 else "client") + " reset"
            moved[i] += len(data)
            last = monotonic()


def _send_all(sock: socket.socket, data: bytes, timeout: float) -> None:
    """sendall on a non-blocking socket (plain or TLS), waiting at most `timeout` for room."""
    view = memoryview(data)
    waiter = None
    while view:
        try:
            view = view[sock.send(view) :]
            continue
        except (BlockingIOError, ssl.SSLWantWriteError):
            event = select.POLLOUT
        except ssl.SSLWantReadError:
            event = select.POLLIN
        if waiter is None:
            waiter = select.poll()
        waiter.register(sock, event)
        if not waiter.poll(timeout * 1000):
            raise socket.timeout("peer not reading")
        waiter.unregister(sock)


def close_all(tunnels: dict) -> int:
    """The drain's deadline: end every open tunnel (both sides see the close; their threads finish)."""
    n = 0
    for client, up in list(tunnels.items()):
        for s in (client, up):
            try:
                socket.socket.shutdown(s, socket.SHUT_RDWR)  # not SSLSocket's: see proxy.wake_idle
            except OSError:
                pass
        n += 1
    return n
