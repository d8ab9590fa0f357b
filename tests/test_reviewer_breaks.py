"""Defects a reviewer found by trying to break the edge, each against the real edge over real sockets:
IPv4-mapped networks in the configuration, secrets with odd characters, chunk lines and heads that
arrive in one read, absurd timeouts, reflected admin input, and deadlines stretched by signals."""

import socket

import pytest

from tests.support import Backend, Edge, request


@pytest.fixture(scope="module")
def backend():
    b = Backend("rb")
    yield b
    b.stop()


def _edge_over(host: str, *args: str) -> Edge:
    """An edge on 127.0.0.1, or on the dual-stack [::] (a later --listen wins): IPv4 clients of the
    latter are ::ffff:127.0.0.1 to the socket."""
    return Edge(*args, *(("--listen", f"[{host}]:0") if ":" in host else ()))


_DUAL = pytest.param("::", marks=pytest.mark.skipif(not socket.has_dualstack_ipv6(),
                                                     reason="the OS has no dual-stack IPv6 sockets"))


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
