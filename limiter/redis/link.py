"""The Redis connection layer: one bounded pool + circuit breaker per Redis server per process.

limiter.redis.store holds the scripts and the decisions; this module only moves bytes: it knows how to
reach a Redis, keep connections, send one EVALSHA and read its reply, and when to stop trying.  Its
interface to the store is small on purpose (so transports can change without touching a script):

    link = link_for(target, timeout, pool_size, retry_interval) # limiter.redis.connect; target: limiter.redis.url.parse(url)
    node = link.route(key_bytes)                                 # the server owning the key (a cluster's node)
    link.slot_of(key_bytes)                                      # keys with equal slot_of may share one call
    link.evalsha(script, key_bytes, now) -> reply bytes          # raises redis.RedisError
    link.up / link.may_try() / link.failed(e) / link.succeeded() / link.retry_at / link.failures
    link.outages                                                 # up -> down transitions so far

The call path is deliberately lean (see docs/redis.md, "Measured"): redis-py's Connection (socket,
connect, AUTH/SELECT, RESP parser, timeouts) but not its Redis client or pools, whose per-command
bookkeeping (pool accounting, observability hooks, retry wrapper, a 3-syscall stale-connection check)
cost more client CPU than the round trip itself on a busy host.  _Pool below keeps the same guarantees.

Faults: short socket timeouts, no client-side retries, a bounded connection pool, and a small circuit
breaker shared by every store on the same Redis: after a failure no request touches Redis until
`retry_interval` has passed, then one request probes it.  One log line per state change.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import socket
import struct
import threading
from collections import deque
from time import monotonic

import redis
from redis._parsers.base import BaseParser
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    InvalidResponse,
    NoScriptError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from limiter.redis.batch import NOT_SENT, Batcher, Call
from limiter.redis.url import Target

log = logging.getLogger("edge")

_parse_error = BaseParser.parse_error  # redis-py's mapping of "-NOSCRIPT ..." etc. to its exception types

# Round trips in the air at once per Redis; 0: no batching.  EDGE_REDIS_FLIGHTS exists for the side-by-side
# benchmark (bench/redis_bench.py --saturation), not as a tuning knob.
FLIGHTS = int(os.environ.get("EDGE_REDIS_FLIGHTS", "2"))


def _kernel_timeout(sock, seconds: float) -> None:
    """The socket stays blocking and its timeout lives in the kernel (SO_RCVTIMEO/SO_SNDTIMEO): each
    send and recv is then one system call. With redis-py's socket_timeout (Python's settimeout) each is
    a poll() and then the call, every one a point where the request thread gives up the GIL and must win
    it back (lb/http/framing.py does the same for HTTP; docs/journal/latency.md has the counts). TLS: left alone."""
    if type(sock) is not socket.socket:
        return
    sock.settimeout(None)
    usec = int(seconds % 1 * 1e6)
    tv = struct.pack("@ll", int(seconds), usec if seconds >= 1 else max(1, usec))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class _Slot:
    """A pooled redis-py Connection (which connects: TLS, AUTH, SELECT) and, once connected, our own
    reader of its replies."""

    __slots__ = ("conn", "sock", "poll", "buf")

    def __init__(self, conn):
        self.conn = conn
        self.sock = None
        self.poll = None
        self.buf = b""

    def fill(self) -> None:
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:  # SO_RCVTIMEO ran out (lb's kernel timeouts: EAGAIN, not socket.timeout)
            raise RedisTimeoutError("Timeout reading from Redis") from None
        except socket.timeout:
            raise RedisTimeoutError("Timeout reading from Redis") from None
        except OSError as e:
            raise RedisConnectionError(f"Error reading from Redis: {e}") from None
        if not data:
            raise RedisConnectionError("Connection closed by server.")
        self.buf += data

    def reply(self, pos: int = 0):
        """(value, end) of the RESP2 reply at buf[pos:]: bytes, int, None, a list, or for an error reply
        the exception redis-py's parser would give (returned, not raised: the connection stays in step)."""
        while True:
            i = self.buf.find(b"\r\n", pos)
            if i >= 0:
                break
            self.fill()
        buf = self.buf
        kind = buf[pos]
        if kind == 36:  # $ bulk string
            n = int(buf[pos + 1 : i])
            if n < 0:
                return None, i + 2
            end = i + 2 + n
            while len(self.buf) < end + 2:
                self.fill()
            return self.buf[i + 2 : end], end + 2
        if kind == 58:  # : integer
            return int(buf[pos + 1 : i]), i + 2
        if kind == 43:  # + simple string
            return buf[pos + 1 : i], i + 2
        if kind == 45:  # - error
            return _parse_error(buf[pos + 1 : i].decode("utf-8", "replace")), i + 2
        if kind == 42:  # * array
            n = int(buf[pos + 1 : i])
            if n < 0:
                return None, i + 2
            out, pos = [], i + 2
            for _ in range(n):
                v, pos = self.reply(pos)
                out.append(v)
            return out, pos
        raise InvalidResponse(f"Protocol error from Redis: {bytes(buf[pos : pos + 20])!r}")

    def next_reply(self):
        buf = self.buf
        if not buf:  # the common case: the last flight left nothing unread
            self.fill()
            buf = self.buf
        if buf[0] == 36:  # a whole bulk string (every decision script's reply) is cut out here, the
            i = buf.find(b"\r\n")  # rest (and a bulk string still arriving) left to reply()
            if i > 0:
                end = i + 2 + int(buf[1:i])
                if end >= i + 2 and len(buf) >= end + 2:
                    self.buf = buf[end + 2 :]
                    return buf[i + 2 : end]
        v, end = self.reply()
        self.buf = self.buf[end:]
        return v


class _Waiter:
    """One caller queued for a connection: a lock it sleeps on, released when a slot is handed to it."""

    __slots__ = ("lock", "slot")

    def __init__(self):
        self.lock = threading.Lock()
        self.lock.acquire()
        self.slot = None


class _Pool:
    """At most `size` connections, first come first served; a caller that waits `timeout` with no
    connection coming back gets redis ConnectionError("No connection available.") -- what
    BlockingConnectionPool does, for ~0.1 µs per checkout instead of a Condition-guarded queue (~3 µs)
    plus redis-py's accounting.

    A waiter gives up (the failure policy decides) only when NO connection came back to the pool for a
    whole `timeout`: every connection is then stuck in a call to Redis, an unhealthy Redis; a long queue
    that keeps moving is a busy edge, not an outage (with 100 threads on 64 connections the GIL alone
    can delay one waiter past 50 ms while the pool hands over thousands of connections a second).

    The fast path is a bare list.pop()/append() (atomic under the GIL), taken only while nobody waits.
    A caller that finds no idle connection takes the lock: it creates one while fewer than `size` exist,
    else it joins a FIFO queue.  A release while someone waits HANDS the connection to the oldest waiter
    (under the lock) instead of putting it back, so a thread that releases and asks again at once
    queues behind the waiters rather than taking its connection straight back: without that, a waiter
    could wake to an empty list again and again until its timeout, and a healthy Redis read as an
    outage (24 threads on 4 connections: 363 failure-policy decisions in one run; now 0).
    (A waiter registers before looking at the idle list again, so a release racing with its
    registration is seen by one of the two.)
    """

    def __init__(self, make, size: int, timeout: float):
        self._make = make
        self._idle: list[_Slot] = []
        self._room = size  # connections that may still be created
        self._waiters: deque[_Waiter] = deque()
        self._lock = threading.Lock()
        self._released = monotonic()  # the last time a connection came back while someone waited
        self.timeout = timeout

    def get(self) -> _Slot:
        if not self._waiters:
            try:
                return self._idle.pop()
            except IndexError:
                pass
        return self._get_slow()

    def _get_slow(self) -> _Slot:
        with self._lock:
            if not self._waiters:
                if self._idle:
                    return self._idle.pop()
                if self._room > 0:
                    self._room -= 1
                    w = None
                else:
                    w = _Waiter()
            else:
                w = _Waiter()
            if w is not None:
                self._waiters.append(w)
                self._hand_over()  # a release may have slipped in before we registered
        if w is None:
            try:
                return _Slot(self._make())  # no I/O: the connection connects on first use
            except BaseException:
                with self._lock:
                    self._room += 1
                raise
        wait = self.timeout
        while not w.lock.acquire(timeout=wait):
            with self._lock:
                if w.slot is not None:  # handed over just as the wait ended
                    break
                wait = self._released + self.timeout - monotonic()
                if wait <= 0.0:  # no connection came back for a whole timeout: Redis, not the queue
                    self._waiters.remove(w)
                    raise RedisConnectionError("No connection available.")
        return w.slot

    def _hand_over(self) -> None:
        """Under the lock: idle connections go to the oldest waiters."""
        if self._idle:
            self._released = monotonic()
        while self._waiters and self._idle:
            w = self._waiters.popleft()
            w.slot = self._idle.pop()
            w.lock.release()

    def put(self, slot: _Slot) -> None:
        self._idle.append(slot)
        if self._waiters:
            self.hand_over()

    def hand_over(self) -> None:
        """After a put while someone waits (RedisLink._flight puts its connection back itself)."""
        with self._lock:
            self._hand_over()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().conn.disconnect()


_ASKING = b"*1\r\n$6\r\nASKING\r\n"

# Error replies that say the server cannot serve this key at all (a demoted master, a cluster without the
# slot, a redirection no hop resolved): the breaker's business, like a refused connection.  Any other
# error reply -- OOM under maxmemory, a script error, WRONGTYPE, NOPERM -- came from a server that is up
# and answering: it fails that one call (its failure policy decides that request) and opens nothing.
# Before, an OOM opened the breaker and sent every key, limited ones too, to the policy.
_SERVER_CANNOT_SERVE = (ReadOnlyError, ClusterDownError, TryAgainError, AskError)


def call_error(e: Exception) -> bool:
    """True when e is the failure of one call on a server that is up (not an outage of the store)."""
    return isinstance(e, ResponseError) and not isinstance(e, _SERVER_CANNOT_SERVE)


class RedisLink:
    """One connection pool + circuit breaker per Redis server (and timeout, pool size) per process.

    Shared by every RedisStore on that server, so an edge with several rates logs one line per state
    change and keeps one pool.  `name` (what the logs show) never holds the password.
    """

    def __init__(
        self,
        target: Target,
        timeout: float,
        pool_size: int,
        retry_interval: float,
        host: str | None = None,
        port: int | None = None,
    ):
        self.target = target
        host, port = (host, port) if host is not None else (target.hosts[0] if target.hosts else (None, None))
        self.name = target.display if target.kind == "single" else f"{target.display} node {host}:{port}"
        self.timeout = timeout
        self.pool_size = pool_size
        self.retry_interval = retry_interval
        self.connection_kwargs = dict(
            target.connection_kwargs(host, port),
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),  # redis-py's default retries would multiply the timeout
            health_check_interval=0,
            protocol=2,  # RESP2: no HELLO handshake, no push messages that could sit unread on a connection
        )
        self.pool = self._new_pool()
        # Batching: at most FLIGHTS round trips at once, later callers share the next one (redis_batch).
        self.batcher = Batcher(self._flight, min(FLIGHTS, pool_size), self._alone) if FLIGHTS else None
        self.up = True
        self.down_since = 0.0
        self.retry_at = 0.0  # while down: the next instant (monotonic) one request may probe Redis
        self.failures = 0  # failed Redis calls (timeouts, refused, errors)
        self.outages = 0  # up -> down transitions: state cached from before one may be gone (a restart)
        self.call_errors = 0  # calls failed by an error reply from a server that is up (OOM, script error)
        self._call_logged = -1e18  # monotonic instant of the last call-error log line
        self._call_logged_count = 0
        self._lock = threading.Lock()

    @property
    def address(self) -> tuple[str, int]:
        kw = self.connection_kwargs
        return (kw["path"], 0) if "path" in kw else (kw["host"], kw["port"])

    def route(self, key: bytes) -> "RedisLink":
        """The server that owns key: this one (a cluster routes by slot)."""
        return self

    @staticmethod
    def slot_of(key: bytes) -> int:
        """Keys with equal slot_of may go in one script call: on one server, all of them (a cluster: the
        key's hash slot).  Group a request's keys by it and make one call per group."""
        return 0

    def _new_pool(self) -> _Pool:
        kwargs = self.connection_kwargs
        cls = (
            redis.UnixDomainSocketConnection
            if self.target.socket
            else redis.SSLConnection
            if self.target.tls
            else redis.Connection
        )
        # (redis's stubs leave UnixDomainSocketConnection's host abstract; it takes a path instead)
        return _Pool(lambda: cls(**kwargs), self.pool_size, self.timeout)  # type: ignore[abstract]

    def _after_fork(self) -> None:
        # The parent's sockets (and possibly a held lock) came along: start with nothing shared.
        self.pool = self._new_pool()
        self._lock = threading.Lock()
        self.batcher = Batcher(self._flight, self.batcher.flights, self._alone) if self.batcher is not None else None

    def evalsha(self, script, key: bytes, now: float, asking: bool = False) -> bytes:
        """Run one of our scripts on key at now; returns its reply (bytes).  Raises RedisError.
        Concurrent calls share round trips (limiter.redis.batch) when batching is on.

        asking: precede it with ASKING (a cluster node importing the key's slot serves it only then);
        such a call (rare: a slot in migration) travels alone."""
        n = b"%.17g" % now  # pack(), inlined: this runs for every decision
        cmd = b"%s$%d\r\n%s\r\n$%d\r\n%s\r\n" % (script.head, len(key), key, len(n), n)
        if self.batcher is not None and not asking:
            return self.batcher.call(script, cmd)
        c = Call(script, _ASKING + cmd if asking else cmd)
        c.asking = asking
        self._flight((c,))
        if c.error is not None:
            raise c.error
        return c.reply

    @staticmethod
    def pack(script, key: bytes, now: float) -> bytes:
        """EVALSHA <sha> 1 <key> <now>, packed by hand (redis-py's generic packer costs ~3x more).  now as
        %.17g: 17 significant digits name the same double as repr's shortest form (the script's tonumber
        reads back exactly the float passed) for half the formatting instructions."""
        n = b"%.17g" % now
        return b"%s$%d\r\n%s\r\n$%d\r\n%s\r\n" % (script.head, len(key), key, len(n), n)

    def _flight(self, calls) -> None:
        """One round trip on one pooled connection for every call: one write, the replies in order.
        Sets each call's reply or error (a MOVED/ASK/READONLY reply too: the caller's link handles it);
        never raises for a Redis error.

        redis-py connects (TLS, AUTH, SELECT); the round trip is ours: one sendall() of the packed
        calls and our own RESP2 reader (_Slot.reply), about half the client CPU of redis-py's
        send_packed_command/read_response (bench/redis_bench.py --saturation).  An error reply is that
        call's alone and the reading goes on, so a connection always ends a flight in step with Redis;
        any other failure closes it (nothing unread can ever be taken for a later call's reply)."""
        pool = self.pool  # the pool the connection goes back to, even if a failover replaced self.pool
        idle = pool._idle
        slot = None
        if not pool._waiters:  # _Pool.get's fast path, inlined: it runs once per flight
            try:
                slot = idle.pop()
            except IndexError:
                pass
        if slot is None:
            try:
                slot = pool.get()
            except RedisError as e:
                for c in calls:
                    c.error = e
                return
        clean = False
        try:
            conn = slot.conn
            sock = conn._sock
            # A connection back from the pool may have been closed by the server while idle (its
            # `timeout`, CLIENT KILL, a middlebox): one poll() shows EOF, and we reconnect before
            # sending anything, so nothing is ever sent twice.  (Skipping it for a connection used a
            # moment ago measured within noise, and a kill in that moment would cost a breaker trip.)
            if sock is None or sock is not slot.sock or slot.poll.poll(0):
                if sock is not None:
                    conn.disconnect()
                conn.connect()
                slot.sock = sock = conn._sock
                slot.buf = b""
                slot.poll = select.poll()
                slot.poll.register(sock, select.POLLIN)
                _kernel_timeout(sock, self.timeout)
            if self._trip(slot, calls) and any(isinstance(c.error, NoScriptError) for c in calls):
                # a restarted or flushed server: load the scripts, run those calls again
                again = [c for c in calls if isinstance(c.error, NoScriptError)]
                for script in {c.script.text: c.script for c in again}.values():
                    self._send(slot, b"".join(conn.pack_command("SCRIPT", "LOAD", script.text)))
                    err = slot.next_reply()
                    if isinstance(err, Exception):
                        raise err
                for c in again:
                    c.error = None
                self._trip(slot, again)
            clean = True
        except RedisError as e:  # the connection failed: every call left fails
            for c in calls:
                if c.reply is None and c.error is None:
                    c.error = e
        finally:
            if not clean:
                conn.disconnect()
                slot.sock = None
            idle.append(slot)  # _Pool.put, inlined
            if pool._waiters:
                pool.hand_over()

    def _alone(self, script, cmd: bytes):
        """_flight for a single call, as the batcher makes when nobody is queued: the same round trip on
        the same pool without a Call, a list or _trip's loop. Returns the reply; raises an error reply
        (the connection stays in step) or a failed connection's error (it is closed), as _flight records
        them. NOT_SENT, having sent nothing, when the pool has no idle connection for us, the connection
        must be (re)connected, or the script must be loaded (NOSCRIPT: it did not run) -- _flight does those."""
        pool = self.pool
        idle = pool._idle
        if pool._waiters:
            return NOT_SENT
        try:
            slot = idle.pop()
        except IndexError:  # (another caller took the last one: not an error, _flight waits for one)
            return NOT_SENT
        sock = slot.sock
        reply = NOT_SENT
        clean = False
        try:
            if sock is not None and sock is slot.conn._sock and not slot.poll.poll(0):
                try:
                    sock.sendall(cmd)
                except (BlockingIOError, socket.timeout):
                    raise RedisTimeoutError("Timeout writing to Redis") from None
                except OSError as e:
                    raise RedisConnectionError(f"Error writing to Redis: {e}") from None
                reply = slot.next_reply()
                if isinstance(reply, NoScriptError):
                    reply = NOT_SENT  # not run: _flight loads the script and sends it again
            clean = True
        finally:
            if not clean:
                slot.conn.disconnect()
                slot.sock = None
            idle.append(slot)  # _Pool.put, inlined
            if pool._waiters:
                pool.hand_over()
        if isinstance(reply, Exception):
            raise reply
        return reply

    @staticmethod
    def _send(slot, data: bytes) -> None:
        try:
            slot.sock.sendall(data)
        except (BlockingIOError, socket.timeout):
            raise RedisTimeoutError("Timeout writing to Redis") from None
        except OSError as e:
            raise RedisConnectionError(f"Error writing to Redis: {e}") from None

    def _trip(self, slot, calls) -> bool:
        """Send the calls, read their replies; True when one of them is an error reply."""
        try:  # (_send, inlined)
            slot.sock.sendall(calls[0].cmd if len(calls) == 1 else b"".join([c.cmd for c in calls]))
        except (BlockingIOError, socket.timeout):
            raise RedisTimeoutError("Timeout writing to Redis") from None
        except OSError as e:
            raise RedisConnectionError(f"Error writing to Redis: {e}") from None
        errors = False
        for c in calls:
            if c.asking:
                slot.next_reply()  # +OK
            r = slot.next_reply()
            if isinstance(r, Exception):
                c.error = r
                errors = True
            else:
                c.reply = r
        return errors

    def may_try(self) -> bool:
        """While down: True for exactly one caller per retry_interval (the probe)."""
        if self.up:
            return True
        with self._lock:
            t = monotonic()
            if self.up or t >= self.retry_at:
                self.retry_at = t + self.retry_interval
                return True
            return False

    def failed(self, error: Exception) -> None:
        with self._lock:
            self.failures += 1
            t = monotonic()
            self.retry_at = t + self.retry_interval
            if self.up:
                self.up = False
                self.outages += 1
                self.down_since = t
                log.warning(
                    "limiter store %s unavailable (%s: %s); failure policy applies, retrying every %gs",
                    self.name,
                    type(error).__name__,
                    error,
                    self.retry_interval,
                )

    def call_failed(self, error: Exception) -> None:
        """One call failed on a server that answers (call_error(error)): counted, the breaker untouched;
        one log line, then at most one a minute saying how many more there were."""
        with self._lock:
            self.call_errors += 1
            t = monotonic()
            if t - self._call_logged < 60.0:
                return
            more = self.call_errors - self._call_logged_count - 1
            self._call_logged, self._call_logged_count = t, self.call_errors
        log.warning(
            "limiter store %s: a call failed (%s: %s); that request's failure policy applies, the store stays up%s",
            self.name,
            type(error).__name__,
            error,
            f" ({more} more such calls in the last minute)" if more > 0 else "",
        )

    def succeeded(self) -> bool:
        """Called after a success while down; True for the one caller that flips the state back."""
        with self._lock:
            if self.up:
                return False
            self.up = True
            log.warning(
                "limiter store %s back after %.1fs; enforcing shared limits again",
                self.name,
                monotonic() - self.down_since,
            )
            return True


class _Script:
    """A script's text, SHA1 and the constant head of its EVALSHA command."""

    __slots__ = ("text", "sha", "head")

    def __init__(self, text: str):
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()
        self.head = b"*5\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n1\r\n" % self.sha.encode()
