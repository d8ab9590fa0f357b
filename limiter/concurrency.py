"""Concurrent requests per key, at most N (nginx's limit_conn): a slot taken before, given back after.

    table = InFlight(limit=2)                  # this process; RedisInFlight(2, url): every edge
    slot = table.acquire("client-key")          # None: the key already has N in flight
    ...                                         # the request
    table.release(slot)                         # exactly once, on every path (the caller's finally)

Not a rate: nothing here reads a clock except RedisInFlight's safety net.  The memory table holds only
keys with a request in flight (an entry is deleted at zero), so it is bounded by the connections.

Redis: one sorted set per key, a member per request in flight, scored by the instant it stops counting
(now + ttl).  Acquiring is one script (drop the expired members, count, add); releasing removes the
member.  The score is the safety net INCR/DECR lacks: an edge that dies (kill -9, a lost network)
without releasing leaves members that stop counting ttl seconds after they were taken, one by one,
even on a key that never goes idle (an INCR counter's TTL would be renewed by every other request and
the leaked count kept forever).  The price: a request held longer than ttl stops counting; the edge
sets ttl above its longest request (response_timeout + 60 s by default; a tunnel can outlive it).
A failure of Redis is decided by the store's failure policy, as for the rate limits: fail-open (and
local) admit without a slot, fail-closed refuses.

Workers (--workers N, no Redis): SharedTable, an anonymous shared mmap the supervisor creates before it
forks (as limiter.shm's Arena), of rows (key digest, pid, count): a worker counts its own requests in
its own row, and a key's count is the sum of its rows.  A worker killed with requests in flight leaves
its rows behind; they are reclaimed when they would refuse a request: a row whose pid no longer exists
is cleared then (the supervisor starts a replacement under a new pid).  One lock for the table (a thread
lock, then an fcntl record lock: the kernel drops a dead process's), held for a scan of PROBE rows.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import logging
import math
import mmap
import os
import struct
import tempfile
import threading
from time import time

from limiter.redis.scripts import lua

log = logging.getLogger("edge")


def _check_limit(limit):
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"in-flight limit must be a positive integer, got {limit!r}")
    return limit


class InFlight:
    """Requests in flight per key in this process (one lock: a dict update, never held across I/O)."""

    __slots__ = ("limit", "_counts", "_lock")

    def __init__(self, limit: int):
        self.limit = _check_limit(limit)
        self._counts: dict = {}
        self._lock = threading.Lock()

    def acquire(self, key):
        with self._lock:
            n = self._counts.get(key, 0)
            if n >= self.limit:
                return None
            self._counts[key] = n + 1
        return key

    def release(self, slot) -> None:
        with self._lock:
            n = self._counts.get(slot, 0) - 1
            if n > 0:
                self._counts[slot] = n
            else:
                self._counts.pop(slot, None)

    def count(self, key) -> int:
        return self._counts.get(key, 0)

    def __len__(self):
        return len(self._counts)


_ACQUIRE = lua("inflight_acquire.lua")
_RELEASE = lua("inflight_release.lua")


class _Script3:
    """A script called with one key and two arguments (now, member): text, sha, head (as redis_link's)."""

    def __init__(self, text: str):
        import hashlib

        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()
        self.head = b"*6\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n1\r\n" % self.sha.encode()

    def pack(self, key: bytes, now: float, member: bytes) -> bytes:
        n = repr(float(now)).encode()
        return b"%s$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (self.head, len(key), key, len(n), n, len(member), member)


class RedisInFlight:
    """Requests in flight per key across every edge on one Redis (see the module's docstring)."""

    def __init__(
        self,
        limit: int,
        url: str,
        *,
        prefix: str = "edge:inflight:",
        ttl: float = 360.0,
        timeout: float = 0.05,
        on_error: str = "fail-open",
        retry_interval: float = 0.5,
        password_file=None,
        ca_file=None,
        cert_file=None,
        key_file=None,
        clock=time,
        **_ignored,
    ):
        from redis.exceptions import RedisError  # limiter imports redis only when a Redis store is used

        from limiter.redis.connect import link_for
        from limiter.redis.url import parse

        self._error = RedisError
        self.limit = _check_limit(limit)
        if not (isinstance(ttl, (int, float)) and 0 < ttl < math.inf):
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
        self.prefix, self.ttl, self.on_error, self.clock = prefix, float(ttl), on_error, clock
        target = parse(url, password_file=password_file, ca_file=ca_file, cert_file=cert_file, key_file=key_file)
        self.link = link_for(target, timeout, 64, retry_interval)
        consts = {"LIMIT": str(self.limit), "TTL": repr(self.ttl)}
        text = _ACQUIRE
        for k, v in consts.items():
            text = text.replace(k, v)
        self._acquire, self._release = _Script3(text), _Script3(_RELEASE)
        self._ids = itertools.count()
        self._me = b"%d-%s-" % (os.getpid(), os.urandom(4).hex().encode())
        self.degraded = 0

    def _call(self, node, script, key: bytes, member: bytes) -> bytes:
        from limiter.redis.batch import Call

        cmd = script.pack(key, self.clock(), member)
        if node.batcher is not None:
            return node.batcher.call(script, cmd)
        c = Call(script, cmd)
        node._flight((c,))
        if c.error is not None:
            raise c.error
        return c.reply

    def acquire(self, key):
        k = f"{self.prefix}{{{key}}}".encode()
        node = self.link.route(k)
        member = self._me + str(next(self._ids)).encode()
        if node.up or node.may_try():
            try:
                reply = self._call(node, self._acquire, k, member)
            except self._error as e:
                (getattr(e, "node", None) or node).failed(e)
            else:
                if not node.up:
                    node.succeeded()
                return (node, k, member) if reply == 1 or reply == b"1" else None
        self.degraded += 1
        return None if self.on_error == "fail-closed" else (None, k, member)  # admitted, no slot held

    def release(self, slot) -> None:
        node, k, member = slot
        if node is None:
            return
        try:
            self._call(node, self._release, k, member)
        except self._error as e:  # the member's score ends it at ttl; one line, the request is done
            log.warning("in-flight slot not released in Redis (it expires in %gs): %s", self.ttl, e)


# ------------------------------------------------------------------------------ across worker processes

_ROW = struct.Struct("=16sii")  # digest, pid, count
_EMPTY = bytes(16)
PROBE = 32  # rows a key may use, from its home row


class SharedTable:
    """The rows every worker's ShmInFlight counts in: create it in the parent, before fork."""

    def __init__(self, rows: int = 65536):
        self.rows = max(PROBE, rows)
        self.mem = mmap.mmap(-1, self.rows * _ROW.size)  # anonymous MAP_SHARED: the same bytes after fork
        fd, path = tempfile.mkstemp(prefix="edge-inflight-lock-")
        os.unlink(path)
        os.ftruncate(fd, 1)
        self.lock_fd = fd
        self.tlock = threading.Lock()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self):
        self.tlock = threading.Lock()  # a lock held by another thread of the parent stays behind

    def close(self):
        self.mem.close()
        os.close(self.lock_fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmInFlight:
    """Requests in flight per key, summed over the worker processes sharing a SharedTable."""

    def __init__(self, limit: int, table: SharedTable, name: str = ""):
        self.limit = _check_limit(limit)
        self.table = table
        self._id = name.encode() + b"\0"
        self.full = 0

    def _where(self, key):
        digest = hashlib.blake2b(self._id + str(key).encode(), digest_size=16).digest()
        return digest, int.from_bytes(digest[:8], "little") % self.table.rows

    def _rows(self, home):
        rows = self.table.rows
        for i in range(PROBE):
            yield ((home + i) % rows) * _ROW.size

    def acquire(self, key):
        t = self.table
        digest, home = self._where(key)
        me = os.getpid()
        with t.tlock:
            fcntl.lockf(t.lock_fd, fcntl.LOCK_EX, 1, 0)
            try:
                mem = t.mem
                total, mine, free, others = 0, None, None, []
                for off in self._rows(home):
                    tag, pid, n = _ROW.unpack_from(mem, off)
                    if tag == digest:
                        total += n
                        if pid == me:
                            mine = (off, n)
                        else:
                            others.append((off, pid, n))
                    elif tag == _EMPTY and free is None:
                        free = off
                if total >= self.limit:
                    for off, pid, n in others:  # a dead worker's rows: reclaimed when they would refuse
                        if not _alive(pid):
                            _ROW.pack_into(mem, off, _EMPTY, 0, 0)
                            total -= n
                            if free is None:
                                free = off
                    if total >= self.limit:
                        return None
                if mine is not None:
                    _ROW.pack_into(mem, mine[0], digest, me, mine[1] + 1)
                    return mine[0]
                if free is None:  # PROBE rows of other keys in flight: refuse, counted
                    self.full += 1
                    return None
                _ROW.pack_into(mem, free, digest, me, 1)
                return free
            finally:
                fcntl.lockf(t.lock_fd, fcntl.LOCK_UN, 1, 0)

    def release(self, slot) -> None:
        t = self.table
        with t.tlock:
            fcntl.lockf(t.lock_fd, fcntl.LOCK_EX, 1, 0)
            try:
                tag, pid, n = _ROW.unpack_from(t.mem, slot)
                if n > 1:
                    _ROW.pack_into(t.mem, slot, tag, pid, n - 1)
                else:
                    _ROW.pack_into(t.mem, slot, _EMPTY, 0, 0)
            finally:
                fcntl.lockf(t.lock_fd, fcntl.LOCK_UN, 1, 0)

    def count(self, key) -> int:
        digest, home = self._where(key)
        return sum(
            n for off in self._rows(home) for tag, _, n in [_ROW.unpack_from(self.table.mem, off)] if tag == digest
        )
