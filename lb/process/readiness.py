"""When a process reports ready: at start-up the limiter store is checked once (fail-closed: not ready
until it answers), and each Redis server's maxmemory-policy is reported (at start and on reload)."""

from __future__ import annotations

import logging
import time

from lb.limiting import store

log = logging.getLogger("edge")


def wait_until_ready(app) -> None:
    """The start-up store check: one line; with fail-closed, not ready until the store answers."""
    ok, line = store.check(app.cfg)
    if line:
        policy = app.cfg.on_store_error
        if ok:
            log.info("%s", line)
        elif policy == "fail-closed":
            log.error("%s; fail-closed: not reporting ready until it answers (requests get 503 meanwhile)", line)
            last = time.monotonic()
            while not app.stopping:
                time.sleep(1.0)
                ok, line = store.check(app.cfg)
                if ok:
                    log.info("%s; ready now", line)
                    break
                if time.monotonic() - last > 30:
                    log.error("%s; still not ready", line)
                    last = time.monotonic()
        else:
            how = {
                "fail-open": "requests are allowed while it is down",
                "local": "each process limits on its own while it is down",
            }[policy]
            log.warning("%s; %s: starting anyway, %s", line, policy, how)
    if ok and not app.stopping:
        memory_policy(app.cfg)
    app.ready = not app.stopping


def memory_policy(cfg) -> None:
    """One line per Redis server about its maxmemory-policy (a warning when it can evict limiter keys)."""
    for level, line in store.memory_policy(cfg):
        log.log(level, "%s", line)
