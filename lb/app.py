"""Assembling the parts from one Config: backends and pools, balancer, health checks, metrics,
the limiter, the proxy server and the admin listener."""

from __future__ import annotations

import logging
from dataclasses import replace

from .accesslog import AccessLog
from .admin import start_admin
from .identity import Identifier
from .backends import make_backend
from .balancer import Balancer
from .config import BackendSpec, Config
from .health import HealthChecker
from .metrics import Metrics
from .proxy import Edge, EdgeServer

log = logging.getLogger("edge")


class App:
    def __init__(self, cfg: Config):
        self.demo_servers = []
        if cfg.demo:
            from . import demo
            self.demo_servers = [demo.start_in_thread(name=n) for n in ("demo-a", "demo-b", "demo-c")]
            specs = tuple(BackendSpec(url=f"http://127.0.0.1:{s.server_address[1]}", host="127.0.0.1",
                                      port=s.server_address[1]) for s in self.demo_servers)
            cfg = replace(cfg, backends=cfg.backends + specs)
        self.cfg = cfg
        self.metrics = Metrics()
        backends = [make_backend(s, cfg) for s in cfg.backends]
        self.balancer = Balancer(backends, cfg.strategy)
        self.health = HealthChecker(cfg.health_path, cfg.health_interval, cfg.health_probe_timeout,
                                    rise=cfg.healthy_threshold, fall=cfg.unhealthy_threshold)
        limiter = None
        if cfg.limit:
            from .ratelimit import LimitStage
            redis = {"timeout": cfg.redis_timeout, "on_error": cfg.on_store_error} if cfg.store != "memory" else {}
            limiter = LimitStage(cfg.limit, cfg.key_limits, cfg.algorithm, cfg.store, **redis)
        self.access_log = AccessLog(cfg.access_log) if cfg.access_log else None
        self.edge = Edge(cfg, self.balancer, self.metrics, limiter=limiter,
                         identifier=Identifier(cfg.trusted_proxies), access_log=self.access_log)
        self.server = EdgeServer(cfg.listen, self.edge)
        host, port = self.server.server_address[:2]
        log.info("listening on %s:%d, %d backends (%s): %s", host, port, len(backends), cfg.strategy,
                 ", ".join(f"{b.url}={b.weight}" for b in backends))
        if limiter:
            log.info("limiting %s per key (%s, %s store%s), %d overrides", cfg.limit, cfg.algorithm,
                     cfg.store.split("@")[-1], "" if cfg.store == "memory" else
                     f", timeout {cfg.redis_timeout:g}s, {cfg.on_store_error} on error", len(cfg.key_limits))
        self.admin = None
        if cfg.admin:
            self.admin = start_admin(cfg.admin, self)
            log.info("admin on %s:%d (/metrics, /status)", *self.admin.server_address[:2])
        for b in backends:
            self.health.watch(b)

    def status(self) -> dict:
        return {
            "listen": "%s:%d" % self.server.server_address[:2],
            "strategy": self.cfg.strategy,
            "connections": self.server.active,
            "backends": [{"url": b.url, "weight": b.weight, "state": "UP" if b.up else "DOWN",
                          "fail_streak": b.fail_streak, "pass_streak": b.pass_streak,
                          "last_probe": b.last_probe, "inflight": b.inflight}
                         for b in self.balancer.backends],
        }

    def serve_forever(self) -> None:
        self.server.serve_forever(poll_interval=0.25)

    def shutdown(self) -> None:
        self.server.shutdown()
        self.health.stop()
        if self.admin:
            self.admin.shutdown()
        for s in self.demo_servers:
            s.shutdown()
