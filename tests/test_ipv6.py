"""IPv6 against real processes on ::1: listeners, backends, dual-stack, brackets everywhere, identity."""

import http.client
import json
import socket
import time

import pytest

from tests.support import Backend, Edge, config_error, request, wait_until


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")


def get6(port, path="/", headers=None, host="::1"):
    c = http.client.HTTPConnection(host, port, timeout=10)
    try:
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


@pytest.fixture(scope="module")
def backend6():
    b = Backend("v6", host="::1")
    yield b
    b.stop()


def test_ipv6_listener_and_backend_written_with_brackets_everywhere(backend6):
    assert backend6.url.startswith("http://[::1]:")
    e = Edge("--listen", "[::1]:0", "--backends", backend6.url, "--admin", "[::1]:0", "--health-interval", "0.2")
    try:
        assert e.wait_log(r"listening on \[::1\]:\d+, 1 backends \(weighted\): http://\[::1\]:\d+=1")
        status, hdrs, body = get6(e.port, "/echo")
        info = json.loads(body)
        assert status == 200 and info["name"] == "v6"
        fwd = {k.lower(): v for k, v in info["headers"]}
        assert fwd["x-forwarded-for"] == "::1"
        st = json.loads(get6(e.admin_port, "/status")[2])
        assert st["listen"] == f"[::1]:{e.port}"
        assert st["backends"][0]["url"] == backend6.url and st["backends"][0]["state"] == "UP"
        assert "HTTP 200" in st["backends"][0]["last_probe"] or st["backends"][0]["last_probe"] == ""
        # The request is counted just after its answer is relayed: the client may ask before that.
        counted = f'lb_requests_total{{backend="{backend6.url}"}} 1'
        wait_until(lambda: counted in get6(e.admin_port, "/metrics")[2].decode(), what="the request counted")
        metrics = get6(e.admin_port, "/metrics")[2].decode()
        assert f'lb_backend_up{{backend="{backend6.url}"}} 1' in metrics and counted in metrics
        # HTTP/1.0 without Host: the edge writes one for the backend, the IPv6 address in brackets.
        with socket.create_connection(("::1", e.port), timeout=10) as s:
            s.sendall(b"GET /echo HTTP/1.0\r\n\r\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        host = {k.lower(): v for k, v in json.loads(out.split(b"\r\n\r\n", 1)[1])["headers"]}["host"]
        assert host == f"[::1]:{backend6.port}"
    finally:
        e.stop()


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="the OS has no dual-stack IPv6 sockets")
def test_dual_stack_listener_serves_ipv4_clients_as_ipv4(backend6):
    e = Edge("--listen", "[::]:0", "--backends", backend6.url, "--health-interval", "30")
    try:
        assert e.wait_log(r"listening on \[::\]:\d+")
        for host, client in (("127.0.0.1", "127.0.0.1"), ("::1", "::1")):
            status, _, body = get6(e.port, "/echo", host=host)
            fwd = {k.lower(): v for k, v in json.loads(body)["headers"]}
            assert status == 200 and fwd["x-forwarded-for"] == client    # never ::ffff:127.0.0.1
    finally:
        e.stop()


def test_identity_by_ipv6_address_and_trusted_ipv6_proxies(backend6):
    common = ["--listen", "[::1]:0", "--backends", backend6.url, "--health-interval", "30", "--limit", "2/m"]
    direct = Edge(*common, "--key-limit", "::1=7/m")
    behind = Edge(*common, "--trusted-proxies", "::1/128,fd00::/8", "--key-limit", "2001:db8::7=5/m",
                  "--ipv6-prefix", "128")     # per address: the /64 default is the next test's
    try:
        # The peer ::1 is the client: its own override applies.
        _, hdrs, _ = get6(direct.port)
        assert hdrs["X-RateLimit-Limit"] == "7"
        # An untrusted peer cannot pick its identity with X-Forwarded-For.
        _, hdrs, _ = get6(direct.port, headers={"X-Forwarded-For": "2001:db8::7"})
        assert hdrs["X-RateLimit-Limit"] == "7"
        # Behind trusted IPv6 proxies (::1, then fd00::1), the rightmost untrusted address is the client.
        _, hdrs, _ = get6(behind.port, headers={"X-Forwarded-For": "2001:db8::7, fd00::1"})
        assert hdrs["X-RateLimit-Limit"] == "5"
        # Another IPv6 client has the default limit and a quota of its own.
        codes = [get6(behind.port, headers={"X-Forwarded-For": "2001:db8::8"})[0] for _ in range(3)]
        assert codes == [200, 200, 429]
        assert get6(behind.port, headers={"X-Forwarded-For": "2001:db8::9"})[0] == 200
    finally:
        direct.stop()
        behind.stop()


def test_ipv6_clients_are_limited_per_64_so_rotating_addresses_gains_nothing(backend6):
    """Any IPv6 client holds at least a /64: keyed per address, rotating inside it minted a bucket per
    request (issue 29: 398 of 399 admitted at 5/s). By default a /64 is one client."""
    common = ["--listen", "[::1]:0", "--backends", backend6.url, "--health-interval", "30", "--limit", "5/s",
              "--trusted-proxies", "::1/128"]
    by_prefix = Edge(*common, "--key-limit", "ip:2001:db8:0:9::/64=2/m")
    by_address = Edge(*common, "--ipv6-prefix", "128")
    try:
        def rotate(edge, n=40, net="2001:db8:0:1"):
            t0 = time.monotonic()
            codes = [get6(edge.port, headers={"X-Forwarded-For": f"{net}:{i:x}::1"})[0] for i in range(1, n + 1)]
            return codes.count(200), time.monotonic() - t0
        admitted, took = rotate(by_prefix)
        assert admitted <= 5 + 5 * took + 1, (admitted, took)     # the bucket's 5, plus what refilled meanwhile
        assert rotate(by_address)[0] == 40                       # per address: every one a fresh bucket
        # Another /64 is another client; an override names a /64 by its prefix (or any address in it).
        assert get6(by_prefix.port, headers={"X-Forwarded-For": "2001:db8:0:2::1"})[0] == 200
        _, hdrs, _ = get6(by_prefix.port, headers={"X-Forwarded-For": "2001:db8:0:9:abcd::5"})
        assert hdrs["X-RateLimit-Limit"] == "2"
    finally:
        by_prefix.stop()
        by_address.stop()


def test_a_repeated_api_key_is_refused_before_any_backend():
    """Limiter and backend must read the same key: a second X-Api-Key beside a known one made the
    limiter count the junk (last wins) while the backend served the known one (first wins)."""
    from tests.support import raw
    b = Backend("dup")
    e = Edge("--backends", b.url, "--health-interval", "30", "--limit", "100/s")
    try:
        out = raw(e.port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Api-Key: acme\r\nX-Api-Key: junk\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400 ") and b"more than one X-Api-Key" in out, out
        assert b.stats()["count"] == 0
    finally:
        e.stop()
        b.stop()


@pytest.mark.parametrize("args,needle", [
    (["--listen", "::1:8080"], "[IPV6]:PORT"),
    (["--trusted-proxies", "2001:db8::/129"], "trusted_proxies"),
    (["--backends", "http://::1:9001"], "bad backend URL"),
])
def test_bad_ipv6_configuration_exits_2_with_one_line(args, needle):
    assert needle in config_error("--backends", "http://[::1]:1", *args)


def test_check_writes_ipv6_addresses_in_brackets():
    import subprocess
    from tests.support import PY, ROOT
    ok = subprocess.run([PY, "edge.py", "--check", "--backends", "http://[::1]:9", "--listen", "[::]:8443"],
                        cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert ok.returncode == 0 and "listen [::]:8443" in ok.stdout, ok
    assert "admin [::1]:8443: the same address as listen" in config_error(
        "--check", "--backends", "http://[::1]:9", "--listen", "[::1]:8443", "--admin", "[::1]:8443")


def test_an_ipv4_mapped_address_from_a_trusted_proxy_is_that_ipv4_client(backend, tmp_path):
    """A dual-stack proxy writes an IPv4 client as ::ffff:a.b.c.d: it is exempt by its IPv4 network,
    and it is one client with its plain spelling (one budget, not one per spelling)."""
    conf = tmp_path / "edge.toml"
    conf.write_text('[limits]\nexempt = ["10.0.0.0/8"]\n')
    e = Edge("--config", str(conf), "--backends", backend.url, "--limit", "1/m",
             "--trusted-proxies", "127.0.0.1")
    try:
        got = [request(e.port, headers={"X-Forwarded-For": "::ffff:10.1.2.3"}).status for _ in range(3)]
        assert got == [200, 200, 200]
        first = request(e.port, headers={"X-Forwarded-For": "203.0.113.7"}).status
        again = request(e.port, headers={"X-Forwarded-For": "::FFFF:203.0.113.7"}).status
        assert (first, again) == (200, 429)
    finally:
        e.stop()


_DUAL = pytest.param("::", marks=pytest.mark.skipif(not socket.has_dualstack_ipv6(),
                                                     reason="the OS has no dual-stack IPv6 sockets"))


def _edge_over(host: str, *args: str) -> Edge:
    """An edge on 127.0.0.1, or on the dual-stack [::] (a later --listen wins): IPv4 clients of the
    latter are ::ffff:127.0.0.1 to the socket."""
    return Edge(*args, *(("--listen", f"[{host}]:0") if ":" in host else ()))


@pytest.mark.parametrize("listen", ["127.0.0.1", _DUAL], ids=["ipv4", "dual-stack"])
def test_ipv4_mapped_networks_in_the_configuration_match_ipv4_clients(backend, tmp_path, listen):
    """`::ffff:127.0.0.0/104` is 127.0.0.0/8 written the IPv6 way (what an operator copies from a
    dual-stack proxy's log): it never matched, neither as a trusted proxy, nor as an exempt network,
    nor as an ip: override, whether the client was seen as 127.0.0.1 or as ::ffff:127.0.0.1."""
    conf = tmp_path / "edge.toml"
    conf.write_text('[limits]\ntrusted_proxies = ["::ffff:127.0.0.0/104"]\n'
                    '[limits.keys]\n"ip:::ffff:203.0.113.9" = "5/m"\n')
    e = _edge_over(listen, "--config", str(conf), "--backends", backend.url, "--limit", "1/m",
                   "--health-interval", "30")
    exempt = tmp_path / "exempt.toml"
    exempt.write_text('[limits]\nexempt = ["::ffff:127.0.0.1/128"]\n')
    x = _edge_over(listen, "--config", str(exempt), "--backends", backend.url, "--limit", "1/m",
                   "--health-interval", "30")
    try:
        # Trusted: each X-Forwarded-For client has a budget of its own (untrusted, all are the peer's).
        got = [request(e.port, headers={"X-Forwarded-For": f"198.51.100.{i}"}).status for i in (1, 2, 3)]
        assert got == [200, 200, 200], e.log()[-2000:]
        # The override named by its mapped spelling is the IPv4 client's.
        r = request(e.port, headers={"X-Forwarded-For": "203.0.113.9"})
        assert (r.status, r.header("X-RateLimit-Limit")) == (200, "5")
        # Exempt by its mapped spelling: never limited (1/m would refuse the second).
        assert [request(x.port).status for _ in range(3)] == [200, 200, 200], x.log()[-2000:]
    finally:
        e.stop()
        x.stop()
