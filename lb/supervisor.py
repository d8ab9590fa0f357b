"""--workers N: N edge processes on one port (SO_REUSEPORT), supervised by this parent.

The parent reserves the port (bound, never listening, so the kernel sends it no connections; with
--listen HOST:0 this is how every worker gets the same port), forks the workers, restarts a worker that
dies (at most once a second), passes SIGHUP on (each worker reloads), and on SIGTERM/SIGINT passes it
on and waits for the workers to drain. It holds no threads when it forks.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import replace

from . import sdnotify
from .netaddr import bind_options, family, hostport

log = logging.getLogger("edge")


def run(cfg, argv) -> int:
    reserve = socket.socket(family(cfg.listen[0]))
    reserve.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    bind_options(reserve, cfg.listen[0])      # the same V6ONLY as the workers' sockets, or no sharing
    reserve.bind(cfg.listen)
    host, port = reserve.getsockname()[:2]
    cfg = replace(cfg, listen=(host, port))
    argv = list(argv or []) + ["--listen", hostport(host, port)]   # a worker's reload keeps this port
    children: dict[int, int] = {}          # pid -> worker index
    last_start: dict[int, float] = {}
    stopping = False
    got: list[int] = []

    def on_signal(signum, frame):
        got.append(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)

    def start(i: int) -> None:
        pause = last_start.get(i, 0) + 1.0 - time.monotonic()
        if pause > 0:
            time.sleep(pause)              # a worker that dies at once is not restarted in a tight loop
        last_start[i] = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    signal.signal(s, signal.SIG_DFL)
                reserve.close()
                from edge import serve
                code = serve(cfg, argv, reuse_port=True, worker=i)
            finally:
                os._exit(code)
        children[pid] = i

    for i in range(cfg.workers):
        start(i)
    log.info("listening on %s with %d workers (supervisor pid %d)", hostport(host, port), cfg.workers, os.getpid())
    sdnotify.notify("READY=1", f"STATUS={cfg.workers} workers")
    while children:
        while got:
            signum = got.pop(0)
            if signum == signal.SIGHUP:
                log.info("SIGHUP: reloading %d workers", len(children))
            else:
                stopping = True
                sdnotify.notify("STOPPING=1")
            for pid in children:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
            continue
        i = children.pop(pid)
        if not stopping:
            log.warning("worker %d (pid %d) exited (%s); restarting it", i, pid,
                        f"status {os.waitstatus_to_exitcode(status)}")
            start(i)
    reserve.close()
    log.info("all workers stopped")
    return 0
