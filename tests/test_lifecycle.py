"""The edge process's life: SIGHUP reload under traffic (and a bad one), SIGTERM drain (readiness off, then
Connection: close), workers, systemd (sd_notify, the unit), CPU pinning. What it tells its operator meanwhile
(configuration errors, logs, metrics) is tests/test_diagnostics.py."""

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter

import pytest

from tests.support import PY, ROOT, Edge, Proc, raw, request, wait_until


def write_config(path, backends, extra=""):
    text = "".join(f'[[backends]]\nurl = "{b.url}"\n' for b in backends)
    path.write_text(text + '[health]\ninterval = 30\n' + extra)


class Traffic:
    """Clients on keep-alive connections sending without pause, recording every answer."""

    def __init__(self, port, clients=4, path="/"):
        self.port, self.path = port, path
        self.results: list[tuple[float, int, bytes]] = []
        self.errors: list[str] = []
        self.stop_flag = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self.stop_flag.is_set():
            try:
                r = request(self.port, "GET", self.path, conn=c)
                self.results.append((time.monotonic(), r.status, r.body))
                if r.header("Connection") == "close":
                    c.close()
                    c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            except (OSError, http.client.HTTPException) as e:
                self.errors.append(repr(e))
                c.close()
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)

    def stop(self):
        self.stop_flag.set()
        for t in self.threads:
            t.join(15)


def test_reload_under_traffic_changes_the_rotation_and_loses_nothing(backends, tmp_path):
    a, b, c = backends
    cfg = tmp_path / "edge.toml"
    write_config(cfg, [a, b])
    e = Edge("--config", str(cfg))
    t = Traffic(e.port)
    try:
        wait_until(lambda: len(t.results) > 50, timeout=10, what="traffic before the reload")
        # a slow request in flight to a backend the reload removes still completes
        slow = {}
        th = threading.Thread(target=lambda: slow.setdefault("r", request(e.port, "GET", "/slow?ms=800")))
        th.start()
        write_config(cfg, [b, c], extra='[limits]\ndefault = "100000/s"\n')
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded: 2 backends \(1 added, 1 removed\)")
        mark = time.monotonic()
        wait_until(lambda: sum(1 for ts, *_ in t.results if ts > mark + 0.1) > 50, timeout=10,
                   what="traffic after the reload")
        th.join(10)
    finally:
        t.stop()
        e.stop()
    assert not t.errors, t.errors[:3]
    assert Counter(s for _, s, _ in t.results) == {200: len(t.results)}   # every request answered, no 5xx
    after = Counter(body for ts, _, body in t.results if ts > mark + 0.1)
    assert set(after) == {b"b\n", b"c\n"}                                 # the new rotation
    assert slow["r"].status == 200
    assert "backend http://127.0.0.1:%d removed (drained)" % a.port in e.log()


def test_a_bad_reload_keeps_the_old_configuration_serving(backends, tmp_path):
    cfg = tmp_path / "edge.toml"
    write_config(cfg, backends[:1])
    e = Edge("--config", str(cfg))
    try:
        cfg.write_text('[[backends]]\nurl = "http://127.0.0.1:1"\nweight = 0\n')
        e.signal(signal.SIGHUP)
        line = e.wait_log(r"reload rejected, the running configuration stays: .*weight.*").group(0)
        assert "weight" in line
        assert request(e.port, "GET", "/").body == b"a\n"
        assert e.alive()
    finally:
        e.stop()


def test_reload_keeps_the_counters_of_unchanged_limits(backends, tmp_path):
    cfg = tmp_path / "edge.toml"
    write_config(cfg, backends[:1], extra='[limits]\ndefault = "3/m"\n')
    e = Edge("--config", str(cfg))
    try:
        assert [request(e.port, "GET", "/").status for _ in range(3)] == [200] * 3
        write_config(cfg, backends[:2], extra='[limits]\ndefault = "3/m"\n')
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded")
        assert request(e.port, "GET", "/").status == 429          # the spent quota survived the reload
    finally:
        e.stop()


def test_sigterm_lets_the_request_in_flight_finish_then_exits_0(backends):
    e = Edge("--backends", backends[0].url)
    try:
        got = {}
        th = threading.Thread(target=lambda: got.setdefault("r", request(e.port, "GET", "/slow?ms=1000")))
        th.start()
        wait_until(lambda: any(p.endswith("ms=1000") for p in backends[0].stats()["last"]), timeout=5,
                   what="the slow request to reach the backend")
        idle = http.client.HTTPConnection("127.0.0.1", e.port, timeout=5)   # an idle keep-alive client
        assert request(e.port, "GET", "/", conn=idle).status == 200
        e.signal(signal.SIGTERM)
        wait_until(lambda: not e.alive(), timeout=10, what="the edge to exit")
        th.join(5)
        assert got["r"].status == 200
        assert e.popen.returncode == 0
        assert idle.sock.recv(10) == b""          # closed cleanly (FIN), not left hanging
        # and it stopped accepting
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", e.port), timeout=1)
    finally:
        e.stop()


def test_workers_share_the_port_and_a_crashed_worker_is_restarted(backends):
    e = Edge("--backends", backends[0].url, "--workers", "2")
    try:
        e.wait_log(r"all 2 workers ready", timeout=20)   # a worker that dies after that is restarted
        children = subprocess.run(["pgrep", "-P", str(e.popen.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2
        assert all(request(e.port, "GET", "/").status == 200 for _ in range(20))
        os.kill(int(children[0]), signal.SIGKILL)
        e.wait_log(r"worker \d \(pid %s\) exited .* restarting it" % children[0])
        wait_until(lambda: len(subprocess.run(["pgrep", "-P", str(e.popen.pid)], capture_output=True,
                                              text=True).stdout.split()) == 2, timeout=10, what="a new worker")
        assert all(request(e.port, "GET", "/").status == 200 for _ in range(20))
        e.signal(signal.SIGTERM)
        wait_until(lambda: not e.alive(), timeout=15, what="supervisor exit")
        assert e.popen.returncode == 0
    finally:
        e.stop()


def exited(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (the reaper of an orphan here may be slow or absent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no holder; a listener is
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_sigkilled_supervisor_takes_its_workers_with_it(backends):
    """kill -9 (or the OOM killer) on the supervisor: each worker gets SIGTERM from the kernel
    (PR_SET_PDEATHSIG), finishes what it is serving as on any SIGTERM and exits, freeing the port:
    no orphans left serving with nothing to restart or stop them."""
    e = Edge("--backends", backends[0].url, "--workers", "2")
    pids: list[int] = []
    try:
        e.wait_log(r"all 2 workers ready", timeout=20)
        pids = [int(p) for p in subprocess.run(["pgrep", "-P", str(e.popen.pid)], capture_output=True,
                                               text=True).stdout.split()]
        assert len(pids) == 2
        slow: dict = {}
        th = threading.Thread(target=lambda: slow.update(r=request(e.port, "GET", "/slow?ms=1500&orphan", timeout=15)))
        th.start()
        wait_until(lambda: "/slow?ms=1500&orphan" in backends[0].stats()["last"], timeout=10,
                   what="the slow request at the backend")
        e.kill()                                                   # SIGKILL: no handler, no goodbye
        wait_until(lambda: all(exited(p) for p in pids), timeout=20, what="every worker gone")
        wait_until(lambda: port_free(e.port), timeout=5, what="the port free")
        th.join(15)
        assert slow["r"].status == 200                             # drained, as on SIGTERM
        assert len(re.findall(r"received SIGTERM: draining", e.log())) == 2
    finally:
        e.stop()
        for p in pids:
            if not exited(p):
                os.kill(p, signal.SIGKILL)


# sitecustomize for the edge: each child sleeps right after fork for the seconds the file says then
FORK_DELAY = """import os, time
if "EDGE_TEST_FORK_DELAY" in os.environ:
    def _pause(path=os.environ["EDGE_TEST_FORK_DELAY"]):
        with open(path) as f:
            time.sleep(float(f.read()))
    os.register_at_fork(after_in_child=_pause)
"""


def test_a_sigterm_to_a_worker_still_starting_stops_it(backends, tmp_path):
    """A SIGTERM that reaches a worker in its first instants (the supervisor stopping, or systemd's
    KillMode=control-group signalling every process, while a crashed worker is being restarted) stops
    it: before, the child still had the supervisor's handler then, which took the signal into the
    child's copy of the supervisor's queue, and the worker served on -- the supervisor waited for it
    for ever. The instants are stretched here (a sleep right after fork, sitecustomize) to be hit."""
    (tmp_path / "sitecustomize.py").write_text(FORK_DELAY)
    delay = tmp_path / "delay"
    delay.write_text("0")
    env = {"PYTHONPATH": str(tmp_path), "EDGE_TEST_FORK_DELAY": str(delay)}
    e = Edge("--backends", backends[0].url, "--workers", "2", env=env)
    pids: list[int] = []
    try:
        e.wait_log(r"all 2 workers ready", timeout=20)

        def children() -> list[int]:
            out = subprocess.run(["pgrep", "-P", str(e.popen.pid)], capture_output=True, text=True).stdout
            return [int(p) for p in out.split()]

        first = children()
        assert len(first) == 2
        delay.write_text("2")
        os.kill(first[0], signal.SIGKILL)
        new = wait_until(lambda: [p for p in children() if p not in first], timeout=10, what="the restarted worker")
        pids = first[1:] + new
        e.signal(signal.SIGTERM)                     # while the new worker is in its first instants
        wait_until(lambda: not e.alive(), timeout=20, what="the supervisor to exit (every worker stopped)")
        assert all(exited(p) for p in pids)
    finally:
        e.stop()
        for p in pids:
            if not exited(p):
                os.kill(p, signal.SIGKILL)


def summed_counters(port) -> dict:
    """/metrics' counter and histogram samples {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    text = request(port, "GET", "/metrics").body.decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) if f.type in ("counter", "histogram")
            for s in f.samples if not s.name.endswith("_created")}


def test_summed_counters_stay_monotonic_when_a_worker_restarts(backends):
    """Worker 1 SIGKILLed and restarted: worker 0's summed /metrics keeps the dead incarnation's numbers,
    so no counter of the sum goes down (Prometheus would read the drop as a reset of the whole sum)."""
    e = Edge("--backends", backends[0].url, "--workers", "2", "--admin", "127.0.0.1:0")
    try:
        e.wait_log(r"all 2 workers ready", timeout=20)
        ports = dict(re.findall(r"worker (\d): admin on 127\.0\.0\.1:(\d+)", e.log()))
        admin0, admin1 = int(ports["0"]), int(ports["1"])
        for _ in range(40):     # a new connection each time, so both workers take some
            assert request(e.port, "GET", "/").status == 200
        assert raw(e.port, b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n").startswith(b"HTTP/1.1 400")
        # (a request is counted just after its answer is relayed: wait for the 40th before reading)
        served = ("lb_requests_total", (("backend", backends[0].url),))
        wait_until(lambda: summed_counters(admin0).get(served, 0) >= 40, what="the 40 requests counted")
        before = summed_counters(admin0)
        assert before[("lb_worker_requests_total", (("worker", "1"),))] > 4    # worker 1 has numbers to lose
        served1 = before[("lb_requests_total", (("backend", backends[0].url),))]
        pid1 = json.loads(request(admin1, "GET", "/status").body)["pid"]
        os.kill(pid1, signal.SIGKILL)
        e.wait_log(r"worker 1 \(pid %d\) exited .* restarting it" % pid1, timeout=20)

        # with --admin HOST:0 the new worker 1 has a new ephemeral admin port: its own log line
        admins1 = lambda: re.findall(r"worker 1: admin on 127\.0\.0\.1:(\d+)", e.log())
        wait_until(lambda: len(admins1()) == 2, timeout=20, what="worker 1 restarted")
        assert json.loads(request(int(admins1()[1]), "GET", "/status").body)["pid"] != pid1
        wait_until(lambda: "lb_workers 2\n" in request(admin0, "GET", "/metrics").body.decode(),
                   timeout=10, what="both workers summed again")
        for _ in range(4):
            assert request(e.port, "GET", "/").status == 200
        wait_until(lambda: summed_counters(admin0).get(served, 0) >= served1 + 4, what="the 4 requests counted")
        after = summed_counters(admin0)
        # every summed series; not the per-worker one: one process's own, it starts over with the process
        went_down = {k: (v, after.get(k)) for k, v in before.items() if k[0] != "lb_worker_requests_total"
                     and (after.get(k) is None or after[k] < v - (1e-6 if k[0].endswith("_sum") else 0))}
        assert not went_down, went_down
        for k in [("lb_requests_total", (("backend", backends[0].url),)),
                  ("lb_backend_responses_total", (("backend", backends[0].url), ("code", "2xx"))),
                  ("lb_edge_responses_total", (("code", "400"),)),
                  ("lb_request_duration_seconds_count", (("code", "2xx"),))]:
            assert k in before and after[k] >= before[k], k      # the families the brief names are there
        assert after[("lb_requests_total", (("backend", backends[0].url),))] == served1 + 4
    finally:
        e.stop()


def test_the_sum_keeps_a_worker_missing_from_a_scrape_and_each_dead_incarnation():
    """The Carry arithmetic on real Metrics snapshots: worker 1 left out of one scrape (restarting) stands
    in with its last numbers; its next incarnation (another id) adds to the dead one's; gauges are not kept."""
    from lb.ops.metrics import Metrics
    w0, w1 = Metrics(), Metrics()
    total = lambda text: int(re.search(r"^lb_requests_total\{[^}]*\} (\d+)$", text, re.M).group(1))
    w0.backend_done("http://b", 200, 0.001)
    for _ in range(5):
        w1.backend_done("http://b", 200, 0.001)
    w1.add_gauge("lb_tunnels_open", 3)
    snap1 = w1.snapshot(worker=1)
    assert total(w0.render(others=[snap1], worker=0)) == 6
    assert total(w0.render(others=[], worker=0)) == 6                 # worker 1 gone from this scrape
    reborn = Metrics()
    reborn.backend_done("http://b", 200, 0.001)
    snap = reborn.snapshot(worker=1)
    snap["id"] = [snap1["id"][0] + 1, snap1["id"][1]]                  # another process (pid) at index 1
    text = w0.render(others=[snap], worker=0)
    assert total(text) == 7 and 'lb_request_duration_seconds_count{code="2xx"} 7' in text
    assert re.search(r"^lb_tunnels_open 0$", text, re.M)              # the dead one's gauge is not carried
    assert 'lb_worker_requests_total{worker="1"} 1' in text           # its own series does start over


@pytest.mark.parametrize("algorithm", ["sliding-log", "token-bucket"])
def test_two_workers_on_the_memory_store_share_one_limit_per_key(backends, algorithm):
    """--workers 2 with the memory store: the workers share one table in shared memory (limiter.shm),
    so one key driven at 2x its limit, over connections the kernel spreads across both, gets exactly N."""
    from prometheus_client.parser import text_string_to_metric_families
    e = Edge("--backends", backends[0].url, "--workers", "2", "--limit", "20/m", "--algorithm", algorithm,
             "--admin", "127.0.0.1:0")
    try:
        e.wait_log(r"all 2 workers ready")
        assert re.search(r"limits shared by 2 workers in \d+ KiB of shared memory", e.log())
        statuses = Counter()
        for _ in range(40):   # a new connection each time, so both workers take turns
            statuses[request(e.port, "GET", "/", {"X-Api-Key": "one-key"}).status] += 1
        assert statuses == {200: 20, 429: 20}
        port = int(re.findall(r"worker \d: admin on 127\.0\.0\.1:(\d+)", e.log())[0])
        fams = {f.name: f for f in text_string_to_metric_families(
            request(port, "GET", "/metrics").body.decode())}
        per_worker = {s.labels["worker"]: s.value for s in fams["lb_worker_requests"].samples}
        assert set(per_worker) == {"0", "1"} and sum(per_worker.values()) == 40
        assert all(n > 0 for n in per_worker.values()), per_worker     # both workers decided some
    finally:
        e.stop()


def test_sd_notify_ready_reloading_stopping(backends, tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    cfg = tmp_path / "edge.toml"
    write_config(cfg, backends[:1])
    e = Edge("--config", str(cfg), env={"NOTIFY_SOCKET": path})
    try:
        assert b"READY=1" in sock.recv(1000)
        e.signal(signal.SIGHUP)
        assert sock.recv(1000).startswith(b"RELOADING=1\nMONOTONIC_USEC=")
        assert b"READY=1" in sock.recv(1000)
        e.signal(signal.SIGTERM)
        assert b"STOPPING=1" in sock.recv(1000)
    finally:
        e.stop()
        sock.close()


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_the_systemd_unit_verifies(tmp_path):
    unit = (ROOT / "conf" / "edge.service").read_text()
    # verify checks that ExecStart exists: point it at this checkout instead of /opt/edge
    unit = unit.replace("/opt/edge/venv/bin/python3", PY).replace("/opt/edge/edge.py", str(ROOT / "edge.py"))
    (tmp_path / "edge.service").write_text(unit)
    p = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "edge.service")], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr
    # and with the low-port lines uncommented, as an operator would
    opened = unit.replace("# AmbientCapabilities=", "AmbientCapabilities=").replace(
        "# CapabilityBoundingSet=CAP", "CapabilityBoundingSet=CAP")
    (tmp_path / "edge.service").write_text(opened)
    p = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "edge.service")], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr


def test_the_unit_starts_without_its_optional_credentials_and_is_hardened():
    """A fresh install has no /etc/edge/redis-password: every LoadCredential= needs a SetCredential= of the
    same name, the fallback systemd (250+) uses instead of failing the start. And the hardening holds:
    systemd-analyze's exposure score (3.2 before the seccomp filter, ProtectProc and the rest)."""
    unit = (ROOT / "conf" / "edge.service").read_text().splitlines()
    loads = [l.split("=", 1)[1].split(":", 1)[0] for l in unit if l.startswith("LoadCredential=")]
    sets = {l.split("=", 1)[1].split(":", 1)[0] for l in unit if l.startswith("SetCredential=")}
    assert loads and set(loads) <= sets, (loads, sets)
    for needed in ("SystemCallFilter=@system-service", "SystemCallErrorNumber=EPERM", "ProtectProc=invisible",
                   "ProcSubset=pid", "PrivateUsers=yes", "DevicePolicy=closed"):
        assert needed in unit, needed
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze not installed")
    p = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(ROOT / "conf" / "edge.service")],
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for edge.service: (\d+\.\d+)", p.stdout)
    if m is None:
        pytest.skip(f"systemd-analyze security --offline not available: {p.stderr.strip()[:200]}")
    assert float(m.group(1)) <= 2.0, p.stdout[-2000:]


def test_two_workers_on_the_redis_store_hold_one_limit_per_key(backends, redis_server):
    """The kernel spreads connections over both workers; the key's limit is still one limit, and the one
    admin port (worker 0's) sums both workers' numbers."""
    from prometheus_client.parser import text_string_to_metric_families
    e = Edge("--backends", backends[0].url, "--workers", "2", "--limit", "20/m", "--algorithm", "sliding-log",
             "--store", redis_server.url, "--redis-timeout", "1", "--admin", "127.0.0.1:0")
    try:
        e.wait_log(r"all 2 workers ready")
        statuses = Counter()
        for _ in range(60):   # a new connection each time, so both workers take turns
            statuses[request(e.port, "GET", "/", {"X-Api-Key": "one-key"}).status] += 1
        assert statuses == {200: 20, 429: 40}
        import re
        ports = [int(p) for p in re.findall(r"worker \d: admin on 127\.0\.0\.1:(\d+)", e.log())]
        assert len(ports) == 2                          # each worker has its own (drain, /status) ...
        texts = [request(p, "GET", "/metrics").body.decode() for p in ports]
        fams = {f.name: f for f in text_string_to_metric_families(texts[0])}
        other = {f.name: f for f in text_string_to_metric_families(texts[1])}
        # ... and either one's /metrics is the sum of both: the same split, from each side
        assert {s.labels["worker"]: s.value for s in other["lb_worker_requests"].samples} == \
            {s.labels["worker"]: s.value for s in fams["lb_worker_requests"].samples}
        value = lambda fam, **lab: sum(s.value for s in fams[fam].samples
                                       if all(s.labels.get(k) == v for k, v in lab.items()))
        assert value("lb_requests") == 20 and value("lb_rate_limited") == 40
        assert value("lb_workers") == 2
        per_worker = {s.labels["worker"]: s.value for s in fams["lb_worker_requests"].samples}
        assert set(per_worker) == {"0", "1"} and sum(per_worker.values()) == 60
        assert all(n > 0 for n in per_worker.values()), per_worker     # each worker answered some
        assert value("lb_limiter_store_up") == 1
    finally:
        e.stop()


def cpus_allowed(pid: int) -> str:
    status = open(f"/proc/{pid}/status").read()
    return status.split("Cpus_allowed_list:")[1].split()[0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_each_process_is_pinned_to_one_cpu_unless_told_otherwise(backends):
    e = Edge("--backends", backends[0].url)
    off = Edge("--backends", backends[0].url, "--cpu-affinity", "off")
    w = Edge("--backends", backends[0].url, "--workers", "2")
    try:
        cpu = e.wait_log(r"on CPU (\d+) \(--cpu-affinity auto\)").group(1)
        assert cpus_allowed(e.popen.pid) == cpu                  # every thread inherits it
        assert "," in cpus_allowed(off.popen.pid) or "-" in cpus_allowed(off.popen.pid)
        w.wait_log(r"all 2 workers ready")    # both lines are there by then (each worker pins, then reports)
        workers = dict(__import__("re").findall(r"worker (\d): on CPU (\d+)", w.log()))
        assert workers["0"] != workers["1"]                      # worker i takes the i-th CPU
        assert request(e.port, "GET", "/").status == 200
    finally:
        for x in (e, off, w):
            x.stop()


def policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of pid."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(os.sched_getscheduler(int(tid)))
        except OSError:  # a thread that ended meanwhile
            pass
    return out


def test_sched_batch_puts_every_thread_under_sched_batch_and_only_when_asked(backends):
    """--sched-batch: every thread of the edge (those serving connections too) under SCHED_BATCH, the log
    says so, requests are served; without it the default policy, as any process."""
    batch = Edge("--backends", backends[0].url, "--sched-batch")
    plain = Edge("--backends", backends[0].url)
    try:
        batch.wait_log(r"threads under SCHED_BATCH \(--sched-batch\)")
        with socket.create_connection(("127.0.0.1", batch.port)) as held:  # a connection thread, alive
            held.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert held.recv(65536).startswith(b"HTTP/1.1 200 ")
            assert len(os.listdir(f"/proc/{batch.popen.pid}/task")) > 2
            assert policies(batch.popen.pid) == {os.SCHED_BATCH}
        assert request(plain.port, "GET", "/").status == 200
        assert policies(plain.popen.pid) == {os.SCHED_OTHER}
        assert "SCHED_BATCH" not in plain.log()
    finally:
        for x in (batch, plain):
            x.stop()


def test_a_refused_sched_batch_is_one_warning_naming_the_policy_kept_and_the_edge_serves(backends):
    """Started under SCHED_IDLE without CAP_SYS_NICE (RLIMIT_NICE 0), a thread may not leave SCHED_IDLE:
    --sched-batch is refused. The edge says so once, with the policy its threads keep, and serves."""
    if not (shutil.which("chrt") and shutil.which("setpriv") and shutil.which("prlimit")):
        pytest.skip("needs util-linux's chrt, setpriv and prlimit")
    jail = ["chrt", "-i", "0", "prlimit", "--nice=0:0", "setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice"]
    e = Proc([*jail, PY, "edge.py", "--listen", "127.0.0.1:0", "--backends", backends[0].url, "--sched-batch"], "edge")
    try:
        port = int(e.wait_log(r"listening on (\S+):(\d+)").group(2))
        e.wait_log(r"--sched-batch: SCHED_BATCH refused \(.*Operation not permitted; the threads keep SCHED_IDLE, ")
        assert request(port, "GET", "/").status == 200
        assert policies(e.popen.pid) == {os.SCHED_IDLE}
        assert "threads under SCHED_BATCH" not in e.log() and e.log().count("SCHED_BATCH refused") == 1
    finally:
        e.stop()


def test_a_bad_cpu_affinity_is_a_configuration_error():
    p = subprocess.run([PY, "edge.py", "--backends", "http://127.0.0.1:9", "--cpu-affinity", "fast"],
                       cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert p.returncode == 2 and "cpu_affinity" in p.stderr


# Draining: readiness off first, then Connection: close on every response

def test_readyz_fails_as_soon_as_a_drain_starts_while_requests_are_still_served(backends):
    e = Edge("--backends", backends[0].url, "--admin", "127.0.0.1:0", "--grace", "3")
    try:
        wait_until(lambda: request(e.admin_port, "GET", "/readyz").status == 200, timeout=5, what="ready")
        # before any traffic the request histogram is already there (scrapers read it from the start)
        text = request(e.admin_port, "GET", "/metrics").body.decode()
        assert 'lb_request_duration_seconds_count{code="2xx"} 0' in text and 'lb_request_duration_seconds_count{code="4xx"} 0' in text
        assert request(e.admin_port, "GET", "/healthz").body == b"ok\n"
        e.signal(signal.SIGTERM)
        wait_until(lambda: request(e.admin_port, "GET", "/readyz").status == 503, timeout=5, what="not ready")
        assert request(e.port, "GET", "/").status == 200      # still accepting during the grace period
        wait_until(lambda: not e.alive(), timeout=15, what="exit after the grace period")
        assert e.popen.returncode == 0
    finally:
        e.stop()


def test_from_sigterm_on_a_502_also_says_connection_close_and_the_connection_closes(backends):
    """Issue 24 (6) for the edge's own answers to a failed backend (Forwarder.failed): a 502 inside the
    grace period closes a keep-alive connection like a relayed 200 does, so the client does not meet
    the drain's close on its next request."""
    e = Edge("--backends", backends[0].url, "--admin", "127.0.0.1:0", "--grace", "3", "--retries", "0",
             "--eject-after", "0")
    try:
        wait_until(lambda: request(e.admin_port, "GET", "/readyz").status == 200, timeout=5, what="ready")
        e.signal(signal.SIGTERM)
        wait_until(lambda: request(e.admin_port, "GET", "/readyz").status == 503, timeout=5, what="not ready")
        for path in (b"/garbage", b"/reset"):
            s = socket.create_connection(("127.0.0.1", e.port), timeout=5)
            s.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = _read_response(s)
            assert b" 502 " in answer.split(b"\r\n")[0], answer
            assert b"\r\nconnection: close\r\n" in answer.lower(), (path, answer)
            assert s.recv(1) == b"", "the edge closes the connection after that response"
            s.close()
    finally:
        e.stop()


def test_from_sigterm_on_keep_alive_responses_say_connection_close_and_the_connection_closes(backends):
    """Issue 24 (6): during --grace (and the drain after it) every response on a keep-alive connection
    carries Connection: close and the edge closes it after, so a client opens its next connection to
    whoever serves the port next instead of meeting the close. A client that honours it (http.client
    reconnects by itself) sees no error while the grace lasts."""
    import threading
    e = Edge("--backends", backends[0].url, "--admin", "127.0.0.1:0", "--grace", "2")
    errors, statuses, stop = [], [], threading.Event()

    def honouring_client():
        c = http.client.HTTPConnection("127.0.0.1", e.port, timeout=5)
        while not stop.is_set():
            try:
                statuses.append(request(e.port, "GET", "/", conn=c).status)
            except (OSError, http.client.HTTPException) as ex:
                errors.append(repr(ex))
                c.close()
        c.close()

    try:
        wait_until(lambda: request(e.admin_port, "GET", "/readyz").status == 200, timeout=5, what="ready")
        s = socket.create_connection(("127.0.0.1", e.port), timeout=5)
        get = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        s.sendall(get)
        first = _read_response(s)
        assert b" 200 " in first.split(b"\r\n")[0] and b"\r\nconnection: close" not in first.lower(), first
        t = threading.Thread(target=honouring_client)
        t.start()
        e.signal(signal.SIGTERM)
        wait_until(lambda: request(e.admin_port, "GET", "/readyz").status == 503, timeout=5, what="not ready")
        s.sendall(get)                                  # the same connection, inside the grace period
        second = _read_response(s)
        assert b" 200 " in second.split(b"\r\n")[0], second
        assert b"\r\nconnection: close\r\n" in second.lower(), second
        s.settimeout(5)
        assert s.recv(1) == b"", "the edge closes the connection after that response"
        s.close()
        time.sleep(0.5)                                 # the honouring client keeps going inside the grace
        stop.set()
        t.join(10)
        assert not errors, errors[:3]
        assert len(statuses) > 5 and set(statuses) == {200}, statuses[-5:]
        wait_until(lambda: not e.alive(), timeout=15, what="exit after the grace period")
    finally:
        stop.set()
        e.stop()


def _read_response(s: socket.socket) -> bytes:
    """One response with a Content-Length body off a raw socket."""
    s.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    n = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
    while len(body) < n:
        chunk = s.recv(65536)
        assert chunk, data
        body += chunk
    return head + b"\r\n\r\n" + body


# Reload and the systemd unit

def test_reload_applies_pool_and_log_settings_and_names_what_needs_a_restart(backends, tmp_path):
    cfg = tmp_path / "edge.toml"
    log1, log2 = tmp_path / "one.log", tmp_path / "two.log"
    base = f'access_log = "{{}}"\n[[backends]]\nurl = "{backends[0].url}"\n[health]\ninterval = 30\n'
    cfg.write_text(base.format(log1) + "[upstream]\npool_maxsize = 4\n")
    e = Edge("--config", str(cfg))
    try:
        request(e.port, "GET", "/a")
        cfg.write_text(base.format(log2) + "[upstream]\npool_maxsize = 1\n[server]\ncpu_affinity = \"off\"\n")
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded: 1 backends .*new connection pools")
        line = e.wait_log(r"reload: cpu_affinity changed; that needs a restart.*").group(0)
        assert "auto" in line and "off" in line
        request(e.port, "GET", "/b")
        wait_until(lambda: log2.exists() and "/b" in log2.read_text(), timeout=5, what="the new access log")
        assert "/b" not in log1.read_text()
    finally:
        e.stop()


def test_the_unit_runs_check_before_reload_and_its_low_port_lines_work():
    unit = (ROOT / "conf" / "edge.service").read_text()
    lines = [x.strip() for x in unit.splitlines()]
    reload_lines = [x for x in lines if x.startswith("ExecReload=")]
    assert "--check" in reload_lines[0] and "kill -HUP" in reload_lines[-1]
    assert "WatchdogSec=" in unit and "UMask=0077" in unit and "LoadCredential=" in unit
    # Uncommenting the low-port lines must leave CAP_NET_BIND_SERVICE in the bounding set: no later
    # empty CapabilityBoundingSet= may reset it.
    opened = [x.lstrip("# ") if "CAP_NET_BIND_SERVICE" in x else x for x in lines]
    cbs = [x for x in opened if x.startswith("CapabilityBoundingSet=")]
    assert cbs and cbs[-1] == "CapabilityBoundingSet=CAP_NET_BIND_SERVICE", cbs
    assert any(x == "AmbientCapabilities=CAP_NET_BIND_SERVICE" for x in opened)
    stop = int(next(x for x in lines if x.startswith("TimeoutStopSec=")).split("=")[1])
    assert stop > 30                                   # above drain_timeout's default (and say so there)
    assert not any(x.startswith("NotifyAccess=all") for x in lines)   # workers never notify: main is enough
