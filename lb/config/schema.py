"""The one table of settings: Config's fields, each with its flag, TOML key, kind, default and help.

Everything else is generated from it: the flags and their --help (lb/config/load.py build_argparser,
the default appended to each help), the TOML keys the file may have and the unknown-key errors that
list them (load.read_file), the per-value checks (the kind: type and range; `choices`), and the
README's configuration table (`python3 -m lb.config.docs --markdown`; tests/test_settings_table.py
fails when docs/reference/configuration.md's table and this one disagree, `--write docs/reference/configuration.md` rewrites it in place).
Checks that span several keys (cert goes with key, health.timeout < interval, ...) are in
lb/config/validate.py.

Adding a setting is one entry, in the class of its TOML table (UpstreamTable for [upstream], ...):

    hedge_after: float = setting(0.0, SECONDS0, toml="upstream.hedge_after", flag="--hedge-after",
                                 shown="`0`: off", help="seconds before a second try goes to another backend")

  - the attribute name is what the rest of the code reads (cfg.hedge_after), its annotation the value's type;
  - the kind reads the value and names the key in its errors (lb/config/kinds.py: Num ranges such as SECONDS,
    SECONDS0 or Num(True, 1, 64); STR; BOOL, a switch as a flag; ONOFF, on|off; HOSTPORT; LIST, comma
    separated as a flag; ...) and says how --help writes the value (S, N, on|off, HOST:PORT; else metavar=);
  - toml: the dotted path "section.key", or a top-level "key", or a tuple of aliases; none: flag only.
    A new [section] needs nothing else (it is known once an entry names it; give it a class of its own
    in the chain below to keep its keys together);
  - flag: none for a file-only key; help: the --help text, plain, without the default (appended);
    doc: the README's meaning when it says more (markdown; else the help); shown: the default as the
    README writes it (markdown), when the value alone does not say it ("" shows none); env: a variable
    that sets it instead; choices: the words it takes (checked after flags and file are merged);
  - then `python3 -m lb.config.docs --write docs/reference/configuration.md` (tests/test_settings_table.py insists), and the
    key in conf/edge.toml (the test insists on that too).

  E.g. `[server] http2`: `http2: bool = setting(False, ONOFF, toml="server.http2", flag="--http2", help="...")` in
  ServerTable. A table of tables ([[pools]], [[routes]]) is a Kind of its own in kinds.py (file() parses the
  list, with unknown keys refused like Backends.file; toml_shown() names it in the README) and then one
  entry like any other: `pools: tuple = setting((), POOLS, toml="pools", doc="...")` in TopLevel.

The order here is the order of --help, the configuration reference's table and the "known:" lists of unknown-key errors
(the top-level list's order is the top-level keys' order, then each [section] by its first key).
Checks that span several keys are validate.py's.

A leaf: the standard library and lb/config/kinds.py only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from lb.config.kinds import (
    BACKENDS,
    BOOL,
    CERTIFICATES,
    HOSTPORT,
    KEYS,
    LIST,
    MS,
    ONOFF,
    PERCENT,
    RATES,
    RETRY_ON,
    RULES,
    SECONDS,
    SECONDS0,
    STR,
    STREAK,
    BackendSpec,
    CertSpec,
    Kind,
    Num,
)
from lb.config.routes import POOLS, ROUTES

STRATEGIES = ("round-robin", "weighted", "least-request")
STORE_ERROR_POLICIES = ("fail-open", "fail-closed", "local")
UNKNOWN_KEYS = ("as-ip", "reject")
ACCESS_LOG_FORMATS = ("text", "json")
ALGORITHMS = ("token-bucket", "fixed-window", "sliding-log", "sliding-counter")
# A rejection's status: 4xx/5xx codes that need no header of their own (not 401's WWW-Authenticate, 405's
# Allow, 407, 416's Content-Range, 426's Upgrade) and do not speak of the request's framing (408, 411,
# 413, 414, 431) -- nginx's limit_req_status takes any 400-599, which lets a typo send a 401.
REJECT_STATUSES = frozenset({400, 403, 404, 410, 429, 500, 502, 503, 504})
REDACTED_PARAMS = ("token", "access_token", "api_key", "key", "password", "secret", "signature")


@dataclass(frozen=True)
class Setting:
    """One setting's facts; `name` is its Config attribute (filled in from the field)."""

    kind: Kind
    default: Any
    toml: tuple[str, ...] = ()  # dotted paths in the file; () flag only
    flag: str | None = None  # None: file only
    help: str = ""  # --help, plain text, without the default
    doc: str | None = None  # the README's meaning (markdown); None: the help
    shown: str | None = None  # the default as the README writes it (markdown); None: from the value
    metavar: str | None = None
    env: str | None = None  # an environment variable that sets it instead (README's flag column)
    choices: tuple = ()  # the words it takes; checked once flags and file are merged
    label: str | None = None  # the key a choices error names (default: the first TOML path)
    name: str = ""

    @property
    def value_name(self) -> str | None:
        """The flag's value as --help and the README write it: the entry's metavar, else its kind's."""
        return self.metavar or self.kind.metavar


def setting(default, kind: Kind, *, toml: str | tuple[str, ...] = (), compare: bool = True, **facts) -> Any:
    """A Config field carrying its Setting (Any: so each field keeps its own annotation for type checkers)."""
    paths = (toml,) if isinstance(toml, str) else tuple(toml)
    return field(default=default, compare=compare, metadata={"setting": Setting(kind, default, paths, **facts)})


# The table, one class per TOML table: each adds its settings to the one before (a chain, so the fields'
# order -- --help's, the README's, the known-key lists' -- is the file's), and Config is the last.
@dataclass(frozen=True)
class TopLevel:
    """The top of the file: where to listen, the pool, the strategy, the access log; and the flags of no table."""

    config_path: str | None = setting(
        None, STR, flag="--config", metavar="FILE", compare=False, shown="", help="TOML file; flags override it"
    )
    check: bool = setting(
        False,
        BOOL,
        flag="--check",
        compare=False,
        shown="",
        help="validate the configuration, print one line per problem, exit 0 or 2; starts nothing",
    )
    listen: tuple[str, int] = setting(
        ("127.0.0.1", 8080),
        HOSTPORT,
        toml="listen",
        flag="--listen",
        help="HOST:PORT to serve on (port 0 picks a free one)",
        doc="where to serve (port 0: any free port, logged); IPv6 in brackets: `[::1]:8080`, `[::]:8080` (dual-stack)",
    )
    admin: tuple[str, int] | None = setting(
        None,
        HOSTPORT,
        toml=("admin", "admin.listen"),
        flag="--admin",
        help="HOST:PORT for /metrics and /status",
        doc="`/` (the dashboard), `/metrics` (Prometheus), `/status` (JSON), `/limits/KEY`, `/healthz`, `/readyz`; "
        "`[admin] listen` is the same address when the `[admin]` table is used (TOML cannot have both)",
    )
    strategy: str = setting(
        "weighted",
        STR,
        toml="strategy",
        flag="--strategy",
        choices=STRATEGIES,
        help="round-robin | weighted (equal weights = round robin) | least-request",
        doc="`weighted` (smooth WRR; equal weights = round robin), `round-robin`, `least-request` (fewest in "
        "flight: power of two choices)",
    )
    demo: bool = setting(
        False,
        BOOL,
        toml="demo",
        flag="--demo",
        help="start three built-in identity backends and balance over them",
        doc="three built-in identity backends",
    )
    access_log: str | None = setting(
        None,
        STR,
        toml="access_log",
        flag="--access-log",
        metavar="PATH",
        help="file path, or - for stderr",
        doc="one line per request (refusals too); `-` for stderr",
    )
    access_log_format: str = setting(
        "text",
        STR,
        toml="access_log_format",
        flag="--access-log-format",
        choices=ACCESS_LOG_FORMATS,
        help="text | json: one JSON object per line",
        doc="`text` (escaped, quoted) or `json` (one object per line)",
    )
    sticky: bool = setting(
        False,
        BOOL,
        toml="sticky",
        flag="--sticky",
        help="sticky sessions: a route cookie pins a client to a backend",
        doc="`Cookie: route=<id>` pins a client to an UP backend (no round-robin turn)",
    )
    backends: tuple[BackendSpec, ...] = setting(
        (),
        BACKENDS,
        toml="backends",
        flag="--backends",
        metavar="URL[=W],...",
        shown="",
        help="URL[=WEIGHT],... e.g. http://127.0.0.1:9001=3,http://127.0.0.1:9002",
        doc="the pool; weight a whole number ≥ 1; `http://[::1]:9001`, `https://...`, `h2c://HOST:PORT` (HTTP/2 by "
        'prior knowledge: gRPC services, see "HTTP/2 from clients")',
    )
    rules: tuple = setting(
        (),
        RULES,
        toml="rules",  # lb.limiting.rules.RuleSpec per [[rules]] table
        doc="limit rules (name, key, limit, algorithm, match, dry_run, cost, max_in_flight): "
        "[Limit rules](#limit-rules)",
    )
    pools: tuple = setting(
        (),
        POOLS,
        toml="pools",  # lb.config.routes.PoolSpec per [[pools]] table
        doc="named pools (name, strategy, backends, health, upstream), each with its own balancer, "
        "health checks, ejection, slow start, connection pools and circuit breaker; "
        "`--backends` / `[[backends]]` are the pool `default`: [docs/routes.md](../routes.md)",
    )
    routes: tuple = setting(
        (),
        ROUTES,
        toml="routes",  # lb.config.routes.RouteSpec per [[routes]] table
        doc="first match wins (match: path_prefix, host, methods, headers) → `pool` or a canary "
        "`split`; `request_headers` / `response_headers` {set, remove}; `allow` / `deny` "
        "CIDRs → 403: [docs/routes.md](../routes.md)",
    )
    keys: tuple = setting(
        (),
        KEYS,
        toml="keys",  # lb.limiting.keys.KeySpec: [[keys]], then api_keys_file's
        doc="known API keys (name, key, tier) and their tiers (`[limits.tiers]`)",
    )


@dataclass(frozen=True)
class AdminTable(TopLevel):
    """[admin]: the admin listener's token and host names (its address is `admin` above)."""

    admin_token_file: str | None = setting(
        None,
        STR,
        toml="admin.token_file",
        env="EDGE_ADMIN_TOKEN",
        shown="none: writes off",
        doc="the token admin writes (drain, enable) need, as `Authorization: Bearer TOKEN`; one of the two (the "
        "file's first line; `${CREDENTIALS_DIRECTORY}` expanded)",
    )
    admin_allowed_hosts: tuple[str, ...] = setting(
        (),
        LIST,
        toml="admin.allowed_hosts",
        doc="`Host` names the admin listener answers to beyond IP addresses, `localhost` and the machine's name "
        "(e.g. the DNS name Prometheus scrapes)",
    )


@dataclass(frozen=True)
class HealthTable(AdminTable):
    """[health]: active probes, passive ejection, slow start."""

    health_path: str = setting("/health", STR, toml="health.path", flag="--health-path", help="GET, 2xx = pass")
    health_protocol: str = setting(
        "http",
        STR,
        toml="health.protocol",
        flag="--health-protocol",
        choices=("http", "grpc"),
        help="grpc: h2c:// backends are probed with grpc.health.v1.Health/Check (SERVING passes) | http: GET the "
        "health path (over HTTP/2 for an h2c:// backend)",
        doc='`grpc`: an `h2c://` backend is probed with `grpc.health.v1.Health/Check` (service `""`), SERVING = '
        "pass; `http`: GET `path` (over HTTP/2 for an `h2c://` backend)",
    )
    health_interval: float = setting(
        10.0, SECONDS, toml="health.interval", flag="--health-interval", help="seconds between probes (floats allowed)"
    )
    health_timeout: float | None = setting(
        None,
        SECONDS,
        toml="health.timeout",
        flag="--health-timeout",
        shown="80% of the interval, at most 2 s",
        help="probe timeout, shorter than the interval",
    )
    unhealthy_threshold: int = setting(
        2,
        STREAK,
        toml="health.unhealthy_threshold",
        flag="--unhealthy-threshold",
        help="consecutive failures -> out of rotation (DOWN)",
    )
    healthy_threshold: int = setting(
        2,
        STREAK,
        toml="health.healthy_threshold",
        flag="--healthy-threshold",
        help="consecutive passes -> back in rotation (UP)",
    )
    eject_after: int = setting(
        5,
        Num(True, 0, 1000),
        toml="health.eject_after",
        flag="--eject-after",
        help="consecutive failed requests (connect failure, timeout, 5xx) that eject a backend; 0 off",
    )
    eject_for: float = setting(
        30.0,
        SECONDS,
        toml="health.eject_for",
        flag="--eject-for",
        help="seconds a backend stays ejected, times the number of its ejections (at most 300); then it returns",
    )
    max_ejected_percent: float = setting(
        50.0,
        PERCENT,
        toml="health.max_ejected_percent",
        flag="--max-ejected-percent",
        help="never more of the pool ejected at once, percent (rounded down)",
    )
    slow_start: float = setting(
        0.0,
        SECONDS0,
        toml="health.slow_start",
        flag="--slow-start",
        shown="`0`: off",
        help="seconds over which a (re)joining backend ramps from 10% to its weight",
    )


@dataclass(frozen=True)
class UpstreamTable(HealthTable):
    """[upstream]: the backend side: timeouts, the pool, retries, the circuit breaker, DNS."""

    connect_timeout: float = setting(
        2.0,
        SECONDS,
        toml="upstream.connect_timeout",
        flag="--connect-timeout",
        help="seconds to connect to a backend -> 502",
    )
    read_timeout: float = setting(
        30.0,
        SECONDS,
        toml="upstream.read_timeout",
        flag="--read-timeout",
        help="seconds a backend may stay silent -> 504",
    )
    response_timeout: float = setting(
        300.0,
        SECONDS,
        toml="upstream.response_timeout",
        flag="--response-timeout",
        help="seconds for a whole response, however it trickles",
        doc="a whole response, however it trickles, counted from when the backend has the whole request (a slow "
        "upload or a delay-mode hold does not spend it)",
    )
    pool_maxsize: int = setting(
        64,
        Num(True, 1, 100_000),
        toml="upstream.pool_maxsize",
        flag="--pool-maxsize",
        help="connections per backend, a hard cap",
        doc="connections per backend, a hard cap; a backend at its cap is passed over for one with a free "
        "connection (nginx's `max_conns`)",
    )
    pool_timeout: float = setting(
        1.0,
        SECONDS,
        toml="upstream.pool_timeout",
        flag="--pool-timeout",
        help="seconds to wait for a free backend connection -> 503",
        doc="when every backend is at its cap: wait in line (first come, first served) for a free connection, then 503",
    )
    pool_idle_timeout: float = setting(
        30.0,
        SECONDS0,
        toml="upstream.pool_idle_timeout",
        flag="--pool-idle-timeout",
        help="seconds a pooled connection may idle before it is discarded, not reused",
    )
    no_pool: bool = setting(
        False,
        BOOL,
        toml="upstream.no_pool",
        flag="--no-pool",
        help="a new TCP connection per request (to measure the win)",
    )
    ca_file: str | None = setting(
        None,
        STR,
        toml="upstream.ca_file",
        flag="--ca-file",
        metavar="FILE",
        shown="system CAs",
        help="PEM CA bundle that https:// backends are verified against",
    )
    retries: int = setting(
        2,
        Num(True, 0, 100),
        toml="upstream.retries",
        flag="--retries",
        help="retries of a connect failure on other backends not yet tried, any method; 0 off",
    )
    retry_budget_percent: float = setting(
        20.0,
        PERCENT,
        toml="upstream.retry_budget_percent",
        flag="--retry-budget-percent",
        help="retries in flight at most this % of requests in flight...",
    )
    retry_budget_min: int = setting(
        10,
        Num(True, 0, 100_000),
        toml="upstream.retry_budget_min",
        flag="--retry-budget-min",
        help="...but this many always allowed",
    )
    max_requests: int = setting(
        0,
        Num(True, 0, 10_000_000),
        toml="upstream.max_requests",
        flag="--max-requests",
        shown="`0`: off",
        help="circuit breaker: requests in flight to the pool, past it a 503 at once",
        doc="circuit breaker: requests in flight to the pool (every backend); past it a `503` at once, "
        '`lb_overflow_total{limit="max_requests"}` (Envoy\'s `max_requests`)',
    )
    max_pending: int = setting(
        0,
        Num(True, 0, 10_000_000),
        toml="upstream.max_pending",
        flag="--max-pending",
        shown="`0`: unlimited",
        help="requests waiting for a pooled connection, past it a 503 at once",
        doc="requests waiting (`pool_timeout`) for a pooled connection, pool-wide; past it a `503` at once instead "
        'of waiting, `lb_overflow_total{limit="max_pending"}` (Envoy\'s `max_pending_requests`)',
    )
    resolver: str | None = setting(
        None,
        STR,
        toml="upstream.resolver",
        flag="--resolver",
        metavar="IP:PORT|system",
        help="DNS-named backends: every address a backend's name resolves to is a backend; HOST:PORT of a DNS "
        "server, or 'system' (getaddrinfo); off: a name is one backend",
        doc="DNS-named backends (below, *Failover*): every A/AAAA record of a backend's name is a backend; a DNS "
        "server to ask (nginx's `resolver`), or `system` (getaddrinfo). Off: a name is one backend, as before",
    )
    resolve_interval: float = setting(
        30.0,
        SECONDS,
        toml="upstream.resolve_interval",
        flag="--resolve-interval",
        help="seconds between re-resolutions of DNS-named backends (sooner when a record's TTL is shorter, at "
        "most once a second)",
    )
    retry_on: tuple = setting(
        ("connect",),
        RETRY_ON,
        toml="upstream.retry_on",
        flag="--retry-on",
        metavar="LIST",
        help="failed tries retried on another backend: connect,reset,timeout,5xx,502,503,504 (all but connect: "
        "idempotent methods with a buffered body only)",
        doc="which failed tries are retried: `connect`, `reset`, `timeout`, `5xx`, `502`, `503`, `504` (the list "
        "replaces the default: keep `connect` in it). All but `connect`: idempotent methods with a buffered "
        "body only, after a jittered backoff (see Failover)",
    )
    per_try_timeout: float = setting(
        0.0,
        SECONDS0,
        toml="upstream.per_try_timeout",
        flag="--per-try-timeout",
        shown="`0`: off",
        help="seconds one try waits for its response head (below --read-timeout)",
        doc="the most one try waits for its response head (below `--read-timeout`); a try past it is a `timeout` "
        "(retried with `--retry-on timeout`, else a 504)",
    )
    hedge_after: float = setting(
        0.0,
        SECONDS0,
        toml="upstream.hedge_after",
        flag="--hedge-after",
        shown="`0`: off",
        help="seconds without a response head after which an idempotent request with no or a small body is also "
        "sent to another backend; the first head wins",
        doc="hedged requests: an idempotent request with no body or a small one, still without a response head "
        "after S, is also sent to another backend; the first head wins, the other exchange is closed; within "
        "the retry budget (see Failover)",
    )
    proxy_buffering: bool = setting(
        True,
        ONOFF,
        toml="upstream.proxy_buffering",
        flag="--proxy-buffering",
        help="on: read a response ahead of a slow client (memory, then a temp file) so the backend connection is "
        "freed when the backend is done | off: the backend waits on the client",
        doc="read a response ahead of a slow client (memory, then a temp file), so its backend connection is free "
        "when the backend is done (nginx's `proxy_buffering`); `text/event-stream` and `X-Accel-Buffering: no` "
        "always stream (`yes` buffers even when off); `off`: every response streams, the backend waits on the "
        "client",
    )
    max_temp_file_size: int = setting(
        1 << 30,
        Num(True, 0, 2**50),
        toml="upstream.max_temp_file_size",
        flag="--max-temp-file-size",
        metavar="BYTES",
        help="bytes of one buffered response on disk (0: memory only); past it the rest streams",
    )


@dataclass(frozen=True)
class ServerTable(UpstreamTable):
    """[server]: the client side: processes, timeouts, sizes, buffering, upgrades."""

    workers: int = setting(
        1,
        Num(True, 1, 256),
        toml="server.workers",
        flag="--workers",
        help="processes sharing the listening port (SO_REUSEPORT); with the memory store they share their limits "
        "in shared memory",
    )
    takeover: bool = setting(
        False,
        BOOL,
        flag="--takeover",
        help="start beside a running edge on the same --listen and --admin ports (a zero-downtime upgrade: then "
        "TERM the old one); without it, a port another edge serves refuses the start",
    )
    takeover_socket: str = setting(
        "",
        STR,
        toml="server.takeover_socket",
        flag="--takeover-socket",
        metavar="PATH",
        shown="derived",
        help="Unix socket where this edge hands its listening sockets to a --takeover, and where a --takeover asks "
        "for them (both edges must agree); empty: /tmp/edge-UID/takeover-NETNS-HOST-PORT.sock; off: none (SO_REUSEPORT "
        "only); its directory must be the edge user's and writable by no one else",
        doc="Unix socket where this edge hands its listening sockets to a `--takeover`, and where a `--takeover` "
        "asks for them (both must agree); empty: `/tmp/edge-UID/takeover-NETNS-HOST-PORT.sock`; `off`: none (binding "
        "beside with SO_REUSEPORT only); its directory must be the edge user's, writable by no one else",
    )
    cpu_affinity: str = setting(
        "auto",
        STR,
        toml="server.cpu_affinity",
        flag="--cpu-affinity",
        help="auto: each process pinned to one CPU (worker i on the i-th) | off | a CPU list, e.g. 0,2",
    )
    sched_batch: bool = setting(
        False,
        BOOL,
        toml="server.sched_batch",
        flag="--sched-batch",
        help="run every thread under SCHED_BATCH: a woken thread no longer preempts the one holding the GIL "
        "(fewer futile switches at hundreds of connections); for an edge with its CPU to itself",
        doc="every thread under Linux's SCHED_BATCH: a thread woken by its socket no longer preempts the one "
        "holding the GIL only to sleep on the GIL at once. At hundreds of connections it keeps the edge out of "
        "the preemption cascades (half the requests/s) the default policy falls into in some runs; otherwise "
        "the same (docs/performance.md, twelfth stop). Off by default: on a CPU shared with other busy "
        "processes the edge's wake-ups would wait for the scheduler's tick instead of preempting them",
    )
    drain_timeout: float = setting(
        30.0,
        SECONDS0,
        toml="server.drain_timeout",
        flag="--drain-timeout",
        help="seconds in-flight requests may take to finish after SIGTERM",
    )
    grace: float = setting(
        0.0,
        SECONDS0,
        toml="server.grace",
        flag="--grace",
        help="seconds between SIGTERM (/readyz fails at once) and closing the listener",
    )
    max_connections: int = setting(
        1024,
        Num(True, 1, 1_000_000),
        toml="server.max_connections",
        flag="--max-connections",
        help="concurrent client connections; at the cap the longest-idle keep-alive one is closed for a new one",
        doc="concurrent clients; at it, a new one closes the longest-idle keep-alive connection (nginx's "
        '"reusing connections"); none idle: 503 and close, at once',
    )
    running_threads: int = setting(
        0,
        Num(True, 0, 100_000),
        toml="server.running_threads",
        flag="--running-threads",
        help="connection threads doing work at once, e.g. 32 for hundreds of connections (0: no bound); the others "
        "wait in arrival order, out of the GIL's crowd (a thread blocked elsewhere over 50 ms gives its place up)",
        doc="connection threads doing work at once, e.g. `32`; the others wait in arrival order (requests under "
        "way first), outside the GIL's crowd, so hundreds of connections are served in turn rather than some "
        "waiting seconds (a thread blocked elsewhere over 50 ms -- a slow client, a tunnel, a dead backend's "
        "connect -- gives its place up); it costs throughput at saturation (docs/performance.md); 0: no bound",
    )
    thread_cache: int = setting(
        32,
        Num(True, 0, 100_000),
        toml="server.thread_cache",
        flag="--thread-cache",
        help="connection threads kept parked for the next connection when theirs ends (0: none kept)",
        doc="connection threads kept parked when their connection ends, for the next one (MySQL's "
        "`thread_cache_size`): handing a connection to a parked thread costs ~17 µs of CPU here, starting a "
        "thread ~60; each parked thread keeps its stack's touched pages (tens of KB); 0: every connection "
        "starts a thread",
    )
    thread_stack: int = setting(
        512 * 1024,
        Num(True, 0, 2**30),
        toml="server.thread_stack",
        flag="--thread-stack",
        metavar="BYTES",
        help="stack size of each connection thread (0: the system's, ulimit -s); address space, not memory",
        doc="stack size of each connection thread, in bytes (0: the system's default, `ulimit -s`, 8 MiB on "
        "most Linux systems); only the touched pages are memory, so this is address space, and what bounds "
        "the thread count under a `ulimit -v` or a container's limit; the deepest recursion the edge and "
        "Python's own modules need at the default recursion limit fits in 256 KiB (docs/performance.md)",
    )
    header_timeout: float = setting(
        10.0,
        SECONDS,
        toml="server.header_timeout",
        flag="--header-timeout",
        help="seconds to receive a whole request head (slowloris) -> 408",
    )
    body_timeout: float = setting(
        30.0,
        SECONDS,
        toml="server.body_timeout",
        flag="--body-timeout",
        help="seconds of silence inside a request body -> 408 and close",
    )
    keepalive_timeout: float = setting(
        75.0,
        SECONDS,
        toml="server.keepalive_timeout",
        flag="--keepalive-timeout",
        help="seconds an idle client connection is kept",
    )
    body_min_rate: float = setting(
        8192.0,
        Num(False, 1.0, 1e12, zero=True),
        toml="server.body_min_rate",
        flag="--body-min-rate",
        help="bytes/s a request body must average beyond --body-timeout (0: off) -> 408",
    )
    send_timeout: float = setting(
        60.0,
        SECONDS,
        toml="server.send_timeout",
        flag="--send-timeout",
        help="seconds a client may take to accept each write of a response; one that stops reading is dropped (499)",
    )
    max_body_size: int = setting(
        10 * 1024 * 1024,
        Num(True, 1, 2**40),
        toml="server.max_body_size",
        flag="--max-body-size",
        metavar="BYTES",
        help="bytes -> 413 (checked before 100 Continue; a chunked body's framing counts)",
    )
    tunnel_idle_timeout: float = setting(
        300.0,
        SECONDS,
        toml="server.tunnel_idle_timeout",
        flag="--tunnel-idle-timeout",
        help="seconds an upgraded (WebSocket) connection may be silent both ways",
    )
    upgrades: frozenset = setting(
        frozenset({"websocket"}),
        LIST,
        toml="server.upgrades",
        flag="--upgrades",
        metavar="LIST",
        help="Upgrade protocols tunnelled to backends, comma separated ('' for none)",
        doc="`Upgrade` protocols tunnelled to backends; `''` / `[]`: none",
    )
    request_id_response: bool = setting(
        False,
        BOOL,
        toml="server.request_id_response",
        flag="--request-id-response",
        help="send the request id (X-Request-Id) back on every response, replacing a backend's own (off: it goes "
        "to the backend and the access log only, the spec's transparency)",
    )
    allow_underscores: bool = setting(
        False,
        BOOL,
        toml="server.allow_underscores",
        flag="--allow-underscores",
        help="forward request header names containing '_' (off: dropped, as nginx's underscores_in_headers off)",
        doc="forward request header names with `_` (dropped by default, as nginx's `underscores_in_headers off`: "
        "CGI-style backends read `X_Forwarded_For` as `X-Forwarded-For`)",
    )
    http2: bool = setting(
        True,
        ONOFF,
        toml="server.http2",
        flag="--http2",
        help="on: HTTP/2 from clients too, on the same port (prior knowledge in cleartext, ALPN h2 then http/1.1 "
        "over TLS) | off: HTTP/1.1 only",
        doc="HTTP/2 from clients on the same port: cleartext by prior knowledge (the connection preface), ALPN "
        "`h2` then `http/1.1` over TLS; `off`: HTTP/1.1 only (a preface gets 505, ALPN offers `http/1.1`)",
    )
    http2_max_concurrent_streams: int = setting(
        100,
        Num(True, 1, 10_000),
        toml="server.http2_max_concurrent_streams",
        doc="streams one HTTP/2 connection may have open (SETTINGS_MAX_CONCURRENT_STREAMS); one past it is "
        "refused alone (REFUSED_STREAM, counted), and streams the client reset that are still being served "
        "count too",
    )
    request_buffering: bool = setting(
        True,
        ONOFF,
        toml="server.request_buffering",
        flag="--request-buffering",
        help="on: a request body is read whole (memory, then a temp file) before a backend connection is taken "
        "| off: bodies over 64 KiB stream",
        doc="a body over 64 KiB is read whole (memory, then a temp file) before a backend connection is taken "
        "(nginx's `proxy_request_buffering`); a temp file that cannot be written → `503`; `off`: it streams",
    )
    buffer_memory: int = setting(
        64 << 20,
        Num(True, 0, 2**44),
        toml="server.buffer_memory",
        flag="--buffer-memory",
        metavar="BYTES",
        help="bytes all request and response buffers of a process may hold in memory together (each at most "
        "256 KiB; with --workers N, per worker); past it they go to temp files",
    )
    temp_dir: str | None = setting(
        None,
        STR,
        toml="server.temp_dir",
        flag="--temp-dir",
        metavar="DIR",
        shown="system temp dir",
        help="directory of the buffers' temp files",
        doc="where buffers' temp files go: mode 0600, unlinked at once, closed on every path (a crash leaves none)",
    )
    log_redact_params: tuple = setting(
        REDACTED_PARAMS,
        LIST,
        toml="server.log_redact_params",
        doc="query parameters the access log writes as `***` (names compared case-insensitively)",
    )


@dataclass(frozen=True)
class TlsTable(ServerTable):
    """[tls]: TLS termination, SNI and mutual TLS."""

    tls_cert: str | None = setting(
        None,
        STR,
        toml="tls.cert",
        flag="--tls-cert",
        metavar="FILE",
        help="PEM certificate (chain) file: the listener speaks HTTPS (with --tls-key)",
    )
    tls_key: str | None = setting(
        None, STR, toml="tls.key", flag="--tls-key", metavar="FILE", help="PEM private key file for --tls-cert"
    )
    tls_ciphers: str | None = setting(
        None,
        STR,
        toml="tls.ciphers",
        flag="--tls-ciphers",
        shown="Python's defaults",
        help="OpenSSL cipher list for TLS 1.2 (1.3's suites are fixed)",
    )
    tls_min_version: str = setting(
        "TLSv1.2",
        STR,
        toml="tls.min_version",
        flag="--tls-min-version",
        help="TLSv1.2 | TLSv1.3; TLS 1.0 and 1.1 are never accepted",
    )
    tls_certificates: tuple[CertSpec, ...] = setting(
        (),
        CERTIFICATES,
        toml="tls.certificates",
        doc="more certificates, each chosen by the client's server name (SNI) against its own SAN names: "
        "[SNI](#tls-websocket-and-ipv6-nothing-needs-to-stand-in-front)",
    )
    tls_strict_sni: bool = setting(
        False,
        BOOL,
        toml="tls.strict_sni",
        shown="`false`",
        doc="`true`: a client sending no server name, or one no certificate has, fails the handshake (else: the "
        "default certificate)",
    )
    tls_client_ca: str | None = setting(
        None,
        STR,
        toml="tls.client_ca",
        flag="--tls-client-ca",
        metavar="FILE",
        help="PEM CA file: mutual TLS, clients must present a certificate it signed ([tls] client_auth = "
        '"optional" to serve clients without one)',
        doc="mutual TLS: clients present a certificate this CA (PEM, one or more) signed; the backend gets "
        "`X-Forwarded-Client-Cert`",
    )
    tls_client_auth: str = setting(
        "require",
        STR,
        toml="tls.client_auth",
        doc="`require`: no valid client certificate, no handshake; `optional`: a client without one is served, "
        "unidentified (an invalid one is still refused)",
    )
    tls_client_crl: str | None = setting(
        None,
        STR,
        toml="tls.client_crl",
        doc="PEM CRL(s) of the client CA; the client's certificate is checked against it, re-read on `SIGHUP`",
    )


@dataclass(frozen=True)
class LimitsTable(TlsTable):
    """[limits]: rate limiting, its store, known keys and shaping."""

    limit: str | None = setting(
        None,
        STR,
        toml="limits.default",
        flag="--limit",
        metavar="N/PERIOD",
        help="N/PERIOD for every key, e.g. 100/s, 600/m, 50/10s",
        shown="off: no limiting",
        doc="every key: `100/s`, `600/m`, `50/10s`, `3/500ms` (N at most 2^53 − 1, PERIOD at least 1 ms: beyond, "
        "a double cannot hold the arithmetic and start-up refuses it, naming the key)",
    )
    algorithm: str = setting(
        "token-bucket",
        STR,
        toml="limits.algorithm",
        flag="--algorithm",
        choices=ALGORITHMS,
        label="algorithm",
        help="token-bucket | fixed-window | sliding-log | sliding-counter",
    )
    store: str = setting(
        "memory",
        STR,
        toml="limits.store",
        flag="--store",
        help="memory | redis://[USER:PASS@]HOST:PORT/DB | rediss://... (TLS) | redis+unix:///PATH.sock[?db=N] | "
        "redis-sentinel://H:P,.../MASTER | redis-cluster://H:P,... (the password: better in env "
        "EDGE_REDIS_PASSWORD or [limits] redis_password_file)",
        doc="or `redis://[USER:PASSWORD@]HOST:PORT/DB`, `rediss://…` (TLS), `redis+unix:///PATH.sock[?db=N]` (a "
        "Redis on this host, over its unix socket; also `unix://`), `redis-sentinel://H:P,…/MASTER`, "
        "`redis-cluster://H:P,…` (shared by every edge)",
    )
    redis_timeout: float = setting(
        0.05,
        SECONDS,
        toml="limits.redis_timeout",
        flag="--redis-timeout",
        help="seconds per Redis call (connect and read) before --on-store-error applies",
    )
    on_store_error: str = setting(
        "fail-open",
        STR,
        toml="limits.on_store_error",
        flag="--on-store-error",
        choices=STORE_ERROR_POLICIES,
        help="fail-open (admit) | fail-closed (503) | local (in-process limiter)",
    )
    redis_password_file: str | None = setting(
        None,
        STR,
        toml="limits.redis_password_file",
        env="EDGE_REDIS_PASSWORD",
        shown="none",
        doc="the Redis password's file (or env `EDGE_REDIS_PASSWORD`; either keeps it out of the URL, so out of "
        "`ps` and the TOML; `${CREDENTIALS_DIRECTORY}` is expanded)",
    )
    redis_ca_file: str | None = setting(
        None,
        STR,
        toml="limits.redis_ca_file",
        shown="none",
        doc="`rediss://`: the CA that signed the server's certificate",
    )
    redis_cert_file: str | None = setting(
        None,
        STR,
        toml="limits.redis_cert_file",
        shown="none",
        doc="`rediss://`: a client certificate (with `redis_key_file`)",
    )
    redis_key_file: str | None = setting(
        None, STR, toml="limits.redis_key_file", shown="none", doc="`rediss://`: the client certificate's key"
    )
    trusted_proxies: tuple[str, ...] = setting(
        (),
        LIST,
        toml="limits.trusted_proxies",
        flag="--trusted-proxies",
        metavar="CIDR,...",
        help="CIDR,... whose X-Forwarded-For is believed",
        doc="peers whose `X-Forwarded-For` is believed",
    )
    key_limits: tuple[tuple[str, str], ...] = setting(
        (),
        RATES,
        toml="limits.keys",
        flag="--key-limit",
        metavar="KEY=N/PERIOD",
        help="key:NAME=N/PERIOD or ip:ADDRESS=N/PERIOD override, repeatable (a bare address is an ip:, anything "
        "else a key:)",
        doc="per-identity overrides: `key:NAME` or `ip:ADDRESS` (a bare address is an `ip:`, anything else a `key:`)",
    )
    api_keys_file: str | None = setting(
        None,
        STR,
        toml="limits.api_keys_file",
        shown="none",
        doc="known API keys, as `[[keys]]` tables in a file of their own; re-read on SIGHUP",
    )
    unknown_keys: str = setting(
        "as-ip",
        STR,
        toml="limits.unknown_keys",
        choices=UNKNOWN_KEYS,
        doc="with known keys, an unknown `X-Api-Key`: `as-ip` (treated as no key) or `reject` (401)",
    )
    exempt: tuple[str, ...] = setting(
        (), LIST, toml="limits.exempt", doc="never limited: CIDRs and `key:NAME` of known keys"
    )
    ietf_headers: bool = setting(
        False,
        BOOL,
        toml="limits.ietf_headers",
        shown="`false`",
        doc="also send `RateLimit-Policy` / `RateLimit` (draft-ietf-httpapi-ratelimit-headers)",
    )
    tiers: tuple[tuple[str, str], ...] = setting(
        (), RATES, toml="limits.tiers", doc="tier name = `N/PERIOD`, the limit of the known keys of that tier"
    )
    max_keys: int = setting(
        100_000,
        Num(True, 1, 100_000_000),
        toml="limits.max_keys",
        doc="keys held in memory per limiter (each rule has its own). When full, a state that decides exactly as "
        "a fresh key would (full bucket, empty windows) is dropped, the one that expired first; when there is "
        "none, the **new** key is refused with 503 and no client's state is ever dropped (one log line; "
        "`lb_limiter_keys{rule}`, `lb_limiter_table_full_total{rule}`)",
    )
    ipv6_prefix: int = setting(
        64,
        Num(True, 0, 128),
        toml="limits.ipv6_prefix",
        flag="--ipv6-prefix",
        help="IPv6 clients are limited per /N prefix (0 or 128: per address)",
    )
    max_delay: float = setting(
        0.0,
        Num(False, MS, 60.0, zero=True),
        toml="limits.max_delay",
        flag="--max-delay",
        shown="`0`: off",
        help="seconds an over-limit request may be held (its slot reserved) instead of refused (nginx's limit_req "
        "delay); at most 60; every store and algorithm",
        doc="an over-limit request whose turn comes within S seconds is held that long (its slot reserved at once) "
        "and then forwarded, instead of refused (nginx's `limit_req … delay`); at most 60; every store and "
        "algorithm: [Shaping](#shaping-delay-concurrency-cost-status)",
    )
    max_delayed: int = setting(
        256,
        Num(True, 1, 100_000),
        toml="limits.max_delayed",
        doc="requests held at once (each holds its connection's thread); past it, the rejection status at once "
        "(`lb_delayed_refused_total`)",
    )
    max_in_flight: int = setting(
        0,
        Num(True, 0, 1_000_000),
        toml="limits.max_in_flight",
        flag="--max-in-flight",
        shown="`0`: off",
        help="concurrent requests per client identity (nginx's limit_conn) -> 429 with Retry-After: 1",
        doc="concurrent requests per client identity (nginx's `limit_conn`); the (N+1)-th gets the rejection status "
        "with `Retry-After: 1`; shared by `--workers` (shared memory) and across edges with Redis",
    )
    limit_status: int = setting(
        429,
        Num(True, 400, 599),
        toml="limits.status",
        flag="--limit-status",
        metavar="CODE",
        help="status of a rate-limit or in-flight rejection (nginx's limit_req_status): one of "
        + ", ".join(map(str, sorted(REJECT_STATUSES))),
    )


@dataclass(frozen=True)
class Config(LimitsTable):
    """The configuration the rest of the code reads: every setting above, one frozen object."""

    @property
    def health_probe_timeout(self) -> float:
        if self.health_timeout is not None:
            return self.health_timeout
        return max(0.05, min(2.0, self.health_interval * 0.8))


SETTINGS: tuple[Setting, ...] = tuple(replace(f.metadata["setting"], name=f.name) for f in fields(Config))


# ---------------------------------------------------------------------- views the loaders read


def file_keys() -> dict[str, dict[str, Setting]]:
    """TOML paths by table: {"": top-level keys, "health": {...}, ...}, in the table's order."""
    out: dict[str, dict[str, Setting]] = {"": {}}
    for s in SETTINGS:
        for path in s.toml:
            section, _, key = path.rpartition(".")
            out.setdefault(section, {})[key] = s
    return out
