"""Fuzzing the request reader: the parsers in-process (hypothesis), then mutated requests at a real edge.

What must hold: a parser returns a result or raises its own error type, never anything else; the edge
answers every mutated request with a well-formed status (or closes), never a 500, never a traceback,
and still answers a clean request afterwards.
"""

import random
import re
import socket
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lb.http.framing import Reader, iter_chunked, parse_request, parse_response
from lb.errors import HttpError, UpstreamError
from tests.support import Backend, Edge, request

CLEAN = [
    b"GET /echo?a=1 HTTP/1.1\r\nHost: x\r\nX-Api-Key: k\r\nAccept: */*\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Type: text/plain\r\n\r\nhello",
    b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"PUT /a/b HTTP/1.0\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nhi",
    b"OPTIONS * HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nz",
]
TOKENS = [b"\r\n", b"\n", b"\r", b" ", b"\t", b":", b",", b";", b"\x00", b"\x7f", b"\xff", b"chunked",
          b"Content-Length: ", b"Transfer-Encoding: ", b"Host: ", b"HTTP/1.1", b"0", b"-1", b"ffffffff",
          b"999999999999999999", b"/", b"//", b"http://", b"%00", b"Connection: close", b"\r\n\r\n"]


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] = rng.randrange(256)
        elif op == 1:
            b[i:i] = rng.choice(TOKENS)
        elif op == 2 and b:
            del b[i:i + rng.randint(1, 8)]
        elif op == 3:
            j = rng.randrange(len(b) + 1)
            b[i:i] = b[min(i, j):max(i, j)][:64]
        else:
            lines = bytes(b).split(b"\r\n")
            rng.shuffle(lines)
            b = bytearray(b"\r\n".join(lines))
    return bytes(b)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=600),
                 st.builds(lambda i, seed: mutate(CLEAN[i].split(b"\r\n\r\n")[0], random.Random(seed)),
                           st.integers(0, len(CLEAN) - 1), st.integers())))
def test_parse_request_returns_a_request_or_an_http_error(head):
    try:
        r = parse_request(head)
    except HttpError as e:
        assert 400 <= e.status <= 505 and e.reason
        return
    assert r.method and r.target and r.version in (b"HTTP/1.0", b"HTTP/1.1")
    assert not (r.chunked and r.content_length is not None)   # never both framings


@settings(max_examples=800, deadline=None)
@given(st.binary(max_size=400))
def test_parse_response_returns_a_head_or_an_upstream_error(head):
    try:
        r = parse_response(head)
    except UpstreamError as e:
        assert e.kind == "protocol"
        return
    assert 0 <= r.status <= 999


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_chunked_decoder_yields_data_or_raises_http_error(body):
    a, b = socket.socketpair()
    try:
        b.sendall(body)
        b.shutdown(socket.SHUT_WR)
        reader = Reader(a)
        reader.timeout = 2
        try:
            total = sum(len(piece) for piece in iter_chunked(reader, 10_000))
            assert total <= 10_000
        except HttpError as e:
            assert e.status in (400, 413)
        except EOFError:
            pass               # the body ended early: the caller's to call a client gone (499)
    finally:
        a.close()
        b.close()


def test_mutated_requests_at_a_real_edge_never_crash_it():
    backend = Backend("fuzz")
    edge = Edge("--backends", backend.url, "--health-interval", "30", "--header-timeout", "1",
                "--body-timeout", "0.5", "--read-timeout", "2", "--limit", "100000/s")
    rng = random.Random(20261129)
    statuses = {}
    try:
        deadline = time.monotonic() + 20     # bounded in time as well as in count
        for n in range(300):
            if time.monotonic() > deadline:
                break
            data = mutate(rng.choice(CLEAN), rng)
            with socket.create_connection(("127.0.0.1", edge.port), timeout=5) as s:
                try:
                    s.sendall(data)
                    s.shutdown(socket.SHUT_WR)
                    out = b""
                    while chunk := s.recv(65536):
                        out += chunk
                except OSError:
                    out = b""
            for m in re.finditer(rb"HTTP/1\.1 (\d{3}) ", out):
                code = int(m.group(1))
                statuses[code] = statuses.get(code, 0) + 1
                assert code != 500, data
        print(f"\n[fuzz] {n + 1} mutated requests, statuses: {dict(sorted(statuses.items()))}")
        assert request(edge.port, "GET", "/").status == 200
        assert edge.alive()
        log = edge.log()
        assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]
        assert statuses.get(400, 0) > 0     # the fuzzer did produce bad requests
    finally:
        edge.stop()
        backend.stop()
