"""Limit rules: what a [[rules]] table says, and whether a request matches it.

    [[rules]]
    name = "login-guard"          # label in metrics, logs and /status
    key = "ip"                    # ip | api-key | header:NAME | client-cert | global
    limit = "5/m"                 # optional when max_in_flight is set (at least one of the two)
    algorithm = "sliding-log"     # optional; default [limits] algorithm
    cost = 1                      # units each matching request spends of `limit` (at most its N)
    max_in_flight = 0             # concurrent matching requests per key (nginx's limit_conn); 0 off
    match = { path_prefix = "/login", methods = ["POST"], host = "api.example.com" }   # all ANDed
    # (and client_cert_subject = "CN=partner-a,O=Example" or a list: mutual TLS, the verified subject)
    # (and route = "NAME": the request matched that [[routes]] table, lb/proxy/routes.py)
    dry_run = false               # true: decide and count, never reject

The path is matched after normalisation (percent-encoded unreserved characters decoded, dot segments
removed, repeated slashes merged), so `//login`, `/./login` and `/%6Cogin` cannot slip past a guard on
`/login` while the backend serves them as `/login`; the request itself is forwarded unchanged. A host
matches the Host header case-insensitively, without its port; `*.example.com` matches any subdomain.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from limiter import ALGORITHMS, parse_rate

KINDS = ("ip", "api-key", "global", "client-cert")  # and header:NAME; client-cert: the subject (mutual TLS)
BUILTIN = "default"  # the name of the built-in per-identity rule (--limit)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


@dataclass(frozen=True)
class RuleSpec:
    name: str
    key: str  # ip | api-key | global | client-cert | header:NAME (lower-cased)
    limit: str | None  # None: a concurrency-only rule (max_in_flight)
    algorithm: str | None = None  # None: [limits] algorithm
    path_prefix: str | None = None
    methods: tuple[str, ...] = ()
    host: str | None = None
    dry_run: bool = False
    cost: int = 1  # units a matching request spends of limit
    max_in_flight: int = 0  # concurrent requests per key; 0: no concurrency limit
    client_cert_subjects: tuple[str, ...] = ()  # any of these verified subjects (RFC 2253, lower-cased)
    route: str | None = None  # the [[routes]] table the request matched (lb/proxy/routes.py)

    @property
    def header(self) -> bytes | None:
        return self.key[7:].encode() if self.key.startswith("header:") else None


def parse_rules(value) -> tuple[RuleSpec, ...]:
    """[[rules]] tables -> RuleSpecs. ValueError naming rules[i].field on anything wrong."""
    if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
        raise ValueError("rules: expected [[rules]] tables")
    seen: set[str] = set()
    return tuple(_parse_rule(r, i, seen) for i, r in enumerate(value))


def _parse_rule(r: dict, i: int, seen: set[str]) -> RuleSpec:
    """One [[rules]] table; its checks in the order an operator fixes them (name first, then what it limits)."""
    where = f"rules[{i}]"
    unknown = set(r) - {"name", "key", "limit", "algorithm", "match", "dry_run", "cost", "max_in_flight"}
    if unknown:
        raise ValueError(
            f"{where}: unknown key {sorted(unknown)[0]!r} "
            f"(known: name, key, limit, algorithm, match, dry_run, cost, max_in_flight)"
        )
    name = _rule_name(r.get("name"), where, seen)
    where = f"rules[{i}] ({name})"
    if "key" not in r:
        raise ValueError(f"{where}: missing key")
    conc = r.get("max_in_flight", 0)
    if isinstance(conc, bool) or not isinstance(conc, int) or not 0 <= conc <= 1_000_000:
        raise ValueError(f"{where}.max_in_flight: expected a whole number 0..1000000 (0: off), got {conc!r}")
    if "limit" not in r and not conc:
        raise ValueError(f"{where}: missing limit (a rule needs a limit, a max_in_flight, or both)")
    key = _rule_key(r["key"], where)
    cost = _rule_cost(r, where)
    algorithm = r.get("algorithm")
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValueError(f"{where}.algorithm: {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    dry = r.get("dry_run", False)
    if not isinstance(dry, bool):
        raise ValueError(f"{where}.dry_run: expected true or false, got {dry!r}")
    prefix, methods, host, subjects = _rule_match(r.get("match", {}), where)
    return RuleSpec(
        name=name,
        key=key,
        limit=r.get("limit"),
        algorithm=algorithm,
        cost=cost,
        max_in_flight=conc,
        path_prefix=normalize_path(prefix.encode()).decode("latin-1") if prefix else None,
        methods=tuple(x.upper() for x in methods),
        host=host.lower() if host else None,
        dry_run=dry,
        client_cert_subjects=tuple(x.lower() for x in subjects),
        route=_rule_route(r.get("match", {}), where),
    )


def _rule_name(name, where: str, seen: set[str]) -> str:
    """The rule's label: present, well-formed, not the built-in's, and unique (metrics and /status key on it)."""
    if name is None:
        raise ValueError(
            f"{where}.name: missing; every [[rules]] table needs one, as the metrics, the access "
            f'log\'s limited_by and /status call the rule (e.g. name = "per-ip")'
        )
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}.name: letters, digits, '_', '.', '-' (at most 64), got {name!r}")
    where = f"{where} ({name})"
    if name == BUILTIN:
        raise ValueError(f"{where}.name: {BUILTIN!r} is the built-in per-identity rule (--limit); choose another name")
    if name in seen:
        raise ValueError(f"{where}.name: two rules are named {name!r}")
    seen.add(name)
    return name


def _rule_key(key, where: str) -> str:
    """What the rule counts per: one of KINDS, or header:NAME with the name lower-cased."""
    if not isinstance(key, str):
        raise ValueError(f"{where}.key: expected a string, got {key!r}")
    if key.startswith("header:"):
        hname = key[7:].strip()
        if not hname or not _TOKEN.fullmatch(hname.encode()):
            raise ValueError(f"{where}.key: header:NAME needs a header name, got {key!r}")
        return "header:" + hname.lower()
    if key not in KINDS:
        raise ValueError(f"{where}.key: expected ip, api-key, header:NAME, client-cert or global, got {key!r}")
    return key


def _rule_cost(r: dict, where: str) -> int:
    """Units a matching request spends: at most the limit's N, or no request could ever be admitted."""
    cost = r.get("cost", 1)
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        raise ValueError(f"{where}.cost: expected a whole number >= 1, got {cost!r}")
    if "limit" in r:
        try:
            n, _ = parse_rate(r["limit"])
        except ValueError as e:
            raise ValueError(f"{where}.limit: {e}") from None
        if cost > n:
            raise ValueError(
                f"{where}.cost: {cost} is more than the limit's {n}: a matching request could never be admitted"
            )
    elif "cost" in r:
        raise ValueError(f"{where}.cost: a cost needs a limit to spend from")
    return cost


def _rule_route(m, where: str) -> str | None:
    """match.route: the name of a [[routes]] table (that it exists is validate's, across tables)."""
    route = m.get("route") if isinstance(m, dict) else None
    if route is not None and (not isinstance(route, str) or not _NAME.fullmatch(route)):
        raise ValueError(f"{where}.match.route: expected a [[routes]] name, got {route!r}")
    return route


def _rule_match(m, where: str) -> tuple[str | None, list, str | None, list]:
    """The match table -> (path_prefix, methods, host, client_cert_subjects), each as written."""
    if not isinstance(m, dict):
        raise ValueError(f'{where}.match: expected a table like {{ path_prefix = "/login" }}')
    unknown = set(m) - {"path_prefix", "methods", "host", "client_cert_subject", "route"}
    if unknown:
        raise ValueError(
            f"{where}.match: unknown key {sorted(unknown)[0]!r} "
            f"(known: path_prefix, methods, host, client_cert_subject, route)"
        )
    subjects = m.get("client_cert_subject", [])
    if isinstance(subjects, str):
        subjects = [subjects]
    if not isinstance(subjects, list) or not all(isinstance(x, str) and x for x in subjects):
        raise ValueError(
            f'{where}.match.client_cert_subject: expected a subject like "CN=partner-a,O=Example" '
            f"or a list of them, got {subjects!r}"
        )
    prefix = m.get("path_prefix")
    if prefix is not None and (not isinstance(prefix, str) or not prefix.startswith("/")):
        raise ValueError(f"{where}.match.path_prefix: must start with '/', got {prefix!r}")
    methods = m.get("methods", [])
    if isinstance(methods, str):
        methods = [methods]
    if not isinstance(methods, list) or not all(isinstance(x, str) and _TOKEN.fullmatch(x.encode()) for x in methods):
        raise ValueError(f'{where}.match.methods: expected a list of methods like ["POST"], got {methods!r}')
    host = m.get("host")
    if host is not None and (not isinstance(host, str) or not host or " " in host):
        raise ValueError(f"{where}.match.host: expected a host name, got {host!r}")
    return prefix, methods, host, subjects


@functools.lru_cache(maxsize=4)
def configured_subjects(specs: tuple) -> frozenset:
    """The client-certificate subjects the rules name: the only ones metrics may use as labels."""
    return frozenset(s for spec in specs for s in spec.client_cert_subjects)


# ------------------------------------------------------------------------------------------ matching

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PCT = re.compile(rb"%([0-9A-Fa-f]{2})")
_SLASHES = re.compile(rb"/{2,}")


def _unescape_unreserved(m: re.Match) -> bytes:
    c = int(m.group(1), 16)
    return bytes((c,)) if c in _UNRESERVED else b"%" + m.group(1).upper()


def normalize_path(target: bytes) -> bytes:
    """The path a backend would serve for this request target (RFC 3986 6.2.2, plus merged slashes)."""
    # (37 is "%": a byte value's `in` is one memchr; find(), not `in`, for the others: a bytes operand's
    # `in` raises and clears a TypeError inside CPython 3.11 first, lb/http/framing.py's not_relayed)
    if target[:1] != b"/":  # absolute-form: http://host/path
        i = target.find(b"/", j + 2) if (j := target.find(b"//")) >= 0 else -1
        target = target[i:] if i >= 0 else b"/"
    path = target.split(b"?", 1)[0].split(b"#", 1)[0]
    if 37 in path:
        path = _PCT.sub(_unescape_unreserved, path)
    if path.find(b"//") >= 0:
        path = _SLASHES.sub(b"/", path)
    if path.find(b"/.") < 0:
        return path
    out: list[bytes] = []
    segs = path.split(b"/")[1:]
    for i, seg in enumerate(segs):
        last = i == len(segs) - 1
        if seg == b".":
            if last:
                out.append(b"")
        elif seg == b"..":
            if out:
                out.pop()
            if last:
                out.append(b"")
        else:
            out.append(seg)
    return b"/" + b"/".join(out)


class Matcher:
    """A compiled match table; an empty one matches every request."""

    __slots__ = ("prefix", "methods", "host", "wildcard", "always", "subjects", "route")

    def __init__(self, spec: RuleSpec):
        self.prefix = spec.path_prefix.encode("latin-1") if spec.path_prefix else None
        self.methods = frozenset(m.encode() for m in spec.methods)
        h = spec.host.encode() if spec.host else None
        self.wildcard = h is not None and h.startswith(b"*.")
        self.host = h[1:] if h and self.wildcard else h  # "*.example.com" -> ".example.com"
        self.subjects = frozenset(spec.client_cert_subjects)
        self.route = spec.route
        self.always = (
            self.prefix is None and not self.methods and self.host is None and not self.subjects and self.route is None
        )

    def __call__(self, req, path, route: str | None = None) -> bool:
        """path: a callable giving the request's normalised path (computed once per request); route: the
        name of the [[routes]] table the request matched, None if none did."""
        if self.always:
            return True
        if self.route is not None and route != self.route:
            return False
        if self.methods and req.method not in self.methods:
            return False
        if self.host is not None:
            h = req.host or b""
            if h[:1] == b"[":  # [v6]:port
                h = h[: h.find(b"]") + 1]
            else:
                h = h.rsplit(b":", 1)[0]
            h = h.lower().rstrip(b".")
            if not (h.endswith(self.host) and len(h) > len(self.host) if self.wildcard else h == self.host):
                return False
        if self.prefix is not None and not path().startswith(self.prefix):
            return False
        if self.subjects:  # DN values compare case-insensitively (X.520 caseIgnoreMatch)
            cert = req.client_cert
            if cert is None or cert.subject.lower() not in self.subjects:
                return False
        return True
