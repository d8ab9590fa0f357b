"""What an operator sees (issue 30): the admin page in a real browser, the limiter's metrics, a key's
state without spending it, and /status the same with --workers."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.browser import Browser, chromium
from tests.support import ADMIN_AUTH, ADMIN_ENV, Backend, Edge, request, wait_until


def metrics(e: Edge) -> dict:
    """{(sample name, frozenset of labels): value}."""
    text = request(e.admin_port, "GET", "/metrics").body.decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def status(e: Edge) -> dict:
    return json.loads(request(e.admin_port, "GET", "/status").body)


@pytest.mark.skipif(chromium() is None, reason="needs Debian's chromium (./run-tests installs it)")
def test_the_dashboard_in_a_real_browser_shows_every_backend_up_then_a_killed_one_down():
    a, b = Backend("dash-a"), Backend("dash-b")
    e = Edge("--backends", f"{a.url},{b.url}", "--admin", "127.0.0.1:0", "--limit", "5/s",
             "--health-interval", "0.2", "--unhealthy-threshold", "2")
    browser = None
    try:
        page = request(e.admin_port, "GET", "/")
        assert page.status == 200 and page.header("Content-Type").startswith("text/html")
        html = page.body.decode()
        # self-contained: no script, style, image or font fetched from anywhere
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html) and "@import" not in html
        for _ in range(8):
            request(e.port, "GET", "/")          # 5/s: a few are 429s
        browser = Browser(f"http://127.0.0.1:{e.admin_port}/")
        states = ("[...document.querySelectorAll('#backends tr[data-backend]')]"
                  ".map(r => [r.dataset.backend, r.querySelector('.state').textContent])")
        shown = wait_until(lambda: (s := dict(browser.evaluate(states) or [])) and len(s) == 2 and s,
                           timeout=20, what="both backends on the page")
        assert shown == {a.url: "UP", b.url: "UP"}
        # the limit rule and the limited client are there too (the client is hashed as in the access log)
        wait_until(lambda: browser.evaluate("document.querySelector('#rules tr[data-rule=\"default\"]') !== null"),
                   timeout=10, what="the default rule's row")
        assert "ip:127.0.0.1" in browser.evaluate("document.querySelector('#top').textContent")
        assert "0.3" in browser.evaluate("document.getElementById('version').textContent")
        a.kill()
        # DOWN within its health window: 2 failed probes 0.2 s apart, plus a poll (1.5 s); generous bound
        wait_until(lambda: dict(browser.evaluate(states))[a.url] == "DOWN", timeout=15, what="DOWN on the page")
        assert dict(browser.evaluate(states))[b.url] == "UP"
        # no drain buttons: no admin token is configured
        assert browser.evaluate("document.querySelectorAll('#backends button').length") == 0
    finally:
        if browser is not None:
            browser.close()
        e.stop()
        a.stop()
        b.stop()


def test_limiter_backend_and_status_class_series_are_there_from_start_and_count(backends):
    e = Edge("--backends", ",".join(x.url for x in backends[:2]), "--admin", "127.0.0.1:0",
             "--limit", "3/m", "--health-interval", "0.2", env=ADMIN_ENV)
    try:
        m = metrics(e)
        for b in backends[:2]:
            for k in [("lb_rate_limit_admitted_total", {"rule": "default"}),
                      ("lb_rate_limited_total", {"rule": "default", "dry_run": "false"}),
                      ("lb_backend_transitions_total", {"backend": b.url, "to": "DOWN"}),
                      ("lb_health_probes_total", {"backend": b.url, "result": "fail"}),
                      ("lb_backend_responses_total", {"backend": b.url, "code": "5xx"}),
                      ("lb_upstream_errors_total", {"backend": b.url, "kind": "timeout"}),
                      ("lb_edge_responses_total", {"code": "429"}),
                      ("lb_request_duration_seconds_count", {"code": "4xx"}),
                      ("lb_request_duration_seconds_count", {"code": "2xx"})]:
                assert m.get((k[0], frozenset(k[1].items()))) == 0, k     # present, at zero, before traffic
        assert m[("lb_build_info", frozenset(m_labels(m, "lb_build_info")))] == 1
        assert m_labels(m, "lb_build_info") == m_labels(m, "edge_build_info")    # the old name kept
        statuses = [request(e.port, "GET", "/").status for _ in range(5)]
        assert statuses == [200, 200, 200, 429, 429]
        m = metrics(e)
        assert m[("lb_rate_limit_admitted_total", frozenset({"rule": "default"}.items()))] == 3
        assert m[("lb_rate_limited_total", frozenset({"rule": "default", "dry_run": "false"}.items()))] == 2
        # the latency histogram split by status class: the 429s do not dilute the 2xx latency
        assert m[("lb_request_duration_seconds_count", frozenset({"code": "2xx"}.items()))] == 3
        assert m[("lb_request_duration_seconds_count", frozenset({"code": "4xx"}.items()))] == 2
        wait_until(lambda: metrics(e)[("lb_health_probes_total",
                                       frozenset({"backend": backends[0].url, "result": "pass"}.items()))] >= 2,
                   timeout=10, what="probes counted")
        # a drain and an enable: two transitions (DRAINED, then UP again)
        route = status(e)["backends"][0]["route"]
        assert request(e.admin_port, "POST", f"/backends/{route}/drain", headers=ADMIN_AUTH).status == 200
        assert request(e.admin_port, "POST", f"/backends/{route}/enable", headers=ADMIN_AUTH).status == 200
        m = metrics(e)
        tr = lambda to: m[("lb_backend_transitions_total", frozenset({"backend": backends[0].url, "to": to}.items()))]
        assert (tr("DRAINED"), tr("UP"), tr("DOWN")) == (1, 1, 0)
        st = status(e)
        assert st["top_limited"] == [{"key": "ip:127.0.0.1", "rejected": 2}]
        assert st["key_table"] == {"keys": 1, "max_keys": 100000, "shared": False}
        assert st["uptime"] >= 0 and st["version"] and st["admin_writes"] is True     # a token is configured (ADMIN_ENV)
    finally:
        e.stop()


def m_labels(m: dict, name: str) -> set:
    return next(set(labels) for (n, labels) in m if n == name)


def test_a_killed_backend_counts_failed_probes_and_one_transition_to_down():
    a = Backend("probe-a")
    e = Edge("--backends", a.url, "--admin", "127.0.0.1:0", "--health-interval", "0.2")
    try:
        a.kill()
        down = ("lb_backend_transitions_total", frozenset({"backend": a.url, "to": "DOWN"}.items()))
        wait_until(lambda: metrics(e)[down] == 1, timeout=10, what="the DOWN transition counted")
        assert metrics(e)[("lb_health_probes_total", frozenset({"backend": a.url, "result": "fail"}.items()))] >= 2
    finally:
        e.stop()
        a.stop()


def test_limits_key_answers_each_rules_state_without_spending_it(backends, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "acme"\nkey = "k-acme-secret"\nlimit = "2/m"\n')
    conf = tmp_path / "edge.toml"
    conf.write_text(f'backends = [{{ url = "{backends[0].url}" }}]\nadmin = "127.0.0.1:0"\n'
                    f'[limits]\ndefault = "4/m"\napi_keys_file = "{keys}"\n'
                    '[[rules]]\nname = "everyone"\nkey = "global"\nlimit = "100/m"\n')
    e = Edge("--config", str(conf), "--admin", "127.0.0.1:0")
    try:
        def peek(path, **headers):
            r = request(e.admin_port, "GET", path, headers=headers)
            return r.status, json.loads(r.body)

        st, before = peek("/limits/ip:127.0.0.1")
        assert st == 200 and before["key"] == "ip:127.0.0.1"
        rows = {r["rule"]: r for r in before["rules"]}
        assert rows["default"]["remaining"] == 4 and rows["default"]["tracked"] is False
        assert rows["everyone"]["remaining"] == 100
        for _ in range(3):
            assert peek("/limits/ip:127.0.0.1") == (200, before)      # an untracked key stays untracked
        assert {r["rule"]: r["remaining"] for r in peek("/limits/ip:127.0.0.1")[1]["rules"]} == {"default": 4, "everyone": 100}
        assert request(e.port, "GET", "/").status == 200             # peeking spent nothing: 4 still there
        after = {r["rule"]: r for r in peek("/limits/ip:127.0.0.1")[1]["rules"]}
        assert after["default"]["remaining"] == 3 and after["default"]["tracked"] is True
        assert after["everyone"]["remaining"] == 99
        # a known key by its name; its tier (2/m) is the built-in rule's limit for it
        assert request(e.port, "GET", "/", headers={"X-Api-Key": "k-acme-secret"}).status == 200
        st, acme = peek("/limits/key:acme")
        row = acme["rules"][0]
        assert st == 200 and (row["rule"], row["source"], row["limit"], row["remaining"]) == ("default", "tier", 2, 1)
        # a raw key: only in a header, never in the URL
        assert peek("/limits/key", **{"X-Api-Key": "k-acme-secret"})[1]["key"] == "key:acme"
        st, body = peek("/limits/key:k-acme-secret")
        assert st == 404 and "X-Api-Key header" in body["error"] and "k-acme-secret" not in json.dumps(body)
        assert peek("/limits/ip:not-an-ip")[0] == 400 and peek("/limits/whatever")[0] == 400
        assert request(e.port, "GET", "/", headers={"X-Api-Key": "k-acme-secret"}).status == 200
        assert request(e.port, "GET", "/", headers={"X-Api-Key": "k-acme-secret"}).status == 429
    finally:
        e.stop()


def test_status_in_workers_mode_sums_the_limited_clients_and_shows_the_shared_table(backends, tmp_path):
    conf = tmp_path / "edge.toml"
    conf.write_text('[[rules]]\nname = "per-ip"\nkey = "ip"\nlimit = "100/m"\n'
                    '[[rules]]\nname = "untouched"\nkey = "ip"\nlimit = "100/m"\nmatch = { path_prefix = "/never" }\n')
    e = Edge("--config", str(conf), "--backends", backends[0].url, "--workers", "2", "--admin", "127.0.0.1:0",
             "--limit", "2/m")
    try:
        wait_until(lambda: metrics(e).get(("lb_workers", frozenset())) == 2, timeout=20, what="both workers")
        codes = [request(e.port, "GET", "/", headers={"X-Api-Key": "k-w"}).status for _ in range(12)]
        assert codes.count(200) == 2, codes
        # connections spread over both workers; the one /status answer counts every worker's rejections
        st = wait_until(lambda: (s := status(e)) and s["top_limited"] and s["top_limited"][0]["rejected"] == 10 and s,
                        timeout=10, what="every worker's rejections in /status")
        assert st["top_limited"][0]["key"].startswith("key:#") and "k-w" not in json.dumps(st)
        assert st["workers"] == 2 and st["key_table"]["shared"] is True
        # per rule, as with one process (the one table every worker shares, counted by each rule's tag):
        # from a census of the table each worker takes at most once a second, so polled (one /status read
        # right after the requests could meet a census from before them: per-ip 0 in a full run)
        st = wait_until(lambda: (s := status(e)) and {r["name"]: r["keys"] for r in s["rules"]} ==
                        {"per-ip": 1, "untouched": 0} and s, timeout=10, what="each rule's keys in /status")
        assert st["key_table"]["keys"] == 2            # k-w in the built-in rule, 127.0.0.1 in per-ip
    finally:
        e.stop()


def test_the_top_limited_list_stays_bounded_under_rotating_keys():
    from lb.ops.metrics import TopKeys
    t = TopKeys()
    for _ in range(50):
        t.count("ip:10.0.0.1")
    for i in range(100_000):
        t.count(f"key:#{i:012x}")
    assert len(t.counts) <= TopKeys.CAP and t.top(1) == [("ip:10.0.0.1", 50)]


@pytest.mark.parametrize("algorithm", ["token-bucket", "fixed-window", "sliding-log", "sliding-counter"])
@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.integration)])
def test_peek_answers_as_allow_would_and_changes_nothing(algorithm, store, request):
    from limiter import build
    url = request.getfixturevalue("redis_server").url if store == "redis" else "memory"
    lim = build(algorithm, limit=3, window=60.0, store=url, **({"prefix": f"peek:{algorithm}:"} if store == "redis" else {}))
    t = 1_000_000.0
    assert lim.peek("c", t)[0] is False
    for i in range(3):
        held, d = lim.peek("c", t + i)
        assert lim.peek("c", t + i) == (held, d)                        # peeking twice: the same answer
        assert d.allowed and d == lim.allow("c", t + i), i             # and the one allow then gives
        assert lim.peek("c", t + i)[0] is True
    held, d = lim.peek("c", t + 3)
    assert held and not d.allowed and d == lim.allow("c", t + 3)


@pytest.mark.skipif(chromium() is None, reason="needs Debian's chromium (./run-tests installs it)")
def test_the_page_asks_for_the_token_when_writes_are_enabled_and_drains_with_it():
    """The page against a scripted admin (a real HTTP server on 127.0.0.1) that says admin_writes: the
    token field appears, the entered token is kept and a drain is POSTed with Authorization: Bearer."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from lb.ops import dashboard
    posts = []
    st = {"version": "t", "python": "3", "uptime": 5, "workers": 1, "strategy": "weighted", "store": "memory",
          "store_up": None, "connections": 0, "limit": None, "rules": [], "top_limited": [], "key_table": None,
          "admin_writes": True, "backends": [{"url": "http://10.0.0.9:80", "route": "abc123", "weight": 1,
                                              "effective_weight": 1, "state": "UP", "inflight": 0, "drained": False,
                                              "ejected": False, "last_probe": "HTTP 200"}]}

    class Admin(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body: bytes, ctype: str):
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/":
                self._send(dashboard.page(), dashboard.CONTENT_TYPE)
            elif self.path == "/status":
                self._send(json.dumps(st).encode(), "application/json")
            else:
                self._send(b"lb_requests_total{backend=\"http://10.0.0.9:80\"} 1\n", "text/plain")

        def do_POST(self):
            posts.append((self.path, self.headers.get("Authorization")))
            st["backends"][0].update(drained=True, state="DRAINED")
            self._send(b"{}", "application/json")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Admin)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    browser = Browser(f"http://127.0.0.1:{srv.server_address[1]}/")
    try:
        wait_until(lambda: browser.evaluate("getComputedStyle(document.getElementById('token')).display") != "none",
                   timeout=15, what="the token field")
        assert browser.evaluate("document.querySelectorAll('#backends button').length") == 0   # no token yet
        browser.evaluate("document.getElementById('token-input').value = 's3cret'; document.getElementById('token-save').click()")
        wait_until(lambda: browser.evaluate("document.querySelectorAll('#backends button').length") == 1,
                   timeout=10, what="the drain button")
        assert browser.evaluate("sessionStorage.getItem('edge-admin-token')") == "s3cret"
        browser.evaluate("document.querySelector('#backends button').click()")
        wait_until(lambda: posts, timeout=10, what="the drain POST")
        assert posts[0] == ("/backends/abc123/drain", "Bearer s3cret")
        wait_until(lambda: browser.evaluate("document.querySelector('#backends button').textContent") == "enable",
                   timeout=10, what="the enable button once DRAINED")
    finally:
        browser.close()
        srv.shutdown()


def test_limits_key_through_the_edge_on_the_redis_store(backends, redis_server):
    e = Edge("--backends", backends[0].url, "--admin", "127.0.0.1:0", "--limit", "3/m", "--store", redis_server.url,
             "--algorithm", "sliding-log")
    try:
        peek = lambda: json.loads(request(e.admin_port, "GET", "/limits/ip:127.0.0.1").body)["rules"][0]
        assert (peek()["tracked"], peek()["remaining"]) == (False, 3)
        assert request(e.port, "GET", "/").status == 200
        assert [peek()["remaining"] for _ in range(3)] == [2, 2, 2]        # read-only: Redis keeps 1 of 3 spent
        assert [request(e.port, "GET", "/").status for _ in range(3)] == [200, 200, 429]
        row = peek()
        assert (row["tracked"], row["would_admit"], row["remaining"]) == (True, False, 0) and row["retry_after"] > 0
    finally:
        e.stop()
