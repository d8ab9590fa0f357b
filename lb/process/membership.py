"""Backends joining and leaving a running App's rotation (a reload, a DNS answer): those that join are
counted and probed, those that leave drain before their pool closes."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("edge")


def joined_and_left(app, added, removed) -> None:
    """Backends that joined the rotation (a reload, a DNS answer) are counted and probed; those that left
    are forgotten by health and ejection and drained (their in-flight requests finish, then the pool closes)."""
    app.metrics.declare_backends(b.url for b in added)
    for b in added:
        app._watch(b)
    for b in removed:
        app.health.unwatch(b)
        app.ejector.forget(b)
        threading.Thread(target=drain_backend, args=(b,), daemon=True, name=f"drain {b.url}").start()


def drain_backend(b, deadline: float = 300.0) -> None:
    """A backend taken out by reload: its in-flight requests finish, then its pool is closed."""
    end = time.monotonic() + deadline
    while b.inflight > 0 and time.monotonic() < end:
        time.sleep(0.05)
    b.pool.close()
    if b.h2 is not None:
        b.h2.close()  # an h2c:// backend's HTTP/2 connections
    log.info("backend %s removed (drained)", b.url)
