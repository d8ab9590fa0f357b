"""gRPC end to end through the edge: grpcio clients and grpcio servers (h2c:// backends), none of them ours.

Every kind of call (unary, server stream, client stream, bidirectional, an error status with trailing
metadata, a deadline), per-call balancing on one channel, the gRPC health check, and a client's
cancellation reaching the backend."""

import pytest

from tests.support import PY, Edge, Proc, request, wait_until

grpc = pytest.importorskip("grpc", reason="grpcio (requirements-dev.txt) is the client and the servers")
pytest.importorskip("grpc_health", reason="grpcio-health-checking (requirements-dev.txt)")


class GrpcBackend(Proc):
    def __init__(self, name: str):
        super().__init__([PY, "-m", "tests.grpc_backend", "--name", name], f"grpc-{name}")
        self.port = int(self.wait_log(r"listening \S+:(\d+) ").group(1))
        self.url = f"h2c://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def servers():
    bs = [GrpcBackend(f"g{i}") for i in (1, 2, 3)]
    yield bs
    for b in bs:
        b.stop()


@pytest.fixture(scope="module")
def edge(servers):
    e = Edge("--backends", ",".join(b.url for b in servers), "--health-protocol", "grpc", "--health-interval", "30",
             "--admin", "127.0.0.1:0")
    yield e
    e.stop()


def channel(port: int):
    return grpc.insecure_channel(f"127.0.0.1:{port}")


def test_every_kind_of_call_passes_through_with_its_trailers(edge):
    with channel(edge.port) as ch:
        reply, call = ch.unary_unary("/test.Echo/Unary").with_call(b"hi", timeout=10)
        assert reply.endswith(b":hi")
        assert dict(call.trailing_metadata())["x-served-by"] == reply.split(b":")[0].decode()
        assert len(list(ch.unary_stream("/test.Echo/ServerStream")(b"50", timeout=10))) == 50
        assert ch.stream_unary("/test.Echo/ClientStream")(iter([b"a", b"b", b"c"]), timeout=10) == b"a|b|c"
        got = list(ch.stream_stream("/test.Echo/Bidi")(iter([b"x" * 100000, b"y"]), timeout=10))
        assert [g.split(b":", 1)[1] for g in got] == [b"x" * 100000, b"y"]
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/test.Echo/Fail")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and e.value.details() == "no such thing"
        assert dict(e.value.trailing_metadata()) == {"x-why": "because"}
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/test.Echo/Slow")(b"3000", timeout=0.5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_90_unary_calls_on_one_channel_land_30_30_30(edge):
    with channel(edge.port) as ch:
        u = ch.unary_unary("/test.Echo/Unary")
        names = [u(b"n", timeout=10).split(b":")[0] for _ in range(90)]
    assert sorted(names.count(n) for n in (b"g1", b"g2", b"g3")) == [30, 30, 30]


def test_a_client_cancellation_cancels_the_backend_stream(servers):
    e = Edge("--backends", servers[0].url, "--health-interval", "30")
    try:
        with channel(servers[0].port) as direct:
            before = int(direct.unary_unary("/test.Echo/Cancels")(b"", timeout=10))
            with channel(e.port) as ch:
                it = ch.unary_stream("/test.Echo/Watch")(b"", timeout=30)
                assert next(it) == b"0" and next(it) == b"1"
                it.cancel()
            wait_until(lambda: int(direct.unary_unary("/test.Echo/Cancels")(b"", timeout=10)) > before,
                       what="the backend's stream cancelled")
    finally:
        e.stop()


def test_grpc_health_protocol_takes_a_not_serving_backend_out(tmp_path):
    sick, well = GrpcBackend("sick"), GrpcBackend("well")
    e = Edge("--backends", f"{sick.url},{well.url}", "--health-protocol", "grpc", "--health-interval", "0.3",
             "--admin", "127.0.0.1:0")
    try:
        with channel(sick.port) as direct:
            direct.unary_unary("/test.Echo/Sick")(b"", timeout=10)
        e.wait_log(r"backend h2c://127.0.0.1:%d DOWN: .*NOT_SERVING" % sick.port, timeout=20)
        with channel(e.port) as ch:
            u = ch.unary_unary("/test.Echo/Unary")
            assert {u(b"n", timeout=10).split(b":")[0] for _ in range(6)} == {b"well"}
        assert "DOWN" in request(e.admin_port, "GET", "/status").body.decode()
    finally:
        e.stop()
        sick.stop()
        well.stop()


def test_a_limit_is_resource_exhausted_with_its_metadata_and_no_backend_is_unavailable(servers):
    e = Edge("--backends", servers[0].url, "--health-interval", "30", "--limit", "2/m")
    try:
        with channel(e.port) as ch:
            u = ch.unary_unary("/test.Echo/Unary")
            for _ in range(2):
                u(b"n", timeout=10, metadata=(("x-api-key", "k1"),))
            with pytest.raises(grpc.RpcError) as err:
                u(b"n", timeout=10, metadata=(("x-api-key", "k1"),))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        md = dict(err.value.trailing_metadata())
        assert md["x-ratelimit-limit"] == "2" and md["x-ratelimit-remaining"] == "0" and int(md["retry-after"]) > 0
    finally:
        e.stop()
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    e = Edge("--backends", f"h2c://127.0.0.1:{dead}", "--health-interval", "30")
    try:
        with channel(e.port) as ch, pytest.raises(grpc.RpcError) as err:
            ch.unary_unary("/test.Echo/Unary")(b"n", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        e.stop()


def test_sigterm_lets_a_call_in_flight_finish(servers):
    import signal
    import threading
    e = Edge("--backends", servers[0].url, "--health-interval", "30", "--admin", "127.0.0.1:0")
    out = {}
    try:
        with channel(e.port) as ch:
            slow = ch.unary_unary("/test.Echo/Slow")
            assert slow(b"1", timeout=10) == b"late"         # the connection is up

            def call():
                try:
                    out["reply"] = slow(b"1500", timeout=20)
                except grpc.RpcError as ex:
                    out["error"] = ex
            t = threading.Thread(target=call)
            t.start()
            wait_until(lambda: 'lb_backend_inflight{backend="%s"} 1' % servers[0].url
                       in request(e.admin_port, "GET", "/metrics").body.decode(), what="the call in flight")
            e.signal(signal.SIGTERM)
            t.join(20)
        assert out.get("reply") == b"late", out
        e.popen.wait(20)
        assert e.popen.returncode == 0
    finally:
        e.stop()


def test_a_backend_stopping_gracefully_lets_the_calls_in_flight_through_the_edge_finish():
    import signal
    import threading
    b = GrpcBackend("graceful")
    e = Edge("--backends", b.url, "--health-interval", "30", "--admin", "127.0.0.1:0")
    out = {}
    try:
        with channel(e.port) as ch:
            slow = ch.unary_unary("/test.Echo/Slow")
            assert slow(b"1", timeout=10) == b"late"         # the edge's connection to the backend is up

            def call():
                try:
                    out["reply"] = slow(b"1500", timeout=20)
                except grpc.RpcError as ex:
                    out["error"] = ex
            t = threading.Thread(target=call)
            t.start()
            wait_until(lambda: 'lb_backend_inflight{backend="%s"} 1' % b.url
                       in request(e.admin_port, "GET", "/metrics").body.decode(), what="the call in flight")
            b.signal(signal.SIGTERM)                          # grpcio's stop(grace): GOAWAY, then the call ends
            t.join(20)
        assert out.get("reply") == b"late", out
    finally:
        e.stop()
        b.stop()


def test_a_call_to_a_backend_that_refuses_connections_is_retried_on_another(servers):
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    e = Edge("--backends", f"h2c://127.0.0.1:{dead},{servers[0].url}", "--health-interval", "30",
             "--eject-after", "0")
    try:
        with channel(e.port) as ch:
            u = ch.unary_unary("/test.Echo/Unary")
            assert all(u(b"n", timeout=10).startswith(b"g1:") for _ in range(10))
        e.wait_log(r"backend h2c://127.0.0.1:%d connect: POST /test.Echo/Unary .*retrying on %s" % (dead, servers[0].url))
    finally:
        e.stop()


def test_grpc_over_tls_alpn_h2_to_an_h2c_backend(servers, tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    e = Edge("--backends", servers[1].url, "--health-interval", "30", "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        with grpc.secure_channel(f"127.0.0.1:{e.port}", creds) as ch:
            assert ch.unary_unary("/test.Echo/Unary")(b"tls", timeout=10) == b"g2:tls"
            got = list(ch.stream_stream("/test.Echo/Bidi")(iter([b"a" * 300000, b"b"]), timeout=10))
            assert [g.split(b":", 1)[1] for g in got] == [b"a" * 300000, b"b"]
    finally:
        e.stop()
