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

from lb import logs
from lb.config.load import Config, admin_token
from lb.errors import ConfigError, StartError
from lb.limiting.identity import Identifier
from lb.limiting.keys import draw_label_secret
from lb.limiting.stage import SharedTables
from lb.netaddr import held, hostport
from lb.ops import fanout
from lb.ops import metrics as metrics_mod
from lb.ops.admin import AdminServer, start_admin
from lb.ops.metrics import Metrics
from lb.process import actions, gctune, handover, parts, readiness, reloading, resolving, sdnotify, startlog, status
from lb.proxy.edge import Edge, EdgeServer
from lb.proxy.tunnel import close_all as close_tunnels
from lb.upstream.backends import BackendSpec, make_backend
from lb.upstream.balancer import Balancer
from lb.upstream.breaker import Breaker
from lb.upstream.health import HealthChecker
from lb.upstream.outlier import Ejector
from lb.upstream.retrybudget import RetryBudget

log = logging.getLogger("edge")


class Server(EdgeServer):
    """The listener (IPv4 or IPv6 by the address: EdgeServer), and a heartbeat of the accept loop
    (service_actions runs every pass, at least every poll interval) for the watchdog. SO_REUSEPORT always:
    workers share the port, and an edge started with --takeover can bind beside this one (the kernel allows
    that only to a process of the same effective uid). Another edge started without --takeover is refused
    before it binds (netaddr.held)."""

    loop_seen = 0.0
    given: socket.socket | None = None  # a listening socket handed over (lb/process/handover.py): no bind

    def __init__(self, addr, edge, given: socket.socket | None = None):
        self.given = given
        super().__init__(addr, edge)

    def server_bind(self):
        if self.given is not None:  # the socket socketserver made is never bound: this one serves instead
            self.socket.close()
            self.socket = self.given
            # Shared with another process (the old edge, or the supervisor and a worker's predecessor): both may
            # wake for one connection, and the one that loses the accept must not block in it (the flag is the
            # open file's, so this sets it for the old edge too; socketserver takes EAGAIN as "none").
            self.socket.setblocking(False)
            self.server_address = self.socket.getsockname()
            return
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

    def server_activate(self):
        if self.given is None:  # a socket handed over listens already, with its queue
            super().server_activate()

    def service_actions(self):
        self.loop_seen = time.monotonic()


TAKE_OVER = (
    "Address already in use: another edge (or another program) is serving there; to replace a "
    "running edge without dropping a request, start the new one with --takeover, then TERM the old "
    "one (README: Zero-downtime upgrade)"
)
SHARED_ONLY = (
    " (--takeover joins only sockets that share the port: an edge run by the same user, and not "
    "the listener or admin port of an edge older than --takeover, unless it ran --workers without --admin)"
)


def refuse_if_held(flag: str, addr, cfg: Config) -> None:
    """One instance per port unless --takeover asks to join: SO_REUSEPORT alone would let a second edge
    bind beside the first and split the traffic (each with its own limits)."""
    if not cfg.takeover and held(*addr[:2]):
        raise StartError(f"{flag} {hostport(*addr[:2])}: {TAKE_OVER}")


def make_server(addr, edge, takeover: bool = False, given: socket.socket | None = None) -> Server:
    try:
        return Server(addr, edge, given)
    except OSError as e:
        raise StartError(f"--listen {hostport(*addr)}: {e.strerror or e}{SHARED_ONLY if takeover else ''}") from None


class App:
    def __init__(
        self,
        cfg: Config,
        argv: list[str] | None = None,
        worker: int | None = None,
        rundir: str | None = None,
        shared: SharedTables | None = None,
    ):
        """Raises StartError naming what could not be opened or bound. shared: see serve()."""
        self.argv = argv
        self.shared = shared or SharedTables()
        draw_label_secret()  # before any serving thread (a worker: inherited, drawn before fork)
        self.worker = worker
        self.rundir = rundir
        self.ready = False  # serving, and the store answered when fail-closed asks for it
        self.stopping = False  # a drain started: /readyz fails from here on
        self._reload_lock = threading.Lock()
        self.demo_servers = []
        if cfg.demo:
            from demo import backends as demo

            self.demo_servers = [demo.start_in_thread(name=n) for n in ("demo-a", "demo-b", "demo-c")]
        cfg = self._with_demo(cfg)
        self.cfg = cfg
        self.resolved: dict[str, list[str]] = {}  # a DNS-named backend's URL -> its addresses (lb/upstream/resolve.py)
        self.resolve_failing: dict[str, str] = {}  # ... -> why its last resolution failed (logged once)
        self.resolutions = {"ok": 0, "failed": 0}
        self._resolving: threading.Thread | None = None  # the re-resolution thread, once a resolver is set
        backends = self._build(cfg)
        self._bind(cfg, worker)
        startlog.log_start(cfg, self.server, self.edge.limiter, backends)
        self.admin: AdminServer | None = None
        try:
            self.admin_token = admin_token(cfg)  # None: admin writes are off (403 says how to turn them on)
        except ConfigError as e:
            self.server.server_close()
            raise StartError(str(e)) from None
        self.published: socket.socket | None = None
        self.published_ctl: socket.socket | None = None
        if rundir is not None:  # workers: each publishes its numbers; worker 0 sums them on /metrics
            assert worker is not None  # a rundir is given to workers only (lb/process/supervisor.py), with their index
            self._join_workers(rundir, worker)
        if cfg.admin:
            self._open_admin(cfg, worker)
        self.metrics.declare_backends(b.url for b in backends)
        for b in backends:
            self._watch(b)
        resolving.start_resolving(self)

    def _build(self, cfg: Config) -> list:
        """The serving parts, from cfg: metrics, backends and their guards, the Edge, pools and routes, TLS.
        Returns the default pool's backends (to watch once the process is bound)."""
        self.metrics = Metrics()
        self.breaker = Breaker(cfg.max_requests, cfg.max_pending)  # the pool's circuit breaker
        self.metrics.breaker = self.breaker
        try:
            specs = resolving.concrete(self, cfg.backends, cfg)
            resolving.concrete_pools(self, cfg)  # asked here: a [[pools]] name that does not resolve is refused too
        except ConfigError as e:
            raise StartError(str(e)) from None
        backends = [make_backend(s, cfg, breaker=self.breaker) for s in specs]
        self.balancer = Balancer(backends, cfg.strategy, slow_start=cfg.slow_start)
        self.ejector = Ejector(cfg.eject_after, cfg.eject_for, cfg.max_ejected_percent)
        self.retry_budget = RetryBudget(cfg.retry_budget_percent, cfg.retry_budget_min)
        self.metrics.retry_budget = self.retry_budget
        self.health = HealthChecker(
            cfg.health_path,
            cfg.health_interval,
            cfg.health_probe_timeout,
            rise=cfg.healthy_threshold,
            fall=cfg.unhealthy_threshold,
            ejector=self.ejector,
            metrics=self.metrics,
            protocol=cfg.health_protocol,
        )
        self.access_log = parts.open_access_log(cfg)
        self.edge = Edge(
            cfg,
            self.balancer,
            self.metrics,
            limiter=parts.limit_stage(self, cfg, None),
            identifier=Identifier(cfg.trusted_proxies),
            access_log=self.access_log,
            ejector=self.ejector,
            retry_budget=self.retry_budget,
            breaker=self.breaker,
        )
        self.pools: dict = {}  # the named pools, [[pools]] (lb/upstream/pools.py); "default" is the Edge's
        parts.set_routes(self, cfg)
        from lb.http import tls as tls_mod

        self.edge.tls = tls_mod.take_inherited() or parts.tls_context(cfg)  # a worker: the supervisor's
        return backends

    def _bind(self, cfg: Config, worker: int | None) -> None:
        """The listener: a worker's from the supervisor, the old edge's on --takeover (handover.py), else bound."""
        given, self.handed_over = handover.listener(cfg, worker)  # handed_over: the old edge's own sockets
        if worker is None and not given:  # (workers: the supervisor checked, and its listeners hold the port)
            refuse_if_held("--listen", cfg.listen, cfg)
        if cfg.admin:
            refuse_if_held("--admin", self._admin_addr(cfg, worker), cfg)
        self.server = make_server(cfg.listen, self.edge, cfg.takeover, given[0] if given else None)
        self.extra = handover.Extra(self.server, given[1:])  # an old edge's beyond the first, when it had more
        # A single process offers its listeners once ready (serve.py); a worker none (the supervisor does).
        offered = (self.server.socket, *given[1:]) if worker is None else ()
        self.offer = handover.Offer(self.server.server_address, list(offered), cfg.takeover_socket)

    def _join_workers(self, rundir: str, worker: int) -> None:
        """A worker of --workers N: its numbers published (worker 0 sums them), the others' admin actions
        heard, and the drains they made before this worker (re)started applied here too."""
        self.published = metrics_mod.publish(
            os.path.join(rundir, f"worker-{worker}.sock"), lambda: self.metrics.snapshot(status.live(self), worker)
        )
        self.published_ctl = fanout.listen(
            fanout.ctl_path(rundir, worker), lambda action, route: actions.apply_forwarded(self, action, route)
        )
        for route in fanout.drained_routes(rundir):
            b = self.find_backend(route)
            if b is not None and not b.drained:
                b.drained = True
                b.refresh()
                log.warning(
                    "backend %s DRAINED, as in the other workers (drained by the admin API before this worker started)",
                    b.url,
                )

    def _open_admin(self, cfg: Config, worker: int | None) -> None:
        addr = self._admin_addr(cfg, worker)
        try:
            # SO_REUSEPORT as the listener: with --takeover both edges answer here until the old one exits
            self.admin = admin = start_admin(addr, self, reuse_port=True)
        except OSError as e:
            self.server.server_close()
            raise StartError(
                f"--admin {hostport(*addr)}: {e.strerror or e}{SHARED_ONLY if cfg.takeover else ''}"
            ) from None
        log.info(
            "admin on %s (/ the dashboard, /metrics%s, /status, /limits/KEY, /healthz, /readyz, "
            "POST /backends/<route>/drain|enable%s)",
            hostport(*admin.server_address[:2]),
            " of every worker" if worker is not None else "",
            " with the token" if self.admin_token else ": off, no token configured",
        )

    def _watch(self, b) -> None:
        """Health checks for b, and its state changes counted (lb_backend_transitions_total)."""
        b.on_state = self._state_changed
        self.health.watch(b)

    def _state_changed(self, b, state: str) -> None:
        self.metrics.transition(b.url, state)

    @staticmethod
    def _admin_addr(cfg: Config, worker: int | None):
        addr = cfg.admin
        assert addr is not None  # asked only with --admin set
        if worker and addr[1]:
            addr = (addr[0], addr[1] + worker)  # worker i on PORT + i: its /status and drain; any /metrics sums
        return addr

    @property
    def loop_seen(self) -> float:
        return self.server.loop_seen

    def _with_demo(self, cfg: Config) -> Config:
        specs = tuple(
            BackendSpec(url=f"http://127.0.0.1:{s.server_address[1]}", host="127.0.0.1", port=s.server_address[1])
            for s in self.demo_servers
        )
        return replace(cfg, backends=cfg.backends + specs) if specs else cfg

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
        readiness.wait_until_ready(self)

    def reopen_logs(self) -> None:
        """SIGUSR1/SIGHUP: a fresh access-log file and stderr (when it is a file) after logrotate moved them."""
        if self.access_log is not None:
            self.access_log.reopen()
        logs.reopen_stderr()
        log.info("logs reopened")

    # -- reload -------------------------------------------------------------------------------------

    def reload(self) -> bool:
        """SIGHUP: lb/process/reloading.py, one reload at a time (and none while a DNS answer is applied)."""
        with self._reload_lock:
            sdnotify.reloading()
            return reloading.reload(self)

    def _take_queued(self) -> int:
        """Accept what waits in the listener's queue, right before it closes: Linux resets those connections
        when a SO_REUSEPORT listener closes (unless net.ipv4.tcp_migrate_req = 1 hands them to another
        listener on the port), and after a --takeover the other edge serves on. Each is served like any
        other (one request, Connection: close)."""
        sock = self.server.socket
        try:
            sock.setblocking(False)
            return handover.take_queued(self.server, sock)
        except OSError:
            return 0  # (the count only feeds a log line)

    # -- serving and stopping ----------------------------------------------------------------------

    def serve_forever(self) -> None:
        gctune.freeze_startup()  # what start-up built, out of the collector's way (lb/process/gctune.py)
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
        self.offer.close()
        taken = self._take_queued() + self.extra.stop()
        self.server.socket.close()
        if taken:
            log.info("took %d queued connections before closing the listener", taken)
        deadline = time.monotonic() + self.cfg.drain_timeout
        self.edge.wake_idle()
        while self.edge.busy() and time.monotonic() < deadline:
            time.sleep(0.02)
            self.edge.wake_idle()  # a connection that finished its request is idle now
        closed = close_tunnels(self.edge.tunnels)
        if closed:
            log.warning("drain deadline (%gs): closing %d tunnels", self.cfg.drain_timeout, closed)
            end = time.monotonic() + 1.0  # let their threads log them
            while self.edge.tunnels and time.monotonic() < end:
                time.sleep(0.01)
        left = self.edge.busy()
        if left:
            log.warning("drain deadline (%gs) passed with %d requests in flight; closing", self.cfg.drain_timeout, left)
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
