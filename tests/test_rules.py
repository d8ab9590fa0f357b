"""Limit rules, identity kinds, known keys and the allowlist at the stage level, on an injected clock.

Requests are real parsed heads (lb.httpio.parse_request); the stage runs on the memory store and,
where composition is the point, on a real redis-server too (one script call per request).
"""

import uuid

import pytest

from lb.config.load import load
from lb.errors import ConfigError
from lb.http.framing import parse_request
from lb.limiting.keys import parse_keys
from lb.limiting.stage import LimitStage, release
from lb.limiting.rules import normalize_path, parse_rules
from limiter.compose import allow_all
from limiter import build

ALGORITHMS = ["token-bucket", "fixed-window", "sliding-log", "sliding-counter"]
T0 = 1_000_000.0


def req(method="GET", path="/", host="api.example.com", **headers):
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n" + "".join(
        f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    return parse_request(head.encode()[:-2])


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration)])
def store(request):
    """{} for the memory store; the Redis options for a redis-server of this test's own."""
    if request.param == "memory":
        return {}
    server = request.getfixturevalue("own_redis")
    return {"store": server.url, "timeout": 2.0}


def stage(default=None, rules=(), **kw):
    return LimitStage(default, rules=parse_rules(list(rules)), **kw)


def hdr(v, name):
    for line in v.headers.decode().split("\r\n"):
        k, _, val = line.partition(": ")
        if k == name:
            return val
    return None


# ------------------------------------------------------------------------------ acceptance, stage level

@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_25_random_keys_from_one_ip_admit_exactly_the_ip_rule(store, algorithm):
    """Acceptance 1: default 5/s per identity, an ip rule of 10/s: minting keys buys nothing past 10."""
    st = stage("5/s", [{"name": "ip-cap", "key": "ip", "limit": "10/s"}], algorithm=algorithm, **store)
    verdicts = [st.check(req(X_Api_Key=uuid.uuid4().hex), "203.0.113.9", now=T0 + 0.25) for _ in range(25)]
    assert sum(v.status == 0 for v in verdicts) == 10
    assert {v.limited_by for v in verdicts if v.status} == {"ip-cap"}
    assert all(v.status == 429 for v in verdicts[10:])


def test_login_rule_limits_posts_to_login_and_nothing_else(store):
    """Acceptance 2: a /login rule of 2/10s admits 2 of 4 POSTs; 4 GETs to /other all pass."""
    st = stage(None, [{"name": "login", "key": "ip", "limit": "2/10s",
                       "match": {"path_prefix": "/login", "methods": ["POST"]}}], **store)
    posts = [st.check(req("POST", "/login"), "198.51.100.7", now=T0 + i * 0.1).status for i in range(4)]
    others = [st.check(req("GET", "/other"), "198.51.100.7", now=T0 + 1 + i * 0.1) for i in range(4)]
    assert posts == [0, 0, 429, 429]
    assert [v.status for v in others] == [0] * 4
    assert all(v.headers == b"" for v in others)      # no limit applies to them: no limit headers
    gets = [st.check(req("GET", "/login"), "198.51.100.7", now=T0 + 2).status for _ in range(3)]
    assert gets == [0, 0, 0]                         # methods = ["POST"]: a GET of /login is not counted


def test_a_path_guard_cannot_be_dodged_by_spelling_the_path_differently():
    st = stage(None, [{"name": "login", "key": "ip", "limit": "1/m", "match": {"path_prefix": "/login"}}])
    assert st.check(req("POST", "/login"), "192.0.2.1", now=T0).status == 0
    for path in ("//login", "/./login", "/x/../login", "/%6Cogin", "/%6cogin?a=1", "/login/", "/login.php"):
        assert st.check(req("POST", path), "192.0.2.1", now=T0).status == 429, path
    assert st.check(req("POST", "/log"), "192.0.2.1", now=T0).status == 0
    assert normalize_path(b"http://h.example/a//b/./c/../d%7e") == b"/a/b/d~"
    assert normalize_path(b"/a/%2F/b") == b"/a/%2F/b"              # an encoded slash is not a separator


def test_a_global_dry_run_rule_rejects_nothing_and_reports_every_would_be_rejection(store):
    """Acceptance 3: global dry-run 1/m: nothing rejected, headers untouched, would-be rejections listed."""
    st = stage("100/m", [{"name": "ceiling", "key": "global", "limit": "1/m", "dry_run": True}], **store)
    vs = [st.check(req(), f"192.0.2.{i}", now=T0 + i) for i in range(6)]
    assert [v.status for v in vs] == [0] * 6
    assert [v.limited_by for v in vs] == [""] + ["ceiling:dry_run"] * 5
    assert [v.dry for v in vs[1:]] == [("ceiling",)] * 5
    assert all(hdr(v, "X-RateLimit-Limit") == "100" for v in vs)   # the dry-run rule never shows


def test_match_host_and_methods_are_anded():
    st = stage(None, [{"name": "h", "key": "global", "limit": "1/m",
                       "match": {"host": "*.example.com", "methods": ["PUT", "POST"], "path_prefix": "/v1/"}}])
    misses = [req("PUT", "/v1/x", host="example.com"), req("GET", "/v1/x", host="a.example.com"),
              req("PUT", "/v2/x", host="a.example.com"), req("PUT", "/v1/x", host="a.example.org")]
    for r in misses:
        assert st.check(r, "192.0.2.1", now=T0).headers == b""
    hits = [req("PUT", "/v1/x", host="A.Example.COM:8443"), req("POST", "/v1/y", host="b.a.example.com")]
    assert [st.check(r, "192.0.2.1", now=T0).status for r in hits] == [0, 429]


# -------------------------------------------------------------------------------- composition, spending

def test_a_rejected_request_spends_nothing_in_the_rules_that_admitted_it(store):
    """ip 1/m and global 3/m: the first client's 5 rejected retries must not eat the global ceiling."""
    st = stage(None, [{"name": "per-ip", "key": "ip", "limit": "1/m", "algorithm": "fixed-window"},
                      {"name": "ceiling", "key": "global", "limit": "3/m", "algorithm": "fixed-window"}], **store)
    now = 60.0 * 20000 + 1
    assert st.check(req(), "192.0.2.1", now=now).status == 0
    for _ in range(5):
        v = st.check(req(), "192.0.2.1", now=now)
        assert (v.status, v.rejected) == (429, ("per-ip",))
    assert [st.check(req(), f"192.0.2.{i}", now=now).status for i in (2, 3, 4)] == [0, 0, 429]
    v = st.check(req(), "192.0.2.5", now=now)
    assert v.rejected == ("ceiling",) and hdr(v, "X-RateLimit-Limit") == "3"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allow_all_is_all_or_nothing_for_every_algorithm(store, algorithm):
    tag = uuid.uuid4().hex[:8]
    extra = {"prefix": f"t:{tag}:a:"} if store else {}
    a = build(algorithm, 1, 60.0, **store, **extra)
    b = build(algorithm, 5, 60.0, **store, **({"prefix": f"t:{tag}:b:"} if store else {}))
    assert allow_all([(a, "k", True), (b, "k", True)], T0)[0] is True
    for _ in range(3):
        ok, (da, db) = allow_all([(a, "k", True), (b, "k", True)], T0)
        assert (ok, da.allowed, db.allowed) == (False, False, True)
    # b was not charged for the three rejected requests: 4 of its 5 remain
    got = [b.allow("k", T0).allowed for _ in range(5)]
    assert got == [True] * 4 + [False]


def test_dry_run_rules_spend_only_when_the_request_is_admitted():
    shadow = build("fixed-window", 2, 60.0)
    gate = build("fixed-window", 1, 60.0)
    t = 60.0 * 30000
    assert allow_all([(gate, "k", True), (shadow, "s", False)], t)[0] is True
    ok, (dg, ds) = allow_all([(gate, "k", True), (shadow, "s", False)], t)
    assert (ok, dg.allowed, ds.allowed) == (False, False, True)       # rejected: the shadow spends nothing
    assert [shadow.allow("s", t).allowed for _ in range(2)] == [True, False]


# ------------------------------------------------------------------------------------------- headers

def test_headers_describe_the_most_restrictive_rule():
    st = stage("10/m", [{"name": "burst", "key": "ip", "limit": "3/s", "algorithm": "fixed-window"},
                        {"name": "hourly", "key": "api-key", "limit": "4/h", "algorithm": "fixed-window"}],
               algorithm="fixed-window")
    t = 3600.0 * 300
    seen = [st.check(req(X_Api_Key="k1"), "192.0.2.1", now=t) for _ in range(4)]
    # remaining per rule after request i: default 9,8,7 ; burst 2,1,0 ; hourly 3,2,1 -> the least wins
    assert [hdr(v, "X-RateLimit-Remaining") for v in seen[:3]] == ["2", "1", "0"]
    assert [hdr(v, "X-RateLimit-Limit") for v in seen[:3]] == ["3", "3", "3"]
    assert seen[3].status == 429 and seen[3].rejected == ("burst",) and hdr(seen[3], "Retry-After") == "1"
    # a second later: burst is whole again, hourly has 1 left -> it is the one shown
    v = st.check(req(X_Api_Key="k1"), "192.0.2.1", now=t + 1)
    assert (v.status, hdr(v, "X-RateLimit-Limit"), hdr(v, "X-RateLimit-Remaining")) == (0, "4", "0")
    assert int(hdr(v, "X-RateLimit-Reset")) == 3599
    # IP .2 spends its burst with another key; then k1 (hourly spent) from .2: both reject, and
    # Retry-After is the later of the two retry times (the hour's)
    assert [st.check(req(X_Api_Key="k2"), "192.0.2.2", now=t + 1).status for _ in range(4)] == [0, 0, 0, 429]
    v = st.check(req(X_Api_Key="k1"), "192.0.2.2", now=t + 1)
    assert v.rejected == ("burst", "hourly") and hdr(v, "Retry-After") == "3599"
    assert v.limited_by == "burst,hourly"


def test_ietf_fields_are_off_by_default_and_list_the_binding_policy_first():
    rules = [{"name": "burst", "key": "ip", "limit": "3/s"}]
    assert b"RateLimit-Policy" not in stage("10/m", rules).check(req(), "192.0.2.1", now=T0).headers
    v = stage("10/m", rules, ietf_headers=True).check(req(), "192.0.2.1", now=T0)
    assert hdr(v, "RateLimit-Policy") == '"burst";q=3;w=1, "default";q=10;w=60'
    assert hdr(v, "RateLimit") == '"burst";r=2;t=1, "default";r=9;t=6'


# ---------------------------------------------------------------------------------------- identities

def test_an_api_key_that_looks_like_an_ip_does_not_get_that_ips_override():
    """The reproduced defect: X-Api-Key: 10.0.0.5 from 203.0.113.9 got the override for the IP 10.0.0.5."""
    st = stage("5/s", overrides=[("10.0.0.5", "1000/s")])
    forged = [st.check(req(X_Api_Key="10.0.0.5"), "203.0.113.9", now=T0).status for _ in range(50)]
    assert forged.count(0) == 5
    real = [st.check(req(), "10.0.0.5", now=T0).status for _ in range(50)]
    assert real.count(0) == 50
    keyed = stage("5/s", overrides=[("key:10.0.0.5", "1000/s")])   # said explicitly: it is a key
    assert [keyed.check(req(X_Api_Key="10.0.0.5"), "203.0.113.9", now=T0).status
            for _ in range(50)].count(0) == 50
    assert [keyed.check(req(), "10.0.0.5", now=T0).status for _ in range(50)].count(0) == 5


KEYS = [{"name": "acme", "key": "sk-acme-1", "tier": "pro"},
        {"name": "bob", "sha256": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"},  # "test"
        {"name": "batch", "key": "sk-batch"}]


def known(**kw):
    return parse_keys(KEYS, {"pro": "20/s"}, "keys")


def test_known_keys_get_their_tier_unknown_keys_are_limited_by_ip():
    st = stage("5/s", keys=known())
    assert [st.check(req(X_Api_Key="sk-acme-1"), "192.0.2.1", now=T0).status for _ in range(25)].count(0) == 20
    v = st.check(req(X_Api_Key="test"), "192.0.2.1", now=T0)
    assert v.label == "key:bob" and v.key_name == "bob" and hdr(v, "X-RateLimit-Limit") == "5"
    minted = [st.check(req(X_Api_Key=uuid.uuid4().hex), "192.0.2.2", now=T0) for _ in range(25)]
    assert sum(v.status == 0 for v in minted) == 5                  # one bucket: the IP's
    assert {v.label for v in minted} == {"ip:192.0.2.2"}


def test_unknown_keys_can_be_refused_with_401():
    st = stage("5/s", keys=known(), unknown_keys="reject")
    v = st.check(req(X_Api_Key="sk-guess"), "192.0.2.1", now=T0)
    assert (v.status, v.reason) == (401, "unknown API key")
    assert v.label.startswith("key:#") and "sk-guess" not in v.label
    assert st.check(req(), "192.0.2.1", now=T0).status == 0          # no key at all: limited by IP
    assert st.check(req(X_Api_Key="sk-batch"), "192.0.2.1", now=T0).label == "key:batch"


def test_no_raw_key_in_the_label_without_a_registry():
    st = stage("5/s")
    v = st.check(req(X_Api_Key="s3cr3t-value"), "192.0.2.1", now=T0)
    assert "s3cr3t" not in v.label and v.label.startswith("key:#") and len(v.label) == 17
    assert v.label == st.check(req(X_Api_Key="s3cr3t-value"), "192.0.2.9", now=T0).label
    assert st.check(req(X_Api_Key="x" * 257), "192.0.2.1", now=T0).status == 400


def test_unregistered_keys_are_identified_apart_and_the_label_cache_stays_bounded():
    from lb.limiting import stage as ratelimit
    st = stage("2/m")
    a = [st.check(req(X_Api_Key="key-a"), "192.0.2.1", now=T0) for _ in range(3)]
    b = st.check(req(X_Api_Key="key-b"), "192.0.2.1", now=T0)
    assert [v.status for v in a] == [0, 0, 429] and b.status == 0     # one quota per key, cached or not
    assert a[0].label == a[2].label != b.label
    for i in range(ratelimit._UNREGISTERED_MAX + 10):                  # a key-rotating client
        st.check(req(X_Api_Key=f"rotating-{i}"), "192.0.2.1", now=T0)
    assert len(ratelimit._unregistered) <= ratelimit._UNREGISTERED_MAX
    assert st.check(req(X_Api_Key="key-a"), "192.0.2.1", now=T0).status == 429   # its state is the store's


def test_exempt_clients_bypass_every_rule_and_are_reported():
    st = stage("1/m", [{"name": "g", "key": "global", "limit": "1/m"}], keys=known(),
               exempt=["10.0.0.0/8", "key:batch"])
    for _ in range(5):
        v = st.check(req(), "10.1.2.3", now=T0)
        assert (v.status, v.exempt, v.headers) == (0, True, b"")
        assert st.check(req(X_Api_Key="sk-batch"), "192.0.2.1", now=T0).exempt
    assert st.check(req(), "192.0.2.1", now=T0).status == 0
    assert st.check(req(), "192.0.2.2", now=T0).status == 429


def test_header_rule_falls_back_to_the_client_ip_never_to_one_shared_bucket():
    st = stage(None, [{"name": "tenant", "key": "header:X-Tenant", "limit": "1/m"}])
    assert st.check(req(X_Tenant="t1"), "192.0.2.1", now=T0).status == 0
    assert st.check(req(X_Tenant="t1"), "192.0.2.2", now=T0).status == 429     # same tenant, other IP
    assert st.check(req(X_Tenant="t2"), "192.0.2.1", now=T0).status == 0
    assert st.check(req(), "192.0.2.3", now=T0).status == 0                   # no header: by IP
    assert st.check(req(), "192.0.2.4", now=T0).status == 0
    assert st.check(req(), "192.0.2.3", now=T0).status == 429
    assert st.check(req(X_Tenant=""), "192.0.2.5", now=T0).status == 0         # empty: by IP too


def test_a_repeated_header_a_rule_keys_on_is_a_400_and_spends_nothing():
    """Which of two X-Tenant values would the limiter count, and which the backend read? Neither: a 400."""
    st = stage("5/m", [{"name": "tenant", "key": "header:X-Tenant", "limit": "2/m"}])
    twice = parse_request(b"GET / HTTP/1.1\r\nHost: a\r\nX-Tenant: t1\r\nX-Tenant: t2")
    v = st.check(twice, "192.0.2.1", now=T0)
    assert v.status == 400 and "more than one x-tenant header" in v.reason
    ok = st.check(req(X_Tenant="t1"), "192.0.2.1", now=T0)
    assert ok.status == 0 and hdr(ok, "X-RateLimit-Remaining") == "1"       # t1 had spent nothing


def test_ipv6_clients_share_their_64_in_rules_and_the_default():
    st = stage("2/m", [{"name": "per-ip", "key": "ip", "limit": "3/m"}])
    for i in range(2):
        assert st.check(req(), f"2001:db8:0:1::{i + 1}", now=T0).status == 0
    v = st.check(req(), "2001:db8:0:1:ffff::9", now=T0)
    assert v.status == 429 and v.label == "ip:2001:db8:0:1::/64"
    assert st.check(req(), "2001:db8:0:2::1", now=T0).status == 0              # the next /64: another client
    per_address = stage("2/m", ipv6_prefix=128)
    assert all(per_address.check(req(), f"2001:db8::{i + 1}", now=T0).status == 0 for i in range(5))


def test_memory_stays_bounded_per_rule_with_random_header_values():
    """Acceptance 6 at the stage: each rule's store holds at most max_keys keys, whatever arrives."""
    st = stage(None, [{"name": "h1", "key": "header:X-Rand", "limit": "5/m"},
                      {"name": "h2", "key": "header:X-Rand", "limit": "7/m", "algorithm": "sliding-log"}],
               max_keys=500)
    statuses = [st.check(req(X_Rand=uuid.uuid4().hex), "192.0.2.1", now=T0 + i * 0.001).status
                for i in range(3000)]
    assert [len(r.limiter) for r in st.rules] == [500, 500]
    # full of live state: a new value is refused (503, as nginx's limit_req when its zone is full), and no
    # live key was forgotten to make room -- a limited client cannot buy a fresh quota by flooding
    assert statuses == [0] * 500 + [503] * 2500
    assert st.rules[0].limiter.full == 2500


# -------------------------------------------------------------------------------------------- config

def write(tmp_path, text, name="edge.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_config_rules_keys_and_exempt_round_trip(tmp_path):
    keys = write(tmp_path, '[tiers]\nfree = "1/s"\n[[keys]]\nname = "acme"\nkey = "sk-1"\ntier = "free"\n',
                 "keys.toml")
    cfg = load(["--config", write(tmp_path, f'''
[[backends]]
url = "http://127.0.0.1:9"
[limits]
default = "5/s"
api_keys_file = "{keys}"
unknown_keys = "reject"
exempt = ["10.0.0.0/8", "key:acme"]
[limits.keys]
"key:acme" = "9/s"
[[rules]]
name = "login"
key = "header:X-User"
limit = "2/10s"
match = {{ path_prefix = "/login", methods = ["post"] }}
dry_run = true
''')])
    assert cfg.rules[0].key == "header:x-user" and cfg.rules[0].methods == ("POST",) and cfg.rules[0].dry_run
    assert [k.name for k in cfg.keys] == ["acme"] and cfg.keys[0].limit == "1/s"
    assert "sk-1" not in repr(cfg)


@pytest.mark.parametrize("body, message", [
    ('[[rules]]\nname = "a"\nkey = "ip"\n', "rules[0] (a): missing limit"),
    ('[[rules]]\nname = "a"\nkey = "cookie"\nlimit = "1/s"\n', "rules[0] (a).key: expected ip, api-key"),
    ('[[rules]]\nname = "default"\nkey = "ip"\nlimit = "1/s"\n', "built-in per-identity rule"),
    ('[[rules]]\nname = "a"\nkey = "ip"\nlimit = "1/s"\n[[rules]]\nname = "a"\nkey = "ip"\nlimit = "2/s"\n',
     "two rules are named 'a'"),
    ('[[rules]]\nname = "a"\nkey = "ip"\nlimit = "1/s"\nmatch = { path = "/x" }\n', "unknown key 'path'"),
    ('[[rules]]\nname = "a"\nkey = "ip"\nlimit = "fast"\n', "rules[0] (a).limit: rate must look like"),
    ('[[rules]]\nname = "a"\nkey = "header:"\nlimit = "1/s"\n', "header:NAME needs a header name"),
    ('[limits]\nexempt = ["key:nobody"]\n', "not a known key"),
    ('[limits]\nexempt = ["10.0.0.300/8"]\n', "not an address or CIDR"),
    ('[limits]\nunknown_keys = "maybe"\n', "limits.unknown_keys"),
    ('[limits]\ndefault = "1/s"\n[limits.keys]\n"ip:nope" = "2/s"\n', "limits.keys: 'ip:nope'"),
    ('[[keys]]\nname = "a"\nkey = "x"\n[[keys]]\nname = "b"\nkey = "x"\n', "same secret"),
    ('[[keys]]\nname = "a"\nkey = "x"\ntier = "gold"\n', "no tier 'gold'"),
    ('[limits]\ndefault = "1/s"\n[[keys]]\nname = "a"\nkey = "x"\n[limits.keys]\n"key:zed" = "2/s"\n',
     "an override names a key"),
])
def test_bad_rule_and_key_config_is_one_clear_line(tmp_path, body, message):
    with pytest.raises(ConfigError) as e:
        load(["--config", write(tmp_path, '[[backends]]\nurl = "http://127.0.0.1:9"\n' + body)])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_the_readme_rule_examples_are_valid_configurations(tmp_path):
    import re
    from tests.support import ROOT
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Limit rules"):text.index("## Many edges")]
    blocks = re.findall(r"```toml\n(.*?)```", section, re.S)
    assert len(blocks) == 5   # the fifth: Shaping (delay, concurrency, cost, status)
    keys = tmp_path / "keys.toml"
    keys.write_text('[tiers]\nfree = "60/m"\n[[keys]]\nname = "internal-batch"\nkey = "sk-b"\ntier = "free"\n')
    for block in blocks:
        block = block.replace("/etc/edge/keys.toml", str(keys))
        cfg = load(["--config", write(tmp_path, '[[backends]]\nurl = "http://127.0.0.1:9"\n' + block)])
        assert cfg.rules


@pytest.mark.parametrize("policy", ["fail-open", "fail-closed", "local"])
def test_several_rules_on_a_dead_redis_follow_the_failure_policy(own_redis, policy):
    rules = [{"name": "per-ip", "key": "ip", "limit": "1/m"}, {"name": "ceiling", "key": "global", "limit": "3/m"}]
    st = stage(None, rules, store=own_redis.url, timeout=0.2, on_error=policy)
    assert st.check(req(), "192.0.2.1", now=T0).status == 0
    own_redis.kill()
    # .1's denial was known before the kill (per-ip has nothing left): answered from the denial cache
    v = st.check(req(), "192.0.2.1", now=T0)
    assert (v.status, v.rejected, v.degraded) == (429, ("per-ip",), False)
    vs = [st.check(req(), ip, now=T0) for ip in ("192.0.2.2", "192.0.2.1", "192.0.2.1", "192.0.2.3",
                                                 "192.0.2.4", "192.0.2.5")]
    assert all(v.degraded for v in vs)
    statuses = [v.status for v in vs]
    if policy == "fail-open":
        assert statuses == [0] * 6
    elif policy == "fail-closed":
        assert statuses == [503] * 6
    else:  # fresh in-process counts, still all or nothing: .1's rejection spends no ceiling
        assert statuses == [0, 0, 429, 0, 429, 429]
        assert vs[2].rejected == ("per-ip",) and vs[4].rejected == ("ceiling",)


def test_allow_all_under_threads_is_exact_and_never_deadlocks():
    """8 threads composing (per-ip 5, global 200) over 50 addresses, 2 more hitting the global store
    alone, many new keys (growth locks) and a small table: exactly 200 admitted, 5 per address at most."""
    import threading
    per_ip = build("fixed-window", 5, 3600.0, max_keys=40)
    ceiling = build("fixed-window", 200, 3600.0)
    t = 3600.0 * 400
    admitted = []

    def composing(n):
        for i in range(300):
            ip = f"ip:{(n * 7 + i) % 50}"
            ok, _ = allow_all([(per_ip, ip, True), (ceiling, "*", True)], t)
            if ok:
                admitted.append(ip)

    def alone():
        for _ in range(100):
            if ceiling.allow("*", t).allowed:
                admitted.append("alone")

    threads = [threading.Thread(target=composing, args=(n,)) for n in range(8)]
    threads += [threading.Thread(target=alone) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "deadlock"
    assert len(admitted) == 200
    from collections import Counter
    assert max(Counter(a for a in admitted if a != "alone").values()) <= 5
    assert len(per_ip) <= 40


def test_allow_all_on_another_kind_of_store_decides_one_by_one():
    class Plain:               # a store allow_all has no atomic path for (e.g. one added later)
        def __init__(self, inner):
            self.inner = inner

        def allow(self, key, now=None):
            return self.inner.allow(key, now)

    a, b = Plain(build("fixed-window", 1, 60.0)), Plain(build("fixed-window", 5, 60.0))
    t = 60.0 * 40000
    assert allow_all([(a, "k", True), (b, "k", True)], t)[0] is True
    ok, (da, db) = allow_all([(a, "k", True), (b, "k", True)], t)
    assert (ok, da.allowed, db.allowed) == (False, False, True)   # b spent: no atomic path here
    assert [b.allow("k", t).allowed for _ in range(4)] == [True, True, True, False]


def test_the_one_script_survives_a_script_flush(own_redis):
    """NOSCRIPT (a restarted or flushed Redis): the assembled script is loaded again transparently."""
    st = stage(None, [{"name": "a", "key": "ip", "limit": "2/m"}, {"name": "b", "key": "global", "limit": "9/m"}],
               store=own_redis.url, timeout=2.0)
    assert st.check(req(), "192.0.2.1", now=T0).status == 0
    own_redis.client().script_flush()
    assert [st.check(req(), "192.0.2.1", now=T0).status for _ in range(2)] == [0, 429]
    assert not st.check(req(), "192.0.2.1", now=T0).degraded


def test_an_abuser_costs_no_round_trip_once_a_rule_is_known_to_deny(own_redis):
    """The denial cache on the one-script path: after per-ip ran out, the next 45 requests are
    answered locally -- 5 EVALSHA for 50 requests -- with what Redis would have said."""
    rules = [{"name": "per-ip", "key": "ip", "limit": "5/m"}, {"name": "ceiling", "key": "global", "limit": "900/m"},
             {"name": "shadow", "key": "global", "limit": "2/m", "dry_run": True}]
    red = stage(None, rules, store=own_redis.url, timeout=2.0)
    mem = stage(None, rules)
    rc = own_redis.client()
    rc.config_resetstat()
    got = [red.check(req(), "192.0.2.1", now=T0 + i * 0.01) for i in range(50)]
    want = [mem.check(req(), "192.0.2.1", now=T0 + i * 0.01) for i in range(50)]
    assert [v.status for v in got] == [v.status for v in want] == [0] * 5 + [429] * 45
    assert [v.headers for v in got] == [v.headers for v in want]      # one rejecting rule: exact headers
    assert [v.limited_by for v in got] == [v.limited_by for v in want]   # (the shadow's denial is cached too)
    assert got[-1].limited_by == "per-ip,shadow:dry_run"
    ev = rc.info("commandstats")["cmdstat_evalsha"]
    assert ev["calls"] - ev["failed_calls"] == 5                  # (the first call's NOSCRIPT aside)


def test_one_script_with_the_denial_cache_decides_as_the_memory_store_does(own_redis):
    """A seeded random history over 3 rules and 4 algorithms: the same verdicts as the memory store,
    the same headers on every admitted request, and a Retry-After never later than the memory store's
    (a cached rejection reports the rejecting limits the cache knows)."""
    import random
    rnd = random.Random(16)
    rules = [{"name": "per-ip", "key": "ip", "limit": "4/2s", "algorithm": "sliding-log"},
             {"name": "per-key", "key": "api-key", "limit": "6/3s", "algorithm": "sliding-counter"},
             {"name": "all", "key": "global", "limit": "9/s", "algorithm": "fixed-window"}]
    red = stage("5/s", rules, store=own_redis.url, timeout=2.0)
    mem = stage("5/s", rules)
    t = 5000.0
    for _ in range(600):
        t += rnd.choice((0.0, 0.001, 0.01, 0.05, 0.2))
        r = req(X_Api_Key=rnd.choice("abc"))
        ip = rnd.choice(("192.0.2.1", "192.0.2.2", "192.0.2.3"))
        a, b = red.check(r, ip, now=t), mem.check(r, ip, now=t)
        assert a.status == b.status, (t, a.limited_by, b.limited_by)
        if a.status == 0:
            assert a.headers == b.headers
        else:
            assert set(a.rejected) <= set(b.rejected)
            assert int(hdr(a, "Retry-After")) <= int(hdr(b, "Retry-After"))


def test_costs_and_delays_in_one_script_decide_as_the_memory_store_does(own_redis):
    """Issue 29: a cost on every algorithm and delay mode together, three rules and the built-in limit
    in one script call (limiter.redis.multi): every verdict, delay and header equals the memory store's."""
    import random
    rnd = random.Random(29)
    rules = [{"name": "log", "key": "ip", "limit": "7/2s", "algorithm": "sliding-log", "cost": 2},
             {"name": "counter", "key": "api-key", "limit": "9/3s", "algorithm": "sliding-counter", "cost": 3},
             {"name": "all", "key": "global", "limit": "20/s", "algorithm": "sliding-log", "cost": 1}]
    red = stage("5/s", rules, store=own_redis.url, timeout=2.0, max_delay=0.8, algorithm="sliding-counter")
    mem = stage("5/s", rules, max_delay=0.8, algorithm="sliding-counter")
    t, held = 7000.0, 0
    for _ in range(600):
        t += rnd.choice((0.0, 0.001, 0.01, 0.05, 0.2, 0.7))
        r = req(X_Api_Key=rnd.choice("abc"))
        ip = rnd.choice(("192.0.2.1", "192.0.2.2", "192.0.2.3"))
        a, b = red.check(r, ip, now=t), mem.check(r, ip, now=t)
        assert (a.status, a.delay) == (b.status, b.delay), (t, a.limited_by, b.limited_by)
        held += a.delay > 0
        if a.status == 0:
            assert a.headers == b.headers
        else:
            assert set(a.rejected) <= set(b.rejected)
            assert int(hdr(a, "Retry-After")) <= int(hdr(b, "Retry-After"))
    assert held > 30, held


# ------------------------------------------------------------- cost, in-flight and delay in the stage

@pytest.mark.parametrize("rule, message", [
    ({"name": "x", "key": "ip", "limit": "3/s", "cost": 4}, "could never be admitted"),
    ({"name": "x", "key": "ip", "limit": "3/s", "cost": 0}, "rules[0] (x).cost"),
    ({"name": "x", "key": "ip", "limit": "3/s", "cost": "2"}, "rules[0] (x).cost"),
    ({"name": "x", "key": "ip", "max_in_flight": 2, "cost": 2}, "a cost needs a limit"),
    ({"name": "x", "key": "ip", "max_in_flight": -1}, "rules[0] (x).max_in_flight"),
    ({"name": "x", "key": "ip", "max_in_flight": True}, "rules[0] (x).max_in_flight"),
    ({"name": "x", "key": "ip"}, "missing limit"),
    ({"name": "x", "key": "ip", "limit": "1/s", "burst": 2}, "cost, max_in_flight"),
])
def test_rule_cost_and_in_flight_are_checked(rule, message):
    with pytest.raises(ValueError) as e:
        parse_rules([rule])
    assert message in str(e.value)


def test_an_in_flight_refusal_spends_no_rate_and_a_rate_refusal_holds_no_slot():
    st = stage("2/m", [{"name": "exports", "key": "ip", "max_in_flight": 1, "match": {"path_prefix": "/export"}}])
    first = st.check(req(path="/export"), "192.0.2.1", now=T0)
    assert first.status == 0 and len(first.slots) == 1
    second = st.check(req(path="/export"), "192.0.2.1", now=T0)      # the one slot is taken: refused...
    assert (second.status, second.rejected, second.slots) == (429, ("exports",), None)
    assert hdr(second, "Retry-After") == "1"
    release(first.slots)
    third = st.check(req(path="/export"), "192.0.2.1", now=T0)       # ...and spent no rate: 2 of 2 admitted
    assert third.status == 0
    release(third.slots)
    fourth = st.check(req(path="/export"), "192.0.2.1", now=T0)      # the rate refuses: the slot is given back
    assert fourth.status == 429 and fourth.rejected == ("default",) and fourth.slots is None
    assert st.rules[0].inflight.count("ip:192.0.2.1") == 0


def test_the_built_in_in_flight_limit_counts_per_identity_and_the_status_is_configurable():
    st = stage(None, max_in_flight=2, status=503)
    a = [st.check(req(X_Api_Key="k"), "192.0.2.1", now=T0) for _ in range(3)]
    assert [v.status for v in a] == [0, 0, 503]
    assert st.check(req(X_Api_Key="other"), "192.0.2.1", now=T0).status == 0
    for v in a[:2]:
        release(v.slots)
    assert st.inflight.count("key:k") == 0


def test_delay_mode_in_the_stage_holds_and_dry_run_rules_never_hold():
    st = stage("2/s", [{"name": "shadow", "key": "global", "limit": "1/s", "dry_run": True}], max_delay=1.0)
    vs = [st.check(req(), "192.0.2.1", now=T0) for _ in range(5)]
    assert [v.status for v in vs] == [0, 0, 0, 0, 429]
    assert [v.delay for v in vs[:4]] == pytest.approx([0.0, 0.0, 0.5, 1.0])
    assert "shadow:dry_run" in vs[2].limited_by


def test_a_rule_cost_and_delay_with_another_limit_are_all_or_nothing_in_both_stores(store):
    """Two limits in one request (one script call on Redis): the cost is charged, a held request's delay
    is reported, and a refusal spends nothing."""
    st = stage("10/s", [{"name": "export", "key": "api-key", "limit": "4/s", "cost": 2, "algorithm": "fixed-window",
                         "match": {"path_prefix": "/export"}}], max_delay=0.5, **store)
    vs = [st.check(req(path="/export", X_Api_Key="k"), "192.0.2.1", now=T0 + 0.1) for _ in range(5)]
    # 4 units per window: two now, two in the next window (0.9 s away: beyond 0.5 s, refused)
    assert [v.status for v in vs] == [0, 0, 429, 429, 429]
    # the built-in 10/s spent only for the two admitted: 8 left at the same instant, the 9th held 0.1 s
    plain = [st.check(req(path="/", X_Api_Key="k"), "192.0.2.1", now=T0 + 0.1) for _ in range(9)]
    assert [v.status for v in plain] == [0] * 9
    assert [v.delay for v in plain] == pytest.approx([0.0] * 8 + [0.1])
    later = st.check(req(path="/export", X_Api_Key="k"), "192.0.2.1", now=T0 + 0.6)
    assert later.status == 0 and later.delay == pytest.approx(0.4)      # held until the next window
