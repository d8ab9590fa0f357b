"""[[pools]] and [[routes]]: what the tables say, checked (one line per problem, the key named).

    [[pools]]
    name = "v2"
    strategy = "least-request"                 # optional; the top level's otherwise
    backends = [{ url = "http://10.0.0.5:8080", weight = 3 }, { url = "http://10.0.0.6:8080" }]
    health = { path = "/ready", interval = 2 }  # optional: [health] keys, the rest inherited from [health]
    upstream = { max_requests = 200 }           # optional: the per-pool [upstream] keys (POOL_UPSTREAM)

    [[routes]]
    name = "api-v2"
    match = { path_prefix = "/v2/", host = "api.example.com", methods = ["GET"], headers = { "x-beta" = "1" } }
    pool = "v2"                                 # or split = [{ pool = "v1", weight = 90 }, { pool = "v2", weight = 10 }]
    request_headers = { set = { "X-Client" = "$remote_addr" }, remove = ["Cookie"] }
    response_headers = { set = { "Strict-Transport-Security" = "max-age=63072000" }, remove = ["Server"] }
    allow = ["10.0.0.0/8"]                      # optional; deny = [...] too (deny first, then allow)

`--backends` / [[backends]] are the pool named `default`, where a request no route matches goes; so a
[[pools]] table may not take that name.

POOLS and ROUTES are the settings table's kinds for the two tables of tables (lb/config/schema.py); a
pool's own health/upstream keys are read afterwards with the table's kinds (typed_overrides, from load),
so they are checked exactly as the top level's; validate() is the cross-table checks (from validate.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lb.config.kinds import Kind, parse_backend_url
from lb.errors import ConfigError
from lb.netaddr import network
from lb.upstream.backends import BackendSpec
from lb.upstream.pools import pool_config

DEFAULT_POOL = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# What a pool may set of [upstream]: what its backends' connection pools and its circuit breaker are made of.
# Retries, their budget and conditions, timeouts of the whole response and buffering stay edge-wide.
POOL_UPSTREAM = (
    "connect_timeout",
    "read_timeout",
    "pool_maxsize",
    "pool_timeout",
    "pool_idle_timeout",
    "no_pool",
    "max_requests",
    "max_pending",
)
# Header names the edge owns, which no route may set or remove: the framing it writes itself, the
# hop-by-hop fields, Host, the forwarding and request-id fields it appends, the rate-limit answer.
OWNED = frozenset(
    {
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "host",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "x-forwarded-port",
        "x-forwarded-client-cert",
        "x-request-id",
        "retry-after",
        "ratelimit",
        "ratelimit-policy",
        "forwarded",
    }
)
OWNED_PREFIXES = ("x-forwarded-", "x-ratelimit-", "proxy-")
VARIABLES = ("$remote_addr", "$request_id", "$host")
_VAR = re.compile(r"\$[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class PoolSpec:
    name: str
    backends: tuple[BackendSpec, ...]
    strategy: str | None = None  # None: the top level's
    overrides: tuple = ()  # ((Config field, value), ...) from its health/upstream tables
    raw: tuple = ()  # ((section, key, value), ...) as read, until typed_overrides


@dataclass(frozen=True)
class HeaderRules:
    set: tuple[tuple[str, str], ...] = ()  # (Name as written, value with $variables)
    remove: tuple[str, ...] = ()  # lower-case names

    def __bool__(self) -> bool:
        return bool(self.set or self.remove)


@dataclass(frozen=True)
class RouteSpec:
    name: str
    pool: str | None = None
    split: tuple[tuple[str, int], ...] = ()  # ((pool, weight), ...)
    path_prefix: str | None = None  # normalised (lb.limiting.rules.normalize_path)
    host: str | None = None  # lower case, no port; "*.example.com" for any subdomain
    methods: tuple[str, ...] = ()
    headers: tuple[tuple[str, str], ...] = ()  # (lower-case name, exact value)
    request_headers: HeaderRules = HeaderRules()
    response_headers: HeaderRules = HeaderRules()
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.split) if self.split else (self.pool or DEFAULT_POOL,)


def _name(value, where: str, what: str) -> str:
    if value is None:
        raise ConfigError(
            f"{where}.name: missing; every [[{what}]] table needs one (metrics, logs and /status call it by its name)"
        )
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ConfigError(f"{where}.name: letters, digits, '_', '.', '-' (at most 64), got {value!r}")
    return value


def _unknown(table: dict, known: tuple, where: str) -> None:
    bad = set(table) - set(known)
    if bad:
        raise ConfigError(f"{where}: unknown key {sorted(bad)[0]!r} (known: {', '.join(known)})")


def _cidrs(values, key: str) -> tuple[str, ...]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ConfigError(f'{key}: expected a list of CIDRs like ["10.0.0.0/8"], got {values!r}')
    for v in values:
        try:
            network(v)
        except ValueError:
            raise ConfigError(f"{key}: not an address or CIDR: {v!r}") from None
    return tuple(values)


def parse_pools(value) -> tuple[PoolSpec, ...]:
    """[[pools]] tables; their health/upstream keys are kept as read (typed_overrides checks them)."""
    if not isinstance(value, list) or not all(isinstance(p, dict) for p in value):
        raise ConfigError("pools: expected [[pools]] tables with name and backends")
    out, seen, problems = [], set(), []
    for i, p in enumerate(value):
        where = f"pools[{i}]"
        try:
            _unknown(p, ("name", "strategy", "backends", "health", "upstream"), where)
            name = _name(p.get("name"), where, "pools")
            where = f"pools[{i}] ({name})"
            if name == DEFAULT_POOL:
                raise ConfigError(
                    f"{where}.name: {DEFAULT_POOL!r} is the pool of --backends / [[backends]]; choose another name"
                )
            if name in seen:
                raise ConfigError(f"{where}.name: two pools are named {name!r}")
            seen.add(name)
            strategy = p.get("strategy")
            from lb.upstream.balancer import STRATEGIES

            if strategy is not None and strategy not in STRATEGIES:
                raise ConfigError(f"{where}.strategy: {strategy!r} is not one of {', '.join(STRATEGIES)}")
            bs = p.get("backends")
            if not isinstance(bs, list) or not bs or not all(isinstance(b, dict) for b in bs):
                raise ConfigError(f"{where}.backends: expected a list of {{ url, weight }} tables, at least one")
            specs, urls = [], set()
            for j, b in enumerate(bs):
                _unknown(b, ("url", "weight"), f"{where}.backends[{j}]")
                if "url" not in b:
                    raise ConfigError(f"{where}.backends[{j}]: missing url")
                s = parse_backend_url(b["url"], b.get("weight", 1), f"{where}.backends[{j}]")
                if s.url in urls:
                    raise ConfigError(f"{where}.backends: {s.url} is listed twice")
                urls.add(s.url)
                specs.append(s)
            raw = []
            for section in ("health", "upstream"):
                t = p.get(section, {})
                if not isinstance(t, dict):
                    raise ConfigError(f"{where}.{section}: expected a table like {{ interval = 2 }}")
                for k, v in t.items():
                    if section == "upstream" and k not in POOL_UPSTREAM:
                        raise ConfigError(
                            f"{where}.upstream.{k}: not a per-pool setting (per pool: "
                            f"{', '.join(POOL_UPSTREAM)}; the rest is [upstream]'s, edge-wide)"
                        )
                    raw.append((section, k, v))
            out.append(PoolSpec(name, tuple(specs), strategy, raw=tuple(raw)))
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(*problems)
    return tuple(out)


def typed_overrides(pools: tuple, table: dict, problems: list[str]) -> tuple:
    """Each pool's health/upstream keys read with the settings table's own kinds (table: load's
    {section: {key: Setting}}), as (Config field, value); a bad one is a problem naming pools[i]."""
    from dataclasses import replace

    out = []
    for i, p in enumerate(pools):
        typed = []
        for section, k, v in p.raw:
            key = f"pools[{i}] ({p.name}).{section}.{k}"
            s = table.get(section, {}).get(k)
            try:
                if s is None:
                    raise ConfigError(f"{key}: unknown key (known in [{section}]: {', '.join(table.get(section, {}))})")
                typed.append((s.name, s.kind.file(v, key)))
            except ConfigError as e:
                problems.extend(e.problems)
        out.append(replace(p, overrides=tuple(typed), raw=()))
    return tuple(out)


def _header_rules(t, where: str) -> HeaderRules:
    if not isinstance(t, dict):
        raise ConfigError(f'{where}: expected a table like {{ set = {{ "X-Name" = "value" }}, remove = ["Server"] }}')
    _unknown(t, ("set", "remove"), where)
    sets, removes = t.get("set", {}), t.get("remove", [])
    if not isinstance(sets, dict) or not isinstance(removes, list):
        raise ConfigError(f"{where}: set is a table of name = value, remove a list of names")
    out_set = []
    for n, v in sets.items():
        _header_name(n, f"{where}.set")
        if not isinstance(v, str) or any(c in v for c in "\r\n\0") or not v.isprintable():
            raise ConfigError(f"{where}.set.{n}: expected a printable one-line string, got {v!r}")
        for var in _VAR.findall(v.replace("$$", "")):
            if var not in VARIABLES:
                raise ConfigError(
                    f"{where}.set.{n}: unknown variable {var} (known: {', '.join(VARIABLES)}; "
                    f"a literal $ is written $$)"
                )
        out_set.append((n, v.strip()))
    for n in removes:
        _header_name(n, f"{where}.remove")
    return HeaderRules(tuple(out_set), tuple(dict.fromkeys(n.lower() for n in removes)))


def _header_name(n, where: str) -> None:
    if not isinstance(n, str) or not _TOKEN.fullmatch(n):
        raise ConfigError(f"{where}: not a header name: {n!r}")
    low = n.lower()
    if low in OWNED or low.startswith(OWNED_PREFIXES):
        raise ConfigError(
            f"{where}: {n} is the edge's own (framing, Host, X-Forwarded-*, X-Request-Id, the rate-limit "
            f"headers): a route can neither set nor remove it"
        )


def parse_routes(value) -> tuple[RouteSpec, ...]:
    if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
        raise ConfigError("routes: expected [[routes]] tables with name, match and pool (or split)")
    out, seen, problems = [], set(), []
    for i, r in enumerate(value):
        where = f"routes[{i}]"
        try:
            _unknown(
                r, ("name", "match", "pool", "split", "request_headers", "response_headers", "allow", "deny"), where
            )
            name = _name(r.get("name"), where, "routes")
            where = f"routes[{i}] ({name})"
            if name in seen:
                raise ConfigError(f"{where}.name: two routes are named {name!r}")
            seen.add(name)
            if ("pool" in r) == ("split" in r):
                raise ConfigError(f'{where}: needs pool = "NAME" or split = [{{ pool, weight }}, ...], one of the two')
            pool = r.get("pool")
            split: tuple[tuple[str, int], ...] = ()
            if "pool" in r and (not isinstance(pool, str) or not pool):
                raise ConfigError(f"{where}.pool: expected a pool's name, got {pool!r}")
            if "split" in r:
                split = _split(r["split"], where)
            prefix, host, methods, headers = _match(r.get("match", {}), where)
            allow = _cidrs(r.get("allow", []), f"{where}.allow")
            deny = _cidrs(r.get("deny", []), f"{where}.deny")
            out.append(
                RouteSpec(
                    name=name,
                    pool=pool,
                    split=split,
                    path_prefix=prefix,
                    host=host,
                    methods=methods,
                    headers=headers,
                    request_headers=_header_rules(r.get("request_headers", {}), f"{where}.request_headers"),
                    response_headers=_header_rules(r.get("response_headers", {}), f"{where}.response_headers"),
                    allow=allow,
                    deny=deny,
                )
            )
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(*problems)
    return tuple(out)


def _split(sp, where: str) -> tuple[tuple[str, int], ...]:
    """A route's split = [{ pool, weight }, ...]: each pool once, each weight a whole number >= 1."""
    if not isinstance(sp, list) or not sp:
        raise ConfigError(f'{where}.split: empty; expected [{{ pool = "a", weight = 90 }}, ...]')
    parts: list[tuple[str, int]] = []
    for j, s in enumerate(sp):
        if not isinstance(s, dict):
            raise ConfigError(f'{where}.split[{j}]: expected {{ pool = "NAME", weight = N }}')
        _unknown(s, ("pool", "weight"), f"{where}.split[{j}]")
        w = s.get("weight", 1)
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ConfigError(f"{where}.split[{j}].weight: must be a whole number >= 1, got {w!r}")
        p = s.get("pool")
        if not isinstance(p, str) or not p:
            raise ConfigError(f"{where}.split[{j}].pool: expected a pool's name, got {p!r}")
        if p in (q for q, _ in parts):
            raise ConfigError(f"{where}.split: pool {p!r} is named twice")
        parts.append((p, w))
    return tuple(parts)


def _match(m, where: str) -> tuple[str | None, str | None, tuple[str, ...], tuple[tuple[str, str], ...]]:
    """A route's match table, checked and put in the form requests are compared in (path, host, methods, headers)."""
    from lb.limiting.rules import normalize_path

    if not isinstance(m, dict):
        raise ConfigError(f'{where}.match: expected a table like {{ path_prefix = "/v2/" }}')
    _unknown(m, ("path_prefix", "host", "methods", "headers"), f"{where}.match")
    prefix = m.get("path_prefix")
    if prefix is not None and (not isinstance(prefix, str) or not prefix.startswith("/") or not prefix.isascii()):
        raise ConfigError(f"{where}.match.path_prefix: must start with '/', got {prefix!r}")
    host = m.get("host")
    if host is not None and (not isinstance(host, str) or not host or any(c in host for c in " /:@")):
        raise ConfigError(f"{where}.match.host: expected a host name without a port, got {host!r}")
    methods = m.get("methods", [])
    if isinstance(methods, str):
        methods = [methods]
    if not isinstance(methods, list) or not all(isinstance(x, str) and _TOKEN.fullmatch(x) for x in methods):
        raise ConfigError(f'{where}.match.methods: expected a list of methods like ["GET"], got {methods!r}')
    hs = m.get("headers", {})
    if not isinstance(hs, dict) or not all(
        isinstance(k, str) and _TOKEN.fullmatch(k) and isinstance(v, str) for k, v in hs.items()
    ):
        raise ConfigError(f'{where}.match.headers: expected a table of name = "exact value", got {hs!r}')
    return (
        normalize_path(prefix.encode()).decode("latin-1") if prefix else None,
        host.lower().rstrip(".") if host else None,
        tuple(x.upper() for x in methods),
        tuple(sorted((k.lower(), v) for k, v in hs.items())),
    )


def _covers(a: RouteSpec, b: RouteSpec) -> bool:
    """Whether every request b matches, a matches too (b after a is then never reached)."""
    if a.path_prefix is not None and (b.path_prefix is None or not b.path_prefix.startswith(a.path_prefix)):
        return False
    if a.host is not None:
        if b.host is None:
            return False
        if a.host.startswith("*."):
            if not (b.host.endswith(a.host[1:]) and len(b.host) > len(a.host) - 1):
                return False
        elif a.host != b.host:
            return False
    if a.methods and (not b.methods or not set(b.methods) <= set(a.methods)):
        return False
    return set(a.headers) <= set(b.headers)


def validate(c) -> list[str]:
    """Across tables: every pool a route names exists, and no route is shadowed by an earlier one."""
    bad = []
    for i, p in enumerate(c.pools):
        pc = pool_config(c, p)
        if not pc.health_path.startswith("/"):
            bad.append(f"pools[{i}] ({p.name}).health.path: must start with '/', got {pc.health_path!r}")
        if pc.health_timeout is not None and pc.health_timeout >= pc.health_interval:
            bad.append(
                f"pools[{i}] ({p.name}).health.timeout: must be shorter than the interval "
                f"({pc.health_interval:g}), got {pc.health_timeout:g}"
            )
    names = {DEFAULT_POOL, *(p.name for p in c.pools)}
    for i, r in enumerate(c.routes):
        for p in r.pools:
            if p not in names:
                key = "split" if r.split else "pool"
                bad.append(f"routes[{i}] ({r.name}).{key}: no pool named {p!r} (pools: {', '.join(sorted(names))})")
        for j, earlier in enumerate(c.routes[:i]):
            if _covers(earlier, r):
                bad.append(
                    f"routes[{i}] ({r.name}).match: unreachable: routes[{j}] ({earlier.name}) matches every "
                    f"request it would (first match wins); put it first or narrow routes[{j}]"
                )
                break
    route_names = {r.name for r in c.routes}
    for rule in c.rules:
        if getattr(rule, "route", None) is not None and rule.route not in route_names:
            bad.append(
                f"rules ({rule.name}).match.route: no route named {rule.route!r}"
                f"{' (routes: ' + ', '.join(sorted(route_names)) + ')' if route_names else ' (no [[routes]])'}"
            )
    return bad


class Pools(Kind):
    """[[pools]]: PoolSpec per table (parse_pools)."""

    def file(self, value, key):
        return parse_pools(value)

    def toml_shown(self, path):
        return f"`[[{path}]]`"


class Routes(Kind):
    """[[routes]]: RouteSpec per table (parse_routes)."""

    def file(self, value, key):
        return parse_routes(value)

    def toml_shown(self, path):
        return f"`[[{path}]]`"


POOLS, ROUTES = Pools(), Routes()
