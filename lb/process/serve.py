"""One serving process: pin it, build the App, install the signals, say when it is ready, serve, drain.

Used directly by edge.py (one process) and by lb/process/supervisor.py in each forked worker. A worker does
not talk to systemd: it tells the supervisor on a pipe ("ready", "beat", "fail <why>") and the
supervisor speaks for all of them (one READY=1, one STOPPING=1, WATCHDOG=1 only while every worker
beats).

Signals: TERM/INT drain (readiness fails at once; the listener closes `grace` seconds later); HUP
reloads the configuration and reopens the logs; USR1 reopens the logs (logrotate's postrotate habit).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from lb.netaddr import migrate_req
from lb.process import gctune, memory, sdnotify, signals
from lb.process.signals import HANDLED

log = logging.getLogger("edge")


def pin_to_one_cpu(setting: str, worker: int | None) -> int | None:
    """Run this process's threads on one CPU. Only one thread runs Python at a time (the GIL), and
    handing it between threads on different CPUs costs a cross-CPU wake-up each time, which on a VM
    is a VM exit: measured here, pinning gives 2.1-2.3x the requests per second (README). Called
    before any thread starts, so every thread inherits the mask. Like nginx's worker_cpu_affinity."""
    allowed = sorted(os.sched_getaffinity(0))
    if setting == "off" or len(allowed) < 2:
        return None
    cpus = allowed if setting == "auto" else [c for c in map(int, setting.split(",")) if c in allowed]
    if not cpus:
        return None
    # worker i takes the i-th CPU; a single process picks by pid, so separate edges spread out
    cpu = cpus[(worker if worker is not None else os.getpid()) % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return cpu


def batch_scheduling() -> str | None:
    """SCHED_BATCH for this thread and every thread it starts (--sched-batch): the scheduler no longer lets a
    woken thread preempt the running one. Under the GIL, a wakee that preempts the holder can only go to
    sleep on the GIL, and so does every thread that runs before the holder has its CPU back (at -c512, 1-6
    preemptions per request, each a cascade of futile switches). Unprivileged; called before any thread starts (and before the logs are
    set up: serve() says what came of it). None when done, else why not."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (OSError, AttributeError) as e:  # not Linux, a seccomp profile, or SCHED_IDLE without CAP_SYS_NICE
        return f"{str(e) or type(e).__name__}; the threads keep {policy_name()}, the policy the edge was started under"
    return None


def policy_name() -> str:
    """This thread's scheduling policy, by name (what a refused --sched-batch leaves the threads under)."""
    try:
        policy = os.sched_getscheduler(0)
    except (OSError, AttributeError):
        return "the platform's policy"
    names = {getattr(os, n, None): n for n in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE", "SCHED_FIFO", "SCHED_RR")}
    return names.get(policy, f"policy {policy}")


def say_where(cfg, cpu: int | None, refused: str | None) -> None:
    """The log lines of pin_to_one_cpu's and batch_scheduling's outcome (once the logs are set up)."""
    if cpu is not None:
        log.info("on CPU %d (--cpu-affinity %s)", cpu, cfg.cpu_affinity)
    if cfg.sched_batch:
        if refused is None:
            log.info("threads under SCHED_BATCH (--sched-batch)")
        else:
            log.warning("--sched-batch: SCHED_BATCH refused (%s)", refused)


def watchdog_interval() -> float | None:
    """Half of systemd's WatchdogSec for this process, or None when no watchdog is asked for."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.05, int(usec) / 2e6)
    except ValueError:
        return None


def serve(
    cfg, argv, worker: int | None = None, channel: int | None = None, rundir: str | None = None, shared=None
) -> int:
    """Serve until told to stop, then drain; 0 on a clean stop. Raises StartError before serving.

    channel: (workers) the pipe to the supervisor; rundir: where workers publish their metrics;
    shared: (workers) the tables the supervisor created for them before forking (SharedTables)."""
    from lb.process.app import App

    cpu = pin_to_one_cpu(cfg.cpu_affinity, worker)
    refused = batch_scheduling() if cfg.sched_batch else None
    memory.limit_arenas()  # before the connection threads: see lb/process/memory.py
    early: list[int] = []  # a signal that came while the App was being built: acted on once it is
    app = None
    lock = threading.Lock()  # on_signal runs on the signals thread, the App is built on this one

    def on_signal(signum, frame):
        with lock:
            if app is None:
                early.append(signum)
                return
        if signum in (signal.SIGTERM, signal.SIGINT):
            log.info(
                "received %s: draining (readiness off now; listener closes in %gs; up to %gs for requests)",
                signal.Signals(signum).name,
                app.cfg.grace,
                app.cfg.drain_timeout,
            )
            threading.Thread(target=app.stop_accepting, name="stop", daemon=True).start()
        elif signum == signal.SIGHUP:  # reload, and reopen the logs as nginx does on HUP
            threading.Thread(target=gctune.after(app.reload, app.reopen_logs), name="reload", daemon=True).start()
        elif signum == signal.SIGUSR1:
            threading.Thread(target=app.reopen_logs, name="reopen", daemon=True).start()

    for s in HANDLED:
        signal.signal(s, on_signal)
    signals.route(lambda signum: on_signal(signum, None))  # before any thread: none of them reads with EINTR
    built = App(cfg, argv, worker=worker, rundir=rundir, shared=shared)
    with lock:
        app = built
        pending = early[:]
    say_where(cfg, cpu, refused)
    if cfg.takeover and not worker and not built.handed_over and migrate_req() == "0":
        log.warning(  # (a listener handed over by the old edge has no such instant)
            "--takeover: net.ipv4.tcp_migrate_req = 0: a connection that reaches the old edge in the "
            "instant its listener closes is reset by the kernel; set it to 1 (Linux 5.14+) for none"
        )
    for signum in pending:
        on_signal(signum, None)

    def tell(msg: str) -> None:
        if channel is not None:
            try:
                os.write(channel, (msg.replace("\n", " ") + "\n").encode()[:4000])
            except OSError:
                pass

    def when_ready():
        app.wait_until_ready()  # e.g. fail-closed: the store must answer first
        if app.stopping:
            return
        tell("ready")
        app.offer.serve_in_thread()  # the next --takeover is handed the listener (workers: none; the supervisor's)
        if channel is None:  # (workers: the supervisor says "all N workers ready")
            log.info("ready")  # e.g. for --takeover: the old edge may be stopped from here on
        sdnotify.notify("READY=1", f"STATUS=serving {len(app.balancer.backends)} backends")

    threading.Thread(target=when_ready, name="ready", daemon=True).start()
    memory.start_trimmer()  # RSS returns after a burst of large bodies (lb/process/memory.py)
    period = watchdog_interval() if channel is None else 1.0
    if period:

        def ping():
            sdnotify.notify("WATCHDOG=1") if channel is None else tell("beat")

        threading.Thread(target=_watchdog, args=(app, period, ping), name="watchdog", daemon=True).start()
    app.serve_forever()
    app.drain()
    log.info("stopped")
    return 0


def _watchdog(app, period: float, ping) -> None:
    """Ping only while the accept loop goes round (it passes service_actions at least every 0.25 s)
    or a drain is under way; a wedged accept loop stops the pings and systemd restarts the edge."""
    stale = max(5.0, 2 * period)
    while True:
        if app.edge.draining or time.monotonic() - app.loop_seen < stale:
            ping()
        time.sleep(period)
