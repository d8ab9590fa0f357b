"""What the admin port shows of a running App: /status (and the dashboard's view of it), /metrics (this
process's samples, summed with the other workers' with --workers) and /limits/KEY. Read-only views of
the app's parts, kept apart from the wiring that builds and changes them (lb/process/app.py)."""

from __future__ import annotations

import os
import sys
import time

from lb import __version__
from lb.netaddr import hostport
from lb.ops import metrics as metrics_mod
from lb.proxy import hedge
from limiter.memory import MemoryStore
from limiter.redis import url as redis_url


def status(app) -> dict:
    app.edge.sweep_ejections()  # an ejection whose time is up shows as over, traffic or not
    for p in app.pools.values():
        p.sweep_ejections(app.metrics)
    now = time.monotonic()
    return {
        "listen": hostport(*app.server.server_address[:2]),
        "tls": bool(app.edge.tls),
        "worker": app.worker,
        "pid": os.getpid(),
        "strategy": app.cfg.strategy,
        "connections": app.server.active,
        "ready": app.not_ready() is None,
        "draining": app.stopping,
        "limit": app.cfg.limit,
        "algorithm": app.cfg.algorithm,
        "store": redis_url.redact(app.cfg.store),
        "shaping": {
            "max_delay": app.cfg.max_delay,
            "held": app.edge.holds.n,
            "max_delayed": app.cfg.max_delayed,
            "max_in_flight": app.cfg.max_in_flight,
            "status": app.cfg.limit_status,
        },
        "retries": {
            "max": app.cfg.retries,
            "in_flight": app.retry_budget.retrying,
            "budget_now": app.retry_budget.allowed(),
            "peak": app.retry_budget.peak,
            "on": list(app.cfg.retry_on),
            "per_try_timeout": app.cfg.per_try_timeout,
            "by_condition": app.metrics.by_label("lb_retries_by_condition_total", "condition"),
        },
        "breaker": app.breaker.status(),
        "hedge": hedge.status(app.cfg, app.metrics),
        "resolver": app.cfg.resolver,
        "resolve_interval": app.cfg.resolve_interval,
        "resolved": {
            u: {"addresses": a, **({"failing": app.resolve_failing[u]} if u in app.resolve_failing else {})}
            for u, a in app.resolved.items()
        },
        "rules": app.edge.limiter.status() if app.edge.limiter is not None else [],
        "known_keys": len(app.cfg.keys),
        "unknown_keys": app.cfg.unknown_keys,
        "backends": [backend_status(app, b, now) for b in app.balancer.backends],
        "pools": {
            p.name: {
                "strategy": p.balancer.strategy,
                "breaker": p.breaker.status(),
                "backends": [backend_status(app, b, now, p.balancer) for b in p.backends],
            }
            for p in app.pools.values()
        },
        "routes": app.edge.router.status() if app.edge.router is not None else [],
        **operator_status(app),
    }


def operator_status(app) -> dict:
    """What the dashboard shows beside the backends: build, uptime, the store, the key table and the
    most rejected clients -- the last two over every worker with --workers, as /metrics sums them."""
    stage = app.edge.limiter
    others = other_snapshots(app)
    out = {
        "version": __version__,
        "python": sys.version.split()[0],
        "uptime": round(time.time() - app.metrics.started, 1),
        "workers": app.cfg.workers if app.rundir is not None else 1,
        "admin_writes": bool(getattr(app, "admin_token", None)),  # the admin token (issue 24) wires this
        "store_up": None,
        "key_table": None,
        "top_limited": metrics_mod.top_keys([{"top": app.metrics.top_now()}, *others]),
    }
    if stage is not None:
        for lim in (getattr(stage, "limiters", None) or {}).values():
            link = getattr(lim, "link", None)
            if link is not None:
                out["store_up"] = bool(link.up) and out["store_up"] is not False
        out["key_table"] = stage.table()
    return out


def other_snapshots(app) -> list:
    if app.rundir is None:
        return []
    return metrics_mod.gather(
        os.path.join(app.rundir, f"worker-{i}.sock") for i in range(app.cfg.workers) if i != app.worker
    )


def backend_status(app, b, now: float, balancer=None) -> dict:
    balancer = balancer or app.balancer
    return {
        "url": b.url,
        "route": b.route,
        "weight": b.weight,
        "effective_weight": round(balancer.effective_weight(b, now), 3),
        "state": b.state,
        "in_rotation": b.in_rotation,
        "health": "UP" if b.up else "DOWN",
        "drained": b.drained,
        "ejected": b.ejected,
        "ejected_for": round(max(0.0, b.ejected_until - now), 3) if b.ejected else 0,
        "times_ejected": b.times_ejected,
        "fail_streak": b.fail_streak,
        "pass_streak": b.pass_streak,
        "last_probe": b.last_probe,
        "inflight": b.inflight,
        "resting_for": round(max(0.0, balancer.resting.get(b, 0.0) - balancer.clock()), 3),
        **({"pool": b.cluster.name} if b.cluster is not None and b.cluster.name != "default" else {}),
        **({"name": b.spec.url, "address": b.spec.address} if b.spec.address else {}),
    }


def live(app) -> dict:
    """Gauges read at scrape time, and the counters other parts keep, as metric samples."""
    out: dict[tuple[str, tuple], float] = {
        ("lb_client_connections", ()): app.server.active,
        ("lb_idle_client_connections", ()): len(app.edge.idle),
        ("lb_refused_connections_total", ()): app.edge.refused_connections,
        ("lb_idle_connections_closed_total", ()): app.edge.idle_closed,
        ("lb_buffer_memory_bytes", ()): app.edge.buffers.used,
        ("lb_buffer_temp_files", ()): app.edge.buffers.files,
    }
    if app.cfg.resolver is not None:
        for result, n in app.resolutions.items():
            out[("lb_dns_resolutions_total", (("result", result),))] = n
        for u, a in app.resolved.items():
            out[("lb_dns_addresses", (("backend", u),))] = len(a)
    for b in app.balancer.backends:
        lab = (("backend", b.url),)
        out[("lb_backend_up", lab)] = 1 if b.up else 0
        out[("lb_backend_in_rotation", lab)] = 1 if b.in_rotation else 0
        out[("lb_backend_ejected", lab)] = 1 if b.ejected else 0
        out[("lb_backend_drained", lab)] = 1 if b.drained else 0
        out[("lb_backend_inflight", lab)] = b.inflight
        out.setdefault(("lb_requests_total", lab), 0)
    for p in app.pools.values():  # a URL in two pools: one backend label (lb/upstream/pools.py)
        for b in p.backends:
            lab = (("backend", b.url),)
            out[("lb_backend_up", lab)] = max(out.get(("lb_backend_up", lab), 0), 1 if b.up else 0)
            out[("lb_backend_in_rotation", lab)] = max(
                out.get(("lb_backend_in_rotation", lab), 0), 1 if b.in_rotation else 0
            )
            out.setdefault(("lb_backend_ejected", lab), 1 if b.ejected else 0)
            out.setdefault(("lb_backend_drained", lab), 1 if b.drained else 0)
            out[("lb_backend_inflight", lab)] = out.get(("lb_backend_inflight", lab), 0) + b.inflight
            out.setdefault(("lb_requests_total", lab), 0)
    stage = app.edge.limiter
    key_tables(stage, out)
    for lim in (getattr(stage, "limiters", None) or {}).values():
        link = getattr(lim, "link", None)
        if link is not None:
            out[("lb_limiter_store_up", (("store", redis_url.redact(app.cfg.store)),))] = 1 if link.up else 0
    return out


def key_tables(stage, out: dict) -> None:
    """lb_limiter_keys / lb_limiter_table_full_total by rule: the built-in rule's limiters (default,
    overrides, tiers; one limiter may serve several) and each [[rules]] table's."""
    from lb.limiting.rules import BUILTIN

    if stage is None:
        return
    groups = {
        BUILTIN: [
            getattr(stage, "default", None),
            *getattr(stage, "overrides", {}).values(),
            *getattr(stage, "tiers", {}).values(),
        ]
    }
    for r in getattr(stage, "rules", ()):
        groups.setdefault(r.name, []).append(r.limiter)
    for rule, lims in groups.items():
        lims = list({id(x): x for x in lims if x is not None and hasattr(x, "full")}.values())
        if not lims:
            continue
        lab = (("rule", rule),)
        out[("lb_limiter_table_full_total", lab)] = sum(x.full for x in lims)
        tables = [x for x in lims if isinstance(x, MemoryStore)]
        if tables:
            out[("lb_limiter_keys", lab)] = sum(len(x) for x in tables)


def render_metrics(app) -> str:
    others = other_snapshots(app)  # any worker's /metrics is the sum of all of them
    samples = live(app)
    # counters kept elsewhere are added to this process's own, not double counted
    for k in [k for k in samples if k[0] == "lb_requests_total"]:
        if k in app.metrics.counters:
            del samples[k]
    return app.metrics.render(samples, others, app.worker)


def peek_limits(app, who: str, api_key: bytes | None = None) -> tuple[int, dict]:
    """GET /limits/KEY: the client's state in each limit now, unchanged (LimitStage.peek)."""
    stage = app.edge.limiter
    if stage is None:
        return 404, {"error": "rate limiting is off"}
    return stage.peek(who, api_key)
