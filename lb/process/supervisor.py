"""--workers N: N edge processes on one port (SO_REUSEPORT), supervised by this parent.

The parent reserves the port (bound, never listening, so the kernel sends it no connections; with
--listen HOST:0 this is how every worker gets the same port), forks the workers and speaks to systemd
for all of them. Each worker has a pipe back: "ready" once it listens (and its store check passed),
"beat" while its accept loop goes round, "fail <why>" when it could not start.

- READY=1 once every worker said ready; WATCHDOG=1 only while every ready worker beats; one STOPPING=1.
- A worker that fails to start is logged with its own reason. Three failures of one worker before it
  was ever ready, or five deaths within 30 s, is a crash loop: the supervisor stops the others and
  exits 1, so systemd's Restart= (and the operator) see it instead of a healthy-looking service.
- SIGHUP is passed on (each worker reloads; one arriving during start-up waits until all are ready);
  SIGUSR1 reopens the logs here and in every worker; SIGTERM/SIGINT are passed on and the workers
  drain. The parent holds no threads when it forks.
- Metrics: each worker publishes its numbers on a unix socket in a private directory; worker 0's admin
  port sums them (one scrape target).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import tempfile
import time
from collections import deque
from dataclasses import replace

from lb import logs
from lb.process import sdnotify
from lb.netaddr import bind_options, family, hostport
from lb.process.serve import watchdog_interval
from lb.errors import StartError


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

START_FAILURES = 3          # consecutive failures of a worker that never became ready
DEATHS, DEATH_WINDOW = 5, 30.0


class Worker:
    def __init__(self, index: int):
        self.index = index
        self.pid = 0
        self.fd = -1               # read end of its pipe
        self.buf = b""
        self.ready = False
        self.ever_ready = False
        self.beat = 0.0
        self.failures = 0          # consecutive start failures
        self.last_error = ""
        self.started = 0.0


def run(cfg, argv) -> int:
    from lb.limiting.keys import draw_label_secret
    from lb.limiting.stage import SharedTables
    from lb.process.app import SHARED_ONLY, refuse_if_held
    draw_label_secret()                # before any fork: one key-label secret for every worker
    refuse_if_held("--listen", cfg.listen, cfg)      # a second edge must not join this port unasked
    if cfg.admin and cfg.admin[1]:
        for i in range(cfg.workers):                  # here, one line, rather than a worker's crash loop
            refuse_if_held("--admin", (cfg.admin[0], cfg.admin[1] + i), cfg)
    reserve = socket.socket(family(cfg.listen[0]))
    reserve.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    bind_options(reserve, cfg.listen[0])      # the same V6ONLY as the workers' sockets, or no sharing
    try:
        reserve.bind(cfg.listen)
    except OSError as e:
        raise StartError(f"--listen {hostport(*cfg.listen)}: {e.strerror or e}"
                         f"{SHARED_ONLY if cfg.takeover else ''}") from None
    host, port = reserve.getsockname()[:2]
    cfg = replace(cfg, listen=(host, port))
    argv = list(argv or []) + ["--listen", hostport(host, port)]   # a worker's reload keeps this port
    shared = SharedTables()                # before any fork: the workers must inherit the same mappings
    if cfg.store == "memory" and (cfg.limit or cfg.rules or any(k.limit for k in cfg.keys)):
        shared = shared._replace(limits=_share_limits(cfg))
    if cfg.store == "memory":              # in-flight counts across workers (also for a reload that adds them)
        from limiter.concurrency import SharedTable
        rows = min(1 << 16, max(1024, 2 * cfg.workers * cfg.max_connections))
        shared = shared._replace(inflight=SharedTable(rows))
    if cfg.tls_cert:
        # before any fork: every worker inherits one context, so one set of session-ticket keys (lb/http/tls.py)
        from lb.http import tls
        from lb.config.check import certificate_warnings
        from lb.config.load import tls_listener
        from lb.errors import ConfigError
        try:
            tls.inherited = tls_listener(cfg)
        except ConfigError as e:
            raise StartError(str(e)) from None
        for w in certificate_warnings(cfg):
            log.warning("%s", w)
    rundir = tempfile.mkdtemp(prefix="edge-workers-")
    workers = [Worker(i) for i in range(cfg.workers)]
    by_pid: dict[int, Worker] = {}
    got: list[int] = []
    stopping = False
    announced = False
    pending_hup = False
    deaths: deque[float] = deque()
    wd = watchdog_interval()
    last_ping = 0.0
    code = 0

    def on_signal(signum, frame):
        got.append(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(s, on_signal)

    def start(w: Worker) -> None:
        pause = w.started + 1.0 - time.monotonic()
        if pause > 0:
            time.sleep(pause)              # a worker that dies at once is not restarted in a tight loop
        w.started = time.monotonic()
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child(w.index, wfd, [x.fd for x in workers if x.fd >= 0] + [r], reserve, cfg, argv, rundir, shared)
        os.close(wfd)
        w.pid, w.fd, w.buf, w.ready, w.beat = pid, r, b"", False, 0.0
        by_pid[pid] = w

    def send_all(signum: int) -> None:
        for pid in by_pid:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def stop_all(reason: str) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            log.info("%s: stopping %d workers", reason, len(by_pid))
            sdnotify.notify("STOPPING=1")
            send_all(signal.SIGTERM)

    for w in workers:
        start(w)
    if cfg.tls_cert:
        # A worker restarted later reads the certificates from disk itself, as before: the files may have
        # been replaced (and reloaded) since, and a stale copy must not come back (it loses the shared keys).
        from lb.http import tls
        tls.inherited = None
    log.info("listening on %s with %d workers (supervisor pid %d)", hostport(host, port), cfg.workers, os.getpid())
    try:
        while by_pid:
            while got:
                signum = got.pop(0)
                if signum == signal.SIGHUP:
                    logs.reopen_stderr()
                    if announced:
                        log.info("SIGHUP: reloading %d workers", len(by_pid))
                        send_all(signum)
                    else:
                        pending_hup = True     # a worker still starting would die of it: after READY
                elif signum == signal.SIGUSR1:
                    logs.reopen_stderr()
                    send_all(signum)
                elif not stopping:
                    stop_all(signal.Signals(signum).name)
            _read_pipes(workers, 0.05)
            if not announced and all(w.ready for w in workers):
                announced = True
                log.info("all %d workers ready", len(workers))
                sdnotify.notify("READY=1", f"STATUS={cfg.workers} workers")
                if pending_hup:
                    pending_hup = False
                    log.info("SIGHUP: reloading %d workers (it came during start-up)", len(by_pid))
                    send_all(signal.SIGHUP)
            now = time.monotonic()
            if wd and announced and not stopping and now - last_ping >= wd:
                if all(now - w.beat < 2 * wd + 2 for w in workers if w.ready):
                    sdnotify.notify("WATCHDOG=1")
                    last_ping = now
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    pid = 0
                    by_pid.clear()
                if pid == 0:
                    break
                w = by_pid.pop(pid, None)
                if w is None:
                    continue
                _read_pipes([w], 0)
                os.close(w.fd)
                w.fd = -1
                if stopping:
                    continue
                why = exit_reason(status)
                if not w.ready:
                    w.failures += 1
                    log.error("worker %d (pid %d) failed to start (%s): %s", w.index, pid, why,
                              w.last_error or "no reason given (see its lines above)")
                    if w.failures >= START_FAILURES:
                        log.error("worker %d failed to start %d times in a row; giving up", w.index, w.failures)
                        code = 1
                        stop_all("crash loop")
                        continue
                else:
                    log.warning("worker %d (pid %d) exited (%s); restarting it", w.index, pid, why)
                deaths.append(now)
                while deaths and now - deaths[0] > DEATH_WINDOW:
                    deaths.popleft()
                if len(deaths) >= DEATHS:
                    log.error("%d worker exits within %gs; giving up", len(deaths), DEATH_WINDOW)
                    code = 1
                    stop_all("crash loop")
                    continue
                start(w)
    finally:
        reserve.close()
        shutil.rmtree(rundir, ignore_errors=True)
    log.info("all workers stopped")
    return code


def _read_pipes(workers, timeout: float) -> None:
    fds = {w.fd: w for w in workers if w.fd >= 0}
    if not fds:
        time.sleep(timeout)
        return
    try:
        ready, _, _ = select.select(list(fds), [], [], timeout)
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


def _child(index: int, wfd: int, close_fds, reserve, cfg, argv, rundir, shared) -> None:
    """In the forked worker: never returns."""
    code = 1
    try:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_DFL)
        for s in (signal.SIGHUP, signal.SIGUSR1):
            signal.signal(s, signal.SIG_IGN)     # until serve() installs its handlers
        for fd in close_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        reserve.close()
        for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            os.environ.pop(k, None)              # the supervisor speaks to systemd for everyone
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
    limits = [(cfg.algorithm, r, 1, cfg.max_delay) for r in (cfg.limit, *(rate for _, rate in cfg.key_limits),
                                                             *(k.limit for k in cfg.keys)) if r]
    limits += [(s.algorithm or cfg.algorithm, s.limit, s.cost, 0.0 if s.dry_run else cfg.max_delay)
               for s in cfg.rules if s.limit]
    need = 24
    for algorithm, rate, cost, delay in limits:   # delay mode: a sliding log holds its reservations too
        n, period = parse_rate(rate)
        need = max(need, shm.state_size(shaped(ALGORITHMS[algorithm](n, period), cost, delay)))
    slots = max(1024, min(cfg.max_keys, (64 << 20) // (need + 24)))
    arena = shm.Arena(slots, need)
    log.info("limits shared by %d workers in %d KiB of shared memory (%d keys, %d bytes of state each)",
             cfg.workers, arena.bytes >> 10, arena.slots, need)
    return arena
