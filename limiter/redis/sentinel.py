"""redis-sentinel://H:P,.../MASTER: the link follows whichever server the sentinels name as the master.

The master is asked of the sentinels (SENTINEL get-master-addr-by-name, the first that answers wins and
is asked first next time) when the link is made, and again after a call fails with a connection error or
a READONLY reply -- the two signs that the server we talk to is no longer the master (killed, or demoted
to a replica after a failover).  When the answer is a new address the pool is replaced (connections to the
old server are dropped as they come back) and the failed call is retried once on the new master: a
READONLY script never ran, so nothing is counted twice; a connection that broke mid-call may have run on
the old master, whose last writes a failover can lose anyway.

Besides, one call per `recheck` seconds (1 s) asks the sentinels first: after a manual failover (or a
partition that heals) the old master stays a writable master until a sentinel reconfigures it, ~10 s
later, and everything written there meanwhile is lost -- the recheck moves the edge within a second of
the promotion instead.  Otherwise the call path is RedisLink's.  While the sentinels have not promoted
anybody, calls fail, the circuit breaker opens, and its probe (one call every
retry_interval) asks the sentinels again -- so the edge follows a failover within about one
retry_interval of the sentinels' promotion, without a restart.  The sentinels are asked without the
master's credentials (a sentinel with its own password is not supported).
"""

from __future__ import annotations

import logging
import threading
from time import monotonic

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from limiter.redis.link import RedisLink

log = logging.getLogger("edge")


class SentinelLink(RedisLink):
    recheck = 1.0  # seconds between two unprompted questions to the sentinels

    def __init__(self, target, timeout: float, pool_size: int, retry_interval: float):
        self.sentinels = list(target.hosts)
        self._discover_lock = threading.Lock()
        self._asked_at = -1e9
        self._recheck_at = 0.0
        self._said_none = False
        super().__init__(target, timeout, pool_size, retry_interval, host="", port=0)
        self.name = target.display
        self.master: tuple[str, int] | None = None
        self._discover()

    def _ask(self, host: str, port: int):
        conn = redis.Connection(
            host=host,
            port=port,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
            retry=Retry(NoBackoff(), 0),
            protocol=2,
        )
        try:
            conn.send_command("SENTINEL", "get-master-addr-by-name", self.target.master)
            reply = conn.read_response()
        finally:
            conn.disconnect()
        if not reply:
            raise RedisConnectionError(f"sentinel {host}:{port} knows no master named {self.target.master!r}")
        return reply[0].decode(), int(reply[1])

    def _discover(self) -> bool:
        """Ask the sentinels for the master; True when it moved (the pool was replaced)."""
        errors = []
        for i, (host, port) in enumerate(self.sentinels):
            try:
                addr = self._ask(host, port)
            except RedisError as e:
                errors.append(f"{host}:{port}: {e}")
                continue
            if i:  # ask the one that answered first next time
                self.sentinels.insert(0, self.sentinels.pop(i))
            self._asked_at = monotonic()
            if addr == self.master:
                return False
            old, self.master = self.master, addr
            kwargs = dict(self.connection_kwargs, host=addr[0], port=addr[1])
            self.connection_kwargs = kwargs
            old_pool, self.pool = self.pool, self._new_pool()
            self.outages += 1  # the new master may lack the old one's last writes: drop what was cached
            old_pool.close()  # idle connections to the old master; busy ones are dropped with their pool
            log.warning(
                "limiter store %s: master %s:%d%s",
                self.name,
                *addr,
                f" (was {old[0]}:{old[1]}): failover followed" if old else "",
            )
            return True
        self._asked_at = monotonic()
        if self.master is None and not self._said_none:  # once, not once per probe
            self._said_none = True
            log.warning("limiter store %s: no sentinel named the master (%s)", self.name, "; ".join(errors))
        return False

    def evalsha(self, script, key: bytes, now: float, asking: bool = False) -> bytes:
        pool = self.pool
        if self.master is None:
            with self._discover_lock:
                if self.master is None:
                    self._discover()
            if self.master is None:
                raise RedisConnectionError(f"no sentinel of {self.name} named the master")
            pool = self.pool
        elif monotonic() >= self._recheck_at and self._discover_lock.acquire(blocking=False):
            try:  # one caller per `recheck`; the others do not wait for it
                self._recheck_at = monotonic() + self.recheck
                self._discover()
                pool = self.pool
            finally:
                self._discover_lock.release()
        try:
            return RedisLink.evalsha(self, script, key, now)
        except (RedisConnectionError, RedisTimeoutError, ReadOnlyError):
            with self._discover_lock:
                # another caller may have found the new master while we waited: then just retry
                moved = self.pool is not pool or (monotonic() - self._asked_at > 0.05 and self._discover())
            if not moved:
                raise
            return RedisLink.evalsha(self, script, key, now)

    def _after_fork(self) -> None:
        super()._after_fork()
        self._discover_lock = threading.Lock()
