"""TLS termination against real processes: HTTPS in, versions, ALPN, handshake deadlines, wrong-protocol
clients, certificate reload on SIGHUP, and https:// backends verified against a CA file."""

import http.client
import json
import signal
import socket
import ssl
import threading
import time

import pytest

from tests.support import Edge, config_error, raw, request, wait_until

trustme = pytest.importorskip("trustme", reason="trustme (requirements-dev.txt) makes the test certificates")


def client_ctx(pki, **versions) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki["ca"])
    ctx.set_alpn_protocols(["http/1.1"])
    for k, v in versions.items():
        setattr(ctx, k, v)
    return ctx


def https(port, pki, ctx=None, timeout=10.0) -> http.client.HTTPSConnection:
    return http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=ctx or client_ctx(pki))


def tls_edge(pki, backends, *args, n="1"):
    return Edge("--backends", backends[0].url, "--health-interval", "30", "--tls-cert", pki["cert" + n],
                "--tls-key", pki["key" + n], *args)


def peer_cert(port, pki) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        with client_ctx(pki).wrap_socket(s, server_hostname="127.0.0.1") as t:
            return t.getpeercert(binary_form=True)


def test_https_in_keep_alive_alpn_and_forwarded_proto(backends, pki):
    e = tls_edge(pki, backends, "--admin", "127.0.0.1:0")
    try:
        c = https(e.port, pki)
        infos = [json.loads(request(e.port, "GET", f"/echo/{i}", conn=c).body) for i in range(5)]
        assert c.sock.version() in ("TLSv1.2", "TLSv1.3")
        assert c.sock.selected_alpn_protocol() == "http/1.1"
        c.close()
        assert [i["target"] for i in infos] == [f"/echo/{i}" for i in range(5)]
        for info in infos:
            hdrs = {k.lower(): v for k, v in info["headers"]}
            assert hdrs["x-forwarded-proto"] == "https"
        # A trusted proxy's word stands (it terminated TLS in front of us, or did not).
        trusted = tls_edge(pki, backends, "--trusted-proxies", "127.0.0.1/32")
        try:
            info = json.loads(request(trusted.port, "GET", "/echo", {"X-Forwarded-Proto": "http"},
                                      conn=https(trusted.port, pki)).body)
            assert {k.lower(): v for k, v in info["headers"]}["x-forwarded-proto"] == "http"
        finally:
            trusted.stop()
        status = json.loads(request(e.admin_port, "GET", "/status").body)
        assert status["tls"] is True
        # With HTTP/2 on (the default) a client offering h2 gets it (tests/test_http2.py); with it off
        # ([server] http2 = false) h2 is never claimed: HTTP/1.1 as before.
        off = tls_edge(pki, backends, "--http2", "off")
        try:
            ctx = client_ctx(pki)
            ctx.set_alpn_protocols(["h2", "http/1.1"])
            c = https(off.port, pki, ctx)
            assert request(off.port, "GET", "/", conn=c).status == 200
            assert c.sock.selected_alpn_protocol() == "http/1.1"
            c.close()
        finally:
            off.stop()
        ctx = client_ctx(pki)
        ctx.set_alpn_protocols(["h2", "http/1.1"])
        with socket.create_connection(("127.0.0.1", e.port), timeout=10) as s:
            with ctx.wrap_socket(s, server_hostname="127.0.0.1") as t:
                assert t.selected_alpn_protocol() == "h2"
    finally:
        e.stop()


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion:DeprecationWarning")
def test_tls_1_0_and_1_1_are_refused_and_min_version_1_3_refuses_1_2(backends, pki):
    e = tls_edge(pki, backends, "--admin", "127.0.0.1:0")
    e13 = tls_edge(pki, backends, "--tls-min-version", "TLSv1.3")
    try:
        old = client_ctx(pki, minimum_version=ssl.TLSVersion.TLSv1, maximum_version=ssl.TLSVersion.TLSv1_1)
        old.set_ciphers("DEFAULT:@SECLEVEL=0")    # let this client offer what a 2010 client would
        with pytest.raises((ssl.SSLError, ConnectionResetError)):
            request(e.port, "GET", "/", conn=https(e.port, pki, old))
        tls12 = client_ctx(pki, maximum_version=ssl.TLSVersion.TLSv1_2)
        c = https(e.port, pki, tls12)
        assert request(e.port, "GET", "/", conn=c).status == 200      # the same client at 1.2 is fine
        assert c.sock.version() == "TLSv1.2"
        c.close()
        with pytest.raises((ssl.SSLError, ConnectionResetError)):
            request(e13.port, "GET", "/", conn=https(e13.port, pki, tls12))
        c = https(e13.port, pki)
        assert request(e13.port, "GET", "/", conn=c).status == 200
        assert c.sock.version() == "TLSv1.3"
        c.close()
        e.wait_log(r"TLS handshake failed: unsupported protocol")
        metrics = request(e.admin_port, "GET", "/metrics").body.decode()
        assert "lb_tls_handshake_failures_total 1" in metrics
    finally:
        e.stop()
        e13.stop()


def test_silent_and_trickling_tls_clients_never_delay_a_real_one(backends, pki):
    header_timeout = 3.0
    e = tls_edge(pki, backends, "--header-timeout", str(header_timeout))
    silent, closed_at = [], {}
    stop = threading.Event()
    try:
        start = time.monotonic()
        for _ in range(50):
            s = socket.create_connection(("127.0.0.1", e.port), timeout=30)
            silent.append(s)
        # One more sends a ClientHello a byte at a time, for as long as it is let.
        hello = _client_hello(pki)

        def trickle():
            with socket.create_connection(("127.0.0.1", e.port), timeout=30) as s:
                try:
                    for b in hello:
                        if stop.is_set():
                            return
                        s.sendall(bytes([b]))
                        time.sleep(0.2)
                except OSError:
                    pass
                closed_at["trickle"] = time.monotonic() - start

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        # A real client, while 51 connections sit in their handshakes: answered well before any
        # of them is cut off (if handshakes queued behind each other, it would wait 51 x 3 s).
        c = https(e.port, pki)
        assert request(e.port, "GET", "/", conn=c).status == 200
        real = time.monotonic() - start
        c.close()
        assert real < header_timeout, f"a real client waited {real:.2f}s behind silent handshakes"

        def wait_closed(s):
            s.settimeout(30)
            try:
                return s.recv(1) == b""
            except ConnectionResetError:
                return True
        assert all(wait_closed(s) for s in silent)
        cut = time.monotonic() - start
        # Cut off by the handshake deadline (header_timeout), generously bounded on a busy machine.
        assert header_timeout * 0.9 <= cut < header_timeout + 10, cut
        t.join(30)
        assert header_timeout * 0.9 <= closed_at["trickle"] < header_timeout + 10, closed_at
        assert len(hello) * 0.2 > closed_at["trickle"] + 5   # it was cut off mid-hello, not finished
        e.wait_log(r"TLS handshake not completed in time|no TLS handshake in time")
    finally:
        stop.set()
        for s in silent:
            s.close()
        e.stop()


def _client_hello(pki) -> bytes:
    """The bytes of a real ClientHello (from an in-memory TLS client)."""
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = client_ctx(pki).wrap_bio(inc, out, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def test_plain_http_to_the_tls_port_gets_400_and_tls_to_a_plain_port_is_closed_at_once(backends, pki):
    e = tls_edge(pki, backends, "--header-timeout", "30")
    plain = Edge("--backends", backends[0].url, "--health-interval", "30", "--header-timeout", "30")
    try:
        t0 = time.monotonic()
        out = raw(e.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", timeout=20)
        assert out.startswith(b"HTTP/1.1 400 ") and b"plain HTTP request sent to the HTTPS port" in out
        assert time.monotonic() - t0 < 10       # not held until the 30 s header timeout
        t0 = time.monotonic()
        out = raw(plain.port, _client_hello(pki), timeout=20)
        assert out == b"" and time.monotonic() - t0 < 10
        plain.wait_log(r"TLS handshake sent to a plain-HTTP port; closed")
        assert request(plain.port, "GET", "/").status == 200     # and plain HTTP there is untouched
    finally:
        e.stop()
        plain.stop()


def test_sighup_loads_a_replaced_pair_and_a_broken_one_keeps_the_old(backends, pki, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(open(pki["cert1"], "rb").read())
    key.write_bytes(open(pki["key1"], "rb").read())
    e = Edge("--backends", backends[0].url, "--health-interval", "30", "--tls-cert", str(cert),
             "--tls-key", str(key))
    try:
        first = peer_cert(e.port, pki)
        kept = https(e.port, pki)
        assert request(e.port, "GET", "/", conn=kept).status == 200
        cert.write_bytes(open(pki["cert2"], "rb").read())
        key.write_bytes(open(pki["key2"], "rb").read())
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded:")
        second = peer_cert(e.port, pki)
        assert second != first
        assert request(e.port, "GET", "/", conn=kept).status == 200     # a kept connection carries on
        # A broken pair (cert 1 with key 2): one line, and the running pair keeps serving.
        cert.write_bytes(open(pki["cert1"], "rb").read())
        e.signal(signal.SIGHUP)
        m = e.wait_log(r"reload rejected.*\n")
        assert "key does not match the certificate" in m.group(0)
        assert peer_cert(e.port, pki) == second
        assert request(e.port, "GET", "/", conn=https(e.port, pki)).status == 200
        kept.close()
    finally:
        e.stop()


@pytest.mark.parametrize("args,needle", [
    (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"], "cannot read"),
    (["--tls-cert", "CERT1"], "cert and key go together"),
    (["--tls-cert", "CERT1", "--tls-key", "KEY2"], "key does not match the certificate"),
    (["--tls-cert", "CERT1", "--tls-key", "KEY1", "--tls-min-version", "TLSv1.1"], "tls.min_version"),
    (["--tls-cert", "CERT1", "--tls-key", "KEY1", "--tls-ciphers", "NOPE-NOTHING"], "tls.ciphers"),
    (["--ca-file", "/nonexistent/ca.pem"], "ca_file"),
])
def test_bad_tls_configuration_exits_2_with_one_line(pki, args, needle):
    args = [pki.get(a.lower(), a) if a in ("CERT1", "KEY1", "KEY2") else a for a in args]
    assert needle in config_error("--backends", "http://127.0.0.1:1", *args)


def test_https_backend_is_verified_against_the_ca_file(backends, pki):
    # The HTTPS backend: a TLS edge in front of an identity backend (real TLS, a real server).
    front = tls_edge(pki, backends)
    url = f"https://127.0.0.1:{front.port}"
    # interval 1 s: a probe's 0.8 s is its whole deadline (connect, TLS handshake, head) on a busy machine
    e = Edge("--backends", url, "--ca-file", pki["ca"], "--health-interval", "1", "--admin", "127.0.0.1:0")
    unverified = Edge("--backends", url, "--health-interval", "30")     # system CAs: ours is unknown
    try:
        r = request(e.port, "GET", "/echo")
        assert r.status == 200 and json.loads(r.body)["name"] == backends[0].stats()["name"]
        # Health probes go over TLS too: the backend stays UP through several of them.
        wait_until(lambda: "HTTP 200" in json.dumps(json.loads(request(e.admin_port, "GET", "/status").body)),
                   what="an https health probe")
        status = json.loads(request(e.admin_port, "GET", "/status").body)
        assert status["backends"][0]["url"] == url and status["backends"][0]["state"] == "UP"
        r = request(unverified.port, "GET", "/")
        assert r.status == 502
        unverified.wait_log(r"backend https://127\.0\.0\.1:\d+ connect: GET / -> 502 \(TLS: certificate verify failed")
    finally:
        e.stop()
        unverified.stop()
        front.stop()
