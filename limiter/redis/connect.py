"""The process's one link per Redis target: a RedisLink for one server, a SentinelLink or a ClusterLink.

The factory lives above the three link kinds, not in the base module: limiter.redis.link is what
cluster and sentinel build on, so it cannot also import them. Links are shared by every store and
limit on the same target (one pool, one circuit breaker per server) and survive a fork re-armed.
"""

from __future__ import annotations

import os
import threading

from limiter.redis.cluster import ClusterLink
from limiter.redis.link import RedisLink
from limiter.redis.sentinel import SentinelLink
from limiter.redis.url import Target

_LINKS: dict[tuple, RedisLink] = {}  # one link per (target, settings) per process
_LINKS_LOCK = threading.Lock()


def link_for(target: Target, timeout: float = 0.05, pool_size: int = 64, retry_interval: float = 0.5):
    """The process's one link to target (limiter.redis.url.parse(url, ...)): a RedisLink for one server, a
    SentinelLink (limiter.redis.sentinel) or a ClusterLink (limiter.redis.cluster, one RedisLink per node)."""
    key = (target, float(timeout), int(pool_size), float(retry_interval))
    with _LINKS_LOCK:
        link = _LINKS.get(key)
        if link is None:
            cls = {"cluster": ClusterLink, "sentinel": SentinelLink}.get(target.kind, RedisLink)
            link = _LINKS[key] = cls(target, timeout, pool_size, retry_interval)
        return link


def _after_fork_in_child():
    global _LINKS_LOCK
    _LINKS_LOCK = threading.Lock()
    for link in _LINKS.values():
        link._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
