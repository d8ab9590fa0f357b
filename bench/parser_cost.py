"""Our head parsers against httptools (llhttp's C binding, uvicorn's parser) on bench/request_path.py's two
heads, each function timed alone (timeit, best of 7 x 20,000, interleaved rounds: argv[1], 3). httptools is not a requirement: install it
where you run this (`python3 -m venv --system-site-packages /tmp/ht && /tmp/ht/bin/pip install httptools`).

    flock /tmp/edge-bench.lock taskset -c 1 /tmp/ht/bin/python bench/parser_cost.py [ROUNDS]
    /tmp/ht/bin/python bench/parser_cost.py --instructions      # callgrind: instructions per call, no lock

What each row yields, so the rows compare like with like (docs/journal/issue31-parser.md):
  ours            parse_request / parse_response: the whole Request / ResponseHead, every check, the
                  special fields read, their spans (a relayed head is then written from slices)
  httptools bare  feed_data of the head (CRLFCRLF appended) with callbacks that keep the URL and the
                  (name, value) pairs, then get_method/get_http_version: the C parser's floor, with none
                  of the edge's rules and no spans (a relayed head would be rebuilt from the pairs)
  httptools+edge  the same, then what the edge needs from it: lowercase names, our _read_fields (request)
                  or the Content-Length/Transfer-Encoding/Connection reading (response) -- still no spans
                  and none of the stricter-than-nginx checks (bare CR/LF, control bytes, the Host
                  charset, TRACE...), which would be another pass in Python
  +strict         the same after our one-pass regex (_FAST_REQUEST/_FAST_RESPONSE), the cheapest check
                  that refuses what ours refuses
  head work       bench/head_cost.py's one request: both parses, the backend's head, the client's fields
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.head_cost import upstream_head_args  # noqa: E402  (one copy: the signature's two shapes)
from bench.request_path import REQUEST, RESPONSE  # noqa: E402
from lb.http import framing  # noqa: E402

REQ_HEAD = REQUEST[: REQUEST.index(b"\r\n\r\n")]
RESP_HEAD = RESPONSE[: RESPONSE.index(b"\r\n\r\n")]
N = 20000
ROUNDS = int(sys.argv[1]) if sys.argv[1:2] and sys.argv[1].isdigit() else 3


def best(fn) -> float:
    return min(timeit.repeat(fn, number=N, repeat=7)) / N * 1e6


def _collected(row: int, n: int) -> int:
    with tempfile.TemporaryDirectory(prefix="callgrind-") as d:
        env = dict(os.environ, PARSER_COST_ROW=str(row), PARSER_COST_N=str(n))
        r = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={d}/out", sys.executable, __file__],
            env=env,
            capture_output=True,
            text=True,
        )
        m = re.search(r"Collected : (\d+)", r.stderr)
        if m is None:
            raise SystemExit(r.stderr[-2000:])
        return int(m.group(1))


def instructions(row: int, n: int = 2000) -> float:
    """Per call, deterministic: callgrind's count for 2n calls less that for n, over n (start-up cancels)."""
    return (_collected(row, 2 * n) - _collected(row, n)) / n


def main() -> None:
    import httptools

    class Proto:
        __slots__ = ("url", "fields")

        def __init__(self):
            self.url = b""
            self.fields = []

        def on_url(self, url):
            self.url += url

        def on_header(self, name, value):
            self.fields.append((name, value))

    req_proto = Proto()
    req_parser = httptools.HttpRequestParser(req_proto)  # one per connection, reused across requests
    req_wire = REQ_HEAD + b"\r\n\r\n"
    resp_wire = RESP_HEAD + b"\r\n\r\n"

    def ht_request_bare():
        req_proto.url = b""
        req_proto.fields = []
        req_parser.feed_data(req_wire)
        return req_parser.get_method(), req_proto.url, req_parser.get_http_version(), req_proto.fields

    def ht_request_edge():
        method, url, version, fields = ht_request_bare()
        r = framing.Request()
        r.method, r.target, r.version = method, url, b"HTTP/" + version.encode()
        r.raw, r.spans, r.sent = None, None, None  # (no memo: upstream_head writes the head whole)
        r._headers = [(n, n.lower(), v) for n, v in fields]  # no spans: a relay rebuilds from these
        r.keep_alive = framing._read_fields(r, [(0, 0, ln, v) for _, ln, v in r._headers], version == "1.1")
        return r

    def ht_request_strict():
        # what keeps the stricter-than-nginx list: the cheapest check that refuses what ours refuses is
        # our own one-pass regex (the fast path's), so it runs before httptools does
        if framing._FAST_REQUEST.fullmatch(REQ_HEAD) is None:
            raise AssertionError("the slow path's checks would run here")
        return ht_request_edge()

    # A response parser wants the body after the head (Content-Length: 615): one parser per response, as
    # a backend connection's parser could not be reused across responses without feeding it their bodies.
    def ht_response_bare():
        p = Proto()
        parser = httptools.HttpResponseParser(p)
        parser.feed_data(resp_wire)
        return parser.get_status_code(), parser.get_http_version(), p.fields

    def ht_response_edge():
        status, version, fields = ht_response_bare()
        cl = None
        close = version == "1.0"
        for name, value in fields:
            lname = name.lower()
            if lname == b"content-length":
                cl = int(value)
            elif lname == b"connection":
                close = b"close" in value.lower()
        return status, cl, close

    def ht_response_strict():
        if framing._FAST_RESPONSE.fullmatch(RESP_HEAD) is None:
            raise AssertionError("the slow path's checks would run here")
        return ht_response_edge()

    # The whole head work of one request as bench/head_cost.py counts it (parse the request, write the
    # backend's head, parse the response, write the client's fields): ours from slices, httptools' from
    # the (name, value) pairs (plan.py's line-by-line path, the one a head without spans takes).
    from lb.http.plan import response_fields
    from lb.proxy.forward import upstream_head

    head_args = upstream_head_args(upstream_head)

    skip = framing.not_relayed(b"", b"")

    def ours_head_work():
        r = framing.parse_request(REQ_HEAD)
        upstream_head(*head_args(r))
        response_fields(framing.parse_response(RESP_HEAD), skip, False)

    def ht_head_work():
        r = ht_request_strict()
        upstream_head(*head_args(r))
        if framing._FAST_RESPONSE.fullmatch(RESP_HEAD) is None:
            raise AssertionError("the slow path's checks would run here")
        status, version, fields = ht_response_bare()
        rh = framing.ResponseHead()
        rh.status, rh.status_line, rh.raw, rh.spans = status, b"HTTP/" + version.encode() + b" 200 OK", None, None
        rh._headers = h = [(n, n.lower(), v) for n, v in fields]
        rh.content_length, rh.close, tokens = None, version == "1.0", framing._NO_TOKENS
        for _, lname, value in h:  # parse_response's reading, as ht_response_edge's
            if lname == b"content-length":
                rh.content_length = int(value)
            elif lname == b"connection":
                v = value.lower()
                rh.close = b"close" in v
                tokens = frozenset(t.strip() for t in v.split(b","))
        rh.conn_tokens = tokens
        response_fields(rh, skip, False)

    # Only the head, as the edge's Reader hands it over: httptools also finds its end (CRLFCRLF), which
    # read_head does with one bytes.find, so that part is not ours to save.
    assert ht_request_edge().api_key == framing.parse_request(REQ_HEAD).api_key == b"bench-unlimited"
    assert ht_response_edge()[1] == framing.parse_response(RESP_HEAD).content_length == 615
    rows = [
        ("request", "ours parse_request", lambda: framing.parse_request(REQ_HEAD)),
        ("request", "httptools bare", ht_request_bare),
        ("request", "httptools+edge", ht_request_edge),
        ("request", "httptools+edge+strict", ht_request_strict),
        ("response", "ours parse_response", lambda: framing.parse_response(RESP_HEAD)),
        ("response", "httptools bare", ht_response_bare),
        ("response", "httptools+edge", ht_response_edge),
        ("response", "httptools+edge+strict", ht_response_strict),
        ("head work", "ours (head_cost's one request)", ours_head_work),
        ("head work", "httptools+edge+strict, relayed from pairs", ht_head_work),
    ]
    print(f"httptools {httptools.__version__}, Python {sys.version.split()[0]}")
    only = os.environ.get("PARSER_COST_ROW")
    if only is not None:  # a child under callgrind: run one row n times
        fn = rows[int(only)][2]
        for _ in range(int(os.environ["PARSER_COST_N"])):
            fn()
        return
    if "--instructions" in sys.argv:
        print("| head | parser | instructions per call (callgrind) |\n|---|---|---:|")
        for i, (head, name, _) in enumerate(rows):
            print(f"| {head} | {name} | {instructions(i):,.0f} |", flush=True)
        return
    got: list[list[float]] = [[] for _ in rows]
    for _ in range(ROUNDS):  # interleaved: a minute of load on this shared machine falls on every row
        for i, (_, _, fn) in enumerate(rows):
            got[i].append(best(fn))
    print(f"| head | parser | µs, best of {ROUNDS} rounds | per round |\n|---|---|---:|---|")
    for (head, name, _), g in zip(rows, got):
        print(f"| {head} | {name} | {min(g):.2f} | {' / '.join(f'{x:.1f}' for x in g)} |", flush=True)


if __name__ == "__main__":
    main()
