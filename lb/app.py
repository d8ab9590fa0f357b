"""Assembling the parts from one Config, and changing them while serving: reload and drain.

Reload (SIGHUP) re-reads the configuration with the flags given at start still on top, and applies it
without closing a client connection: backends that stay keep their health state and pool, new ones
start UP, removed ones leave the rotation at once and are drained (their in-flight requests finish,
then their pool closes); limiters whose rate is unchanged are reused, so their counters are kept.
An invalid new configuration is refused in one log line and the running one keeps serving.
The listen and admin addresses and the worker count need a restart (logged when they change).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import replace

from . import sdnotify
from .accesslog import AccessLog
from .admin import start_admin
from .backends import make_backend
from .balancer import Balancer
from .config import BackendSpec, Config, ConfigError, load, redis_files
from .health import HealthChecker
from .identity import Identifier
from .metrics import Metrics
from .netaddr import hostport
from .outlier import Ejector
from .tunnel import close_all as close_tunnels
from .proxy import Edge, EdgeServer
from .retrybudget import RetryBudget

log = logging.getLogger("edge")


class ReusePortServer(EdgeServer):
    """Worker processes each bind the same port; the kernel spreads connections between them."""

    def server_bind(self):
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


class App:
    def __init__(self, cfg: Config, argv: list[str] | None = None, reuse_port: bool = False,
                 worker: int | None = None):
        self.argv = argv
        self.worker = worker
        self._reload_lock = threading.Lock()
        self.demo_servers = []
        if cfg.demo:
            from . import demo
            self.demo_servers = [demo.start_in_thread(name=n) for n in ("demo-a", "demo-b", "demo-c")]
        cfg = self._with_demo(cfg)
        self.cfg = cfg
        self.metrics = Metrics()
        backends = [make_backend(s, cfg) for s in cfg.backends]
        self.balancer = Balancer(backends, cfg.strategy, slow_start=cfg.slow_start)
        self.ejector = Ejector(cfg.eject_after, cfg.eject_for, cfg.max_ejected_percent)
        self.retry_budget = RetryBudget(cfg.retry_budget_percent, cfg.retry_budget_min)
        self.metrics.retry_budget = self.retry_budget
        self.health = HealthChecker(cfg.health_path, cfg.health_interval, cfg.health_probe_timeout,
                                    rise=cfg.healthy_threshold, fall=cfg.unhealthy_threshold)
        self.access_log = AccessLog(cfg.access_log) if cfg.access_log else None
        self.edge = Edge(cfg, self.balancer, self.metrics, limiter=self._limit_stage(cfg, None),
                         identifier=Identifier(cfg.trusted_proxies), access_log=self.access_log,
                         ejector=self.ejector, retry_budget=self.retry_budget)
        self.edge.tls = self._tls_context(cfg)
        self.server = (ReusePortServer if reuse_port else EdgeServer)(cfg.listen, self.edge)
        who = f"worker {worker}: " if worker is not None else ""
        log.info("%slistening on %s%s, %d backends (%s): %s", who, hostport(*self.server.server_address[:2]),
                 f" (https, {cfg.tls_min_version}+)" if cfg.tls_cert else "", len(backends), cfg.strategy,
                 ", ".join(f"{b.url}={b.weight}" for b in backends))
        if self.edge.limiter is not None:
            rules = "".join(f", rule {r.name} {r.limit} by {r.key}{' (dry run)' if r.dry_run else ''}"
                            for r in cfg.rules)
            log.info("%slimiting %s per key (%s, %s store%s), %d overrides, %d known keys%s", who,
                     cfg.limit or "off", cfg.algorithm, cfg.store.split("@")[-1], "" if cfg.store == "memory" else
                     f", timeout {cfg.redis_timeout:g}s, {cfg.on_store_error} on error", len(cfg.key_limits),
                     len(cfg.keys), rules)
        self.admin = None
        if cfg.admin:
            addr = cfg.admin
            if worker is not None and addr[1]:
                addr = (addr[0], addr[1] + worker)   # one admin port per worker: N, N+1, ...
            self.admin = start_admin(addr, self)
            log.info("%sadmin on %s (/metrics, /status, POST /backends/<route>/drain|enable)", who,
                     hostport(*self.admin.server_address[:2]))
        for b in backends:
            self.health.watch(b)

    def _with_demo(self, cfg: Config) -> Config:
        specs = tuple(BackendSpec(url=f"http://127.0.0.1:{s.server_address[1]}", host="127.0.0.1",
                                  port=s.server_address[1]) for s in self.demo_servers)
        return replace(cfg, backends=cfg.backends + specs) if specs else cfg

    @staticmethod
    def _tls_context(cfg: Config):
        """The listener's TLS context, read from disk anew (SIGHUP picks up a replaced pair)."""
        if not cfg.tls_cert:
            return None
        from .tls import server_context
        return server_context(cfg.tls_cert, cfg.tls_key, cfg.tls_ciphers, cfg.tls_min_version)

    def _limit_stage(self, cfg: Config, old):
        if not (cfg.limit or cfg.rules or cfg.keys):
            return None
        from .ratelimit import LimitStage
        opts = {"timeout": cfg.redis_timeout, "on_error": cfg.on_store_error,
                **{k: v for k, v in redis_files(cfg).items() if v is not None}} if cfg.store != "memory" else {}
        opts["max_keys"] = cfg.max_keys
        reuse = None
        if old is not None and (old.algorithm, old.store, old.options) == (
                cfg.algorithm, cfg.store, tuple(sorted(opts.items()))):
            reuse = old.limiters      # same algorithm, store and options: unchanged rates keep their counters
        stage = LimitStage(cfg.limit, cfg.key_limits, cfg.algorithm, cfg.store, reuse=reuse, rules=cfg.rules,
                           keys=cfg.keys, unknown_keys=cfg.unknown_keys, exempt=cfg.exempt,
                           ietf_headers=cfg.ietf_headers, **opts)
        self.metrics.declare_rules(stage.declared)
        return stage

    # -- status -------------------------------------------------------------------------------------

    def status(self) -> dict:
        self.edge.sweep_ejections()     # an ejection whose time is up shows as over, traffic or not
        now = time.monotonic()
        return {
            "listen": hostport(*self.server.server_address[:2]),
            "tls": bool(self.edge.tls),
            "worker": self.worker,
            "strategy": self.cfg.strategy,
            "connections": self.server.active,
            "draining": self.edge.draining,
            "limit": self.cfg.limit, "algorithm": self.cfg.algorithm, "store": self.cfg.store.split("@")[-1],
            "retries": {"max": self.cfg.retries, "in_flight": self.retry_budget.retrying,
                        "budget_now": self.retry_budget.allowed(), "peak": self.retry_budget.peak},
            "rules": self.edge.limiter.status() if self.edge.limiter is not None else [],
            "known_keys": len(self.cfg.keys), "unknown_keys": self.cfg.unknown_keys,
            "backends": [self.backend_status(b, now) for b in self.balancer.backends],
        }

    def backend_status(self, b, now: float) -> dict:
        return {"url": b.url, "route": b.route, "weight": b.weight,
                "effective_weight": round(self.balancer.effective_weight(b, now), 3),
                "state": b.state, "in_rotation": b.in_rotation, "health": "UP" if b.up else "DOWN",
                "drained": b.drained, "ejected": b.ejected,
                "ejected_for": round(max(0.0, b.ejected_until - now), 3) if b.ejected else 0,
                "times_ejected": b.times_ejected, "fail_streak": b.fail_streak, "pass_streak": b.pass_streak,
                "last_probe": b.last_probe, "inflight": b.inflight}

    # -- admin actions ------------------------------------------------------------------------------

    def find_backend(self, name: str):
        """A backend by its route id (as in /status and the sticky cookie) or its HOST:PORT."""
        for b in self.balancer.backends:
            if name in (b.route, f"{b.spec.host}:{b.spec.port}", hostport(b.spec.host, b.spec.port)):
                return b
        return None

    def set_drained(self, b, drained: bool) -> dict:
        """Drain: no new requests (sticky clients are reassigned), in-flight ones finish. Enable: back."""
        if b.drained != drained:
            b.drained = drained
            b.refresh()
            self.metrics.admin_action(b.url, "drain" if drained else "enable")
            log.warning("backend %s %s by the admin API (%d in flight)", b.url,
                        "DRAINED" if drained else "ENABLED", b.inflight)
        return self.backend_status(b, time.monotonic())

    # -- reload -------------------------------------------------------------------------------------

    def reload(self) -> bool:
        with self._reload_lock:
            sdnotify.reloading()
            try:
                new = self._with_demo(load(self.argv))
            except ConfigError as e:
                log.error("reload rejected, the running configuration stays: %s", e)
                sdnotify.notify("READY=1", "STATUS=reload rejected: see the log")
                return False
            old = self.cfg
            for name in ("listen", "admin", "workers"):
                if getattr(new, name) != getattr(old, name):
                    log.warning("reload: %s changed (%s -> %s); that needs a restart, ignored",
                                name, getattr(old, name), getattr(new, name))
                    new = replace(new, **{name: getattr(old, name)})
            try:
                limiter = self._limit_stage(new, self.edge.limiter)
                tls = self._tls_context(new)   # a broken new pair: rejected here, the old one serves on
            except (ValueError, ConfigError) as e:
                log.error("reload rejected, the running configuration stays: %s", e)
                sdnotify.notify("READY=1")
                return False

            current = {b.url: b for b in self.balancer.backends}
            keep, added = [], []
            for spec in new.backends:
                b = current.pop(spec.url, None)
                if b is None:
                    b = make_backend(spec, new, joined_at=time.monotonic())   # slow start, if on
                    added.append(b)
                else:
                    b.weight = spec.weight
                    b.spec = spec
                keep.append(b)
            removed = list(current.values())

            h = self.health
            h.path, h.interval, h.timeout = new.health_path, new.health_interval, new.health_probe_timeout
            h.rise, h.fall = new.healthy_threshold, new.unhealthy_threshold
            self.ejector.configure(new.eject_after, new.eject_for, new.max_ejected_percent)
            self.retry_budget.configure(new.retry_budget_percent, new.retry_budget_min)
            # One assignment each: a request in flight sees the old or the new part, never half of one.
            self.edge.cfg = new
            self.edge.limiter = limiter
            self.edge.tls = tls                # new connections handshake with the new pair
            self.edge.identifier = Identifier(new.trusted_proxies)
            self.balancer.set_backends(keep, new.strategy, new.slow_start)
            self.cfg = new
            for b in added:
                self.health.watch(b)
            for b in removed:
                self.health.unwatch(b)
                self.ejector.forget(b)
                threading.Thread(target=self._drain_backend, args=(b,), daemon=True,
                                 name=f"drain {b.url}").start()
            log.info("reloaded: %d backends (%d added, %d removed), limit %s, %d rules, %d known keys", len(keep),
                     len(added), len(removed), new.limit or "off", len(new.rules), len(new.keys))
            sdnotify.notify("READY=1", f"STATUS=serving {len(keep)} backends")
            return True

    def _drain_backend(self, b, deadline: float = 300.0) -> None:
        """A backend taken out by reload: its in-flight requests finish, then its pool is closed."""
        end = time.monotonic() + deadline
        while b.inflight > 0 and time.monotonic() < end:
            time.sleep(0.05)
        b.pool.close()
        log.info("backend %s removed (drained)", b.url)

    # -- serving and stopping ----------------------------------------------------------------------

    def serve_forever(self) -> None:
        sdnotify.notify("READY=1", f"STATUS=serving {len(self.balancer.backends)} backends")
        self.server.serve_forever(poll_interval=0.25)

    def stop_accepting(self) -> None:
        """From a signal handler's thread: ends serve_forever in the main thread."""
        sdnotify.notify("STOPPING=1")
        self.edge.draining = True
        self.server.shutdown()

    def drain(self) -> None:
        """After serve_forever returned: close the listener, let in-flight requests finish, clean up."""
        self.server.socket.close()
        deadline = time.monotonic() + self.cfg.drain_timeout
        self.edge.wake_idle()
        while self.edge.busy() and time.monotonic() < deadline:
            time.sleep(0.02)
            self.edge.wake_idle()   # a connection that finished its request is idle now
        closed = close_tunnels(self.edge.tunnels)
        if closed:
            log.warning("drain deadline (%gs): closing %d tunnels", self.cfg.drain_timeout, closed)
            end = time.monotonic() + 1.0      # let their threads log them
            while self.edge.tunnels and time.monotonic() < end:
                time.sleep(0.01)
        left = self.edge.busy()
        if left:
            log.warning("drain deadline (%gs) passed with %d requests in flight; closing", self.cfg.drain_timeout,
                        left)
        self.health.stop()
        if self.admin:
            self.admin.shutdown()
        if self.access_log:
            self.access_log.close()
        for s in self.demo_servers:
            s.shutdown()
