"""The parts of a running App that a Config decides and a reload builds anew: the access log, the
listener's TLS context, the limiting stage (reusing unchanged limiters, so their counters are kept), and the
named pools with the route table."""

from __future__ import annotations

import logging

from lb.config.load import Config
from lb.errors import StartError
from lb.limiting.store import redis_files
from lb.ops.accesslog import AccessLog
from lb.process import resolving
from lb.upstream import pools as pools_mod

log = logging.getLogger("edge")


def set_routes(app, cfg: Config) -> None:
    """[[pools]] and [[routes]]: named pools built, or updated in place (kept backends keep their state),
    or retired (their backends drain); then the route table, in one assignment (a split's turn carried)."""
    from lb.proxy.routes import Router

    want = {p.name: p for p in resolving.concrete_pools(app, cfg)}  # names: their addresses (asked before)
    for name, spec in want.items():
        if name in app.pools:
            pools_mod.update(app.pools[name], spec, cfg, app.metrics, app._state_changed)
        else:
            app.pools[name] = pools_mod.build(spec, cfg, app.metrics, app._state_changed)
    every = {"default": app.edge.pool, **{n: app.pools[n] for n in want}}
    app.edge.router = Router(cfg.routes, every, app.edge.router) if cfg.routes else None
    app.metrics.declare_routes((r.name, r.pools) for r in cfg.routes)
    for name in [n for n in app.pools if n not in want]:
        gone = app.pools.pop(name)
        for b in gone.backends:
            b.drained = True  # a request that chose it under the old table goes nowhere new
            b.refresh()
            pools_mod.retire(gone, b)
        log.info("pool %s removed (%d backends draining)", name, len(gone.backends))
    if app.pools or cfg.routes:
        log.info(
            "%d routes; pools: %s",
            len(cfg.routes),
            "; ".join(
                f"{p.name} ({p.balancer.strategy}): " + ", ".join(f"{b.url}={b.weight}" for b in p.backends)
                for p in app.pools.values()
            )
            or "default only",
        )


def open_access_log(cfg: Config):
    if not cfg.access_log:
        return None
    try:
        return AccessLog(cfg.access_log, cfg.access_log_format, cfg.log_redact_params)
    except OSError as e:
        raise StartError(f"--access-log {cfg.access_log}: {e.strerror or e}") from None


def tls_context(cfg: Config):
    """The listener's TLS context, read from disk anew (SIGHUP picks up replaced pairs and CRL)."""
    if not cfg.tls_cert:
        return None
    from lb.config.check import certificate_warnings
    from lb.config.load import tls_listener

    ctx = tls_listener(cfg)
    for w in certificate_warnings(cfg):  # served anyway (nginx does too); --check reports it
        log.warning("%s", w)
    return ctx


def limit_stage(app, cfg: Config, old):
    if not (cfg.limit or cfg.rules or cfg.keys or cfg.max_in_flight):
        return None
    from lb.limiting.stage import LimitStage

    opts = (
        {
            "timeout": cfg.redis_timeout,
            "on_error": cfg.on_store_error,
            **{k: v for k, v in redis_files(cfg).items() if v is not None},
        }
        if cfg.store != "memory"
        else {}
    )
    opts["max_keys"] = cfg.max_keys
    # A worker of --workers N with the memory store: the table the supervisor shared before forking
    store = "shm" if cfg.store == "memory" and app.shared.limits is not None else cfg.store
    if store == "shm":
        opts["shm_arena"] = app.shared.limits
    reuse = None
    if old is not None and (old.algorithm, old.store, old.options) == (
        cfg.algorithm,
        store,
        tuple(sorted(opts.items())),
    ):
        reuse = old.limiters  # same algorithm, store and options: unchanged rates keep their counters
    stage = LimitStage(
        cfg.limit,
        cfg.key_limits,
        cfg.algorithm,
        store,
        reuse=reuse,
        rules=cfg.rules,
        keys=cfg.keys,
        unknown_keys=cfg.unknown_keys,
        exempt=cfg.exempt,
        ietf_headers=cfg.ietf_headers,
        ipv6_prefix=cfg.ipv6_prefix,
        max_delay=cfg.max_delay,
        max_delayed=cfg.max_delayed,
        max_in_flight=cfg.max_in_flight,
        status=cfg.limit_status,
        # a request in flight longer than this stops counting in Redis (its safety net)
        inflight_ttl=cfg.response_timeout + cfg.max_delay + 60.0,
        inflight_table=app.shared.inflight if cfg.store == "memory" else None,
        **opts,
    )
    app.metrics.declare_rules(stage.declared)
    return stage
