"""One instance per port unless asked (issue 24, item 5): a second edge on a live port -- workers or not --
refuses to start with one line; --takeover takes over from the running one for a binary upgrade: start the
new one, wait for it to be ready, TERM the old one, which drains. The old edge hands its listening sockets
over (lb/process/handover.py: the same sockets, so no accept queue ever closes); one that offers none is
joined with SO_REUSEPORT. Under continuous keep-alive and new-connection traffic (bench/takeover.py), no
request is lost."""

import os
import signal
import socket
import stat
import subprocess
import tempfile

import pytest

from bench.takeover import admin_ports, in_private_netns, take_over
from lb.netaddr import migrate_req
from tests.support import PY, ROOT, Edge, request, wait_until

START_TIMEOUT = 30


def second(*args: str) -> tuple[int, list[str]]:
    p = subprocess.run([PY, "edge.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=START_TIMEOUT,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return p.returncode, p.stderr.strip().splitlines()


@pytest.mark.parametrize("first_workers,second_workers", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_a_second_edge_on_a_live_port_refuses_to_start_with_one_line(backends, first_workers, second_workers):
    """With --workers the second one used to bind beside the first (SO_REUSEPORT): traffic split, each kept
    its own limits. Now it stops before binding anything."""
    w1 = ["--workers", str(first_workers)] if first_workers > 1 else []
    e = Edge("--backends", backends[0].url, *w1)
    try:
        w2 = ["--workers", str(second_workers)] if second_workers > 1 else []
        code, lines = second("--backends", backends[0].url, "--listen", f"127.0.0.1:{e.port}", *w2)
        assert code == 1 and len(lines) == 1, lines
        assert f"cannot start: --listen 127.0.0.1:{e.port}: Address already in use: another edge" in lines[0], lines
        assert "--takeover" in lines[0], lines
        assert e.alive()
    finally:
        e.stop()


def test_an_admin_port_another_edge_serves_refuses_the_start_too(backends):
    base = admin_ports(2)
    e = Edge("--backends", backends[0].url, "--admin", f"127.0.0.1:{base + 1}")
    try:
        for admin, workers in ((base + 1, []), (base, ["--workers", "2"])):   # worker 1 on base + 1
            code, lines = second("--backends", backends[0].url, "--listen", "127.0.0.1:0",
                                 "--admin", f"127.0.0.1:{admin}", *workers)
            assert code == 1 and len(lines) == 1, (workers, lines)
            assert f"cannot start: --admin 127.0.0.1:{base + 1}: Address already in use: another edge" in lines[0], lines
    finally:
        e.stop()


@pytest.mark.parametrize("workers,new_workers", [(1, 1), (2, 2), (2, 1)])
def test_a_takeover_under_load_loses_no_request(backends, workers, new_workers):
    """Keep-alive clients (told Connection: close from the old edge's SIGTERM on) and new-connection
    clients the whole time. The round runs in a network namespace of its own with
    net.ipv4.tcp_migrate_req = 0 (as root; the machine's setting is left alone), where a SO_REUSEPORT
    listener that closes resets what is queued on it: the old edge hands its listening sockets over, so its
    close closes no socket and none may be lost (before, 1 in ~90,000 was reset in that instant)."""
    args = ["--grace", "1"] + (["--workers", str(workers)] if workers > 1 else [])
    new_args = ["--grace", "1"] + (["--workers", str(new_workers)] if new_workers > 1 else [])
    rounds = in_private_netns(["--rounds", "1", *args, "--new-workers", str(new_workers)], migrate_req=0)
    r = rounds[0] if rounds else take_over(backends[0].url, args, new_args=new_args)
    assert r["requests"] > 100, r            # the traffic ran (no throughput asserted)
    assert r["handed_over"], r
    assert r["lost"] == 0, r


def listening_inodes(port: int) -> set[int]:
    """The inodes of the TCP sockets listening on PORT (IPv4, this network namespace)."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":
                found.add(int(fields[9]))
    return found


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets PID holds open (/proc/PID/fd links read socket:[INODE])."""
    held = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return held                           # gone meanwhile
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            held.add(int(link[8:-1]))
    return held


def workers_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def started(*args: str, name: str) -> Edge:
    e = Edge(*args, name=name)
    e.wait_log(r"all \d+ workers ready" if "--workers" in args else r"INFO edge: ready", timeout=20)
    return e


@pytest.mark.parametrize("workers,new_workers", [(1, 1), (2, 2), (3, 1)])
def test_the_new_edge_serves_on_the_old_edges_own_listening_sockets(backends, workers, new_workers):
    """Not a second socket beside the old one: the very sockets (same inodes), held by the new edge (its
    supervisor with --workers), and no other listener on the port; with fewer workers than the old edge, the
    extra ones are served too. The old one's exit leaves them open."""
    w = ["--workers", str(workers)] if workers > 1 else []
    a = started("--backends", backends[0].url, *w, name="edge-a")
    b = None
    try:
        old = listening_inodes(a.port)
        assert len(old) == workers and old <= socket_inodes(a.popen.pid), (old, a.log()[-2000:])
        nw = ["--workers", str(new_workers)] if new_workers > 1 else []
        b = started("--backends", backends[0].url, "--listen", f"127.0.0.1:{a.port}", "--takeover", *nw, name="edge-b")
        assert old <= socket_inodes(b.popen.pid), b.log()[-2000:]
        assert listening_inodes(a.port) == old           # nothing bound beside them
        assert f"handed {workers} listening socket(s) to pid {b.popen.pid}" in a.log(), a.log()[-2000:]
        assert "tcp_migrate_req" not in b.log() and "binding beside" not in b.log(), b.log()[-2000:]
        a.signal(signal.SIGTERM)
        wait_until(lambda: not a.alive(), timeout=30, what="the old edge's exit")
        assert listening_inodes(a.port) == old
        assert all(request(a.port).status == 200 for _ in range(30))   # new connections: every queue is served
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_takeover_that_fails_to_start_leaves_the_old_edges_offer_in_place(backends):
    """The new edge offers its sockets only once ready: one that was handed them and then could not start
    (here its admin port is taken) has not replaced the offer, and the next attempt is handed them again."""
    a = started("--backends", backends[0].url, name="edge-a")
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))              # no SO_REUSEPORT: the new edge's admin bind fails
    blocker.listen(1)
    c = None
    try:
        code, lines = second("--backends", backends[0].url, "--listen", f"127.0.0.1:{a.port}", "--takeover",
                             "--admin", f"127.0.0.1:{blocker.getsockname()[1]}")
        assert code == 1 and any("--admin" in x and "Address already in use" in x for x in lines), lines
        c = started("--backends", backends[0].url, "--listen", f"127.0.0.1:{a.port}", "--takeover", name="edge-c")
        assert f"handed 1 listening socket(s) to pid {c.popen.pid}" in a.log(), a.log()[-2000:]
        assert "binding beside" not in c.log(), c.log()[-2000:]
    finally:
        blocker.close()
        a.stop()
        if c is not None:
            c.stop()


def test_a_takeover_from_an_edge_that_offers_nothing_binds_beside_it(backends):
    """An older edge (here: one with takeover_socket = off) offers no socket: the new one joins the port with
    SO_REUSEPORT as before, and says so."""
    a = started("--backends", backends[0].url, "--takeover-socket", "off", name="edge-a")
    b = None
    try:
        old = listening_inodes(a.port)
        b = started("--backends", backends[0].url, "--listen", f"127.0.0.1:{a.port}", "--takeover", name="edge-b")
        assert "no edge offers its listening sockets" in b.log() and "binding beside" in b.log(), b.log()[-2000:]
        assert len(listening_inodes(a.port) - old) == 1
        a.signal(signal.SIGTERM)
        wait_until(lambda: not a.alive(), timeout=30, what="the old edge's exit")
        assert request(a.port).status == 200
    finally:
        a.stop()
        if b is not None:
            b.stop()


def ask_as(uid: int, path: str) -> str:
    """Ask PATH for the listening sockets as UID, from a forked child (no exec: this interpreter may not be
    readable by UID): "connected, fds N", "connected, closed" or "not connected"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            c = socket.socket(socket.AF_UNIX)
            c.settimeout(5)
            out = "not connected"
            try:
                c.connect(path)
                out = "connected, closed"  # the old edge may close before the question is sent or read
                c.sendall(b"edge listeners?\n")
                _, fds, _, _ = socket.recv_fds(c, 64, 16)
                out = f"connected, fds {len(fds)}"
            except OSError:
                pass
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return f.read()


@pytest.mark.skipif(os.geteuid() != 0, reason="asking as another user needs root")
def test_only_the_edges_own_user_is_handed_the_sockets_and_only_from_a_private_directory(backends):
    """Two guards, each tested alone: the old edge answers only a peer of its own uid (SO_PEERCRED), even
    when the file is opened to everyone; a --takeover does not use a socket in a directory others can write."""
    d = tempfile.mkdtemp(prefix="edge-takeover-test-")
    path = os.path.join(d, "t.sock")
    a = started("--backends", backends[0].url, "--takeover-socket", path, name="edge-a")
    b = None
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        os.chmod(d, 0o711)
        os.chmod(path, 0o666)        # past the file's guard: the peer check is what refuses now
        got = ask_as(65534, path)
        assert got in ("connected, fds 0", "connected, closed"), got      # past the file, no descriptor
        a.wait_log("refused the listening sockets to uid 65534")
        os.chmod(d, 0o777)
        b = started("--backends", backends[0].url, "--listen", f"127.0.0.1:{a.port}", "--takeover",
                    "--takeover-socket", path, name="edge-b")
        assert "is not a directory only this user can write" in b.log() and "binding beside" in b.log(), b.log()
        assert "handed" not in a.log()
    finally:
        a.stop()
        if b is not None:
            b.stop()
        os.chmod(d, 0o700)
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)


def test_a_takeover_says_when_the_kernel_can_reset_a_connection_in_the_handover(backends):
    """The one gap a takeover leaves is the kernel's: with net.ipv4.tcp_migrate_req = 0 a connection that
    reaches the old listener as it closes is reset. The new edge says so once, where the operator looks."""
    e = Edge("--backends", backends[0].url, "--takeover")
    try:
        e.wait_log(r"INFO edge: ready", timeout=20)
        warned = "tcp_migrate_req = 0" in e.log()
        assert warned == (migrate_req() == "0"), e.log()[-2000:]
    finally:
        e.stop()


def test_a_restarted_worker_serves_on_the_listener_its_predecessor_had(backends):
    """The supervisor holds one listening socket per worker: a worker that dies leaves its queue open (a
    connection the kernel put there waits for the new worker instead of being reset), and the new one
    serves on it; no socket is bound anew."""
    a = started("--backends", backends[0].url, "--workers", "2", name="edge-a")
    try:
        old = listening_inodes(a.port)
        assert len(old) == 2 and old <= socket_inodes(a.popen.pid), a.log()[-2000:]
        victim = workers_of(a.popen.pid)[-1]
        mine = socket_inodes(victim) & old
        assert len(mine) == 1, (mine, old)
        os.kill(victim, signal.SIGKILL)
        a.wait_log(r"worker \d \(pid %d\) exited \(killed by SIGKILL\); restarting it" % victim, timeout=20)
        wait_until(lambda: any(mine <= socket_inodes(w) for w in workers_of(a.popen.pid) if w != victim),
                   timeout=20, what="the new worker holding its predecessor's listener")
        assert all(request(a.port).status == 200 for _ in range(20))
        assert listening_inodes(a.port) == old
    finally:
        a.stop()
