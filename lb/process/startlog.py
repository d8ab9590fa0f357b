"""The lines a process logs once it is bound: where it listens, its backends, and how it limits."""

from __future__ import annotations

import logging

from lb.config.load import Config
from lb.netaddr import hostport
from limiter.redis import url as redis_url

log = logging.getLogger("edge")


def log_start(cfg: Config, server, limiter, backends) -> None:
    log.info(
        "listening on %s%s, %d backends (%s): %s",
        hostport(*server.server_address[:2]),
        f" (https, {cfg.tls_min_version}+)" if cfg.tls_cert else "",
        len(backends),
        cfg.strategy,
        ", ".join(f"{b.url}={b.weight}" for b in backends),
    )
    if limiter is not None:
        rules = "".join(
            f", rule {r.name} {r.limit or ''}{f' max_in_flight {r.max_in_flight}' if r.max_in_flight else ''}"
            f" by {r.key}{' (dry run)' if r.dry_run else ''}"
            for r in cfg.rules
        )
        log.info(
            "limiting %s per key (%s, %s store%s), %d overrides, %d known keys%s",
            cfg.limit or "off",
            cfg.algorithm,
            redis_url.redact(cfg.store),
            "" if cfg.store == "memory" else f", timeout {cfg.redis_timeout:g}s, {cfg.on_store_error} on error",
            len(cfg.key_limits),
            len(cfg.keys),
            rules,
        )
