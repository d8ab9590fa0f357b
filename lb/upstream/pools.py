"""A pool: what is per pool -- its backends, their balancer, active health checks, passive ejection, slow
start (in the balancer), connection pools (one per backend) and circuit breaker.

The pool `default` is --backends / [[backends]], built and reloaded by lb/process/app.py as before; the
named ones ([[pools]], lb/config/routes.py) are built here, each from the top-level configuration with
its own overrides. A URL listed in two pools is two backends: each has its own connection pool, health
state (probed by each pool, with that pool's settings), ejection, drain and in-flight count. What they
share is what names them: the `backend` label of the metrics (counted together) and the sticky-route id.
The retry budget and the retry policy are the edge's, across pools.
"""

from __future__ import annotations

import logging
import threading
import time
from time import monotonic

from lb.upstream.backends import make_backend
from lb.upstream.balancer import Balancer
from lb.upstream.breaker import Breaker
from lb.upstream.health import HealthChecker
from lb.upstream.outlier import Ejector

log = logging.getLogger("edge")

POOL_SETTINGS = (
    "pool_maxsize",
    "pool_timeout",
    "connect_timeout",
    "read_timeout",
    "pool_idle_timeout",
    "no_pool",
    "ca_file",
)


def pool_config(cfg, spec):
    """The configuration a pool's parts are built from: the top level's, with the pool's own overrides
    (a PoolSpec of lb/config/routes.py)."""
    from dataclasses import replace

    return replace(cfg, strategy=spec.strategy or cfg.strategy, **dict(spec.overrides))


class Pool:
    def __init__(self, name: str, balancer: Balancer, ejector: Ejector, breaker: Breaker, health=None, cfg=None):
        self.name = name
        self.balancer = balancer
        self.ejector = ejector
        self.breaker = breaker
        self.health = health  # HealthChecker; the default pool's is the App's
        self.cfg = cfg  # the configuration its parts were built from (named pools)
        for b in balancer.backends:
            b.cluster = self

    @property
    def backends(self):
        return self.balancer.backends

    def has_one(self) -> bool:
        """Anyone in rotation (a split passes over a pool without)."""
        return any(b.in_rotation for b in self.balancer.backends)

    def sweep_ejections(self, metrics) -> None:
        """Ejected backends whose time is up return to the rotation: one log line and a count each."""
        for b in self.ejector.sweep(self.balancer.backends, monotonic()):
            log.warning(
                "backend %s%s returns from ejection (ejected %d times)%s",
                b.url,
                self._of(),
                b.times_ejected,
                "" if b.in_rotation else f"; still out: {b.state}",
            )
            metrics.ejection(b.url, returned=True)

    def _of(self) -> str:
        return "" if self.name == "default" else f" (pool {self.name})"


def build(spec, cfg, metrics, on_state) -> Pool:
    """A named pool from its PoolSpec and the top-level Config, its health checks running."""
    pc = pool_config(cfg, spec)
    breaker = Breaker(pc.max_requests, pc.max_pending)
    ejector = Ejector(pc.eject_after, pc.eject_for, pc.max_ejected_percent)
    health = HealthChecker(
        pc.health_path,
        pc.health_interval,
        pc.health_probe_timeout,
        rise=pc.healthy_threshold,
        fall=pc.unhealthy_threshold,
        ejector=ejector,
        metrics=metrics,
    )
    backends = [make_backend(s, pc, breaker=breaker) for s in spec.backends]
    pool = Pool(spec.name, Balancer(backends, pc.strategy, slow_start=pc.slow_start), ejector, breaker, health, pc)
    metrics.declare_backends(b.url for b in backends)
    for b in backends:
        b.on_state = on_state
        health.watch(b)
    return pool


def update(pool: Pool, spec, cfg, metrics, on_state) -> tuple[int, int]:
    """Reload: the pool takes its new spec and settings in place. Kept backends keep their health state,
    ejection and (unless its settings changed) connection pool; new ones start UP (ramping with slow
    start); removed ones leave the rotation at once and drain. (added, removed)."""
    pc = pool_config(cfg, spec)
    old_pc = pool.cfg
    new_conns = any(getattr(pc, n) != getattr(old_pc, n) for n in POOL_SETTINGS)
    h = pool.health
    h.path, h.interval, h.timeout = pc.health_path, pc.health_interval, pc.health_probe_timeout
    h.rise, h.fall = pc.healthy_threshold, pc.unhealthy_threshold
    pool.ejector.configure(pc.eject_after, pc.eject_for, pc.max_ejected_percent)
    pool.breaker.configure(pc.max_requests, pc.max_pending)
    current = {b.url: b for b in pool.balancer.backends}
    keep, added, old_conns = [], [], []
    for s in spec.backends:
        b = current.pop(s.url, None)
        if b is None:
            b = make_backend(s, pc, joined_at=time.monotonic(), breaker=pool.breaker)
            b.cluster = pool
            added.append(b)
        else:
            b.weight, b.spec = s.weight, s
            if new_conns:
                old_conns.append(b.pool)
                b.pool = make_backend(s, pc, breaker=pool.breaker).pool
        keep.append(b)
    removed = list(current.values())
    pool.balancer.set_backends(keep, pc.strategy, pc.slow_start)
    pool.cfg = pc
    for c in old_conns:
        c.close()
    metrics.declare_backends(b.url for b in added)
    for b in added:
        b.on_state = on_state
        h.watch(b)
    for b in removed:
        retire(pool, b)
    return len(added), len(removed)


def retire(pool: Pool, b) -> None:
    """A backend (or a whole pool's) leaving: no more probes or ejection; in-flight requests finish, then
    its connections close."""
    if pool.health is not None:
        pool.health.unwatch(b)
    pool.ejector.forget(b)
    threading.Thread(target=drain, args=(b,), daemon=True, name=f"drain {b.url}").start()


def drain(b, deadline: float = 300.0) -> None:
    """A backend taken out of its pool (a reload, a DNS answer): its in-flight requests finish, then its
    connections close -- HTTP/1.1 and an h2c:// backend's HTTP/2 ones (any pool's: lb/process/membership.py)."""
    end = time.monotonic() + deadline
    while b.inflight > 0 and time.monotonic() < end:
        time.sleep(0.05)
    b.pool.close()
    if b.h2 is not None:
        b.h2.close()
    log.info("backend %s removed (drained)", b.url)
