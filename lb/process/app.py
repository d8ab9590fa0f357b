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
import sys
import threading
import time
from dataclasses import replace

from limiter.redis import url as redis_url
from limiter.memory import MemoryStore

from lb import __version__, logs
from lb.ops import fanout
from lb.ops import metrics as metrics_mod
from lb.process import sdnotify
from lb.limiting import store
from lb.limiting.store import redis_files
from lb.ops.accesslog import AccessLog
from lb.ops.admin import start_admin
from lb.upstream.backends import BackendSpec, make_backend
from lb.upstream.balancer import Balancer
from lb.config.load import Config, admin_token, load
from lb.errors import ConfigError, ResolveError, StartError
from lb.upstream.health import HealthChecker
from lb.limiting.identity import Identifier
from lb.limiting.keys import draw_label_secret
from lb.limiting.stage import SharedTables
from lb.ops.metrics import Metrics
from lb.netaddr import held, hostport
from lb.upstream.outlier import Ejector
from lb.proxy.tunnel import close_all as close_tunnels
from lb.proxy import hedge
from lb.proxy.edge import Edge, EdgeServer
from lb.upstream.breaker import Breaker
from lb.upstream.resolve import is_address, lookup
from lb.upstream.retrybudget import RetryBudget

log = logging.getLogger("edge")

# Settings a running process cannot take on; a reload names them in one line.
NEED_RESTART = ("listen", "admin", "workers", "cpu_affinity")
RESOLVE_TIMEOUT = 2.0     # one DNS question; a resolver silent this long is a failed resolution
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
        self._resolving = None                     # the re-resolution thread, once a resolver is set
        try:
            specs = self._concrete(cfg.backends, cfg)
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
                                                 lambda: self.metrics.snapshot(self._live(), worker))
            self.published_ctl = fanout.listen(fanout.ctl_path(rundir, worker), self._apply_forwarded)
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
        self._start_resolving()

    # -- DNS-named backends (lb/upstream/resolve.py) ----------------------------------------------------------

    def _concrete(self, specs, cfg) -> list[BackendSpec]:
        """The backends the configured ones stand for: with a resolver set, a DNS name is one backend per
        address (the addresses known, or asked now); an IP literal, or any name without a resolver, is one.
        Raises ConfigError for a name that does not resolve (at start, or new in a reload)."""
        out = []
        for spec in specs:
            if cfg.resolver is None or is_address(spec.host):
                out.append(spec)
                continue
            addrs = self.resolved.get(spec.url)
            if addrs is None:
                try:
                    addrs, _ = lookup(spec.host, cfg.resolver, RESOLVE_TIMEOUT)
                except ResolveError as e:
                    raise ConfigError(f"backends: {spec.url}: {spec.host} does not resolve with resolver "
                                      f"{cfg.resolver} ({e})") from None
                self.resolved[spec.url] = addrs
                self.resolutions["ok"] += 1
            out += [_at(spec, a) for a in addrs]
        return out

    def _start_resolving(self) -> None:
        if self.cfg.resolver is not None and self._resolving is None:
            self._resolving = threading.Thread(target=self._resolve_loop, daemon=True, name="resolve")
            self._resolving.start()

    def _resolve_loop(self) -> None:
        """Every resolve_interval (sooner when a record's TTL is shorter, never more than once a second)."""
        while True:
            cfg = self.cfg
            wait = cfg.resolve_interval
            if cfg.resolver is not None:
                for spec in cfg.backends:
                    if not is_address(spec.host):
                        ttl = self._resolve(spec, cfg)
                        if ttl is not None:
                            wait = min(wait, max(1.0, ttl))
            time.sleep(wait if cfg.resolver is not None else 1.0)

    def _resolve(self, spec: BackendSpec, cfg) -> float | None:
        """Ask again for one name; a changed set is applied. A failure keeps the last good set, logged once."""
        try:
            addrs, ttl = lookup(spec.host, cfg.resolver, RESOLVE_TIMEOUT)
        except ResolveError as e:
            self.resolutions["failed"] += 1
            if spec.url not in self.resolve_failing:
                log.warning("backend %s: resolving %s failed (%s); its last addresses stay: %s", spec.url,
                            spec.host, e, ", ".join(self.resolved.get(spec.url, ())) or "none")
            self.resolve_failing[spec.url] = str(e)
            return None
        self.resolutions["ok"] += 1
        if self.resolve_failing.pop(spec.url, None) is not None:
            log.info("backend %s: %s resolves again", spec.url, spec.host)
        with self._reload_lock:
            if self.cfg is not cfg or addrs == self.resolved.get(spec.url):
                return ttl     # unchanged, or a reload came between (it resolved with what it knew)
            self.resolved[spec.url] = addrs
            want = {s.url: s for s in (_at(spec, a) for a in addrs)}
            mine = spec.url + " ("
            old = self.balancer.backends
            removed = [b for b in old if b.spec.address and b.url.startswith(mine) and b.url not in want]
            have = {b.url for b in old}
            added = [make_backend(s, cfg, joined_at=time.monotonic(), breaker=self.breaker)   # slow start, if on
                     for u, s in want.items() if u not in have]
            self.balancer.set_backends([b for b in old if b not in removed] + added)
            self._joined_and_left(added, removed)
            log.info("backend %s: %s resolves to %s (%d added, %d draining)", spec.url, spec.host,
                     ", ".join(addrs), len(added), len(removed))
        return ttl

    def _watch(self, b) -> None:
        """Health checks for b, and its state changes counted (lb_backend_transitions_total)."""
        b.on_state = self._state_changed
        self.health.watch(b)

    def _state_changed(self, b, state: str) -> None:
        self.metrics.transition(b.url, state)

    @staticmethod
    def _admin_addr(cfg: Config, worker: int | None):
        addr = cfg.admin
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

    # -- status, metrics, readiness ------------------------------------------------------------------

    def status(self) -> dict:
        self.edge.sweep_ejections()     # an ejection whose time is up shows as over, traffic or not
        now = time.monotonic()
        return {
            "listen": hostport(*self.server.server_address[:2]),
            "tls": bool(self.edge.tls),
            "worker": self.worker, "pid": os.getpid(),
            "strategy": self.cfg.strategy,
            "connections": self.server.active,
            "ready": self.not_ready() is None,
            "draining": self.stopping,
            "limit": self.cfg.limit, "algorithm": self.cfg.algorithm, "store": redis_url.redact(self.cfg.store),
            "shaping": {"max_delay": self.cfg.max_delay, "held": self.edge.holds.n, "max_delayed": self.cfg.max_delayed,
                        "max_in_flight": self.cfg.max_in_flight, "status": self.cfg.limit_status},
            "retries": {"max": self.cfg.retries, "in_flight": self.retry_budget.retrying,
                        "budget_now": self.retry_budget.allowed(), "peak": self.retry_budget.peak,
                        "on": list(self.cfg.retry_on), "per_try_timeout": self.cfg.per_try_timeout,
                        "by_condition": self.metrics.by_label("lb_retries_by_condition_total", "condition")},
            "breaker": self.breaker.status(),
            "hedge": hedge.status(self.cfg, self.metrics),
            "resolver": self.cfg.resolver, "resolve_interval": self.cfg.resolve_interval,
            "resolved": {u: {"addresses": a, **({"failing": self.resolve_failing[u]} if u in self.resolve_failing else {})}
                         for u, a in self.resolved.items()},
            "rules": self.edge.limiter.status() if self.edge.limiter is not None else [],
            "known_keys": len(self.cfg.keys), "unknown_keys": self.cfg.unknown_keys,
            "backends": [self.backend_status(b, now) for b in self.balancer.backends],
            **self._operator_status(),
        }

    def _operator_status(self) -> dict:
        """What the dashboard shows beside the backends: build, uptime, the store, the key table and the
        most rejected clients -- the last two over every worker with --workers, as /metrics sums them."""
        stage = self.edge.limiter
        others = self._other_snapshots()
        out = {"version": __version__, "python": sys.version.split()[0], "uptime": round(time.time() - self.metrics.started, 1),
               "workers": self.cfg.workers if self.rundir is not None else 1,
               "admin_writes": bool(getattr(self, "admin_token", None)),   # the admin token (issue 24) wires this
               "store_up": None, "key_table": None,
               "top_limited": metrics_mod.top_keys([{"top": self.metrics.top_now()}, *others])}
        if stage is not None:
            for lim in (getattr(stage, "limiters", None) or {}).values():
                link = getattr(lim, "link", None)
                if link is not None:
                    out["store_up"] = bool(link.up) and out["store_up"] is not False
            out["key_table"] = stage.table()
        return out

    def _other_snapshots(self) -> list:
        if self.rundir is None:
            return []
        return metrics_mod.gather(os.path.join(self.rundir, f"worker-{i}.sock")
                                  for i in range(self.cfg.workers) if i != self.worker)

    def backend_status(self, b, now: float) -> dict:
        return {"url": b.url, "route": b.route, "weight": b.weight,
                "effective_weight": round(self.balancer.effective_weight(b, now), 3),
                "state": b.state, "in_rotation": b.in_rotation, "health": "UP" if b.up else "DOWN",
                "drained": b.drained, "ejected": b.ejected,
                "ejected_for": round(max(0.0, b.ejected_until - now), 3) if b.ejected else 0,
                "times_ejected": b.times_ejected, "fail_streak": b.fail_streak, "pass_streak": b.pass_streak,
                "last_probe": b.last_probe, "inflight": b.inflight,
                "resting_for": round(max(0.0, self.balancer.resting.get(b, 0.0) - self.balancer.clock()), 3),
                **({"name": b.spec.url, "address": b.spec.address} if b.spec.address else {})}

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

    def drain_everywhere(self, b, drained: bool) -> tuple[dict, dict[int, str]]:
        """set_drained here, then in every other worker of --workers N; ({worker: why} of those that did not)."""
        st = self.set_drained(b, drained)
        failed = {}
        if self.rundir is not None:
            fanout.remember(self.rundir, b.route, drained)
            action = "drain" if drained else "enable"
            failed = fanout.send(self.rundir, [i for i in range(self.cfg.workers) if i != self.worker], action, b.route)
            if failed:
                log.error("backend %s: %s applied here but not by worker(s) %s", b.url, action,
                          "; ".join(f"{i}: {why}" for i, why in sorted(failed.items())))
        return st, failed

    def _apply_forwarded(self, action: str, route: str) -> str | None:
        b = self.find_backend(route)
        if b is None:
            return "no such backend"     # a reload in this worker that the others have not had yet
        self.set_drained(b, action == "drain")
        return None

    def _live(self) -> dict:
        """Gauges read at scrape time, and the counters other parts keep, as metric samples."""
        out = {("lb_client_connections", ()): self.server.active,
               ("lb_refused_connections_total", ()): self.edge.refused_connections,
               ("lb_idle_connections_closed_total", ()): self.edge.idle_closed,
               ("lb_buffer_memory_bytes", ()): self.edge.buffers.used,
               ("lb_buffer_temp_files", ()): self.edge.buffers.files}
        if self.cfg.resolver is not None:
            for result, n in self.resolutions.items():
                out[("lb_dns_resolutions_total", (("result", result),))] = n
            for u, a in self.resolved.items():
                out[("lb_dns_addresses", (("backend", u),))] = len(a)
        for b in self.balancer.backends:
            lab = (("backend", b.url),)
            out[("lb_backend_up", lab)] = 1 if b.up else 0
            out[("lb_backend_in_rotation", lab)] = 1 if b.in_rotation else 0
            out[("lb_backend_ejected", lab)] = 1 if b.ejected else 0
            out[("lb_backend_drained", lab)] = 1 if b.drained else 0
            out[("lb_backend_inflight", lab)] = b.inflight
            out.setdefault(("lb_requests_total", lab), 0)
        stage = self.edge.limiter
        self._key_tables(stage, out)
        for lim in (getattr(stage, "limiters", None) or {}).values():
            link = getattr(lim, "link", None)
            if link is not None:
                out[("lb_limiter_store_up", (("store", redis_url.redact(self.cfg.store)),))] = 1 if link.up else 0
        return out

    @staticmethod
    def _key_tables(stage, out: dict) -> None:
        """lb_limiter_keys / lb_limiter_table_full_total by rule: the built-in rule's limiters (default,
        overrides, tiers; one limiter may serve several) and each [[rules]] table's."""
        from lb.limiting.rules import BUILTIN
        if stage is None:
            return
        groups = {BUILTIN: [getattr(stage, "default", None), *getattr(stage, "overrides", {}).values(),
                            *getattr(stage, "tiers", {}).values()]}
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

    def render_metrics(self) -> str:
        others = self._other_snapshots()     # any worker's /metrics is the sum of all of them
        live = self._live()
        # counters kept elsewhere are added to this process's own, not double counted
        for k in [k for k in live if k[0] == "lb_requests_total"]:
            if k in self.metrics.counters:
                del live[k]
        return self.metrics.render(live, others, self.worker)

    def peek_limits(self, who: str, api_key: bytes | None = None) -> tuple[int, dict]:
        """GET /limits/KEY: the client's state in each limit now, unchanged (LimitStage.peek)."""
        stage = self.edge.limiter
        if stage is None:
            return 404, {"error": "rate limiting is off"}
        return stage.peek(who, api_key)

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
                specs = self._concrete(new.backends, new)
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
            self._start_resolving()
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
        if self.admin:
            self.admin.shutdown()
        for sock in (self.published, self.published_ctl):
            if sock is not None:
                sock.close()
        if self.access_log:
            self.access_log.close()
        for s in self.demo_servers:
            s.shutdown()


def _at(spec: BackendSpec, address: str) -> BackendSpec:
    """One address of a DNS-named backend: its own backend, shown as `URL (ADDRESS)`."""
    return replace(spec, url=f"{spec.url} ({address})", address=address)
