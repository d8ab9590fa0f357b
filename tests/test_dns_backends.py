"""DNS-named backends (issue 28): with [upstream] resolver set, every A/AAAA record of a backend's name
is a backend; re-resolved every resolve_interval, an address that joins gets traffic, one that vanished
drains (its requests in flight finish), a failed resolution keeps the last set and is logged once.

The resolver is a small DNS server of the test's own on a loopback port: the machine's is never asked."""

import json
import socket
import struct
import threading
import time

from tests.support import Backend, Edge, request, wait_until


class TinyDNS:
    """Answers A queries from `records` (name -> [IPv4]); AAAA with no records; `fail` -> SERVFAIL;
    `truncate` -> every answer with a record loses its last two bytes (a record shorter than it says);
    `noise` -> instead of the answer, answers with another id every 20 ms for 3 s (late ones to earlier
    queries, or a flood); `spoof` -> before the answer, one with its id to another question (evil.test:
    6.6.6.6)."""

    def __init__(self):
        self.records: dict[str, list[str]] = {}
        self.fail = False
        self.truncate = False
        self.noise = False
        self.spoof = False
        self.queries = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.running = True
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while self.running:
            try:
                data, peer = self.sock.recvfrom(512)
            except OSError:
                return
            self.queries += 1
            qid, _, qd, _, _, _ = struct.unpack("!HHHHHH", data[:12])
            i, labels = 12, []
            while data[i]:
                labels.append(data[i + 1:i + 1 + data[i]].decode())
                i += 1 + data[i]
            qtype = struct.unpack("!H", data[i + 1:i + 3])[0]
            question = data[12:i + 5]
            name = ".".join(labels).lower()
            if self.noise:
                threading.Thread(target=self.flood, args=(data, peer), daemon=True).start()
                continue
            if self.spoof:
                other = b"\x04evil\x04test\x00" + data[i + 1:i + 5]
                fake = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 300, 4) + socket.inet_aton("6.6.6.6")
                self.sock.sendto(struct.pack("!HHHHHH", qid, 0x8180, 1, 1, 0, 0) + other + fake, peer)
            if self.fail:
                self.sock.sendto(struct.pack("!HHHHHH", qid, 0x8182, 1, 0, 0, 0) + question, peer)
                continue
            addrs = self.records.get(name) if qtype == 1 else []
            if addrs is None:      # unknown name: NXDOMAIN
                self.sock.sendto(struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question, peer)
                continue
            answers = b"".join(b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 300, 4) + socket.inet_aton(a)
                               for a in addrs)
            if self.truncate and answers:
                answers = answers[:-2]
            self.sock.sendto(struct.pack("!HHHHHH", qid, 0x8180, 1, len(addrs), 0, 0) + question + answers, peer)

    def flood(self, query, peer):
        qid = struct.unpack("!H", query[:2])[0]
        wrong = struct.pack("!H", qid ^ 0x5A5A) + b"\x81\x80" + query[4:]
        for _ in range(150):
            try:
                self.sock.sendto(wrong, peer)
            except OSError:
                return
            time.sleep(0.02)  # (the noise's pace, not a wait for anything)

    def close(self):
        self.running = False
        self.sock.close()


def status(e):
    return json.loads(request(e.admin_port, "GET", "/status").body)


def addresses(e):
    return sorted(b["address"] for b in status(e)["backends"] if "address" in b)


def served_by(e, n=12):
    return {request(e.port, "GET", "/").header("X-Backend") for _ in range(n)}


def test_each_address_is_a_backend_and_the_set_follows_dns():
    dns = TinyDNS()
    a = Backend("one", 0, host="127.0.0.1")
    port = a.port
    b = Backend("two", port, host="127.0.0.2")
    c = Backend("three", port, host="127.0.0.3")
    dns.records["api.test"] = ["127.0.0.1", "127.0.0.2"]
    e = Edge("--backends", f"http://api.test:{port}", "--resolver", f"127.0.0.1:{dns.port}",
             "--resolve-interval", "0.3", "--admin", "127.0.0.1:0", "--health-interval", "60")
    try:
        assert addresses(e) == ["127.0.0.1", "127.0.0.2"]
        st = status(e)
        assert st["resolved"] == {f"http://api.test:{port}": {"addresses": ["127.0.0.1", "127.0.0.2"]}}
        assert {x["url"] for x in st["backends"]} == {f"http://api.test:{port} (127.0.0.1)",
                                                      f"http://api.test:{port} (127.0.0.2)"}
        assert served_by(e) == {"one", "two"}

        # a request in flight to the address that vanishes finishes; the new address gets traffic
        dns.records["api.test"] = ["127.0.0.1"]
        wait_until(lambda: addresses(e) == ["127.0.0.1"], what="127.0.0.2 removed")
        slow = {}
        t = threading.Thread(target=lambda: slow.update(r=request(e.port, "GET", "/slow?ms=1500", timeout=10)))
        t.start()
        wait_until(lambda: status(e)["backends"][0]["inflight"] == 1, what="the slow request in flight")
        dns.records["api.test"] = ["127.0.0.3"]
        wait_until(lambda: addresses(e) == ["127.0.0.3"], what="the set follows DNS")
        assert served_by(e) == {"three"}
        t.join(10)
        assert slow["r"].status == 200 and slow["r"].header("X-Backend") == "one"   # drained, not cut
        e.wait_log(r"127\.0\.0\.1\) removed \(drained\)")
        assert "resolves to 127.0.0.3 (1 added, 1 draining)" in e.log()

        # a failed resolution keeps the last good set, logged once however many times it fails
        before = dns.queries
        dns.fail = True
        wait_until(lambda: dns.queries >= before + 8, what="several failed resolutions")
        assert e.log().count("resolving api.test failed") == 1
        assert served_by(e, 4) == {"three"}
        text = request(e.admin_port, "GET", "/metrics").body.decode()
        assert 'lb_dns_resolutions_total{result="failed"}' in text
        assert "failing" in status(e)["resolved"][f"http://api.test:{port}"]
        dns.fail = False
        e.wait_log("api.test resolves again")
    finally:
        e.stop()
        for x in (a, b, c):
            x.stop()
        dns.close()


def test_a_new_address_ramps_up_with_slow_start():
    dns = TinyDNS()
    a = Backend("one", 0, host="127.0.0.1")
    b = Backend("two", a.port, host="127.0.0.2")
    dns.records["api.test"] = ["127.0.0.1"]
    e = Edge("--backends", f"http://api.test:{a.port}", "--resolver", f"127.0.0.1:{dns.port}",
             "--resolve-interval", "0.3", "--admin", "127.0.0.1:0", "--health-interval", "60",
             "--slow-start", "30")
    try:
        dns.records["api.test"] = ["127.0.0.1", "127.0.0.2"]
        wait_until(lambda: len(status(e)["backends"]) == 2, what="the new address joins")
        new = [x for x in status(e)["backends"] if x["address"] == "127.0.0.2"][0]
        old = [x for x in status(e)["backends"] if x["address"] == "127.0.0.1"][0]
        assert new["effective_weight"] < 0.5 and old["effective_weight"] == 1
    finally:
        e.stop()
        a.stop()
        b.stop()
        dns.close()


def test_a_name_that_does_not_resolve_at_start_is_refused_in_one_line():
    dns = TinyDNS()
    try:
        import subprocess, sys
        from tests.support import ROOT
        p = subprocess.run([sys.executable, "edge.py", "--listen", "127.0.0.1:0", "--backends", "http://nowhere.test:80",
                            "--resolver", f"127.0.0.1:{dns.port}"], cwd=ROOT, capture_output=True, text=True, timeout=20)
        assert p.returncode != 0 and "Traceback" not in p.stderr
        assert "nowhere.test does not resolve" in p.stderr and "NXDOMAIN" in p.stderr, p.stderr
    finally:
        dns.close()


def test_without_a_resolver_a_name_is_one_backend_as_before():
    a = Backend("one", 0, host="127.0.0.1")
    e = Edge("--backends", f"http://localhost:{a.port}", "--admin", "127.0.0.1:0", "--health-interval", "60")
    try:
        st = status(e)
        assert [x["url"] for x in st["backends"]] == [f"http://localhost:{a.port}"]
        assert "address" not in st["backends"][0] and st["resolved"] == {}
    finally:
        e.stop()
        a.stop()


def test_a_reload_keeps_the_resolved_set_and_a_dropped_resolver_drains_it(tmp_path):
    import signal
    dns = TinyDNS()
    a = Backend("one", 0, host="127.0.0.1")
    b = Backend("two", a.port, host="127.0.0.2")
    other = Backend("other")
    dns.records["api.test"] = ["127.0.0.1", "127.0.0.2"]
    cfg = tmp_path / "edge.toml"
    upstream = f'[upstream]\nresolver = "127.0.0.1:{dns.port}"\nresolve_interval = 0.3\n'
    one = f'[[backends]]\nurl = "http://api.test:{a.port}"\n'
    cfg.write_text(one + upstream)
    e = Edge("--config", str(cfg), "--admin", "127.0.0.1:0", "--health-interval", "60")
    try:
        assert addresses(e) == ["127.0.0.1", "127.0.0.2"]
        # another backend added: the name's two addresses are kept as they are, not re-made
        cfg.write_text(one + f'[[backends]]\nurl = "{other.url}"\n' + upstream)
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded: 3 backends \(1 added, 0 removed")
        assert addresses(e) == ["127.0.0.1", "127.0.0.2"] and len(status(e)["backends"]) == 3
        # no resolver: the name is one backend again, its addresses drain
        cfg.write_text(one + f'[[backends]]\nurl = "{other.url}"\n')
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded: 2 backends \(1 added, 2 removed")
        assert sorted(x["url"] for x in status(e)["backends"]) == sorted([f"http://api.test:{a.port}", other.url])
        assert status(e)["resolved"] == {}
    finally:
        e.stop()
        for x in (a, b, other):
            x.stop()
        dns.close()


def test_answers_are_parsed_a_and_aaaa_with_their_ttl_other_types_skipped():
    from lb.upstream.resolve import AAAA, A, parse_answer
    q = b"\x12\x34\x81\x80\x00\x01\x00\x03\x00\x00\x00\x00" + b"\x03api\x04test\x00" + b"\x00\x1c\x00\x01"
    rr6 = b"\xc0\x0c" + struct.pack("!HHIH", AAAA, 1, 60, 16) + socket.inet_pton(socket.AF_INET6, "fd00::5")
    cname = b"\xc0\x0c" + struct.pack("!HHIH", 5, 1, 60, 4) + b"\x01x\xc0\x0c"   # another type: skipped
    rr4 = b"\xc0\x0c" + struct.pack("!HHIH", A, 1, 7, 4) + socket.inet_aton("10.0.0.5")
    data = q + cname + rr6 + rr4
    assert parse_answer(data, AAAA) == [("fd00::5", 60)]
    assert parse_answer(data, A) == [("10.0.0.5", 7)]


def test_answers_not_to_our_question_are_skipped_within_one_deadline():
    """A query takes only the answer to it (its id, its question: RFC 5452, section 9.1): one with its id
    to another question is skipped for the real one, and a stream of answers with other ids ends the
    query at its timeout -- each used to restart the wait, so a flood held the resolving thread for good."""
    from lb.errors import ResolveError
    from lb.upstream.resolve import lookup

    dns = TinyDNS()
    dns.records["api.test"] = ["127.0.0.7"]
    try:
        dns.spoof = True
        assert lookup("api.test", f"127.0.0.1:{dns.port}", 2.0) == (["127.0.0.7"], 300)
        dns.spoof, dns.noise = False, True
        out: list = []

        def ask():
            try:
                out.append(lookup("api.test", f"127.0.0.1:{dns.port}", 0.3))
            except ResolveError as e:
                out.append(e)

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        t.join(2.5)  # two questions of 0.3 s each, well inside the flood's 3 s
        assert not t.is_alive(), "the query outlived its timeout while answers with other ids kept coming"
        assert isinstance(out[0], ResolveError) and "timed out" in str(out[0]), out
    finally:
        dns.close()


def test_a_resolver_that_is_not_an_address_is_a_config_error_naming_the_key():
    from tests.support import config_error
    line = config_error("--backends", "http://127.0.0.1:9", "--resolver", "dns.example:53")
    assert "upstream.resolver" in line and "dns.example:53" in line
    assert "--max-requests" in config_error("--backends", "http://127.0.0.1:9", "--max-requests", "-1")


def pool_addresses(e, pool):
    return sorted(b["address"] for b in status(e)["pools"][pool]["backends"] if "address" in b)


def test_a_named_pools_names_follow_dns_like_the_default_pools(tmp_path):
    """A [[pools]] entry's backend given by name: one backend per address, re-resolved every
    resolve_interval, joining and draining as the default pool's do; the default pool is left alone."""
    dns = TinyDNS()
    a = Backend("one", 0, host="127.0.0.1")
    b = Backend("two", a.port, host="127.0.0.2")
    d = Backend("default")
    dns.records["pool.test"] = ["127.0.0.1"]
    cfg = tmp_path / "edge.toml"
    cfg.write_text(f"""[upstream]
resolver = "127.0.0.1:{dns.port}"
resolve_interval = 0.3
[[backends]]
url = "{d.url}"
[[pools]]
name = "api"
backends = [{{ url = "http://pool.test:{a.port}" }}]
[[routes]]
name = "api"
match = {{ path_prefix = "/api/" }}
pool = "api"
""")
    e = Edge("--config", str(cfg), "--admin", "127.0.0.1:0", "--health-interval", "60")
    try:
        assert pool_addresses(e, "api") == ["127.0.0.1"]
        assert status(e)["resolved"] == {f"http://pool.test:{a.port}": {"addresses": ["127.0.0.1"]}}
        assert served_by(e) == {"default"}
        assert {request(e.port, "GET", "/api/x").header("X-Backend") for _ in range(6)} == {"one"}

        dns.records["pool.test"] = ["127.0.0.1", "127.0.0.2"]
        wait_until(lambda: pool_addresses(e, "api") == ["127.0.0.1", "127.0.0.2"], what="127.0.0.2 joins the pool")
        assert {request(e.port, "GET", "/api/x").header("X-Backend") for _ in range(12)} == {"one", "two"}
        dns.records["pool.test"] = ["127.0.0.2"]
        wait_until(lambda: pool_addresses(e, "api") == ["127.0.0.2"], what="127.0.0.1 leaves the pool")
        e.wait_log(r"pool\.test:\d+ \(127\.0\.0\.1\) removed \(drained\)")
        assert {request(e.port, "GET", "/api/x").header("X-Backend") for _ in range(6)} == {"two"}
        assert [x["url"] for x in status(e)["backends"]] == [d.url]        # the default pool untouched
        assert served_by(e) == {"default"}
        # a reload keeps the pool's name and its addresses as they are (it asks nothing it knows)
        import signal
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded: 1 backends")
        assert pool_addresses(e, "api") == ["127.0.0.2"]
        assert status(e)["resolved"] == {f"http://pool.test:{a.port}": {"addresses": ["127.0.0.2"]}}
        # a reload that adds a name that does not resolve to the pool is rejected before anything changes
        cfg.write_text(cfg.read_text().replace('backends = [{ url', 'backends = [{ url = "http://nowhere.test:80" }, { url'))
        e.signal(signal.SIGHUP)
        e.wait_log(r"reload rejected.*pools \(api\)\.backends: http://nowhere\.test:80: nowhere\.test does not resolve")
        assert pool_addresses(e, "api") == ["127.0.0.2"]
        assert {request(e.port, "GET", "/api/x").header("X-Backend") for _ in range(4)} == {"two"}
    finally:
        e.stop()
        for x in (a, b, d):
            x.stop()
        dns.close()


def test_a_named_pools_name_that_does_not_resolve_at_start_is_refused_in_one_line(tmp_path):
    dns = TinyDNS()
    cfg = tmp_path / "edge.toml"
    cfg.write_text(f"""[upstream]
resolver = "127.0.0.1:{dns.port}"
[[backends]]
url = "http://127.0.0.1:9"
[[pools]]
name = "api"
backends = [{{ url = "http://nowhere.test:80" }}]
[[routes]]
name = "api"
match = {{ path_prefix = "/api/" }}
pool = "api"
""")
    try:
        import subprocess, sys
        from tests.support import ROOT
        p = subprocess.run([sys.executable, "edge.py", "--listen", "127.0.0.1:0", "--config", str(cfg)],
                           cwd=ROOT, capture_output=True, text=True, timeout=20)
        assert p.returncode != 0 and "Traceback" not in p.stderr
        assert "pools (api).backends: http://nowhere.test:80: nowhere.test does not resolve" in p.stderr, p.stderr
    finally:
        dns.close()


def test_the_resolution_thread_outlives_an_answer_it_cannot_read():
    """Whatever goes wrong with one name's re-resolution (here an answer whose record is shorter than it
    says), the thread that re-resolves every name goes on: the last addresses stay, the trouble is one
    log line, and the next good answer is followed."""
    dns = TinyDNS()
    a = Backend("one", 0, host="127.0.0.1")
    b = Backend("two", a.port, host="127.0.0.2")
    dns.records["api.test"] = ["127.0.0.1"]
    e = Edge("--backends", f"http://api.test:{a.port}", "--resolver", f"127.0.0.1:{dns.port}",
             "--resolve-interval", "0.3", "--admin", "127.0.0.1:0", "--health-interval", "60")
    try:
        assert addresses(e) == ["127.0.0.1"]
        dns.truncate = True
        before = dns.queries
        wait_until(lambda: dns.queries >= before + 8, what="several unreadable answers")
        assert served_by(e, 4) == {"one"}                       # the last good set serves on
        assert e.log().count("resolving api.test failed") == 1   # one line, not one per round
        dns.truncate = False
        dns.records["api.test"] = ["127.0.0.2"]
        wait_until(lambda: addresses(e) == ["127.0.0.2"], what="the next good answer followed")
        assert served_by(e, 4) == {"two"}
    finally:
        e.stop()
        for x in (a, b):
            x.stop()
        dns.close()


def test_an_unreadable_answer_or_name_at_start_is_refused_in_one_line():
    """A name the resolver answers with a record shorter than it says, or a name DNS cannot carry (a label
    of 64 characters): a name that does not resolve, refused in one line like any other, not a traceback."""
    import subprocess
    import sys

    from tests.support import ROOT
    dns = TinyDNS()
    dns.records["api.test"] = ["127.0.0.1"]
    dns.truncate = True
    long_name = "a" * 64 + ".test"
    try:
        for url, why in (("http://api.test:80", "malformed answer"), (f"http://{long_name}:80", "bad name")):
            p = subprocess.run([sys.executable, "edge.py", "--listen", "127.0.0.1:0", "--backends", url,
                                "--resolver", f"127.0.0.1:{dns.port}"],
                               cwd=ROOT, capture_output=True, text=True, timeout=20)
            assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
            assert f"backends: {url}: " in p.stderr and "does not resolve" in p.stderr and why in p.stderr, p.stderr
    finally:
        dns.close()


def test_a_rejected_reload_to_another_resolver_leaves_the_running_answers_alone(tmp_path):
    """A reload that names another resolver, rejected because that one does not answer, changes nothing:
    the running names keep the answers they run on, so a pool with two names still follows the one that
    moves while the other fails (before, the rejected reload had emptied the answers: re-resolving the
    moving name asked again for the failing one, and that error ended re-resolution)."""
    import signal

    from tests.support import free_port
    dns = TinyDNS()
    a = Backend("one", 0, host="127.0.0.1")
    b = Backend("two", a.port, host="127.0.0.2")
    c = Backend("three", a.port, host="127.0.0.3")
    d = Backend("default")
    dns.records["a.test"] = ["127.0.0.1"]
    dns.records["b.test"] = ["127.0.0.2"]
    cfg = tmp_path / "edge.toml"
    conf = f"""[upstream]
resolver = "127.0.0.1:{dns.port}"
resolve_interval = 0.3
[[backends]]
url = "{d.url}"
[[pools]]
name = "api"
backends = [{{ url = "http://a.test:{a.port}" }}, {{ url = "http://b.test:{a.port}" }}]
[[routes]]
name = "api"
match = {{ path_prefix = "/api/" }}
pool = "api"
"""
    cfg.write_text(conf)
    e = Edge("--config", str(cfg), "--admin", "127.0.0.1:0", "--health-interval", "60")
    try:
        assert pool_addresses(e, "api") == ["127.0.0.1", "127.0.0.2"]
        del dns.records["b.test"]                                   # b.test fails from now on: its address stays
        e.wait_log(r"resolving b\.test failed")
        cfg.write_text(conf.replace(f"127.0.0.1:{dns.port}", f"127.0.0.1:{free_port()}"))   # nobody answers there
        e.signal(signal.SIGHUP)
        e.wait_log(r"reload rejected.*a\.test does not resolve with resolver")
        assert status(e)["resolved"][f"http://a.test:{a.port}"]["addresses"] == ["127.0.0.1"]
        dns.records["a.test"] = ["127.0.0.3"]                       # the other name moves: followed
        wait_until(lambda: pool_addresses(e, "api") == ["127.0.0.2", "127.0.0.3"], what="a.test's move followed")
        assert {request(e.port, "GET", "/api/x").header("X-Backend") for _ in range(12)} == {"two", "three"}
    finally:
        e.stop()
        for x in (a, b, c, d):
            x.stop()
        dns.close()
