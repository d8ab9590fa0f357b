"""redis-cluster://H:P,...: route each key to the node that owns its slot; one RedisLink per node.

Routing: the slot is CRC16 of the key's hash tag (the store's keys are `<prefix>{<client key>}`, so all
of one client's keys share a slot); a table of 16384 slots -> node comes from CLUSTER SLOTS, asked of any
node we know (seeds first, until one answers).  Each node is a RedisLink of its own: its own bounded
pool, the same short timeouts, and its OWN circuit breaker -- a node that is down sends only its own keys
to the failure policy, and a redirection is never taken for an outage (a shared breaker tripped by MOVED
once turned the limit off for every key: see docs/redis.md).

Redirections:
  MOVED slot host:port   the slot has a new owner: the table learns it at once, the call is re-sent there,
                         and the whole table is refreshed (at most once per `refresh_every`).
  ASK slot host:port     the slot is being migrated and this key has already left: the call is re-sent to
                         the importing node preceded by ASKING; the table does not change (the slot still
                         belongs to the source until SETSLOT NODE, after which MOVED says so).
At most 3 hops per call.  A failed call also refreshes the table (rate-limited): after a master dies and
its replica is promoted, the next refresh maps the slots to the new master and enforcement resumes.

Several keys in one call (rules with several limits per request, limiter.redis.multi): a script may only
touch keys of one slot, so split_keys() groups a request's keys by slot and each group is one call.  The
keys of one client identity share a slot through the hash tag, so all the limits on one identity are one
atomic call; keys of different identities (an ip and an api-key, or a global key) live on different slots
and possibly nodes: one call each, atomic each.  A TRYAGAIN reply (a group caught half-migrated) is retried
twice after 2 ms before it counts as a failure.  See docs/redis.md, "Cluster".
"""

from __future__ import annotations

import logging
import threading
from time import monotonic, sleep

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import AskError, MovedError, RedisError, TryAgainError
from redis.retry import Retry

from limiter.redis.link import RedisLink

log = logging.getLogger("edge")

SLOTS = 16384
MAX_HOPS = 3
TRYAGAIN_ATTEMPTS, TRYAGAIN_PAUSE = 3, 0.002


class ClusterNode(RedisLink):
    """One cluster node: a RedisLink that hands MOVED/ASK replies back to its cluster."""

    def __init__(self, cluster: "ClusterLink", host: str, port: int):
        super().__init__(cluster.target, cluster.timeout, cluster.pool_size, cluster.retry_interval, host, port)
        self.cluster = cluster

    def evalsha(self, script, key: bytes, now: float, asking: bool = False) -> bytes:
        for attempt in range(TRYAGAIN_ATTEMPTS):
            try:
                return RedisLink.evalsha(self, script, key, now, asking)
            except AskError as e:  # MovedError is an AskError
                return self.cluster.redirected(e, script, key, now)
            except TryAgainError:
                # several keys of one slot, caught half-migrated (some moved, some not): not an outage --
                # the migration of that slot finishes in moments; past the last attempt it is a failure
                if attempt + 1 == TRYAGAIN_ATTEMPTS:
                    raise
                sleep(TRYAGAIN_PAUSE)
        raise AssertionError("unreachable: the last attempt returned or raised")

    def failed(self, error: Exception) -> None:
        super().failed(error)
        self.cluster.refresh(min_age=self.retry_interval)  # a failover may have moved its slots


class ClusterLink:
    """The link the store holds for a cluster: route(key) -> the ClusterNode owning key's slot."""

    def __init__(self, target, timeout: float, pool_size: int, retry_interval: float, refresh_every: float = 0.25):
        self.target = target
        self.name = target.display
        self.timeout = timeout
        self.pool_size = pool_size
        self.retry_interval = retry_interval
        self.refresh_every = refresh_every
        self.nodes: dict[tuple[str, int], ClusterNode] = {}
        self._nodes_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._refreshed_at = -1e9
        self._lost = False
        first = self.node(*target.hosts[0])
        self.slots: list[ClusterNode] = [first] * SLOTS  # until the first refresh: the first seed
        self.refresh()

    # -- routing ----------------------------------------------------------------------------------

    def route(self, key: bytes) -> ClusterNode:
        return self.slots[key_slot(key)]

    slot_of = staticmethod(key_slot)  # for callers grouping several keys into one call per slot

    def split_keys(self, keys: list[bytes]) -> list[list[int]]:
        """limiter.redis.multi's hook: the keys' indexes grouped by slot, one script call per group (a
        script may only touch keys of one slot).  Groups come in the order of their first key."""
        groups: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(key_slot(k), []).append(i)
        return list(groups.values())

    def node(self, host: str, port: int) -> ClusterNode:
        n = self.nodes.get((host, port))
        if n is None:
            with self._nodes_lock:
                n = self.nodes.get((host, port))
                if n is None:
                    n = self.nodes[(host, port)] = ClusterNode(self, host, port)
        return n

    def redirected(self, e: AskError, script, key: bytes, now: float) -> bytes:
        for _ in range(MAX_HOPS):
            target = self.node(e.host, e.port)
            moved = isinstance(e, MovedError)
            if moved:
                slots = self.slots
                if slots[e.slot_id] is not target:
                    slots[e.slot_id] = target
                    self.refresh(min_age=self.refresh_every)
            if not (target.up or target.may_try()):
                err = RedisError(f"{target.name} is down (redirected there by {'MOVED' if moved else 'ASK'})")
                err.node = target  # type: ignore[attr-defined]
                raise err
            try:
                return RedisLink.evalsha(target, script, key, now, asking=not moved)
            except AskError as again:
                e = again
            except RedisError as failure:
                failure.node = target  # type: ignore[attr-defined]  # the store's breaker bookkeeping goes to the node that failed
                raise
        raise RedisError(f"{self.name}: more than {MAX_HOPS} redirections for slot {e.slot_id}")

    # -- topology ---------------------------------------------------------------------------------

    def refresh(self, min_age: float = 0.0) -> bool:
        """Reload the slot table from the first node that answers CLUSTER SLOTS.  Never blocks: a caller
        that finds a refresh under way (or one done less than min_age ago) returns False at once."""
        if monotonic() - self._refreshed_at < min_age or not self._refresh_lock.acquire(blocking=False):
            return False
        try:
            if monotonic() - self._refreshed_at < min_age:
                return False
            # nodes believed up first, then the seeds, then the rest
            known = sorted(self.nodes.values(), key=lambda n: not n.up)
            order = [n.address for n in known if n.up] + list(self.target.hosts) + [n.address for n in known]
            errors = []
            for addr in dict.fromkeys(order):
                try:
                    table = self._slots_from(*addr)
                except RedisError as e:
                    errors.append(f"{addr[0]}:{addr[1]}: {e}")
                    continue
                self.slots = table
                self._refreshed_at = monotonic()
                self._lost = False
                return True
            self._refreshed_at = monotonic()
            if not self._lost:  # one line when the cluster goes out of reach, not one per refresh
                self._lost = True
                log.warning("limiter store %s: no node answered CLUSTER SLOTS (%s)", self.name, "; ".join(errors))
            return False
        finally:
            self._refresh_lock.release()

    def _slots_from(self, host: str, port: int) -> list[ClusterNode]:
        kw = dict(
            self.target.connection_kwargs(host, port),
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
            retry=Retry(NoBackoff(), 0),
            protocol=2,
        )
        conn = (redis.SSLConnection if self.target.tls else redis.Connection)(**kw)
        try:
            conn.send_command("CLUSTER", "SLOTS")
            reply = conn.read_response()
        finally:
            conn.disconnect()
        table = list(self.slots)
        covered = 0
        for start, end, master, *_replicas in reply:
            mhost = master[0].decode() if master[0] else host  # an empty host means "the node you asked"
            n = self.node(mhost, int(master[1]))
            table[start : end + 1] = [n] * (end - start + 1)
            covered += end - start + 1
        if not covered:
            raise RedisError("CLUSTER SLOTS: no slot is served")
        return table

    # -- what the store and the registry expect of a link -----------------------------------------

    @property
    def failures(self) -> int:
        return sum(n.failures for n in list(self.nodes.values()))

    @property
    def up(self) -> bool:
        return all(n.up for n in list(self.nodes.values()))

    def _after_fork(self) -> None:
        self._nodes_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        for n in list(self.nodes.values()):
            n._after_fork()
