"""A running App's reload (SIGHUP), step by step: read the new configuration (flags from the start still on
top), build what it needs fresh (access log, limiter, TLS pair, admin token, the backends its names stand
for), then match the backends against the running ones and swap the parts in, one assignment each.
A step that fails rejects the reload in one log line, before anything was swapped: the running one serves on."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from lb.config.load import Config, admin_token, load
from lb.errors import ConfigError, StartError
from lb.limiting.identity import Identifier
from lb.ops.accesslog import AccessLog
from lb.process import parts, readiness, resolving, sdnotify
from lb.process.membership import joined_and_left
from lb.upstream.backends import make_backend

log = logging.getLogger("edge")

# Settings a running process cannot take on; a reload names them in one line.
NEED_RESTART = ("listen", "admin", "workers", "cpu_affinity", "sched_batch", "takeover_socket")
POOL_SETTINGS = ("pool_maxsize", "pool_timeout", "connect_timeout", "read_timeout", "pool_idle_timeout", "no_pool")
REJECTED = "reload rejected, the running configuration stays: %s"


@dataclass
class Fresh:
    """The parts a new configuration gets anew, built before anything running is touched."""

    access_log: AccessLog | None
    limiter: object
    tls: object
    token: bytes | None


@dataclass
class Matched:
    """The new backend list against the running one: kept ones keep their state (and pool, unless its
    settings changed: then old_pools drain), added ones start fresh, removed ones drain."""

    keep: list
    added: list
    removed: list
    old_pools: list
    reweighted: list


def reload(app) -> bool:
    """Called with app's reload lock held. False: rejected (logged), the running configuration stays."""
    new = read_config(app)
    if new is None:
        return False
    fresh = build_fresh(app, new)
    if fresh is None:
        return False
    running = app.resolved  # what the running names run on: a rejected reload leaves it as it was
    if new.resolver != app.cfg.resolver:
        app.resolved = {}  # another resolver: every name asked again
    try:
        specs = resolving.concrete(app, new.backends, new)
        resolving.concrete_pools(app, new)  # before anything is swapped in (set_routes takes the answers)
    except ConfigError as e:
        app.resolved = running  # (re-resolution needs an answer for every running name: lb/process/resolving.py)
        log.error(REJECTED, e)
        sdnotify.notify("READY=1")
        return False
    for url in set(app.resolved) - {s.url for s in resolving.every_spec(new)}:
        del app.resolved[url]
    matched = match_backends(app, specs, new)
    retune(app, new)
    old_log = swap_in(app, new, fresh, matched)
    for p in matched.old_pools:
        p.close()  # idle connections close now; one in use closes when its request gives it back
    joined_and_left(app, matched.added, matched.removed)
    log.info(
        "reloaded: %d backends (%d added, %d removed%s), limit %s, %d rules, %d known keys%s",
        len(matched.keep),
        len(matched.added),
        len(matched.removed),
        f", {len(matched.reweighted)} reweighted: {', '.join(matched.reweighted)}" if matched.reweighted else "",
        new.limit or "off",
        len(new.rules),
        len(new.keys),
        ", new connection pools" if matched.old_pools else "",
    )
    sdnotify.notify("READY=1", f"STATUS=serving {len(matched.keep)} backends")
    resolving.start_resolving(app)
    readiness.memory_policy(new)  # Redis's own configuration may have changed too
    if old_log is not None:
        old_log.close()  # last: it waits for the old file's queued lines (up to its timeout)
    return True


def read_config(app) -> Config | None:
    """The new configuration, with the settings that need a restart kept at their running values (named)."""
    try:
        new = app._with_demo(load(app.argv))
    except ConfigError as e:
        log.error(REJECTED, e)
        sdnotify.notify("READY=1", "STATUS=reload rejected: see the log")
        return None
    old = app.cfg
    kept = [n for n in NEED_RESTART if getattr(new, n) != getattr(old, n)]
    if kept:
        log.warning(
            "reload: %s changed; that needs a restart, the running value%s stay%s: %s",
            ", ".join(kept),
            "s" if len(kept) > 1 else "",
            "" if len(kept) > 1 else "s",
            ", ".join(f"{n} {getattr(old, n)} (file/flags say {getattr(new, n)})" for n in kept),
        )
        new = replace(new, **{n: getattr(old, n) for n in kept})
    return new


def build_fresh(app, new: Config) -> Fresh | None:
    old = app.cfg
    access_log = app.access_log
    if (new.access_log, new.access_log_format) != (old.access_log, old.access_log_format):
        try:
            access_log = parts.open_access_log(new)
        except StartError as e:
            log.error(REJECTED, e)
            sdnotify.notify("READY=1")
            return None
    try:
        limiter = parts.limit_stage(app, new, app.edge.limiter)
        tls = parts.tls_context(new)  # a broken new pair: rejected here, the old one serves on
        token = admin_token(new)  # a rotated token file applies from the reload on
    except (ValueError, ConfigError) as e:
        log.error(REJECTED, e)
        sdnotify.notify("READY=1")
        return None
    return Fresh(access_log, limiter, tls, token)


def match_backends(app, specs, new: Config) -> Matched:
    current = {b.url: b for b in app.balancer.backends}
    m = Matched([], [], [], [], [])
    new_pools = any(getattr(new, n) != getattr(app.cfg, n) for n in POOL_SETTINGS)
    for spec in specs:
        b = current.pop(spec.url, None)
        if b is None:
            b = make_backend(spec, new, joined_at=time.monotonic(), breaker=app.breaker)  # slow start, if on
            m.added.append(b)
        else:
            if b.weight != spec.weight:
                m.reweighted.append(f"{b.url} {b.weight}->{spec.weight}")
            b.weight = spec.weight
            b.spec = spec
            if new_pools:  # a pool's limits are fixed at creation: a new one, the old drains
                m.old_pools.append(b.pool)
                b.pool = make_backend(spec, new, breaker=app.breaker).pool
        m.keep.append(b)
    m.removed = list(current.values())
    return m


def retune(app, new: Config) -> None:
    """The parts that stay, configured anew in place (their state kept)."""
    h = app.health
    h.path, h.interval, h.timeout = new.health_path, new.health_interval, new.health_probe_timeout
    h.protocol = new.health_protocol
    h.rise, h.fall = new.healthy_threshold, new.unhealthy_threshold
    app.ejector.configure(new.eject_after, new.eject_for, new.max_ejected_percent)
    app.retry_budget.configure(new.retry_budget_percent, new.retry_budget_min)
    app.breaker.configure(new.max_requests, new.max_pending)
    app.server.threads.resize(new.thread_cache)


def swap_in(app, new: Config, fresh: Fresh, matched: Matched):
    """The new parts in; returns the access log replaced (to close last), or None."""
    # One assignment each: a request in flight sees the old or the new part, never half of one.
    app.edge.cfg = new
    app.edge.limiter = fresh.limiter
    app.edge.tls = fresh.tls  # new connections handshake with the new pair
    app.edge.identifier = Identifier(new.trusted_proxies)
    app.admin_token = fresh.token
    app.balancer.set_backends(matched.keep, new.strategy, new.slow_start)
    parts.set_routes(app, new)
    old_log = None
    access_log = fresh.access_log
    if access_log is not None:
        access_log.set_redact(new.log_redact_params)
    if access_log is not app.access_log:
        app.edge.access_log, old_log, app.access_log = access_log, app.access_log, access_log
    app.cfg = new
    return old_log
