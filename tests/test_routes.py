"""Routes and pools (issue 27): named pools, first-match routes, canary splits, header rules, allow/deny,
all through real backends and a real edge."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import threading
from collections import Counter

import pytest

from tests.support import PY, ROOT, Backend, Edge, request, wait_until


@pytest.fixture(scope="module")
def backends():
    bs = {n: Backend(n) for n in ("d1", "v1", "v2", "admin", "canary")}
    yield bs
    for b in bs.values():
        b.stop()


def _conf(bs, split=(90, 10), extra="") -> str:
    return f"""
[[backends]]
url = "{bs['d1'].url}"

[[pools]]
name = "stable"
backends = [{{ url = "{bs['v1'].url}" }}]

[[pools]]
name = "canary"
strategy = "round-robin"
backends = [{{ url = "{bs['canary'].url}" }}]
health = {{ interval = 0.2 }}

[[pools]]
name = "admin"
backends = [{{ url = "{bs['admin'].url}" }}, {{ url = "{bs['v2'].url}", weight = 1 }}]

[[routes]]
name = "admin-host"
match = {{ host = "admin.example.com" }}
pool = "admin"
allow = ["10.0.0.0/8"]

[[routes]]
name = "v2"
match = {{ path_prefix = "/echo/v2/" }}
pool = "admin"
request_headers = {{ set = {{ "X-Client" = "$remote_addr", "X-Seen-Host" = "$host" }}, remove = ["Cookie"] }}
response_headers = {{ set = {{ "Strict-Transport-Security" = "max-age=63072000" }}, remove = ["Server"] }}

[[routes]]
name = "app"
match = {{ path_prefix = "/app/", methods = ["GET"] }}
split = [{{ pool = "stable", weight = {split[0]} }}, {{ pool = "canary", weight = {split[1]} }}]
{extra}"""


def _edge(tmp_path, bs, *args, **kw):
    f = tmp_path / "edge.toml"
    f.write_text(_conf(bs, **kw))
    return Edge("--config", str(f), "--health-interval", "0.2", *args), f


def _who(r) -> str:
    return r.header("X-Backend")


def test_host_prefix_split_and_default(tmp_path, backends):
    e, _ = _edge(tmp_path, backends, "--trusted-proxies", "127.0.0.1/32", "--admin", "127.0.0.1:0")
    try:
        # no match: the default pool
        assert _who(request(e.port, path="/other")) == "d1"
        # host route with an allow list: 10.x (as identified through a trusted proxy) passes, 127.0.0.1 does not
        before = backends["admin"].stats()["count"] + backends["v2"].stats()["count"]
        r = request(e.port, path="/", headers={"Host": "ADMIN.example.com:8443"})
        assert r.status == 403 and b"admin-host" in r.body
        assert backends["admin"].stats()["count"] + backends["v2"].stats()["count"] == before   # reached nobody
        r = request(e.port, path="/", headers={"Host": "admin.example.com", "X-Forwarded-For": "10.1.2.3"})
        assert r.status == 200 and _who(r) in ("admin", "v2")
        # prefix route: the normalised path (no /v2/../ escape), header rules both ways
        assert _who(request(e.port, path="/echo/v2/../other")) == "d1"
        assert _who(request(e.port, path="//echo//v2/%78")) in ("admin", "v2")
        r = request(e.port, path="/echo/v2/x", headers={"Host": "api.example.com:80", "Cookie": "a=b"})
        echo = json.loads(r.body)
        hdrs = {k.lower(): v for k, v in echo["headers"]}
        assert hdrs["x-client"] == "127.0.0.1" and hdrs["x-seen-host"] == "api.example.com"
        assert "cookie" not in hdrs
        assert r.header("Strict-Transport-Security") == "max-age=63072000"
        assert r.header("Server") is None
        assert request(e.port, path="/other").header("Server") is not None       # other routes untouched
        # the split: 90/10 over 1,000 requests, smooth (a POST does not match the GET-only route)
        assert _who(request(e.port, "POST", "/app/x", body=b"")) == "d1"
        c = http.client.HTTPConnection("127.0.0.1", e.port, timeout=10)
        got = Counter(_who(request(e.port, path="/app/x", conn=c)) for _ in range(1000))
        c.close()
        assert set(got) == {"v1", "canary"}
        assert 870 <= got["v1"] <= 930, got
        st = json.loads(request(e.admin_port, path="/status").body)
        app = next(r for r in st["routes"] if r["name"] == "app")
        assert app["split"] == {"stable": 90, "canary": 10}
        assert set(st["pools"]) == {"stable", "canary", "admin"}
        m = request(e.admin_port, path="/metrics").body.decode()
        assert 'lb_route_requests_total{route="app",pool="canary"}' in m
        assert 'lb_route_denied_total{route="admin-host"} 1' in m
    finally:
        e.stop()


def test_nobody_healthy_in_a_route_pool_is_503_for_that_route_only(tmp_path, backends):
    e, _ = _edge(tmp_path, backends)
    try:
        request(backends["canary"].port, "POST", "/_ctl/down")
        e.wait_log(r"backend \S+ DOWN", timeout=15)
        # a split's pool with nobody in rotation takes no turn: the other pool has them all
        assert {_who(request(e.port, path="/app/x")) for _ in range(20)} == {"v1"}
        request(backends["v1"].port, "POST", "/_ctl/down")
        wait_until(lambda: request(e.port, path="/app/x").status == 503, 15, what="the app route's 503")
        assert b"route app" in request(e.port, path="/app/x").body
        assert request(e.port, path="/other").status == 200
        assert request(e.port, path="/echo/v2/x").status == 200
    finally:
        request(backends["canary"].port, "POST", "/_ctl/up")
        request(backends["v1"].port, "POST", "/_ctl/up")
        e.stop()


def test_sticky_client_stays_on_its_pool(tmp_path, backends):
    e, _ = _edge(tmp_path, backends, "--sticky", split=(50, 50))
    try:
        first = request(e.port, path="/app/x")
        cookie = first.header("Set-Cookie").split(";")[0]
        for _ in range(20):
            assert _who(request(e.port, path="/app/x", headers={"Cookie": cookie})) == _who(first)
    finally:
        e.stop()


def test_reload_changes_the_split_under_load_without_a_failure(tmp_path, backends):
    e, f = _edge(tmp_path, backends, split=(90, 10))
    statuses: Counter = Counter()
    stop = threading.Event()

    def load():
        c = http.client.HTTPConnection("127.0.0.1", e.port, timeout=10)
        while not stop.is_set():
            try:
                statuses[request(e.port, path="/app/x", conn=c).status] += 1
            except (OSError, http.client.HTTPException):
                statuses["error"] += 1
                c.close()
                c = http.client.HTTPConnection("127.0.0.1", e.port, timeout=10)
        c.close()

    threads = [threading.Thread(target=load) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: sum(statuses.values()) > 100, 20, what="load")
        f.write_text(_conf(backends, split=(10, 90)))
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded:")
        n = sum(statuses.values())
        wait_until(lambda: sum(statuses.values()) > n + 100, 20, what="load after the reload")
        stop.set()
        for t in threads:
            t.join(15)
        assert set(statuses) == {200}, statuses
        c = http.client.HTTPConnection("127.0.0.1", e.port, timeout=10)
        got = Counter(_who(request(e.port, path="/app/x", conn=c)) for _ in range(100))
        c.close()
        assert 85 <= got["canary"] <= 95, got
    finally:
        stop.set()
        e.stop()


def _check(tmp_path, text: str) -> subprocess.CompletedProcess:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    return subprocess.run([PY, "edge.py", "--config", str(f), "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=20)


@pytest.mark.parametrize("body, says", [
    ('[[routes]]\nname = "a"\npool = "nope"\n', "routes[0] (a).pool: no pool named 'nope'"),
    ('[[routes]]\nname = "a"\nsplit = []\n', "routes[0] (a).split: empty"),
    ('[[routes]]\nname = "a"\nsplit = [{ pool = "default", weight = 0 }]\n', "routes[0] (a).split[0].weight"),
    ('[[routes]]\nname = "a"\npool = "default"\n[[routes]]\nname = "a"\npool = "default"\n', "two routes are named 'a'"),
    ('[[pools]]\nname = "p"\nbackends = [{ url = "http://127.0.0.1:9" }]\n'
     '[[pools]]\nname = "p"\nbackends = [{ url = "http://127.0.0.1:9" }]\n', "two pools are named 'p'"),
    ('[[routes]]\nname = "a"\nmatch = { path_prefix = "/v2/" }\npool = "default"\n'
     '[[routes]]\nname = "b"\nmatch = { path_prefix = "/v2/x", methods = ["GET"] }\npool = "default"\n',
     "routes[1] (b).match: unreachable: routes[0] (a)"),
    ('[[routes]]\nname = "a"\npool = "default"\nrequest_headers = { set = { "X-Forwarded-For" = "1.2.3.4" } }\n',
     "X-Forwarded-For is the edge's own"),
    ('[[routes]]\nname = "a"\npool = "default"\nresponse_headers = { remove = ["X-RateLimit-Remaining"] }\n',
     "X-RateLimit-Remaining is the edge's own"),
    ('[[routes]]\nname = "a"\npool = "default"\nrequest_headers = { remove = ["Host"] }\n', "Host is the edge's own"),
    ('[[routes]]\nname = "a"\npool = "default"\nrequest_headers = { set = { "X-A" = "$uri" } }\n',
     "unknown variable $uri"),
    ('[[routes]]\nname = "a"\npool = "default"\ndeny = ["10.0.0.300/8"]\n', "routes[0] (a).deny"),
    ('[[pools]]\nname = "p"\nbackends = [{ url = "http://127.0.0.1:9" }]\nupstream = { retries = 3 }\n',
     "pools[0] (p).upstream.retries: not a per-pool setting"),
    ('[[pools]]\nname = "p"\nbackends = [{ url = "http://127.0.0.1:9" }]\nhealth = { interval = -1 }\n',
     "pools[0] (p).health.interval"),
    ('[[rules]]\nname = "r"\nkey = "ip"\nlimit = "1/s"\nmatch = { route = "nope" }\n',
     "rules (r).match.route: no route named 'nope'"),
])
def test_check_names_the_key(tmp_path, body, says):
    p = _check(tmp_path, '[[backends]]\nurl = "http://127.0.0.1:9"\n' + body)
    assert p.returncode == 2 and says in p.stderr, p.stderr


def test_check_accepts_the_example(tmp_path, backends):
    p = _check(tmp_path, _conf(backends))
    assert p.returncode == 0, p.stderr


def test_rule_matching_a_route_and_deny_spends_no_token(tmp_path, backends):
    extra = '\n[[rules]]\nname = "app-only"\nkey = "ip"\nlimit = "3/m"\nmatch = { route = "app" }\n'
    e, _ = _edge(tmp_path, backends, extra=extra + '\n[limits]\ndefault = "5/m"\n')
    try:
        for _ in range(3):
            assert request(e.port, path="/app/x").status == 200
        assert request(e.port, path="/app/x").status == 429           # the route's own rule
        # 403s by the allow list spend no token of the default limit
        left = int(request(e.port, path="/other").header("X-RateLimit-Remaining"))
        for _ in range(5):
            r = request(e.port, path="/", headers={"Host": "admin.example.com"})
            assert r.status == 403
        assert int(request(e.port, path="/other").header("X-RateLimit-Remaining")) == left - 1
    finally:
        e.stop()


def test_one_url_in_two_pools_is_two_backends_drained_apart(tmp_path, backends):
    from tests.support import ADMIN_AUTH, ADMIN_ENV
    url = backends["v1"].url
    f = tmp_path / "edge.toml"
    f.write_text(f'[[backends]]\nurl = "{url}"\n[[pools]]\nname = "p"\nbackends = [{{ url = "{url}" }}]\n'
                 f'[[routes]]\nname = "r"\nmatch = {{ path_prefix = "/p/" }}\npool = "p"\n')
    e = Edge("--config", str(f), "--admin", "127.0.0.1:0", env=ADMIN_ENV)
    try:
        st = json.loads(request(e.admin_port, path="/status").body)
        ident = st["pools"]["p"]["backends"][0]["route"]
        r = request(e.admin_port, "POST", f"/backends/p:{ident}/drain", headers=ADMIN_AUTH)
        assert r.status == 200 and json.loads(r.body)["pool"] == "p"
        assert request(e.port, path="/p/x").status == 503            # the pool's only backend is drained
        assert request(e.port, path="/x").status == 200              # the same URL in the default pool is not
        st = json.loads(request(e.admin_port, path="/status").body)
        assert st["pools"]["p"]["backends"][0]["drained"] and not st["backends"][0]["drained"]
    finally:
        e.stop()


def test_a_pool_has_its_own_health_checks_and_circuit_breaker(tmp_path, backends):
    url = backends["v2"].url
    f = tmp_path / "edge.toml"
    # the same backend in both pools: pool "strict" probes a path that resets (DOWN there only), and pool
    # "capped" sheds past one request in flight (its breaker only)
    f.write_text(f'[[backends]]\nurl = "{url}"\n'
                 f'[[pools]]\nname = "strict"\nbackends = [{{ url = "{url}" }}]\nhealth = {{ path = "/garbage" }}\n'
                 f'[[pools]]\nname = "capped"\nbackends = [{{ url = "{url}" }}]\nupstream = {{ max_requests = 1 }}\n'
                 f'[[routes]]\nname = "strict"\nmatch = {{ path_prefix = "/strict/" }}\npool = "strict"\n'
                 f'[[routes]]\nname = "capped"\nmatch = {{ path_prefix = "/slow" }}\npool = "capped"\n')
    e = Edge("--config", str(f), "--health-interval", "0.2", "--unhealthy-threshold", "1", "--max-requests", "0")
    try:
        wait_until(lambda: request(e.port, path="/strict/x").status == 503, 15, what="the strict pool's DOWN")
        assert request(e.port, path="/x").status == 200                   # the default pool's twin is UP
        done = threading.Event()

        def hold():       # again and again: a poll that holds the one slot makes this one the 503
            while not done.is_set():
                request(e.port, path="/slow?ms=500")

        slow = threading.Thread(target=hold)
        slow.start()
        try:
            r = wait_until(lambda: (lambda r: r if r.status == 503 else None)(request(e.port, path="/slow?ms=0")),
                           15, what="the capped pool's 503")
            assert b"max_requests" in r.body
            assert request(e.port, path="/x").status == 200               # the default pool has no cap
        finally:
            done.set()
            slow.join(10)
    finally:
        e.stop()


@pytest.mark.skipif(__import__("tests.browser", fromlist=["chromium"]).chromium() is None,
                    reason="needs Debian's chromium (./run-tests installs it)")
def test_the_dashboard_shows_the_routes_and_every_pool(tmp_path, backends):
    from tests.browser import Browser
    e, _ = _edge(tmp_path, backends, "--admin", "127.0.0.1:0")
    browser = None
    try:
        for _ in range(5):
            request(e.port, path="/app/x")
        browser = Browser(f"http://127.0.0.1:{e.admin_port}/")
        rows = "[...document.querySelectorAll('#routes tr[data-route]')].map(r => r.textContent)"
        shown = wait_until(lambda: browser.evaluate(rows), timeout=20, what="the routes on the page")
        assert len(shown) == 3 and "stable 90 / canary 10" in shown[2], shown
        urls = browser.evaluate("[...document.querySelectorAll('#backends tr[data-backend]')].map(r => r.textContent)")
        assert any(u.startswith("canary: ") for u in urls) and len(urls) == 5, urls
    finally:
        if browser is not None:
            browser.close()
        e.stop()


# -- the matcher and the header edits, without sockets ---------------------------------------------------

def _routes(text: str):
    import tomllib

    from lb.config.routes import parse_routes
    from lb.proxy.routes import Router
    specs = parse_routes(tomllib.loads(text)["routes"])

    class P:
        def __init__(self, name):
            self.name = name
    return Router(specs, {n: P(n) for s in specs for n in s.pools})


def _req(target=b"/", host=b"api.example.com", method=b"GET", headers=()):
    from lb.http.framing import parse_request
    head = b"%s %s HTTP/1.1\r\nHost: %s" % (method, target, host) + b"".join(b"\r\n%s: %s" % h for h in headers)
    return parse_request(head)


def test_matching_rules():
    r = _routes('[[routes]]\nname = "w"\nmatch = { host = "*.example.com", methods = ["POST"] }\npool = "a"\n'
                '[[routes]]\nname = "admin"\nmatch = { path_prefix = "/admin/" }\npool = "a"\n'
                '[[routes]]\nname = "beta"\nmatch = { headers = { "X-Beta" = "1" } }\npool = "a"\n')
    name = lambda req: (lambda m: m and m.name)(r.match(req))   # noqa: E731
    assert name(_req(method=b"POST", host=b"API.Example.COM:8443")) == "w"
    assert name(_req(method=b"POST", host=b"example.com")) is None            # a subdomain only
    assert name(_req(b"/v2/../admin/x")) == "admin"                             # normalised: no escape
    assert name(_req(b"//admin//x")) == "admin" and name(_req(b"/%61dmin/x")) == "admin"
    assert name(_req(b"/v2/admin/x")) is None
    assert name(_req(headers=[(b"x-beta", b"1")])) == "beta"
    assert name(_req(headers=[(b"X-Beta", b"10")])) is None                   # exact values


def test_header_edit_variables():
    from lb.config.routes import HeaderRules
    from lb.proxy.routes import HeaderEdit

    class X:
        client_ip, request_id, req = "10.1.2.3", b"abc123", _req(host=b"API.example.com:80")
    e = HeaderEdit(HeaderRules(set=(("X-A", "$remote_addr $request_id $host $$host"),), remove=("server",)))
    assert e.render(X()) == b"X-A: 10.1.2.3 abc123 api.example.com $host\r\n"
    assert e.drop == {b"x-a", b"server"}
    assert HeaderEdit(HeaderRules(set=(("X-B", "a$$b"),))).render(X()) == b"X-B: a$b\r\n"


def test_routes_over_http2_the_same(tmp_path, backends):
    """An HTTP/2 stream goes through the same pipeline: its route and the route's header rules."""
    from tests.h2client import H2Client
    e, _ = _edge(tmp_path, backends)
    c = H2Client(e.port)
    try:
        r = c.response(c.request("/echo/v2/x", headers=[("cookie", "a=b")]))
        hdrs = dict(r["headers"])
        assert hdrs[b":status"] == b"200" and hdrs[b"strict-transport-security"] == b"max-age=63072000"
        assert b"server" not in hdrs
        seen = {k.lower(): v for k, v in json.loads(r["data"])["headers"]}
        assert seen["x-client"] == "127.0.0.1" and "cookie" not in seen
        assert dict(c.response(c.request("/other"))["headers"])[b"server"]    # the default route: untouched
    finally:
        c.close()
        e.stop()


def test_an_h2c_backend_leaving_a_named_pool_has_its_connection_closed(tmp_path, backends):
    """A named pool's h2c:// backend removed (a reload here; a DNS answer takes the same path) drains and
    then closes its HTTP/2 connection, as one leaving the default pool does: none stays open to a backend
    the edge no longer uses."""
    from tests.h2server import H2Server
    old, new = H2Server(), H2Server()
    conf = tmp_path / "edge.toml"
    body = f"""[[backends]]
url = "{backends['d1'].url}"
[[pools]]
name = "grpc"
backends = [{{ url = "{old.url}" }}]
[[routes]]
name = "grpc"
match = {{ path_prefix = "/g/" }}
pool = "grpc"
"""
    conf.write_text(body)
    e = Edge("--config", str(conf), "--health-interval", "60")
    try:
        assert request(e.port, "GET", "/g/x").status == 200
        wait_until(lambda: old.connections >= 1, what="a connection to the h2c backend")
        closed = old.closed_by_peer
        conf.write_text(body.replace(old.url, new.url))
        e.signal(signal.SIGHUP)
        e.wait_log(r"backend %s removed \(drained\)" % old.url)
        assert request(e.port, "GET", "/g/x").status == 200
        wait_until(lambda: old.closed_by_peer > closed, timeout=10, what="the old backend's connection closed")
    finally:
        e.stop()
        old.close()
        new.close()
