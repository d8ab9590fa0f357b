"""The Redis store's URL, secret and TLS: parsing, rediss:// against a real TLS redis-server, a password
from EDGE_REDIS_PASSWORD that never shows, and the local policy's recovery with two stores on one Redis.

The CA and the server certificate are made here with the openssl command (./run-tests installs it when
missing); redis-server is Debian's, built with TLS.
"""

import shutil
import subprocess
import uuid

import pytest

from limiter import build
from limiter.redis.url import parse
from tests.redis_server import RedisServer
from tests.support import Edge, request, wait_until

# ------------------------------------------------------------------------------------ URL parsing

@pytest.mark.parametrize("url, kind, hosts, extra", [
    ("redis://127.0.0.1:6379/2", "single", [("127.0.0.1", 6379)], {"db": 2}),
    ("rediss://edge:pw@redis.example:6380", "single", [("redis.example", 6380)],
     {"tls": True, "username": "edge", "password": "pw"}),
    ("redis://:p%40ss@[::1]:6379/0", "single", [("::1", 6379)], {"password": "p@ss", "username": None}),
    ("redis-sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster", "sentinel",
     [("10.0.0.1", 26379), ("10.0.0.2", 26379)], {"master": "mymaster"}),
    ("redis-cluster://u:pw@h1:7000,h2:7001", "cluster", [("h1", 7000), ("h2", 7001)], {"username": "u"}),
])
def test_store_urls_parse_into_one_target_shape(url, kind, hosts, extra):
    t = parse(url, environ={})
    assert t.kind == kind and list(t.hosts) == hosts
    for k, v in extra.items():
        assert getattr(t, k) == v
    assert "pw" not in repr(t) and "pw" not in t.display and "p@ss" not in repr(t)


@pytest.mark.parametrize("url, kw, env, words", [
    ("redis://h:1,h:2/0", {}, {}, ["one HOST:PORT"]),
    ("redis://h/0", {}, {}, ["HOST:PORT"]),
    ("redis://h:1/x", {}, {}, ["/DB"]),
    ("redis-sentinel://h:1", {}, {}, ["master"]),
    ("redis://h:1?ssl=1", {}, {}, ["query"]),
    ("redis://h:1/0", {"ca_file": "/etc/hostname"}, {}, ["rediss://"]),
    ("rediss://h:1/0", {"ca_file": "/nonexistent/ca.pem"}, {}, ["redis_ca_file", "cannot read"]),
    ("rediss://h:1/0", {"cert_file": "/etc/hostname"}, {}, ["redis_key_file"]),
    ("redis://u:sekrit@h:1/0", {}, {"EDGE_REDIS_PASSWORD": "x"}, ["twice", "EDGE_REDIS_PASSWORD"]),
    ("redis://h:1/0", {"password_file": "/nonexistent/pw"}, {}, ["redis_password_file", "cannot read"]),
    ("mongo://sekrit@h:1", {}, {}, ["store", "memory", "redis://"]),
])
def test_bad_store_settings_fail_with_one_line_and_no_secret(url, kw, env, words):
    with pytest.raises(ValueError) as e:
        parse(url, environ=env, **kw)
    msg = str(e.value)
    assert "\n" not in msg and "sekrit" not in msg
    for w in words:
        assert w in msg


def test_the_password_comes_from_the_file_or_the_environment(tmp_path):
    f = tmp_path / "pw"
    f.write_text("from-file\n")
    assert parse("redis://h:1/0", password_file=str(f), environ={}).password == "from-file"
    assert parse("redis://h:1/0", environ={"EDGE_REDIS_PASSWORD": "from-env"}).password == "from-env"
    assert parse("redis://edge@h:1/0", environ={}).password == "edge"  # a lone userinfo field: the password
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="empty"):
        parse("redis://h:1/0", password_file=str(tmp_path / "empty"), environ={})


# ------------------------------------------------------------------------ the local policy's recovery

def test_local_policy_recovery_clears_every_stores_fallback_state(own_redis):
    """Two stores (two rates) on one Redis, policy local.  An outage: each store's local limiter counts.
    Redis back: ONE store's call flips the shared breaker; the other store must drop its local counts too
    (the bug: only the flipping store cleared), so in the next outage it starts from a fresh count."""
    prefix = f"rec:{uuid.uuid4().hex[:6]}:"
    kw = dict(store=own_redis.url, timeout=0.2, on_error="local", retry_interval=0.05)
    a = build("fixed-window", 2, 600.0, prefix=prefix + "a:", **kw)
    b = build("fixed-window", 3, 600.0, prefix=prefix + "b:", **kw)
    assert a.link is b.link
    now = 1000.0
    own_redis.kill()
    assert [b.allow("k", now).allowed for _ in range(4)] == [True, True, True, False]  # local: 3 of 3
    assert a.allow("k", now).degraded
    own_redis.start()
    # a's call is the probe that finds Redis back (the breaker is shared: b never sees it flip)
    wait_until(lambda: not getattr(a.allow("other", now), "degraded", False), timeout=5, what="recovery")
    assert a.link.up
    assert not getattr(b.allow("k2", now), "degraded", False)  # b reaches Redis again
    own_redis.kill()
    d = b.allow("k", now)
    assert d.degraded and d.allowed and d.remaining == 2, "b's local state from the first outage survived"


# ------------------------------------------------------------------------------------------- TLS

def _openssl():
    exe = shutil.which("openssl")
    if exe is None:
        pytest.fail("openssl not found: install it (Debian: apt-get install openssl; ./run-tests does this)",
                    pytrace=False)
    return exe


def _make_ca(d, name):
    """A CA (key + self-signed certificate) in directory d."""
    ossl = _openssl()
    subprocess.run([ossl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", d / f"{name}.key", "-out", d / f"{name}.pem", "-days", "2", "-subj", f"/CN={name}"],
                   check=True, capture_output=True)
    return d / f"{name}.pem", d / f"{name}.key"


def _issue(d, ca, name, san):
    """A certificate for `name`, signed by ca, valid for the subjectAltName san (e.g. IP:127.0.0.1)."""
    ossl = _openssl()
    ca_pem, ca_key = ca
    subprocess.run([ossl, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", d / f"{name}.key", "-out", d / f"{name}.csr", "-subj", f"/CN={name}"],
                   check=True, capture_output=True)
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    subprocess.run([ossl, "x509", "-req", "-in", d / f"{name}.csr", "-CA", ca_pem, "-CAkey", ca_key,
                    "-CAcreateserial", "-out", d / f"{name}.pem", "-days", "2", "-extfile", d / f"{name}.ext"],
                   check=True, capture_output=True)
    return d / f"{name}.pem", d / f"{name}.key"


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca = _make_ca(d, "ca")
    other_ca = _make_ca(d, "other-ca")
    cert, key = _issue(d, ca, "server", "IP:127.0.0.1")
    client = _issue(d, ca, "client", "DNS:edge")
    server = RedisServer(extra=("--port", "0", "--tls-port", "0", "--tls-cert-file", cert, "--tls-key-file", key,
                                "--tls-ca-cert-file", ca[0], "--tls-auth-clients", "optional"),
                         ping={"host": "127.0.0.1", "ssl": True, "ssl_ca_certs": str(ca[0])})
    server.extra[server.extra.index("--tls-port") + 1] = str(server.port)
    server.url = f"rediss://127.0.0.1:{server.port}/0"
    server.start()
    yield {"server": server, "ca": str(ca[0]), "other_ca": str(other_ca[0]),
           "client_cert": str(client[0]), "client_key": str(client[1])}
    server.stop()


def test_rediss_with_the_right_ca_enforces_the_limit(tls):
    lim = build("fixed-window", 3, 60.0, store=tls["server"].url, ca_file=tls["ca"], timeout=2.0,
                prefix=f"tls:{uuid.uuid4().hex[:6]}:")
    lim.strict = True
    assert [lim.allow("k", 100.0).allowed for _ in range(4)] == [True, True, True, False]
    assert lim.failures == 0
    # and with a client certificate (the server asks for one optionally and checks it against the CA)
    lim2 = build("fixed-window", 3, 60.0, store=tls["server"].url, ca_file=tls["ca"], timeout=2.0,
                 cert_file=tls["client_cert"], key_file=tls["client_key"], prefix=f"tls:{uuid.uuid4().hex[:6]}:")
    assert lim2.allow("k", 100.0).allowed and lim2.failures == 0


def test_rediss_with_a_wrong_ca_fails_with_one_clear_line(tls, backend, tmp_path):
    conf = tmp_path / "edge.toml"
    conf.write_text(f'[limits]\nredis_ca_file = "{tls["other_ca"]}"\n')
    e = Edge("--config", str(conf), "--backends", backend.url, "--limit", "5/s", "--store", tls["server"].url,
             "--on-store-error", "fail-closed", "--redis-timeout", "1", name="edge-wrong-ca")
    try:
        assert request(e.port, headers={"X-Api-Key": "k"}).status == 503  # fail-closed: the store is unusable
        line = e.wait_log(r".*limiter store rediss://127\.0\.0\.1:\d+/0 unavailable.*").group(0)
        assert "certificate verify failed" in line
        assert len([ln for ln in e.log().splitlines() if "unavailable" in ln]) == 1
    finally:
        e.stop()


# -------------------------------------------------------------------------------------- passwords

SECRET = "s3cr3t-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def locked_redis():
    server = RedisServer(extra=("--requirepass", SECRET, "--user", "edge", "on", f">{SECRET}", "~*", "+@all"),
                         ping={"password": SECRET})
    server.start()
    yield server
    server.stop()


def _all_output(e):
    out = e.log()
    out += request(e.admin_port, path="/status").body.decode()
    out += request(e.admin_port, path="/metrics").body.decode()
    return out


def test_a_password_from_the_environment_works_and_never_shows(locked_redis, backend):
    e = Edge("--backends", backend.url, "--limit", "3/m", "--algorithm", "fixed-window", "--store",
             locked_redis.url, "--on-store-error", "fail-closed", "--redis-timeout", "1", "--admin", "127.0.0.1:0",
             name="edge-env-password", env={"EDGE_REDIS_PASSWORD": SECRET})
    try:
        key = f"pw-{uuid.uuid4().hex[:6]}"
        assert [request(e.port, headers={"X-Api-Key": key}).status for _ in range(4)] == [200, 200, 200, 429]
        assert locked_redis.client().keys(f"*{key}*"), "the state is in the password-protected Redis"
        assert SECRET not in _all_output(e)
    finally:
        e.stop()
    assert SECRET not in e.log()


def test_an_acl_user_from_the_url_works_and_a_wrong_password_is_one_line_without_it(locked_redis, backend):
    url = f"redis://edge:{SECRET}@127.0.0.1:{locked_redis.port}/0"
    lim = build("fixed-window", 2, 60.0, store=url, timeout=2.0, prefix=f"acl:{uuid.uuid4().hex[:6]}:")
    assert [lim.allow("k", 1.0).allowed for _ in range(3)] == [True, True, False]
    assert SECRET not in repr(lim) and SECRET not in lim.url
    wrong = "not-" + SECRET
    e = Edge("--backends", backend.url, "--limit", "3/m", "--store", f"redis://edge:{wrong}@127.0.0.1:"
             f"{locked_redis.port}/0", "--on-store-error", "fail-open", "--admin", "127.0.0.1:0",
             name="edge-wrong-password")
    try:
        assert request(e.port, headers={"X-Api-Key": "k"}).status == 200  # fail-open
        line = e.wait_log(r".*limiter store .* unavailable.*").group(0)
        assert "AuthenticationError" in line
        assert wrong not in _all_output(e) and SECRET not in _all_output(e)
    finally:
        e.stop()


@pytest.mark.parametrize("secret", ["Sup3r/s3cret", "pa@s3cret", "pa ss3cret"], ids=["slash", "at", "space"])
def test_a_redis_password_with_a_slash_an_at_sign_or_a_space_is_redacted_everywhere(backend, secret):
    """The store URL's parser takes userinfo up to the last '@' (as urllib does), but the redaction of
    log lines, /status and the metrics label stopped at the first '/' or '@': the start-up line showed
    `redis://:Sup3r/s3cret@127.0.0.1:1` whole, and `pa@s3cret` as `:***@s3cret@`. A space stopped it
    too (the pattern's \\S): `redis://:pa ss3cret@127.0.0.1:1` was shown whole; now the parser's own
    redaction (limiter.redis_url.redact) writes the store, and the log hides the password's text."""
    e = Edge("--backends", backend.url, "--limit", "5/s", "--store", f"redis://:{secret}@127.0.0.1:1",
             "--on-store-error", "fail-open", "--admin", "127.0.0.1:0")
    try:
        assert request(e.port).status == 200          # fail-open: served, and a store error logged
        seen = e.log() + request(e.admin_port, "GET", "/status").body.decode() + \
            request(e.admin_port, "GET", "/metrics").body.decode()
        assert "redis://:***@127.0.0.1:1" in seen
        assert "s3cret" not in seen, [ln for ln in seen.splitlines() if "s3cret" in ln]
    finally:
        e.stop()
