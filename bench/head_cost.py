"""What the head work of one request costs: parse_request, upstream_head, parse_response and the relayed
fields of an nginx-like response, no sockets. A/B across checkouts, each in its own process, alternating,
best of 7 x 5,000 per run.

    taskset -c 1 python3 bench/head_cost.py --variant main=/work/main --variant new=. --rounds 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import timeit
from pathlib import Path

REQ = (b"GET /api/items?page=2 HTTP/1.1\r\nHost: api.example.com\r\nUser-Agent: bench/1.0\r\n"
       b"Accept: */*\r\nX-Api-Key: bench-unlimited")
RESP = (b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 15:00:00 GMT\r\n"
        b"Content-Type: text/html\r\nContent-Length: 615\r\nLast-Modified: Mon, 23 Jan 2023 10:00:00 GMT\r\n"
        b"Connection: keep-alive\r\nETag: \"63ce5b3c-267\"\r\nAccept-Ranges: bytes")



def upstream_head_args(upstream_head):
    """(req -> upstream_head's arguments) for the checkout's signature: (x, backend, conn, cfg, length) since
    the upstream branch of issue 31, (req, backend, peer, trusted, close, proto, upgrade, request_id,
    length, underscores) before; the same request either way (a client at 127.0.0.1, no id made up)."""
    import inspect
    from types import SimpleNamespace as NS

    if "conn" not in inspect.signature(upstream_head).parameters:
        return lambda r: (r, None, b"127.0.0.1", False, False, b"http", None, None, None, False)
    conn, cfg = NS(peer=b"127.0.0.1", peer_trusted=False), NS(no_pool=False, allow_underscores=False)
    return lambda r: (NS(req=r, proto=b"http", upgrade=None, rid_sent=None, route=None), None, conn, cfg, None)

def measure() -> float:
    from lb.http.framing import not_relayed, parse_request, parse_response
    from lb.proxy.forward import upstream_head

    head_args = upstream_head_args(upstream_head)
    try:
        from lb.http.plan import response_fields
    except ImportError:                 # a checkout before lb/http/plan.py: relay()'s loop, as it was
        def response_fields(rh, skip, limiting):
            out, tokens, cl = bytearray(), rh.conn_tokens, rh.content_length
            for name, lname, value in rh.headers:
                if lname in skip or (tokens and lname in tokens) or (limiting and lname[:12] == b"x-ratelimit-"):
                    if lname == b"content-length" and cl is not None:
                        out += b"Content-Length: %d\r\n" % cl
                        cl = None
                    continue
                out += name + b": " + value + b"\r\n"
            return out
    skip = not_relayed(b"", b"")

    def one():
        r = parse_request(REQ)
        upstream_head(*head_args(r))
        response_fields(parse_response(RESP), skip, False)
    return min(timeit.repeat(one, number=5000, repeat=7)) / 5000 * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", help="NAME=DIR (default: this checkout)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        sys.path.insert(0, a.child)
        print(json.dumps(measure()))
        return
    variants = [v.partition("=")[::2] for v in (a.variant or [f"this={Path.cwd()}"])]
    got: dict[str, list[float]] = {n: [] for n, _ in variants}
    for r in range(a.rounds):
        for name, d in variants:
            out = subprocess.run([sys.executable, __file__, "--child", str(Path(d).resolve())],
                                 capture_output=True, text=True, check=True)
            got[name].append(json.loads(out.stdout))
            print(f"round {r + 1} {name}: {got[name][-1]:.2f} us", flush=True)
    first = min(got[variants[0][0]])
    print("\n| variant | µs, best of rounds | per round | vs first |\n|---|---|---|---|")
    for name, _ in variants:
        print(f"| {name} | {min(got[name]):.2f} | {' / '.join(f'{x:.1f}' for x in got[name])} | "
              f"{first / min(got[name]):.2f}x |")


if __name__ == "__main__":
    main()
