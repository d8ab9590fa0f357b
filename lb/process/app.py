"""Assembling the parts from one Config, and changing them while serving: reload and drain.

Reload (SIGHUP) re-reads the configuration with the flags given at start still on top, and applies it
without closing a client connection: backends that stay keep their health state and pool, new ones
start UP, removed ones leave the rotation at once and are drained (their in-flight requests finish,
then their pool closes); limiters whose rate is unchanged are reused, so their counters are kept.
An invalid new configuration is refused in one log line and the running one keeps serving.
Every other setting applies: kept backends whose pool settings changed get a new pool (the old one
drains like a removed backend's), a new access-log path or format opens a new log. The listen and admin
addresses, the worker count and the CPU affinity need a restart: one line names those that changed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import replace

from limiter.redis import url as redis_url

from lb import logs
from lb.ops import fanout
from lb.ops import metrics as metrics_mod
from lb.process import actions, resolving, sdnotify, status
from lb.limiting import store
from lb.limiting.store import redis_files
from lb.ops.accesslog import AccessLog
from lb.ops.admin import start_admin
from lb.upstream.backends import BackendSpec, make_backend
from lb.upstream.balancer import Balancer
from lb.config.load import Config, admin_token, load
from lb.errors import ConfigError, StartError
from lb.upstream.health import HealthChecker
from lb.limiting.identity import Identifier
from lb.limiting.keys import draw_label_secret
from lb.limiting.stage import SharedTables
from lb.ops.metrics import Metrics
from lb.netaddr import held, hostport
from lb.upstream.outlier import Ejector
from lb.proxy.tunnel import close_all as close_tunnels
from lb.proxy.edge import Edge, EdgeServer
from lb.upstream.breaker import Breaker
from lb.upstream import pools as pools_mod
from lb.upstream.retrybudget import RetryBudget

log = logging.getLogger("edge")

# Settings a running process cannot take on; a reload names them in one line.
NEED_RESTART = ("listen", "admin", "workers", "cpu_affinity")
POOL_SETTINGS = ("pool_maxsize", "pool_timeout", "connect_timeout", "read_timeout", "pool_idle_timeout", "no_pool")


class Server(EdgeServer):
    """The listener (IPv4 or IPv6 by the address: EdgeServer), and a heartbeat of the accept loop
    (service_actions runs every pass, at least every poll interval) for the watchdog. SO_REUSEPORT always:
    workers share the port, and an edge started with --takeover can bind beside this one (the kernel allows
    that only to a process of the same effective uid). Another edge started without --takeover is refused
    before it binds (netaddr.held)."""

    loop_seen = 0.0

    def server_bind(self):
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

    def service_actions(self):
        self.loop_seen = time.monotonic()


TAKE_OVER = ("Address already in use: another edge (or another program) is serving there; to replace a "
             "running edge without dropping a request, start the new one with --takeover, then TERM the old "
             "one (README: Zero-downtime upgrade)")
SHARED_ONLY = (" (--takeover joins only sockets that share the port: an edge run by the same user, and not "
               "the listener or admin port of an edge older than --takeover, unless it ran --workers without --admin)")


def refuse_if_held(flag: str, addr, cfg: Config) -> None:
    """One instance per port unless --takeover asks to join: SO_REUSEPORT alone would let a second edge
    bind beside the first and split the traffic (each with its own limits)."""
    if not cfg.takeover and held(*addr[:2]):
        raise StartError(f"{flag} {hostport(*addr[:2])}: {TAKE_OVER}")


def make_server(addr, edge, takeover: bool = False) -> Server:
    try:
        return Server(addr, edge)
    except OSError as e:
        raise StartError(f"--listen {hostport(*addr)}: {e.strerror or e}{SHARED_ONLY if takeover else ''}") from None


class App:
    def __init__(self, cfg: Config, argv: list[str] | None = None, worker: int | None = None,
                 rundir: str | None = None, shared: SharedTables | None = None):
        """Raises StartError naming what could not be opened or bound. shared: see serve()."""
        self.argv = argv
        self.shared = shared or SharedTables()
        draw_label_secret()              # before any serving thread (a worker: inherited, drawn before fork)
        self.worker = worker
        self.rundir = rundir
        self.ready = False               # serving, and the store answered when fail-closed asks for it
        self.stopping = False            # a drain started: /readyz fails from here on
        self._reload_lock = threading.Lock()
        self.demo_servers = []
        if cfg.demo:
            from demo import backends as demo
            self.demo_servers = [demo.start_in_thread(name=n) for n in ("demo-a", "demo-b", "demo-c")]
        cfg = self._with_demo(cfg)
        self.cfg = cfg
        self.metrics = Metrics()
        self.breaker = Breaker(cfg.max_requests, cfg.max_pending)   # the pool's circuit breaker
        self.metrics.breaker = self.breaker
        self.resolved: dict[str, list[str]] = {}   # a DNS-named backend's URL -> its addresses (lb/upstream/resolve.py)
        self.resolve_failing: dict[str, str] = {}  # ... -> why its last resolution failed (logged once)
        self.resolutions = {"ok": 0, "failed": 0}
        self._resolving: threading.Thread | None = None    # the re-resolution thread, once a resolver is set
        try:
            specs = resolving.concrete(self, cfg.backends, cfg)
        except ConfigError as e:
            raise StartError(str(e)) from None
        backends = [make_backend(s, cfg, breaker=self.breaker) for s in specs]
        self.balancer = Balancer(backends, cfg.strategy, slow_start=cfg.slow_start)
        self.ejector = Ejector(cfg.eject_after, cfg.eject_for, cfg.max_ejected_percent)
        self.retry_budget = RetryBudget(cfg.retry_budget_percent, cfg.retry_budget_min)
        self.metrics.retry_budget = self.retry_budget
        self.health = HealthChecker(cfg.health_path, cfg.health_interval, cfg.health_probe_timeout,
                                    rise=cfg.healthy_threshold, fall=cfg.unhealthy_threshold,
                                    ejector=self.ejector, metrics=self.metrics, protocol=cfg.health_protocol)
        self.access_log = self._open_access_log(cfg)
        self.edge = Edge(cfg, self.balancer, self.metrics, limiter=self._limit_stage(cfg, None),
                         identifier=Identifier(cfg.trusted_proxies), access_log=self.access_log,
                         ejector=self.ejector, retry_budget=self.retry_budget, breaker=self.breaker)
        self.pools: dict = {}            # the named pools, [[pools]] (lb/upstream/pools.py); "default" is the Edge's
        self._set_routes(cfg)
        from lb.http import tls as tls_mod
        self.edge.tls = tls_mod.take_inherited() or self._tls_context(cfg)   # a worker: the supervisor's
        if worker is None:               # (workers: the supervisor checked, and its reserve socket holds the port)
            refuse_if_held("--listen", cfg.listen, cfg)
        if cfg.admin:
            refuse_if_held("--admin", self._admin_addr(cfg, worker), cfg)
        self.server = make_server(cfg.listen, self.edge, cfg.takeover)
        log.info("listening on %s%s, %d backends (%s): %s", hostport(*self.server.server_address[:2]),
                 f" (https, {cfg.tls_min_version}+)" if cfg.tls_cert else "", len(backends), cfg.strategy,
                 ", ".join(f"{b.url}={b.weight}" for b in backends))
        if self.edge.limiter is not None:
            rules = "".join(f", rule {r.name} {r.limit or ''}{f' max_in_flight {r.max_in_flight}' if r.max_in_flight else ''}"
                            f" by {r.key}{' (dry run)' if r.dry_run else ''}"
                            for r in cfg.rules)
            log.info("limiting %s per key (%s, %s store%s), %d overrides, %d known keys%s",
                     cfg.limit or "off", cfg.algorithm, redis_url.redact(cfg.store), "" if cfg.store == "memory" else
                     f", timeout {cfg.redis_timeout:g}s, {cfg.on_store_error} on error", len(cfg.key_limits),
                     len(cfg.keys), rules)
        self.admin = None
        try:
            self.admin_token = admin_token(cfg)      # None: admin writes are off (403 says how to turn them on)
        except ConfigError as e:
            self.server.server_close()
            raise StartError(str(e)) from None
        self.published = self.published_ctl = None
        if rundir is not None:       # workers: each publishes its numbers; worker 0 sums them on /metrics
            self.published = metrics_mod.publish(os.path.join(rundir, f"worker-{worker}.sock"),
                                                 lambda: self.metrics.snapshot(status.live(self), worker))
            assert worker is not None    # a rundir is given to workers only (lb/process/supervisor.py), with their index
            self.published_ctl = fanout.listen(fanout.ctl_path(rundir, worker), lambda action, route: actions.apply_forwarded(self, action, route))
            for route in fanout.drained_routes(rundir):     # drained before this worker (re)started
                b = self.find_backend(route)
                if b is not None and not b.drained:
                    b.drained = True
                    b.refresh()
                    log.warning("backend %s DRAINED, as in the other workers (drained by the admin API before "
                                "this worker started)", b.url)
        if cfg.admin:
            addr = self._admin_addr(cfg, worker)
            try:
                # SO_REUSEPORT as the listener: with --takeover both edges answer here until the old one exits
                self.admin = start_admin(addr, self, reuse_port=True)
            except OSError as e:
                self.server.server_close()
                raise StartError(f"--admin {hostport(*addr)}: {e.strerror or e}"
                                 f"{SHARED_ONLY if cfg.takeover else ''}") from None
            log.info("admin on %s (/ the dashboard, /metrics%s, /status, /limits/KEY, /healthz, /readyz, "
                     "POST /backends/<route>/drain|enable%s)",
                     hostport(*self.admin.server_address[:2]), " of every worker" if worker is not None else "",
                     " with the token" if self.admin_token else ": off, no token configured")
        self.metrics.declare_backends(b.url for b in backends)
        for b in backends:
            self._watch(b)
        resolving.start_resolving(self)

    def _set_routes(self, cfg: Config) -> None:
        """[[pools]] and [[routes]]: named pools built, or updated in place (kept backends keep their state),
        or retired (their backends drain); then the route table, in one assignment (a split's turn carried)."""
        from lb.proxy.routes import Router
        want = {p.name: p for p in cfg.pools}
        for name, spec in want.items():
            if name in self.pools:
                pools_mod.update(self.pools[name], spec, cfg, self.metrics, self._state_changed)
            else:
                self.pools[name] = pools_mod.build(spec, cfg, self.metrics, self._state_changed)
        every = {"default": self.edge.pool, **{n: self.pools[n] for n in want}}
        self.edge.router = Router(cfg.routes, every, self.edge.router) if cfg.routes else None
        self.metrics.declare_routes((r.name, r.pools) for r in cfg.routes)
        for name in [n for n in self.pools if n not in want]:
            gone = self.pools.pop(name)
            for b in gone.backends:
                b.drained = True       # a request that chose it under the old table goes nowhere new
                b.refresh()
                pools_mod.retire(gone, b)
            log.info("pool %s removed (%d backends draining)", name, len(gone.backends))
        if self.pools or cfg.routes:
            log.info("%d routes; pools: %s", len(cfg.routes), "; ".join(
                f"{p.name} ({p.balancer.strategy}): " + ", ".join(f"{b.url}={b.weight}" for b in p.backends)
                for p in self.pools.values()) or "default only")

    def _watch(self, b) -> None:
        """Health checks for b, and its state changes counted (lb_backend_transitions_total)."""
        b.on_state = self._state_changed
        self.health.watch(b)

    def _state_changed(self, b, state: str) -> None:
        self.metrics.transition(b.url, state)

    @staticmethod
    def _admin_addr(cfg: Config, worker: int | None):
        addr = cfg.admin
        assert addr is not None          # asked only with --admin set
        if worker and addr[1]:
            addr = (addr[0], addr[1] + worker)   # worker i on PORT + i: its /status and drain; any /metrics sums
        return addr

    @staticmethod
    def _open_access_log(cfg: Config):
        if not cfg.access_log:
            return None
        try:
            return AccessLog(cfg.access_log, cfg.access_log_format, cfg.log_redact_params)
        except OSError as e:
            raise StartError(f"--access-log {cfg.access_log}: {e.strerror or e}") from None

    @property
    def loop_seen(self) -> float:
        return self.server.loop_seen

    def _with_demo(self, cfg: Config) -> Config:
        specs = tuple(BackendSpec(url=f"http://127.0.0.1:{s.server_address[1]}", host="127.0.0.1",
                                  port=s.server_address[1]) for s in self.demo_servers)
        return replace(cfg, backends=cfg.backends + specs) if specs else cfg

    @staticmethod
    def _tls_context(cfg: Config):
        """The listener's TLS context, read from disk anew (SIGHUP picks up replaced pairs and CRL)."""
        if not cfg.tls_cert:
            return None
        from lb.config.check import certificate_warnings
        from lb.config.load import tls_listener
        ctx = tls_listener(cfg)
        for w in certificate_warnings(cfg):     # served anyway (nginx does too); --check reports it
            log.warning("%s", w)
        return ctx

    def _limit_stage(self, cfg: Config, old):
        if not (cfg.limit or cfg.rules or cfg.keys or cfg.max_in_flight):
            return None
        from lb.limiting.stage import LimitStage
        opts = {"timeout": cfg.redis_timeout, "on_error": cfg.on_store_error,
                **{k: v for k, v in redis_files(cfg).items() if v is not None}} if cfg.store != "memory" else {}
        opts["max_keys"] = cfg.max_keys
        # A worker of --workers N with the memory store: the table the supervisor shared before forking
        store = "shm" if cfg.store == "memory" and self.shared.limits is not None else cfg.store
        if store == "shm":
            opts["shm_arena"] = self.shared.limits
        reuse = None
        if old is not None and (old.algorithm, old.store, old.options) == (
                cfg.algorithm, store, tuple(sorted(opts.items()))):
            reuse = old.limiters      # same algorithm, store and options: unchanged rates keep their counters
        stage = LimitStage(cfg.limit, cfg.key_limits, cfg.algorithm, store, reuse=reuse, rules=cfg.rules,
                           keys=cfg.keys, unknown_keys=cfg.unknown_keys, exempt=cfg.exempt,
                           ietf_headers=cfg.ietf_headers, ipv6_prefix=cfg.ipv6_prefix, max_delay=cfg.max_delay,
                           max_delayed=cfg.max_delayed, max_in_flight=cfg.max_in_flight, status=cfg.limit_status,
                           # a request in flight longer than this stops counting in Redis (its safety net)
                           inflight_ttl=cfg.response_timeout + cfg.max_delay + 60.0,
                           inflight_table=self.shared.inflight if cfg.store == "memory" else None, **opts)
        self.metrics.declare_rules(stage.declared)
        return stage

    # -- status, metrics, admin actions: lb/process/status.py, lb/process/actions.py (the admin port calls these)

    def status(self) -> dict:
        return status.status(self)

    def backend_status(self, b, now: float, balancer=None) -> dict:
        return status.backend_status(self, b, now, balancer)

    def render_metrics(self) -> str:
        return status.render_metrics(self)

    def peek_limits(self, who: str, api_key: bytes | None = None) -> tuple[int, dict]:
        return status.peek_limits(self, who, api_key)

    def find_backend(self, name: str):
        return actions.find_backend(self, name)

    def set_drained(self, b, drained: bool) -> dict:
        return actions.set_drained(self, b, drained)

    def drain_everywhere(self, b, drained: bool) -> tuple[dict, dict[int, str]]:
        return actions.drain_everywhere(self, b, drained)

    def not_ready(self) -> str | None:
        """None when ready; else why not (for /readyz)."""
        if self.stopping:
            return "draining"
        if not self.ready:
            return "starting" if self.cfg.store == "memory" else "waiting for the limiter store"
        return None

    def wait_until_ready(self) -> None:
        """The start-up store check: one line; with fail-closed, not ready until the store answers."""
        ok, line = store.check(self.cfg)
        if line:
            policy = self.cfg.on_store_error
            if ok:
                log.info("%s", line)
            elif policy == "fail-closed":
                log.error("%s; fail-closed: not reporting ready until it answers (requests get 503 meanwhile)",
                          line)
                last = time.monotonic()
                while not self.stopping:
                    time.sleep(1.0)
                    ok, line = store.check(self.cfg)
                    if ok:
                        log.info("%s; ready now", line)
                        break
                    if time.monotonic() - last > 30:
                        log.error("%s; still not ready", line)
                        last = time.monotonic()
            else:
                how = {"fail-open": "requests are allowed while it is down",
                       "local": "each process limits on its own while it is down"}[policy]
                log.warning("%s; %s: starting anyway, %s", line, policy, how)
        if ok and not self.stopping:
            self._memory_policy(self.cfg)
        self.ready = not self.stopping

    @staticmethod
    def _memory_policy(cfg) -> None:
        """One line per Redis server about its maxmemory-policy (a warning when it can evict limiter keys)."""
        for level, line in store.memory_policy(cfg):
            log.log(level, "%s", line)

    def reopen_logs(self) -> None:
        """SIGUSR1/SIGHUP: a fresh access-log file and stderr (when it is a file) after logrotate moved them."""
        if self.access_log is not None:
            self.access_log.reopen()
        logs.reopen_stderr()
        log.info("logs reopened")

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
            kept = [n for n in NEED_RESTART if getattr(new, n) != getattr(old, n)]
            if kept:
                log.warning("reload: %s changed; that needs a restart, the running value%s stay%s: %s",
                            ", ".join(kept), "s" if len(kept) > 1 else "", "" if len(kept) > 1 else "s",
                            ", ".join(f"{n} {getattr(old, n)} (file/flags say {getattr(new, n)})" for n in kept))
                new = replace(new, **{n: getattr(old, n) for n in kept})
            access_log = self.access_log
            if (new.access_log, new.access_log_format) != (old.access_log, old.access_log_format):
                try:
                    access_log = self._open_access_log(new)
                except StartError as e:
                    log.error("reload rejected, the running configuration stays: %s", e)
                    sdnotify.notify("READY=1")
                    return False
            try:
                limiter = self._limit_stage(new, self.edge.limiter)
                tls = self._tls_context(new)   # a broken new pair: rejected here, the old one serves on
                token = admin_token(new)       # a rotated token file applies from the reload on
            except (ValueError, ConfigError) as e:
                log.error("reload rejected, the running configuration stays: %s", e)
                sdnotify.notify("READY=1")
                return False

            if new.resolver != old.resolver:
                self.resolved = {}              # another resolver: every name asked again
            try:
                specs = resolving.concrete(self, new.backends, new)
            except ConfigError as e:
                log.error("reload rejected, the running configuration stays: %s", e)
                sdnotify.notify("READY=1")
                return False
            for url in set(self.resolved) - {s.url for s in new.backends}:
                del self.resolved[url]

            current = {b.url: b for b in self.balancer.backends}
            keep, added, old_pools, reweighted = [], [], [], []
            new_pools = any(getattr(new, n) != getattr(old, n) for n in POOL_SETTINGS)
            for spec in specs:
                b = current.pop(spec.url, None)
                if b is None:
                    b = make_backend(spec, new, joined_at=time.monotonic(), breaker=self.breaker)   # slow start, if on
                    added.append(b)
                else:
                    if b.weight != spec.weight:
                        reweighted.append(f"{b.url} {b.weight}->{spec.weight}")
                    b.weight = spec.weight
                    b.spec = spec
                    if new_pools:        # a pool's limits are fixed at creation: a new one, the old drains
                        old_pools.append(b.pool)
                        b.pool = make_backend(spec, new, breaker=self.breaker).pool
                keep.append(b)
            removed = list(current.values())

            h = self.health
            h.path, h.interval, h.timeout = new.health_path, new.health_interval, new.health_probe_timeout
            h.protocol = new.health_protocol
            h.rise, h.fall = new.healthy_threshold, new.unhealthy_threshold
            self.ejector.configure(new.eject_after, new.eject_for, new.max_ejected_percent)
            self.retry_budget.configure(new.retry_budget_percent, new.retry_budget_min)
            self.breaker.configure(new.max_requests, new.max_pending)
            # One assignment each: a request in flight sees the old or the new part, never half of one.
            self.edge.cfg = new
            self.edge.limiter = limiter
            self.edge.tls = tls                # new connections handshake with the new pair
            self.edge.identifier = Identifier(new.trusted_proxies)
            self.admin_token = token
            self.balancer.set_backends(keep, new.strategy, new.slow_start)
            self._set_routes(new)
            old_log = None
            if access_log is not None:
                access_log.set_redact(new.log_redact_params)
            if access_log is not self.access_log:
                self.edge.access_log, old_log, self.access_log = access_log, self.access_log, access_log
            self.cfg = new
            for p in old_pools:
                p.close()   # idle connections close now; one in use closes when its request gives it back
            self._joined_and_left(added, removed)
            log.info("reloaded: %d backends (%d added, %d removed%s), limit %s, %d rules, %d known keys%s",
                     len(keep), len(added), len(removed),
                     f", {len(reweighted)} reweighted: {', '.join(reweighted)}" if reweighted else "",
                     new.limit or "off", len(new.rules), len(new.keys), ", new connection pools" if old_pools else "")
            sdnotify.notify("READY=1", f"STATUS=serving {len(keep)} backends")
            resolving.start_resolving(self)
            self._memory_policy(new)   # Redis's own configuration may have changed too
            if old_log is not None:
                old_log.close()     # last: it waits for the old file's queued lines (up to its timeout)
            return True

    def _take_queued(self) -> int:
        """Accept what waits in the listener's queue, right before it closes: Linux resets those connections
        when a SO_REUSEPORT listener closes (unless net.ipv4.tcp_migrate_req = 1 hands them to another
        listener on the port), and after a --takeover the other edge serves on. Each is served like any
        other (one request, Connection: close)."""
        sock = self.server.socket
        n = 0
        try:
            sock.setblocking(False)
            while True:
                try:
                    conn, addr = sock.accept()
                except (BlockingIOError, InterruptedError):
                    return n
                conn.setblocking(True)
                self.server.process_request(conn, addr)
                n += 1
        except OSError:
            return n

    def _joined_and_left(self, added, removed) -> None:
        """Backends that joined the rotation (a reload, a DNS answer) are counted and probed; those that left
        are forgotten by health and ejection and drained (their in-flight requests finish, then the pool closes)."""
        self.metrics.declare_backends(b.url for b in added)
        for b in added:
            self._watch(b)
        for b in removed:
            self.health.unwatch(b)
            self.ejector.forget(b)
            threading.Thread(target=self._drain_backend, args=(b,), daemon=True, name=f"drain {b.url}").start()

    def _drain_backend(self, b, deadline: float = 300.0) -> None:
        """A backend taken out by reload: its in-flight requests finish, then its pool is closed."""
        end = time.monotonic() + deadline
        while b.inflight > 0 and time.monotonic() < end:
            time.sleep(0.05)
        b.pool.close()
        if b.h2 is not None:
            b.h2.close()     # an h2c:// backend's HTTP/2 connections
        log.info("backend %s removed (drained)", b.url)

    # -- serving and stopping ----------------------------------------------------------------------

    def serve_forever(self) -> None:
        self.server.serve_forever(poll_interval=0.25)

    def stop_accepting(self) -> None:
        """From a signal handler's thread: readiness off at once, then (after `grace`, still serving, so a
        load balancer polling /readyz stops sending first) end serve_forever in the main thread."""
        if self.stopping:
            return
        self.stopping = True
        # From now on (the grace period too) a keep-alive client is told to close after its response:
        # it opens a new connection (to whoever serves the port next) instead of meeting our close.
        self.edge.closing = True
        sdnotify.notify("STOPPING=1")
        if self.cfg.grace > 0:
            time.sleep(self.cfg.grace)
        self.edge.draining = True
        self.server.shutdown()

    def drain(self) -> None:
        """After serve_forever returned: close the listener, let in-flight requests finish, clean up."""
        taken = self._take_queued()
        self.server.socket.close()
        if taken:
            log.info("took %d queued connections before closing the listener", taken)
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
        for p in self.pools.values():
            p.health.stop()
        if self.admin:
            self.admin.shutdown()
        for sock in (self.published, self.published_ctl):
            if sock is not None:
                sock.close()
        if self.access_log:
            self.access_log.close()
        for s in self.demo_servers:
            s.shutdown()
