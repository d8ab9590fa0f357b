"""--workers N: an admin drain/enable received by one worker acts on all of them (HAProxy's runtime API
acts on the whole process; an operator draining before a deploy means the whole edge).

Each worker listens on a unix socket in the supervisor's private directory (worker-I.ctl, next to the
metrics one), takes one line "drain ROUTE" or "enable ROUTE", applies it locally only (never passes it
on: no loops) and answers one line, "ok" or the reason. The worker whose admin port got the POST applies
it itself, records it in the drained set (drained.json, same directory, for a worker started later),
then sends it to every other worker's socket. Admin only: nothing here is on a request's path.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading

log = logging.getLogger("edge")

TIMEOUT = 3.0  # per worker: a worker that is restarting does not hold the admin call for long


def ctl_path(rundir: str, worker: int) -> str:
    return os.path.join(rundir, f"worker-{worker}.ctl")


def serve_unix(path: str, handle, name: str) -> socket.socket:
    """Call handle(conn) for each connection to a unix socket at path (in the supervisor's private directory),
    one at a time on a thread of its own; these sockets between workers are admin-only (metrics too)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)

    def loop():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(TIMEOUT)
                    handle(conn)
                except OSError:
                    pass
                except Exception:  # a bug here must cost one call, not every later one
                    log.exception("%s failed", name)

    threading.Thread(target=loop, name=name, daemon=True).start()
    return srv


def listen(path: str, apply) -> socket.socket:
    """Serve apply(action, route) -> None (done) or a reason (not done) on the unix socket at path."""

    def handle(conn):
        line = conn.makefile("rb").readline(256).decode("ascii", "replace").split()
        why = apply(*line) if len(line) == 2 and line[0] in ("drain", "enable") else "bad command"
        conn.sendall(f"{why or 'ok'}\n".encode())

    return serve_unix(path, handle, "admin fan-out")


def send(rundir: str, workers, action: str, route: str) -> dict[int, str]:
    """Send action to each of workers; {worker: why} for those that did not confirm it."""
    failed = {}
    for i in workers:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(TIMEOUT)
                s.connect(ctl_path(rundir, i))
                s.sendall(f"{action} {route}\n".encode())
                answer = s.makefile("rb").readline(256).decode("utf-8", "replace").strip()
        except OSError as e:
            answer = f"not answering ({e.strerror or e}; restarting?)"
        if answer != "ok":
            failed[i] = answer or "no answer"
    return failed


# The drained set, in the same private directory, for a worker that starts later: one the supervisor
# restarted after a crash would otherwise come back with nothing drained and send the drained backend
# new requests again. Written by the worker whose admin port got the call, before it passes the call on.


def _drained_path(rundir: str) -> str:
    return os.path.join(rundir, "drained.json")


def remember(rundir: str, route: str, drained: bool) -> None:
    """Add route to (or remove it from) the drained set, under a lock (two admin calls at once)."""
    path = _drained_path(rundir)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        routes = set(drained_routes(rundir))
        (routes.add if drained else routes.discard)(route)
        with open(path + ".tmp", "w") as f:
            json.dump(sorted(routes), f)
        os.replace(path + ".tmp", path)


def drained_routes(rundir: str) -> list[str]:
    try:
        with open(_drained_path(rundir)) as f:
            return list(json.load(f))
    except FileNotFoundError:
        return []
