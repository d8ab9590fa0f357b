"""--workers N: N edge processes on one port (SO_REUSEPORT), supervised by this parent.

The parent holds one listening socket per worker (with --listen HOST:0 the first picks the port, the others
join it), each inherited by its worker, so a restarted worker finds its queue and a --takeover is handed the
same sockets (lb/process/handover.py); it forks the workers and speaks to systemd
for all of them. Each worker has a pipe back: "ready" once it listens (and its store check passed),
"beat" while its accept loop goes round, "fail <why>" when it could not start.

- READY=1 once every worker said ready; WATCHDOG=1 only while every ready worker beats; one STOPPING=1.
- A worker that fails to start is logged with its own reason. Three failures of one worker before it
  was ever ready, or five deaths within 30 s, is a crash loop: the supervisor stops the others and
  exits 1, so systemd's Restart= (and the operator) see it instead of a healthy-looking service.
- SIGHUP is passed on (each worker reloads; one arriving during start-up waits until all are ready);
  SIGUSR1 reopens the logs here and in every worker; SIGTERM/SIGINT are passed on and the workers
  drain. The parent holds no threads when it forks. A parent that dies without a word (SIGKILL) takes
  its workers with it: the kernel sends each SIGTERM (PR_SET_PDEATHSIG), and they drain.
- Metrics: each worker publishes its numbers on a unix socket in a private directory; worker 0's admin
  port sums them (one scrape target).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections import deque
from dataclasses import replace

from lb import logs
from lb.errors import StartError
from lb.netaddr import bind_options, family, hostport
from lb.process import handover, sdnotify
from lb.process.serve import watchdog_interval


def exit_reason(status: int) -> str:
    """A waitpid status as an operator reads it: "status 1", or "killed by SIGKILL" (the OOM killer's
    signal, or someone's kill -9), not the negative exit code Python gives a signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}" + (" (core dumped)" if os.WCOREDUMP(status) else "")
    return f"status {os.waitstatus_to_exitcode(status)}"


log = logging.getLogger("edge")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
START_FAILURES = 3  # consecutive failures of a worker that never became ready
DEATHS, DEATH_WINDOW = 5, 30.0
PASSED_ON = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1}  # the signals run() handles


class Worker:
    def __init__(self, index: int):
        self.index = index
        self.pid = 0
        self.fd = -1  # read end of its pipe
        self.buf = b""
        self.ready = False
        self.ever_ready = False
        self.beat = 0.0
        self.failures = 0  # consecutive start failures
        self.last_error = ""
        self.started = 0.0


def run(cfg, argv) -> int:
    from lb.limiting.keys import draw_label_secret

    draw_label_secret()  # before any fork: one key-label secret for every worker
    listeners = _listeners(cfg)
    host, port = listeners[0].getsockname()[:2]
    cfg = replace(cfg, listen=(host, port))
    argv = list(argv or []) + ["--listen", hostport(host, port)]  # a worker's reload keeps this port
    shared = _shared_tables(cfg)  # before any fork: the workers must inherit the same mappings
    if cfg.tls_cert:
        _inherit_tls(cfg)
    rundir = tempfile.mkdtemp(prefix="edge-workers-")
    offer = handover.Offer((host, port), listeners, cfg.takeover_socket)  # for the next --takeover: these very sockets
    try:
        sup = _Supervisor(cfg, argv, listeners, rundir, shared, offer)
        for s in PASSED_ON:
            signal.signal(s, sup.on_signal)
        sup.start_all()
        log.info("listening on %s with %d workers (supervisor pid %d)", hostport(host, port), cfg.workers, os.getpid())
        code = sup.supervise()
    finally:
        offer.close()
        for x in listeners:
            x.close()
        shutil.rmtree(rundir, ignore_errors=True)
    log.info("all workers stopped")
    return code


def _listeners(cfg) -> list[socket.socket]:
    """One listening socket per worker (SO_REUSEPORT: the kernel spreads connections over them), held here so
    a restarted worker finds its queue and a --takeover can be handed them: the old edge's own, when it offers
    them (lb/process/handover.py; more than workers when it ran more), else bound here. A StartError when the
    port is taken."""
    from lb.process.app import refuse_if_held

    got = handover.fetch(cfg.listen, cfg.takeover_socket) if cfg.takeover else None
    if got:
        handover.handed_over = True  # more than workers: shared out among them (handover.share)
    else:
        refuse_if_held("--listen", cfg.listen, cfg)  # a second edge must not join this port unasked
        got = []
    if cfg.admin and cfg.admin[1]:
        for i in range(cfg.workers):  # here, one line, rather than a worker's crash loop
            refuse_if_held("--admin", (cfg.admin[0], cfg.admin[1] + i), cfg)
    try:
        while len(got) < cfg.workers:  # port 0: the first picks it, the others join it
            got.append(_listen(cfg, got[0].getsockname()[1] if got else cfg.listen[1]))
    except StartError:
        for x in got:
            x.close()
        raise
    return got


def _listen(cfg, port: int) -> socket.socket:
    from lb.process.app import SHARED_ONLY, Server

    sock = socket.socket(family(cfg.listen[0]))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    bind_options(sock, cfg.listen[0])  # the same V6ONLY for all of them, or no sharing
    try:
        sock.bind((cfg.listen[0], port))
        sock.listen(Server.request_queue_size)
    except OSError as e:
        sock.close()
        raise StartError(
            f"--listen {hostport(cfg.listen[0], port)}: {e.strerror or e}{SHARED_ONLY if cfg.takeover else ''}"
        ) from None
    return sock


def _shared_tables(cfg):
    """The shared-memory tables the workers count in together (memory store): limits and in-flight counts."""
    from lb.limiting.stage import SharedTables

    shared = SharedTables()
    if cfg.store == "memory" and (cfg.limit or cfg.rules or any(k.limit for k in cfg.keys)):
        shared = shared._replace(limits=_share_limits(cfg))
    if cfg.store == "memory":  # in-flight counts across workers (also for a reload that adds them)
        from limiter.concurrency import SharedTable

        rows = min(1 << 16, max(1024, 2 * cfg.workers * cfg.max_connections))
        shared = shared._replace(inflight=SharedTable(rows))
    return shared


def _inherit_tls(cfg) -> None:
    """One TLS context for every worker to inherit, so one set of session-ticket keys (lb/http/tls.py)."""
    from lb.config.check import certificate_warnings
    from lb.config.load import tls_listener
    from lb.errors import ConfigError
    from lb.http import tls

    try:
        tls.inherited = tls_listener(cfg)
    except ConfigError as e:
        raise StartError(str(e)) from None
    for w in certificate_warnings(cfg):
        log.warning("%s", w)


class _Supervisor:
    """The workers' lives after the listeners are open: start them, pass signals on, tell systemd, restart
    the dead ones (or give up on a crash loop), and wait for all of them once stopping."""

    def __init__(self, cfg, argv, listeners, rundir: str, shared, offer):
        self.cfg, self.argv, self.listeners, self.rundir, self.shared = cfg, argv, listeners, rundir, shared
        self.offer = offer
        self.workers = [Worker(i) for i in range(cfg.workers)]
        self.by_pid: dict[int, Worker] = {}
        self.got: list[int] = []
        self.stopping = False
        self.announced = False
        self.pending_hup = False
        self.deaths: deque[float] = deque()
        self.wd = watchdog_interval()
        self.last_ping = 0.0
        self.code = 0

    def on_signal(self, signum, frame) -> None:
        self.got.append(signum)  # handled in the loop: a handler must not fork or log

    def start_all(self) -> None:
        for w in self.workers:
            self.start(w)
        if self.cfg.tls_cert:
            # A worker restarted later reads the certificates from disk itself, as before: the files may have
            # been replaced (and reloaded) since, and a stale copy must not come back (it loses the shared keys).
            from lb.http import tls

            tls.inherited = None

    def start(self, w: Worker) -> None:
        pause = w.started + 1.0 - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # a worker that dies at once is not restarted in a tight loop
        w.started = time.monotonic()
        r, wfd = os.pipe()
        parent = os.getpid()
        # Until the child has its own dispositions, a signal for it must wait (blocked, not lost): with this
        # process's handlers it would only land in the child's copy of self.got, and the worker serve on.
        signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
        pid = os.fork()
        if pid == 0:
            _own_signals()
            _die_with(parent)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)  # one that came meanwhile acts now
            _child(
                w.index,
                wfd,
                [x.fd for x in self.workers if x.fd >= 0] + [r] + self.offer.fds(),
                self.listeners,
                self.cfg,
                self.argv,
                self.rundir,
                self.shared,
            )
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
        os.close(wfd)
        w.pid, w.fd, w.buf, w.ready, w.beat = pid, r, b"", False, 0.0
        self.by_pid[pid] = w

    def send_all(self, signum: int) -> None:
        for pid in self.by_pid:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def stop_all(self, reason: str) -> None:
        if not self.stopping:
            self.stopping = True
            log.info("%s: stopping %d workers", reason, len(self.by_pid))
            sdnotify.notify("STOPPING=1")
            self.send_all(signal.SIGTERM)
            # The workers' copies serve out the grace; these would keep a queue open nobody accepts from.
            # (After a --takeover the new edge holds them: nothing queued is lost.)
            self.offer.close()
            for x in self.listeners:
                x.close()

    def supervise(self) -> int:
        """Until the last worker is gone; the exit code (1 after a crash loop)."""
        while self.by_pid:
            self._pass_signals()
            _read_pipes(self.workers, 0.05, self.offer)
            self._tell_systemd()
            self._reap()
        return self.code

    def _pass_signals(self) -> None:
        while self.got:
            signum = self.got.pop(0)
            if signum == signal.SIGHUP:
                logs.reopen_stderr()
                if self.announced:
                    log.info("SIGHUP: reloading %d workers", len(self.by_pid))
                    self.send_all(signum)
                else:
                    self.pending_hup = True  # a worker still starting would die of it: after READY
            elif signum == signal.SIGUSR1:
                logs.reopen_stderr()
                self.send_all(signum)
            elif not self.stopping:
                self.stop_all(signal.Signals(signum).name)

    def _tell_systemd(self) -> None:
        """READY=1 once every worker is ready (then a SIGHUP held during start-up); WATCHDOG=1 while all beat."""
        if not self.announced and all(w.ready for w in self.workers):
            self.announced = True
            self.offer.publish()  # from now on the next --takeover is handed these listeners (not before:
            # a supervisor that fails to start must not replace the offer of the edge still serving)
            log.info("all %d workers ready", len(self.workers))
            sdnotify.notify("READY=1", f"STATUS={self.cfg.workers} workers")
            if self.pending_hup:
                self.pending_hup = False
                log.info("SIGHUP: reloading %d workers (it came during start-up)", len(self.by_pid))
                self.send_all(signal.SIGHUP)
        now = time.monotonic()
        wd = self.wd
        if wd and self.announced and not self.stopping and now - self.last_ping >= wd:
            if all(now - w.beat < 2 * wd + 2 for w in self.workers if w.ready):
                sdnotify.notify("WATCHDOG=1")
                self.last_ping = now

    def _reap(self) -> None:
        """Every worker that exited: its last lines read, and restarted unless stopping or in a crash loop."""
        now = time.monotonic()
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
                self.by_pid.clear()
            if pid == 0:
                break
            w = self.by_pid.pop(pid, None)
            if w is None:
                continue
            _read_pipes([w], 0)
            os.close(w.fd)
            w.fd = -1
            if not self.stopping and self._may_restart(w, pid, exit_reason(status), now):
                self.start(w)

    def _may_restart(self, w: Worker, pid: int, why: str, now: float) -> bool:
        """Log the exit; False (and stop the others) when it makes a crash loop."""
        if not w.ready:
            w.failures += 1
            log.error(
                "worker %d (pid %d) failed to start (%s): %s",
                w.index,
                pid,
                why,
                w.last_error or "no reason given (see its lines above)",
            )
            if w.failures >= START_FAILURES:
                log.error("worker %d failed to start %d times in a row; giving up", w.index, w.failures)
                self.code = 1
                self.stop_all("crash loop")
                return False
        else:
            log.warning("worker %d (pid %d) exited (%s); restarting it", w.index, pid, why)
        deaths = self.deaths
        deaths.append(now)
        while deaths and now - deaths[0] > DEATH_WINDOW:
            deaths.popleft()
        if len(deaths) >= DEATHS:
            log.error("%d worker exits within %gs; giving up", len(deaths), DEATH_WINDOW)
            self.code = 1
            self.stop_all("crash loop")
            return False
        return True


def _read_pipes(workers, timeout: float, offer=None) -> None:
    """Each worker's lines (and a --takeover asking for the listeners, answered here: no thread in this process)."""
    fds = {w.fd: w for w in workers if w.fd >= 0}
    if not fds and (offer is None or offer.sock is None):
        time.sleep(timeout)
        return
    try:
        ready = handover.readable(offer, timeout, list(fds))
    except InterruptedError:
        return
    for fd in ready:
        w = fds[fd]
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        w.buf += data
        *lines, w.buf = w.buf.split(b"\n")
        for line in lines:
            msg = line.decode("utf-8", "replace")
            if msg == "ready":
                w.ready = w.ever_ready = True
                w.failures = 0
                w.beat = time.monotonic()
            elif msg == "beat":
                w.beat = time.monotonic()
            elif msg.startswith("fail "):
                w.last_error = msg[5:]
        if not data and fd in fds:
            # EOF: the worker is gone; waitpid will say how
            pass


def _own_signals() -> None:
    """In the forked worker, before anything: a worker's dispositions instead of the supervisor's handlers
    (TERM/INT stop it at once until serve() installs its own; HUP/USR1 wait for serve())."""
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)
    for s in (signal.SIGHUP, signal.SIGUSR1):
        signal.signal(s, signal.SIG_IGN)


def _die_with(parent: int) -> None:
    """In the forked worker, right after its signals: SIGTERM when the supervisor dies, so a SIGKILLed supervisor (kill -9,
    the OOM killer) leaves no orphans holding the port with nothing to restart or stop them; the worker
    drains as on any SIGTERM. The kernel only sends it for a death after the prctl: a supervisor already
    gone (the worker has been reparented) means stop now, before serving anything."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the orphan stays, as before
        return
    if os.getppid() != parent:
        os._exit(0)


def _child(index: int, wfd: int, close_fds, listeners, cfg, argv, rundir, shared) -> None:
    """In the forked worker: never returns."""
    code = 1
    try:
        for fd in close_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        mine = handover.share(listeners, cfg.workers)[index]  # App serves these, binds nothing
        for x in listeners:
            if x not in mine:
                x.close()
        handover.inherited = mine
        for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            os.environ.pop(k, None)  # the supervisor speaks to systemd for everyone
        logs.setup(worker=index)
        from lb.process.serve import serve

        try:
            code = serve(cfg, argv, worker=index, channel=wfd, rundir=rundir, shared=shared)
        except StartError as e:
            _fail(wfd, f"cannot start: {e}")
        except Exception as e:
            log.exception("cannot start")
            _fail(wfd, f"cannot start: {type(e).__name__}: {e}", logged=True)
    finally:
        os._exit(code)


def _fail(wfd: int, line: str, logged: bool = False) -> None:
    if not logged:
        log.error("%s", line)
    try:
        os.write(wfd, ("fail " + logs.redact(line).replace("\n", " ") + "\n").encode()[:4000])
    except OSError:
        pass


def _share_limits(cfg):
    """The memory store with N workers: one shared table (limiter.shm), nginx's limit_req_zone.  Slots
    for max_keys keys (at most 64 MiB), each sized for the largest state the configured limits need (the
    default, per-key limits, key tiers and every [[rules]] table, each with its algorithm; a sliding log
    holds its limit's worth of instants)."""
    from limiter import ALGORITHMS, parse_rate, shm
    from limiter.shaping import shaped

    limits = [
        (cfg.algorithm, r, 1, cfg.max_delay)
        for r in (cfg.limit, *(rate for _, rate in cfg.key_limits), *(k.limit for k in cfg.keys))
        if r
    ]
    limits += [
        (s.algorithm or cfg.algorithm, s.limit, s.cost, 0.0 if s.dry_run else cfg.max_delay)
        for s in cfg.rules
        if s.limit
    ]
    need = 24
    for algorithm, rate, cost, delay in limits:  # delay mode: a sliding log holds its reservations too
        n, period = parse_rate(rate)
        need = max(need, shm.state_size(shaped(ALGORITHMS[algorithm](n, period), cost, delay)))
    slots = max(1024, min(cfg.max_keys, (64 << 20) // (need + 24)))
    arena = shm.Arena(slots, need)
    log.info(
        "limits shared by %d workers in %d KiB of shared memory (%d keys, %d bytes of state each)",
        cfg.workers,
        arena.bytes >> 10,
        arena.slots,
        need,
    )
    return arena
