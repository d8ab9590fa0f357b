"""Backends joining and leaving a running App's rotation (a reload, a DNS answer): those that join are
counted and probed, those that leave drain before their pool closes."""

from __future__ import annotations

import threading

from lb.upstream.pools import drain


def joined_and_left(app, added, removed) -> None:
    """Backends that joined the rotation (a reload, a DNS answer) are counted and probed; those that left
    are forgotten by health and ejection and drained (their in-flight requests finish, then the pool closes)."""
    app.metrics.declare_backends(b.url for b in added)
    for b in added:
        app._watch(b)
    for b in removed:
        app.health.unwatch(b)
        app.ejector.forget(b)
        threading.Thread(target=drain, args=(b,), daemon=True, name=f"drain {b.url}").start()
