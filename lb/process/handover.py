"""--takeover by handing the listening sockets over (HAProxy's `-x`): the same sockets, so no accept queue closes.

A serving edge offers its listening sockets on a Unix socket, `/tmp/edge-UID/takeover-NETNS-HOST-PORT.sock`
or [server] takeover_socket (its directory owned by the edge's user and writable by no one else, or it is
not used), once it is ready. A new edge started with --takeover on that address connects, asks, receives
the descriptors (SCM_RIGHTS), checks that each is a listening TCP socket on its --listen address, and
serves on them instead of binding. When the old edge is TERMed and closes its listener, the socket itself
stays open in the new edge: nothing queued on it is reset, whatever net.ipv4.tcp_migrate_req says. Only a
peer of the same uid (SO_PEERCRED) is answered, and the new edge only takes sockets from a peer of its own
uid in its own network namespace. No offer there (an older edge, another program, a stale file): the new
edge binds beside the old one with SO_REUSEPORT, as before.

With --workers the supervisor holds one listener per worker and offers those; a worker inherits its own
(`inherited`, set in the forked child) instead of binding. A new edge with fewer workers than the old one
serves the extra listeners too (Extra), one with more binds the rest beside them.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import stat
import struct
import threading
import time

from lb.netaddr import ip

log = logging.getLogger("edge")

ASK = b"edge listeners?\n"
ANSWER = b"edge listeners "  # + count + "\n", the descriptors attached
MAX_FDS = 256  # --workers' upper bound
TIMEOUT = 5.0

inherited: list[socket.socket] = []  # a worker's listeners, given by the supervisor before serve() (the first its own)
handed_over = False  # (workers) the supervisor's listeners are the old edge's, handed over


def take_inherited() -> list[socket.socket]:
    global inherited
    socks, inherited = inherited, []
    return socks


def listener(cfg, worker: int | None) -> tuple[list[socket.socket], bool]:
    """The sockets App serves instead of binding ([]: bind), and whether they are the old edge's: a worker's
    from the supervisor; a single process's from the edge it takes over, when that one offers them. Beyond
    the first, they are listeners of an old edge that ran more workers (Extra serves them)."""
    given = take_inherited()
    if worker is None and not given and cfg.takeover:
        got = fetch(cfg.listen, cfg.takeover_socket)
        if got:
            return got, True
    return given, handed_over


def share(listeners: list, workers: int) -> list[list]:
    """Worker i's listeners: its own (the i-th), and every workers-th one past the last worker's (handed over
    by an old edge that ran more workers), so every queue has a process that accepts from it."""
    return [[listeners[i]] + listeners[workers + i :: workers] for i in range(workers)]


class Extra:
    """Listeners served beside the server's own (handed over by an old edge with more workers): each accepted on
    a thread of its own and served by the server like its own connections, so none of their queues closes
    while the old edge drains. stop(): after serve_forever, the queued ones taken, then closed."""

    def __init__(self, server, socks: list[socket.socket]):
        self.server, self.socks = server, socks
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._serve, args=(x,), name="extra-listener", daemon=True) for x in socks
        ]
        for t in self.threads:
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        sock.setblocking(False)  # shared: another process may win the accept
        while not self.stopping.is_set():
            try:
                if select.select([sock], [], [], 0.25)[0]:
                    self._take(sock)
            except ValueError:  # closed under us at exit
                return
            except OSError:
                if sock.fileno() < 0:
                    return
                time.sleep(0.1)  # out of descriptors, say: they wait in the queue, as on the server's own

    def _take(self, sock: socket.socket) -> int:
        return take_queued(self.server, sock)

    def stop(self) -> int:
        """The connections queued on them, taken; the listeners closed. How many were taken."""
        self.stopping.set()
        for t in self.threads:
            t.join(1.0)
        n = 0
        for x in self.socks:
            try:
                n += self._take(x)
            except OSError:
                pass
            x.close()
        return n


def take_queued(server, sock: socket.socket) -> int:
    """Accept every connection waiting in a non-blocking listener's queue, each served by the server like its
    own; how many. An error other than an empty queue (out of descriptors, say) is the caller's."""
    n = 0
    while True:
        try:
            conn, addr = sock.accept()
        except (BlockingIOError, InterruptedError):
            return n
        conn.setblocking(True)
        try:
            server.process_request(conn, addr)
        except Exception:
            # A thread that cannot start (RLIMIT_AS, RLIMIT_NPROC, TasksMax): what socketserver's own accept
            # loop does, so the connection is logged, closed and counted off (once: process_request counted
            # it), and the drain (or the handed-over listener's thread) goes on with the rest of the queue.
            server.handle_error(conn, addr)
            server.shutdown_request(conn)
            continue
        n += 1


def runtime_dir() -> str:
    return f"/tmp/edge-{os.geteuid()}"


def path_for(addr, setting: str = "") -> str | None:
    """Where the edge serving ADDR offers its listeners: [server] takeover_socket, or one derived from ADDR
    (the same rule in the old edge and the new); None for "off"."""
    if setting == "off":
        return None
    if setting:
        return setting
    return os.path.join(runtime_dir(), f"takeover-{_netns()}{addr[0].replace(':', '_')}-{addr[1]}.sock")


def _netns() -> str:
    """This network namespace's id and a dash ("" where unreadable): 127.0.0.1:8080 in two namespaces is two
    addresses, and two offers."""
    try:
        return os.readlink("/proc/self/ns/net").partition("[")[2].rstrip("]") + "-"
    except OSError:
        return ""


def _private_dir(path: str, create: bool) -> str | None:
    """PATH's directory when only this user can write to it (owned by this uid, no group/other write, not a
    symlink); None (and a warning) else. create: make it first (0700) if missing."""
    d = os.path.dirname(os.path.abspath(path))
    if create:
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            log.warning("--takeover: cannot create %s (%s): listening sockets not offered", d, e.strerror or e)
            return None
    try:
        st = os.lstat(d)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        log.warning("--takeover: %s is not a directory only this user can write: not used for a handover", d)
        return None
    return d


def _peer_uid(conn: socket.socket) -> int:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def _same_netns(pid: int) -> bool:
    """False when PID is in another network namespace; True when it is ours or that cannot be read."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
    except OSError:
        return True


def _peer_pid(conn: socket.socket) -> int:
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]


class Offer:
    """The old edge's side: answers each same-uid peer that asks with the listening sockets. Published once
    this edge is ready, not before: one that fails to start must not have replaced the offer of the edge
    still serving."""

    def __init__(self, addr, listeners: list[socket.socket], setting: str = ""):
        self.listeners = listeners
        self.path = path_for(addr, setting) or ""
        self.sock: socket.socket | None = None
        self._ino = 0
        self.closed = False

    def publish(self) -> None:
        if self.closed or self.sock is not None or not self.listeners or not self.path:
            return
        if _private_dir(self.path, create=True) is None:
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                os.unlink(self.path)  # a stale one, or the edge this one took over from: the newest offers
            except FileNotFoundError:
                pass
            old = os.umask(0o177)
            try:
                s.bind(self.path)
            finally:
                os.umask(old)
            s.listen(8)
            self._ino = os.stat(self.path).st_ino
        except OSError as e:
            s.close()
            log.warning("--takeover: cannot offer the listening sockets on %s: %s", self.path, e.strerror or e)
            return
        self.sock = s

    def fds(self) -> list[int]:
        """To close in a forked worker (which must neither answer nor remove the offer)."""
        return [self.sock.fileno()] if self.sock is not None else []

    def fileno(self) -> int:
        assert self.sock is not None
        return self.sock.fileno()

    def serve_in_thread(self) -> None:
        self.publish()
        if self.sock is not None:
            threading.Thread(target=self._loop, name="takeover-offer", daemon=True).start()

    def _loop(self) -> None:
        while self.sock is not None:
            try:
                self.answer_one()
            except OSError:
                if self.sock is None:
                    return

    def answer_one(self) -> None:
        """Accept one peer and answer it (blocking; call when the socket is readable in a select loop)."""
        s = self.sock
        if s is None:
            return
        conn, _ = s.accept()
        with conn:
            conn.settimeout(TIMEOUT)
            uid = _peer_uid(conn)
            if uid != os.geteuid():
                log.warning("--takeover: refused the listening sockets to uid %d (not this edge's user)", uid)
                return
            if conn.recv(64) != ASK:
                return
            fds = [x.fileno() for x in self.listeners]
            socket.send_fds(conn, [ANSWER + str(len(fds)).encode() + b"\n"], fds)
            log.info("--takeover: handed %d listening socket(s) to pid %d", len(fds), _peer_pid(conn))

    def close(self) -> None:
        """Stop offering; the file is removed unless a newer edge has replaced it with its own."""
        self.closed = True
        s, self.sock = self.sock, None
        if s is None:
            return
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
        try:
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass


def fetch(addr, setting: str = "") -> list[socket.socket] | None:
    """The new edge's side: the listening sockets the edge serving ADDR offers, each checked to be a listening
    TCP socket on ADDR; None (and one warning naming why) when there is no such offer."""
    path = path_for(addr, setting)
    if path is None:
        _none("takeover_socket = off")
        return None
    if not os.path.exists(path) or _private_dir(path, create=False) is None:
        _none(f"no edge offers its listening sockets on {path}")
        return None
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(TIMEOUT)
    try:
        c.connect(path)
        if _peer_uid(c) != os.geteuid():
            _none(f"{path} is served by another user")
            return None
        if not _same_netns(_peer_pid(c)):  # its 127.0.0.1:PORT is not ours (a path is per host, not per namespace)
            _none(f"{path} is served by an edge in another network namespace")
            return None
        c.sendall(ASK)
        msg, fds, _flags, _addr = socket.recv_fds(c, 64, MAX_FDS)
    except OSError as e:
        _none(f"{path}: {e.strerror or e}")
        return None
    finally:
        c.close()
    socks = [socket.socket(fileno=fd) for fd in fds]
    why = "" if msg.startswith(ANSWER) and socks else f"{path} gave no listening socket"
    for s in socks:
        why = why or _not_a_listener_on(s, addr)
    if why:
        for s in socks:
            s.close()
        _none(why)
        return None
    return socks


def _not_a_listener_on(s: socket.socket, addr) -> str:
    """Why S cannot serve ADDR ("" when it can)."""
    try:
        if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
            return "a socket handed over is not a TCP socket"
        if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return "a socket handed over is not listening"
        host, port = s.getsockname()[:2]
        if port != addr[1] or ip(host) != ip(addr[0]):
            return f"a socket handed over listens on {host}:{port}, not on the --listen address"
    except (OSError, ValueError) as e:
        return f"a socket handed over cannot be checked: {e}"
    return ""


def _none(why: str) -> None:  # (the caller returns None: fetch's "no offer")
    log.warning("--takeover: %s; binding beside the old edge (SO_REUSEPORT) instead", why)
    return None


def readable(offer: Offer | None, timeout: float, fds: list[int]) -> list[int]:
    """select() over FDS and the offer's socket (the supervisor's loop, which starts no thread); the offer is
    answered here, the ready FDS returned."""
    watch = list(fds) + ([offer.fileno()] if offer is not None and offer.sock is not None else [])
    if not watch:
        return []
    ready, _, _ = select.select(watch, [], [], timeout)
    if offer is not None and offer.sock is not None and offer.fileno() in ready:
        try:
            offer.answer_one()
        except OSError:
            pass
    return [fd for fd in ready if fd in fds]
