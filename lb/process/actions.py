"""The admin API's actions on a running App's backends: find one by its name, drain or enable it here, and
in every worker of --workers N (lb/ops/fanout.py carries the action to the others)."""

from __future__ import annotations

import logging
import time

from lb.netaddr import hostport
from lb.ops import fanout
from lb.process.status import backend_status

log = logging.getLogger("edge")


def find_backend(app, name: str):
    """A backend by its route id (as in /status and the sticky cookie) or its HOST:PORT; POOL:ID or
    POOL:HOST:PORT names one of a named pool's (a URL in two pools is two backends), else the default
    pool's is found first."""
    pool, sep, rest = name.partition(":")
    if sep and pool in app.pools:
        groups = [app.pools[pool].backends]
        name = rest
    else:
        groups = [app.balancer.backends, *(p.backends for p in app.pools.values())]
    for bs in groups:
        for b in bs:
            if name in (b.route, f"{b.spec.host}:{b.spec.port}", hostport(b.spec.host, b.spec.port)):
                return b
    return None


def set_drained(app, b, drained: bool) -> dict:
    """Drain: no new requests (sticky clients are reassigned), in-flight ones finish. Enable: back."""
    if b.drained != drained:
        b.drained = drained
        b.refresh()
        app.metrics.admin_action(b.url, "drain" if drained else "enable")
        log.warning(
            "backend %s %s by the admin API (%d in flight)", b.url, "DRAINED" if drained else "ENABLED", b.inflight
        )
    return backend_status(app, b, time.monotonic())


def drain_everywhere(app, b, drained: bool) -> tuple[dict, dict[int, str]]:
    """set_drained here, then in every other worker of --workers N; ({worker: why} of those that did not)."""
    st = set_drained(app, b, drained)
    failed = {}
    if app.rundir is not None:
        name = f"{b.cluster.name}:{b.route}" if b.cluster is not None and b.cluster.name in app.pools else b.route
        fanout.remember(app.rundir, name, drained)
        action = "drain" if drained else "enable"
        failed = fanout.send(app.rundir, [i for i in range(app.cfg.workers) if i != app.worker], action, name)
        if failed:
            log.error(
                "backend %s: %s applied here but not by worker(s) %s",
                b.url,
                action,
                "; ".join(f"{i}: {why}" for i, why in sorted(failed.items())),
            )
    return st, failed


def apply_forwarded(app, action: str, route: str) -> str | None:
    b = find_backend(app, route)
    if b is None:
        return "no such backend"  # a reload in this worker that the others have not had yet
    set_drained(app, b, action == "drain")
    return None
