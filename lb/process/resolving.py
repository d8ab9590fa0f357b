"""DNS-named backends of a running App (with a resolver set): each name stands for one backend per address,
asked at start and again every resolve_interval (sooner with a short TTL); a changed answer joins and
drains backends like a reload does, a failed one keeps the last good set (lb/upstream/resolve.py asks).
The default pool's backends and every [[pools]] entry's alike: a URL in several pools is asked once and
its answer applied to each of them."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from lb.errors import ConfigError, ResolveError
from lb.process.membership import joined_and_left
from lb.upstream import pools as pools_mod
from lb.upstream.backends import BackendSpec, make_backend
from lb.upstream.resolve import is_address, lookup

log = logging.getLogger("edge")

RESOLVE_TIMEOUT = 2.0  # one DNS question; a resolver silent this long is a failed resolution


def every_spec(cfg) -> list[BackendSpec]:
    """The backends as configured, the default pool's and then each named pool's, one per URL."""
    seen: dict[str, BackendSpec] = {}
    for spec in (*cfg.backends, *(s for p in cfg.pools for s in p.backends)):
        seen.setdefault(spec.url, spec)
    return list(seen.values())


def concrete_pools(app, cfg) -> list:
    """cfg's [[pools]] entries (PoolSpec) with the backends their names stand for (see concrete).
    Raises ConfigError as concrete does, naming the pool."""
    return [replace(p, backends=tuple(concrete(app, p.backends, cfg, f"pools ({p.name}).backends"))) for p in cfg.pools]


def concrete(app, specs, cfg, where: str = "backends") -> list[BackendSpec]:
    """The backends the configured ones stand for: with a resolver set, a DNS name is one backend per
    address (the addresses known, or asked now); an IP literal, or any name without a resolver, is one.
    Raises ConfigError for a name that does not resolve (at start, or new in a reload)."""
    out = []
    for spec in specs:
        if cfg.resolver is None or is_address(spec.host):
            out.append(spec)
            continue
        addrs = app.resolved.get(spec.url)
        if addrs is None:
            try:
                addrs, _ = lookup(spec.host, cfg.resolver, RESOLVE_TIMEOUT)
            except ResolveError as e:
                raise ConfigError(
                    f"{where}: {spec.url}: {spec.host} does not resolve with resolver {cfg.resolver} ({e})"
                ) from None
            app.resolved[spec.url] = addrs
            app.resolutions["ok"] += 1
        out += [at(spec, a) for a in addrs]
    return out


def start_resolving(app) -> None:
    if app.cfg.resolver is not None and app._resolving is None:
        app._resolving = threading.Thread(target=resolve_loop, args=(app,), daemon=True, name="resolve")
        app._resolving.start()


def resolve_loop(app) -> None:
    """Every resolve_interval (sooner when a record's TTL is shorter, never more than once a second)."""
    while True:
        cfg = app.cfg
        wait = cfg.resolve_interval
        if cfg.resolver is not None:
            for spec in every_spec(cfg):
                if not is_address(spec.host):
                    ttl = _resolve_guarded(app, spec, cfg)
                    if ttl is not None:
                        wait = min(wait, max(1.0, ttl))
        time.sleep(wait if cfg.resolver is not None else 1.0)


def _resolve_guarded(app, spec: BackendSpec, cfg) -> float | None:
    """resolve(), and an error it did not expect is a failed resolution: one line while it lasts, the last
    addresses stay, and the thread goes on -- it is the only one that asks, for every name."""
    try:
        return resolve(app, spec, cfg)
    except Exception as e:
        app.resolutions["failed"] += 1
        if spec.url not in app.resolve_failing:
            log.error(
                "backend %s: resolving %s failed (%s: %s); its last addresses stay: %s",
                spec.url,
                spec.host,
                type(e).__name__,
                e,
                ", ".join(app.resolved.get(spec.url, ())) or "none",
            )
        app.resolve_failing[spec.url] = f"{type(e).__name__}: {e}"
        return None


def resolve(app, spec: BackendSpec, cfg) -> float | None:
    """Ask again for one name; a changed set is applied. A failure keeps the last good set, logged once."""
    try:
        addrs, ttl = lookup(spec.host, cfg.resolver, RESOLVE_TIMEOUT)
    except ResolveError as e:
        app.resolutions["failed"] += 1
        if spec.url not in app.resolve_failing:
            log.warning(
                "backend %s: resolving %s failed (%s); its last addresses stay: %s",
                spec.url,
                spec.host,
                e,
                ", ".join(app.resolved.get(spec.url, ())) or "none",
            )
        app.resolve_failing[spec.url] = str(e)
        return None
    app.resolutions["ok"] += 1
    if app.resolve_failing.pop(spec.url, None) is not None:
        log.info("backend %s: %s resolves again", spec.url, spec.host)
    with app._reload_lock:
        if app.cfg is not cfg or addrs == app.resolved.get(spec.url):
            return ttl  # unchanged, or a reload came between (it resolved with what it knew)
        app.resolved[spec.url] = addrs
        n_added, n_removed = 0, 0
        if any(s.url == spec.url for s in cfg.backends):
            n_added, n_removed = _apply_default(app, spec, addrs, cfg)
        for p in cfg.pools:  # each named pool that lists the name, as a reload would update it
            if any(s.url == spec.url for s in p.backends):
                now = replace(p, backends=tuple(concrete(app, p.backends, cfg)))  # every answer known: no question
                added, removed = pools_mod.update(app.pools[p.name], now, cfg, app.metrics, app._state_changed)
                n_added, n_removed = n_added + added, n_removed + removed
        log.info(
            "backend %s: %s resolves to %s (%d added, %d draining)",
            spec.url,
            spec.host,
            ", ".join(addrs),
            n_added,
            n_removed,
        )
    return ttl


def _apply_default(app, spec: BackendSpec, addrs: list[str], cfg) -> tuple[int, int]:
    """The default pool's backends for spec's name made its addresses' (joined, drained); (added, removed)."""
    want = {s.url: s for s in (at(spec, a) for a in addrs)}
    mine = spec.url + " ("
    old = app.balancer.backends
    removed = [b for b in old if b.spec.address and b.url.startswith(mine) and b.url not in want]
    have = {b.url for b in old}
    added = [
        make_backend(s, cfg, joined_at=time.monotonic(), breaker=app.breaker)  # slow start, if on
        for u, s in want.items()
        if u not in have
    ]
    app.balancer.set_backends([b for b in old if b not in removed] + added)
    joined_and_left(app, added, removed)
    return len(added), len(removed)


def at(spec: BackendSpec, address: str) -> BackendSpec:
    """One address of a DNS-named backend: its own backend, shown as `URL (ADDRESS)`."""
    return replace(spec, url=f"{spec.url} ({address})", address=address)
