"""Routes: which pool a request goes to ([[routes]], first match wins; none matched: the pool `default`),
the canary split across pools, the header rules and the allow/deny lists of each route.

Matching. The path is the normalised one (lb.limiting.rules.normalize_path: percent-encoded unreserved
characters decoded, dot segments resolved, repeated slashes merged -- nginx's `location` rule), the one a
backend serves: `/v2/../admin` and `//admin` match a route for `/admin`, never one for `/v2/`. The request
itself is forwarded as it came. A prefix is a byte prefix of that path (`/v2` matches `/v2x` too; write
`/v2/` for the directory). The host is the Host header without its port, case-insensitively, a trailing
dot ignored; `*.example.com` matches any subdomain (not example.com itself). Methods: any of the list.
Headers: each named header present with exactly that value (the first of its name). Every condition
given must hold; an empty match matches everything. The cost is O(routes) at worst: a few comparisons
per route, the path normalised once (bench/request_path.py --routes N).

A split is the smooth weighted round robin across its pools (nginx's rule, as between backends): weights
90/10 send exactly 9 of every 10 requests to the first, interleaved, never a run of chance. A pool with
nobody in rotation takes no turn; when none of a route's pools has anyone, that route answers 503 and
the others serve on. With --sticky, a client whose route cookie names a backend of one of the split's
pools stays on that pool (and that backend) and takes no turn.
"""

from __future__ import annotations

import threading

from lb import netaddr
from lb.limiting.rules import normalize_path

# Variables a header value may use, as nginx users write them.
_VARIABLES = (b"$remote_addr", b"$request_id", b"$host")


def _host(req) -> bytes:
    """The Host header without port, lower case, no trailing dot."""
    h = req.host or b""
    if h[:1] == b"[":
        h = h[: h.find(b"]") + 1]
    elif 58 in h:  # ":" (a byte value's `in` is a memchr; a bytes operand's raises inside CPython 3.11 first)
        h = h.rsplit(b":", 1)[0]
    return h.lower().rstrip(b".")


class HeaderEdit:
    """A route's request_headers or response_headers: names to drop (removed, and those set: set replaces),
    and the lines to add, their $variables filled per request."""

    __slots__ = ("drop", "lines", "dynamic")

    def __init__(self, rules):
        self.drop = frozenset(n.lower().encode() for n in (*rules.remove, *(n for n, _ in rules.set)))
        self.lines = [(n.encode() + b": " + v.replace("$$", "\0").encode("latin-1") + b"\r\n") for n, v in rules.set]
        self.dynamic = any(b"$" in line for line in self.lines)
        if not self.dynamic:
            self.lines = [b"".join(self.lines).replace(b"\0", b"$")]

    def render(self, x) -> bytes:
        if not self.dynamic:
            return self.lines[0]
        out = b"".join(self.lines)
        if out.find(b"$remote_addr") >= 0:  # (find, not `in`: as in _host)
            out = out.replace(b"$remote_addr", (x.client_ip or "").encode())
        if out.find(b"$request_id") >= 0:
            out = out.replace(b"$request_id", x.request_id or b"")
        if out.find(b"$host") >= 0:
            out = out.replace(b"$host", _host(x.req))
        return out.replace(b"\0", b"$")


class Route:
    __slots__ = (
        "name",
        "spec",
        "prefix",
        "host",
        "wildcard",
        "methods",
        "headers",
        "pools",
        "weights",
        "current",
        "lock",
        "request_edit",
        "response_edit",
        "allow",
        "deny",
        "acl",
    )

    def __init__(self, spec, pools: dict):
        self.name = spec.name
        self.spec = spec
        self.prefix = spec.path_prefix.encode("latin-1") if spec.path_prefix else None
        h = spec.host.encode() if spec.host else None
        self.wildcard = h is not None and h.startswith(b"*.")
        self.host = h[1:] if h is not None and self.wildcard else h  # "*.example.com" -> ".example.com"
        self.methods = frozenset(m.encode() for m in spec.methods)
        self.headers = tuple((n.encode(), v.encode("latin-1")) for n, v in spec.headers)
        names = spec.pools
        self.pools = [pools[n] for n in names]
        self.weights = [w for _, w in spec.split] if spec.split else [1]
        self.current = [0] * len(self.pools)
        self.lock = threading.Lock()
        self.request_edit = HeaderEdit(spec.request_headers) if spec.request_headers else None
        self.response_edit = HeaderEdit(spec.response_headers) if spec.response_headers else None
        self.allow = tuple(netaddr.network(c) for c in spec.allow)
        self.deny = tuple(netaddr.network(c) for c in spec.deny)
        self.acl = bool(self.allow or self.deny)

    def admits(self, ip: str) -> bool:
        """nginx's order of allow/deny, simplified to two lists: a denied address is refused; then, when
        there is an allow list, only an address in it passes."""
        try:
            a = netaddr.ip(ip)
        except ValueError:
            return False
        if any(a in n for n in self.deny):
            return False
        return not self.allow or any(a in n for n in self.allow)

    def choose(self, sticky: str | None = None):
        """The pool for this request: the one a sticky client's backend is in, else the split's next turn
        among the pools with anyone in rotation; None when none has anyone."""
        pools = self.pools
        if len(pools) == 1:
            return pools[0]  # nobody in it: its balancer says so (a 503 for this route)
        if sticky:
            for p in pools:
                if p.balancer.by_route(sticky) is not None:
                    return p
        with self.lock:
            best, total, cur = -1, 0, self.current
            for i, p in enumerate(pools):
                if not p.has_one():
                    continue
                w = self.weights[i]
                cur[i] += w
                total += w
                if best < 0 or cur[i] > cur[best]:
                    best = i
            if best < 0:
                return None
            cur[best] -= total
            return pools[best]

    def status(self) -> dict:
        return {
            "name": self.name,
            "pools": [p.name for p in self.pools],
            **({"split": {p.name: w for p, w in zip(self.pools, self.weights)}} if self.spec.split else {}),
            "match": {
                k: v
                for k, v in (
                    ("path_prefix", self.spec.path_prefix),
                    ("host", self.spec.host),
                    ("methods", list(self.spec.methods)),
                    ("headers", dict(self.spec.headers)),
                )
                if v
            },
            "allow": list(self.spec.allow),
            "deny": list(self.spec.deny),
        }


class Router:
    """The route table of one configuration (rebuilt on reload; a split's turn state is carried over for
    a route whose pools and weights are unchanged)."""

    def __init__(self, specs, pools: dict, old: "Router | None" = None):
        self.routes = [Route(s, pools) for s in specs]
        self.names = frozenset(r.name for r in self.routes)
        self.by_path = any(r.prefix is not None for r in self.routes)
        self.by_host = any(r.host is not None for r in self.routes)
        if old is not None:
            before = {r.name: r for r in old.routes}
            for r in self.routes:
                o = before.get(r.name)
                if o is not None and o.spec.split == r.spec.split:
                    r.current, r.lock = o.current, o.lock  # one turn state, under one lock

    def match(self, req) -> Route | None:
        """The first route whose conditions all hold, or None (the pool `default`). One loop, inline (a
        method call per route was a third of the cost at 100 routes); the path and host made once."""
        path = normalize_path(req.target) if self.by_path else b""  # (made only when a route reads it)
        host = _host(req) if self.by_host else b""
        method = req.method
        headers = None
        for r in self.routes:
            if r.methods and method not in r.methods:
                continue
            h = r.host
            if h is not None and not (host.endswith(h) and len(host) > len(h) if r.wildcard else host == h):
                continue
            if r.prefix is not None and not path.startswith(r.prefix):
                continue
            if r.headers:
                if headers is None:
                    headers = _first_values(req.headers)
                if any(headers.get(n) != v for n, v in r.headers):
                    continue
            return r
        return None

    def status(self) -> list:
        return [r.status() for r in self.routes]


def _first_values(headers) -> dict:
    out: dict[bytes, bytes] = {}
    for _, lname, value in headers:
        out.setdefault(lname, value)
    return out
