"""Configuration: command-line flags over an optional TOML file, validated into one frozen Config.

Every bad value raises ConfigError with one line naming the key and the value; edge.py prints it and
exits 2. The flag names and the file's keys are a contract (README "Configuration").
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tomllib
from typing import NamedTuple
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from limiter.redis import url as redis_url

from lb import __version__, logs
from lb.netaddr import hostport, network, split_hostport
from lb.upstream.retrypolicy import parse_conditions


class ConfigError(ValueError):
    """One or more configuration values are wrong; each problem is one line naming the key and the value."""

    def __init__(self, *problems: str):
        self.problems = list(problems)
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class BackendSpec:
    url: str          # http://host:port or http://[v6]:port, normalised (no path, no trailing slash)
    weight: int = 1
    host: str = ""    # without brackets
    port: int = 80
    scheme: str = "http"   # or https: TLS to the backend, verified
    address: str = ""      # one address a DNS name resolved to (lb/upstream/resolve.py): connect there, host stays the name


@dataclass(frozen=True)
class CertSpec:
    """A certificate (chain) and its key: [tls] cert/key, or one [[tls.certificates]] table."""
    cert: str
    key: str


@dataclass(frozen=True)
class Config:
    listen: tuple[str, int] = ("127.0.0.1", 8080)
    admin: tuple[str, int] | None = None
    admin_token_file: str | None = None      # admin writes need this file's token (or env EDGE_ADMIN_TOKEN)
    admin_allowed_hosts: tuple[str, ...] = ()   # Host names the admin listener answers to, beyond IPs/localhost
    strategy: str = "weighted"
    sticky: bool = False                     # Cookie route=<backend id> pins a client to a backend
    backends: tuple[BackendSpec, ...] = ()
    demo: bool = False
    # health
    health_path: str = "/health"
    health_interval: float = 10.0
    health_timeout: float | None = None      # None: derived, shorter than the interval
    unhealthy_threshold: int = 2
    healthy_threshold: int = 2
    # passive health (outlier ejection) and slow start
    eject_after: int = 5                     # consecutive connect failures/timeouts/5xx -> ejected; 0 off
    eject_for: float = 30.0                  # base ejection time, multiplied by the times ejected
    max_ejected_percent: float = 50.0        # never more of the pool ejected at once
    slow_start: float = 0.0                  # seconds a (re)joining backend ramps its weight; 0 off
    # upstream
    connect_timeout: float = 2.0
    read_timeout: float = 30.0
    response_timeout: float = 300.0          # whole-response deadline: a trickling backend ends here
    pool_maxsize: int = 64                   # connections per backend, a hard cap (block=True)
    pool_timeout: float = 1.0                # wait for a free pooled connection, then 503
    pool_idle_timeout: float = 30.0          # a pooled connection idle longer is closed, not reused
    no_pool: bool = False
    proxy_buffering: bool = True             # read a response ahead of a slow client (nginx's proxy_buffering)
    max_temp_file_size: int = 1 << 30        # a buffered response's temp file, at most; 0: memory only
    ca_file: str | None = None               # https:// backends are verified against this (default: system CAs)
    retries: int = 2                         # a connect failure is retried on another backend, N times
    retry_budget_percent: float = 20.0       # retries in flight at most this % of active requests...
    retry_budget_min: int = 10               # ...but always this many (Envoy's budget, Linkerd's floor)
    max_requests: int = 0                    # circuit breaker: requests in flight to the pool, then 503; 0 off
    max_pending: int = 0                     # requests waiting for a pooled connection, then 503; 0 unlimited
    resolver: str | None = None              # DNS-named backends: "HOST:PORT" (a DNS server) or "system"; None: off
    resolve_interval: float = 30.0           # re-resolve them this often (or sooner, at the records' TTL)
    retry_on: tuple = ("connect",)           # which failed tries are retried (lb/upstream/retrypolicy.py CONDITIONS)
    per_try_timeout: float = 0.0             # one try's wait for its response head (0: read_timeout only)
    # client side
    workers: int = 1                         # processes sharing the port (SO_REUSEPORT)
    takeover: bool = False                   # bind beside a running edge on the same ports (an upgrade)
    cpu_affinity: str = "auto"               # auto: each process on one CPU; off; or a CPU list "0,2"
    drain_timeout: float = 30.0              # SIGTERM: in-flight requests may finish within this
    grace: float = 0.0                       # SIGTERM: /readyz fails at once, accepting stops this much later
    max_connections: int = 1024
    running_threads: int = 0                 # connection threads at work at once, the rest wait in order (0: no bound)
    header_timeout: float = 10.0             # whole request head, slowloris or not
    body_timeout: float = 30.0               # between body reads
    body_min_rate: float = 8192.0            # bytes/s a request body must average after body_timeout; 0 off
    send_timeout: float = 60.0               # between two writes to a client (nginx's send_timeout)
    keepalive_timeout: float = 75.0          # idle client connection (nginx's default)
    max_body_size: int = 10 * 1024 * 1024
    request_id_response: bool = False        # X-Request-Id on responses too (off: the spec's transparency)
    request_buffering: bool = True           # a body is read whole before a backend connection is taken
    buffer_memory: int = 64 << 20            # all buffers' memory together; past it they go to temp files
    temp_dir: str | None = None              # where buffers' temp files go (default: the system's temp dir)
    tunnel_idle_timeout: float = 300.0       # an upgraded connection (WebSocket) silent both ways is closed
    upgrades: frozenset = frozenset({"websocket"})   # Upgrade protocols tunnelled; empty: none
    allow_underscores: bool = False          # forward request header names with '_' (nginx: underscores_in_headers)
    # limiting
    limit: str | None = None                 # "N/PERIOD"; None: limiting off
    key_limits: tuple[tuple[str, str], ...] = ()
    algorithm: str = "token-bucket"
    store: str = "memory"
    redis_timeout: float = 0.05              # seconds per Redis call (connect and read) before on_store_error
    on_store_error: str = "fail-open"        # fail-open | fail-closed (503) | local (in-process limiter)
    redis_password_file: str | None = None   # the Redis password's file (else the URL or EDGE_REDIS_PASSWORD)
    redis_ca_file: str | None = None         # rediss://: the CA that signed the server's certificate
    redis_cert_file: str | None = None       # rediss://: a client certificate (with redis_key_file)
    redis_key_file: str | None = None
    trusted_proxies: tuple[str, ...] = ()
    # TLS termination: both set -> the listener speaks HTTPS
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ciphers: str | None = None           # OpenSSL cipher list for TLS 1.2 (1.3's suites are fixed)
    tls_min_version: str = "TLSv1.2"         # or TLSv1.3; 1.0 and 1.1 are never offered
    tls_certificates: tuple = ()             # CertSpec per [[tls.certificates]]: more names, chosen by SNI
    tls_strict_sni: bool = False             # no SNI, or a name no certificate has: handshake refused
    tls_client_ca: str | None = None         # mutual TLS: clients present a certificate this CA signed
    tls_client_auth: str = "require"         # or optional: a client without one is served, unidentified
    tls_client_crl: str | None = None        # PEM CRL of the client CA (leaf checked), re-read on SIGHUP
    rules: tuple = ()                        # lb.rules.RuleSpec per [[rules]] table
    keys: tuple = ()                         # lb.keys.KeySpec: [[keys]] tables, then api_keys_file's
    tiers: tuple[tuple[str, str], ...] = ()  # [limits.tiers] name = "N/PERIOD"
    api_keys_file: str | None = None
    unknown_keys: str = "as-ip"              # with known keys: an unknown X-Api-Key is no key, or 401
    exempt: tuple[str, ...] = ()             # CIDRs / "key:NAME" never limited
    ietf_headers: bool = False               # also RateLimit-Policy / RateLimit (IETF draft)
    max_keys: int = 100_000                  # keys holding state in memory, per limiter (per rule and rate)
    ipv6_prefix: int = 64                    # IPv6 clients are limited per /N (0 or 128: per address)
    max_delay: float = 0.0                   # hold an over-limit request up to this long instead of refusing it
    max_delayed: int = 256                   # requests held at once (a connection thread each); past it, refused
    max_in_flight: int = 0                   # concurrent requests per identity (nginx limit_conn); 0 off
    limit_status: int = 429                  # the status of a rate-limit (and in-flight) rejection
    # observability
    access_log: str | None = None            # a file path, "-" for stderr; None: off
    access_log_format: str = "text"          # text | json
    # query parameters whose values the access log writes as *** (names compared case-insensitively)
    log_redact_params: tuple = ("token", "access_token", "api_key", "key", "password", "secret", "signature")
    check: bool = field(default=False, compare=False)   # --check: validate and exit
    config_path: str | None = field(default=None, compare=False)

    @property
    def health_probe_timeout(self) -> float:
        if self.health_timeout is not None:
            return self.health_timeout
        return max(0.05, min(2.0, self.health_interval * 0.8))


STRATEGIES = ("round-robin", "weighted", "least-request")
STORE_ERROR_POLICIES = ("fail-open", "fail-closed", "local")
UNKNOWN_KEYS = ("as-ip", "reject")
ACCESS_LOG_FORMATS = ("text", "json")
ALGORITHMS = ("token-bucket", "fixed-window", "sliding-log", "sliding-counter")
# A rejection's status: 4xx/5xx codes that need no header of their own (not 401's WWW-Authenticate, 405's
# Allow, 407, 416's Content-Range, 426's Upgrade) and do not speak of the request's framing (408, 411,
# 413, 414, 431) -- nginx's limit_req_status takes any 400-599, which lets a typo send a 401.
REJECT_STATUSES = frozenset({400, 403, 404, 410, 429, 500, 502, 503, 504})


# ---------------------------------------------------------------------------------------- parsers

def parse_hostport(value: str, key: str) -> tuple[str, int]:
    parts = split_hostport(value)
    if parts is None or not parts[1].isdigit() or not 0 <= int(parts[1]) <= 65535:
        raise ConfigError(f"{key}: expected HOST:PORT or [IPV6]:PORT, got {value!r}")
    return parts[0], int(parts[1])


def parse_backend_url(url: str, weight, key: str) -> BackendSpec:
    try:
        parts = urlsplit(str(url))
        port = parts.port
    except ValueError:
        raise ConfigError(f"{key}: bad backend URL {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ConfigError(f"{key}: bad backend URL {url!r} (expected http://HOST[:PORT] or https://..., "
                          f"[IPV6] in brackets, no path)")
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
        raise ConfigError(f"{key}: weight must be a whole number >= 1, got {weight!r} for {url}")
    port = port or (443 if parts.scheme == "https" else 80)
    return BackendSpec(url=f"{parts.scheme}://{hostport(parts.hostname, port)}", weight=weight,
                       host=parts.hostname, port=port, scheme=parts.scheme)


def parse_backends_flag(value: str) -> tuple[BackendSpec, ...]:
    specs = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            raise ConfigError(f"--backends: empty entry in {value!r}")
        url, sep, w = item.partition("=")
        if sep:
            try:
                weight = int(w)
            except ValueError:
                raise ConfigError(f"--backends: weight must be a whole number >= 1, got {w!r} for {url}") from None
        else:
            weight = 1
        specs.append(parse_backend_url(url, weight, "--backends"))
    return tuple(specs)


class Num(NamedTuple):
    """The range of one numeric setting: every number is finite and inside [lo, hi] (or 0, if zero)."""
    integer: bool
    lo: float
    hi: float
    zero: bool = False                            # 0 allowed too ("none", "off") below lo


DAY = 86400.0
MS = 0.001      # the shortest duration: `1e-300` is no timeout anyone means (and rounds to 1 us in the kernel)
SECONDS = Num(False, MS, DAY)                     # a duration that must be > 0
SECONDS0 = Num(False, MS, DAY, zero=True)         # a duration where 0 means "none"
STREAK = Num(True, 1, 1000)
PERCENT = Num(False, 0.0, 100.0)


def _number(value, key: str, spec: Num):
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    try:
        n = int(value) if spec.integer else float(value)
        if spec.integer and float(value) != n:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        kind = "a whole number" if spec.integer else "a number"
        raise ConfigError(f"{key}: expected {kind}, got {value!r}") from None
    if not math.isfinite(n) or not (spec.lo <= n <= spec.hi or (spec.zero and n == 0)):
        zero = "0 or " if spec.zero else ""
        raise ConfigError(f"{key}: must be {zero}a finite number >= {spec.lo:g} and <= {spec.hi:g}, got {value!r}")
    return n


def check_rate(value: str, key: str) -> str:
    from limiter import parse_rate  # the limiter owns the N/PERIOD grammar
    if str(value).lstrip().startswith("-"):
        raise ConfigError(f"{key}: N in N/PERIOD must be a whole number >= 1, got {value!r}")
    try:
        parse_rate(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    return value


def redis_files(c: "Config") -> dict:
    """The [limits] redis_*_file settings, as limiter.redis_url.parse / RedisStore keyword arguments."""
    pw_file = os.path.expandvars(c.redis_password_file) if c.redis_password_file else None   # ${CREDENTIALS_DIRECTORY}
    return {"password_file": pw_file, "ca_file": c.redis_ca_file,
            "cert_file": c.redis_cert_file, "key_file": c.redis_key_file}


ENV_ADMIN_TOKEN = "EDGE_ADMIN_TOKEN"


def admin_token(c: "Config") -> bytes | None:
    """The token admin writes need: env EDGE_ADMIN_TOKEN or the first line of [admin] token_file (one
    source, as for the Redis password: two would leave an operator guessing which one is in force).
    None: writes are off. Raises ConfigError."""
    env = os.environ.get(ENV_ADMIN_TOKEN)
    if env is not None and c.admin_token_file:
        raise ConfigError(f"admin.token_file: set it or the environment variable {ENV_ADMIN_TOKEN}, not both")
    if c.admin_token_file:
        path = os.path.expandvars(c.admin_token_file)      # ${CREDENTIALS_DIRECTORY}
        try:
            with open(path, "rb") as f:
                token = f.readline().strip()
        except OSError as e:
            raise ConfigError(f"admin.token_file: cannot read {path}: {e.strerror or e}") from None
        if not token:
            raise ConfigError(f"admin.token_file: {path} is empty (its first line is the token)")
    elif env is not None:
        token = env.strip().encode()
        if not token:
            raise ConfigError(f"{ENV_ADMIN_TOKEN}: empty (unset it to turn admin writes off)")
    else:
        return None
    if not all(0x21 <= ch <= 0x7e for ch in token):
        raise ConfigError("admin token: printable ASCII without blanks (it travels in an Authorization header)")
    return token


def check_cidrs(values, key: str) -> tuple[str, ...]:
    out = []
    for v in values:
        try:
            out.append(str(network(str(v).strip())))     # ::ffff:10.0.0.0/104 is shown as 10.0.0.0/8
        except ValueError:
            raise ConfigError(f"{key}: not an address or CIDR: {v!r}") from None
    return tuple(out)


# ------------------------------------------------------------------------------------------- TOML

# The one table of settings: file key -> (Config field, kind). A kind is a Num range (every number is
# checked here: finite, in range, NaN/inf/negative refused with the key named), or "s" string, "b" bool,
# "hostport", "list", "table", "onoff" (true/false in the file, on|off too: nginx's spelling). The numeric
# and on|off flags take their kind from this table too (_FLAG_KINDS).
_TOP = {"listen": "hostport", "admin": "hostport", "strategy": "s", "demo": "b", "access_log": "s",
        "access_log_format": "s", "sticky": "b"}
_SECTIONS = {
    # `admin = "HOST:PORT"` at the top, or an [admin] table (TOML cannot have both under one name)
    "admin": {"listen": ("admin", "hostport"), "token_file": ("admin_token_file", "s"),
              "allowed_hosts": ("admin_allowed_hosts", "list")},
    "health": {"path": ("health_path", "s"), "interval": ("health_interval", SECONDS),
               "timeout": ("health_timeout", SECONDS),
               "unhealthy_threshold": ("unhealthy_threshold", STREAK),
               "healthy_threshold": ("healthy_threshold", STREAK),
               "eject_after": ("eject_after", Num(True, 0, 1000)), "eject_for": ("eject_for", SECONDS),
               "max_ejected_percent": ("max_ejected_percent", PERCENT), "slow_start": ("slow_start", SECONDS0)},
    "upstream": {"connect_timeout": ("connect_timeout", SECONDS), "read_timeout": ("read_timeout", SECONDS),
                 "response_timeout": ("response_timeout", SECONDS),
                 "pool_maxsize": ("pool_maxsize", Num(True, 1, 100_000)),
                 "pool_timeout": ("pool_timeout", SECONDS), "pool_idle_timeout": ("pool_idle_timeout", SECONDS0),
                 "no_pool": ("no_pool", "b"), "ca_file": ("ca_file", "s"), "retries": ("retries", Num(True, 0, 100)),
                 "retry_budget_percent": ("retry_budget_percent", PERCENT),
                 "retry_budget_min": ("retry_budget_min", Num(True, 0, 100_000)),
                 "max_requests": ("max_requests", Num(True, 0, 10_000_000)),
                 "max_pending": ("max_pending", Num(True, 0, 10_000_000)),
                 "resolver": ("resolver", "s"), "resolve_interval": ("resolve_interval", SECONDS),
                 "retry_on": ("retry_on", "retryon"), "per_try_timeout": ("per_try_timeout", SECONDS0),
                 "proxy_buffering": ("proxy_buffering", "onoff"),
                 "max_temp_file_size": ("max_temp_file_size", Num(True, 0, 2 ** 50))},
    "server": {"workers": ("workers", Num(True, 1, 256)), "cpu_affinity": ("cpu_affinity", "s"),
               "drain_timeout": ("drain_timeout", SECONDS0), "grace": ("grace", SECONDS0),
               "max_connections": ("max_connections", Num(True, 1, 1_000_000)),
               "running_threads": ("running_threads", Num(True, 0, 100_000)),
               "header_timeout": ("header_timeout", SECONDS), "body_timeout": ("body_timeout", SECONDS),
               "keepalive_timeout": ("keepalive_timeout", SECONDS),
               "body_min_rate": ("body_min_rate", Num(False, 1.0, 1e12, zero=True)), "send_timeout": ("send_timeout", SECONDS),
               "max_body_size": ("max_body_size", Num(True, 1, 2 ** 40)),
               "tunnel_idle_timeout": ("tunnel_idle_timeout", SECONDS), "upgrades": ("upgrades", "list"),
               "request_id_response": ("request_id_response", "b"),
               "allow_underscores": ("allow_underscores", "b"),
               "request_buffering": ("request_buffering", "onoff"),
               "buffer_memory": ("buffer_memory", Num(True, 0, 2 ** 44)), "temp_dir": ("temp_dir", "s"),
               "log_redact_params": ("log_redact_params", "list")},
    "tls": {"cert": ("tls_cert", "s"), "key": ("tls_key", "s"), "ciphers": ("tls_ciphers", "s"),
            "min_version": ("tls_min_version", "s"), "certificates": ("tls_certificates", "certs"),
            "strict_sni": ("tls_strict_sni", "b"), "client_ca": ("tls_client_ca", "s"),
            "client_auth": ("tls_client_auth", "s"), "client_crl": ("tls_client_crl", "s")},
    "limits": {"default": ("limit", "s"), "algorithm": ("algorithm", "s"), "store": ("store", "s"),
               "redis_timeout": ("redis_timeout", SECONDS), "on_store_error": ("on_store_error", "s"),
               "redis_password_file": ("redis_password_file", "s"), "redis_ca_file": ("redis_ca_file", "s"),
               "redis_cert_file": ("redis_cert_file", "s"), "redis_key_file": ("redis_key_file", "s"),
               "trusted_proxies": ("trusted_proxies", "list"), "keys": ("key_limits", "table"),
               "api_keys_file": ("api_keys_file", "s"), "unknown_keys": ("unknown_keys", "s"),
               "exempt": ("exempt", "list"), "ietf_headers": ("ietf_headers", "b"),
               "tiers": ("tiers", "table"), "max_keys": ("max_keys", Num(True, 1, 100_000_000)),
               "ipv6_prefix": ("ipv6_prefix", Num(True, 0, 128)),
               "max_delay": ("max_delay", Num(False, MS, 60.0, zero=True)),
               "max_delayed": ("max_delayed", Num(True, 1, 100_000)),
               "max_in_flight": ("max_in_flight", Num(True, 0, 1_000_000)),
               "status": ("limit_status", Num(True, 400, 599))},
}


def _typed(value, kind: str, key: str):
    if isinstance(kind, Num):
        return _number(value, key, kind)
    if kind == "onoff" and isinstance(value, str) and value.lower() in ("on", "off"):
        return value.lower() == "on"
    if kind == "onoff":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected on or off (true or false), got {value!r}")
        return value
    if kind == "b":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if kind == "s":
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if kind == "hostport":
        return parse_hostport(value, key)
    if kind == "retryon":     # "connect,503" or ["connect", "503"]
        if not isinstance(value, (str, list)):
            raise ConfigError(f"{key}: expected a list of conditions, got {value!r}")
        try:
            return parse_conditions(value)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
    if kind == "list":
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return tuple(value)
    if kind == "certs":       # [[tls.certificates]]: an array of tables inside [tls]
        if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
            raise ConfigError(f"{key}: expected [[tls.certificates]] tables with cert and key")
        specs = []
        for i, t in enumerate(value):
            unknown = set(t) - {"cert", "key"}
            if unknown:
                raise ConfigError(f"{key}[{i}]: unknown key {sorted(unknown)[0]!r} (known: cert, key)")
            for k in ("cert", "key"):
                if not isinstance(t.get(k), str) or not t[k]:
                    raise ConfigError(f"{key}[{i}]: missing {k} (a PEM file path)")
            specs.append(CertSpec(t["cert"], t["key"]))
        return tuple(specs)
    if kind == "table":
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"{key}: expected a table of \"key\" = \"N/PERIOD\", got {value!r}")
        return tuple(value.items())
    raise AssertionError(kind)


def read_file(path: str, problems: list[str]) -> dict:
    """The TOML file as Config field values (not yet cross-validated); problems collects every bad key."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        problems.append(f"--config {path}: {e.strerror}")
        return {}
    except tomllib.TOMLDecodeError as e:
        problems.append(f"--config {path}: not valid TOML: {e}")
        return {}
    except UnicodeDecodeError as e:        # tomllib decodes the whole file first: a binary or Latin-1 file
        problems.append(f"--config {path}: not valid TOML: not UTF-8 (byte {e.start})")
        return {}
    except RecursionError:                 # tomllib parses nested arrays/tables recursively
        problems.append(f"--config {path}: not valid TOML: nested too deeply")
        return {}
    out: dict = {}
    for key, value in doc.items():
        try:
            if key == "backends":
                if not isinstance(value, list) or not all(isinstance(b, dict) for b in value):
                    raise ConfigError("backends: expected [[backends]] tables with url and weight")
                specs = []
                for i, b in enumerate(value):
                    unknown = set(b) - {"url", "weight"}
                    if unknown:
                        raise ConfigError(f"backends[{i}]: unknown key {sorted(unknown)[0]!r} (known: url, weight)")
                    if "url" not in b:
                        raise ConfigError(f"backends[{i}]: missing url")
                    specs.append(parse_backend_url(b["url"], b.get("weight", 1), f"backends[{i}]"))
                out["backends"] = tuple(specs)
            elif key == "rules":
                from lb.limiting.rules import parse_rules
                try:
                    out["rules"] = parse_rules(value)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
            elif key == "keys":
                out["keys"] = value          # parsed in load(), once the tiers are known
            elif key in _TOP and not (key in _SECTIONS and isinstance(value, dict)):
                out[key] = _typed(value, _TOP[key], key)
            elif key in _SECTIONS:
                if not isinstance(value, dict):
                    raise ConfigError(f"{key}: expected a [{key}] table")
                for sub, v in value.items():
                    try:
                        if sub not in _SECTIONS[key]:
                            known = ", ".join(_SECTIONS[key])
                            raise ConfigError(f"{key}.{sub}: unknown key (known in [{key}]: {known})")
                        name, kind = _SECTIONS[key][sub]
                        out[name] = _typed(v, kind, f"{key}.{sub}")
                    except ConfigError as e:
                        problems.extend(e.problems)
            else:
                known = ", ".join(dict.fromkeys([*_TOP, "backends", "rules", "keys", *_SECTIONS]))
                raise ConfigError(f"{key}: unknown key (known at the top level: {known})")
        except ConfigError as e:
            problems.extend(e.problems)
    return out


# ------------------------------------------------------------------------------------------ flags

def build_argparser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edge.py", description="An L7 load balancer and rate limiter.",
                                argument_default=argparse.SUPPRESS)
    a = p.add_argument
    a("--config", help="TOML file; flags override it")
    a("--version", action="version", version=f"edge {__version__}")
    a("--listen", help="HOST:PORT to serve on (default 127.0.0.1:8080; port 0 picks a free one)")
    a("--backends", help="URL[=WEIGHT],... e.g. http://127.0.0.1:9001=3,http://127.0.0.1:9002")
    a("--strategy", help="round-robin | weighted (default; equal weights = round robin) | least-request")
    a("--sticky", action="store_true", help="sticky sessions: a route cookie pins a client to a backend")
    a("--health-path", help="default /health (2xx = pass)")
    a("--health-interval", help="seconds between probes (default 10)")
    a("--health-timeout", help="probe timeout (default: 80%% of the interval, at most 2 s)")
    a("--unhealthy-threshold", help="consecutive failures -> out of rotation (default 2)")
    a("--healthy-threshold", help="consecutive passes -> back in rotation (default 2)")
    a("--eject-after", help="consecutive connect failures, timeouts or 5xx that eject a backend "
                            "(default 5; 0 off)")
    a("--eject-for", help="seconds a backend stays ejected, times the number of its ejections (default 30)")
    a("--max-ejected-percent", help="most of the pool ejected at once, percent (default 50)")
    a("--slow-start", help="seconds over which a (re)joining backend ramps up to its weight (default 0: off)")
    a("--connect-timeout", help="seconds to connect to a backend (default 2)")
    a("--read-timeout", help="seconds a backend may stay silent (default 30) -> 504")
    a("--response-timeout", help="seconds for a whole response (default 300)")
    a("--pool-maxsize", help="connections per backend, a hard cap (default 64)")
    a("--pool-timeout", help="seconds to wait for a free backend connection (default 1) -> 503")
    a("--pool-idle-timeout", help="seconds a pooled connection may idle before it is discarded (default 30)")
    a("--proxy-buffering", help="on (default): read a response ahead of a slow client (memory, then a temp "
                                "file) so the backend connection is freed when the backend is done | off: "
                                "the backend waits on the client")
    a("--max-temp-file-size", help="bytes of one buffered response on disk (default 1073741824; 0: memory "
                                   "only); past it the rest streams")
    a("--no-pool", action="store_true", help="a new TCP connection per request (to measure the win)")
    a("--retries", help="retries of a connect failure on other backends (default 2; 0 off)")
    a("--retry-budget-percent", help="retries in flight at most this %% of active requests (default 20)")
    a("--retry-budget-min", help="retries in flight always allowed, whatever the budget (default 10)")
    a("--max-requests", help="circuit breaker: requests in flight to the pool, past it a 503 at once (default 0: off)")
    a("--max-pending", help="requests waiting for a pooled connection, past it a 503 at once (default 0: unlimited)")
    a("--resolver", help="DNS-named backends: every address a backend's name resolves to is a backend; "
                         "HOST:PORT of a DNS server, or 'system' (getaddrinfo). Default: off (a name is one backend)")
    a("--resolve-interval", help="seconds between re-resolutions of DNS-named backends (default 30, or the records' TTL)")
    a("--retry-on", help="failed tries retried on another backend: connect,reset,timeout,5xx,502,503,504 "
                         "(default connect; all but connect: idempotent methods with a buffered body only)")
    a("--per-try-timeout", help="seconds one try waits for its response head (default 0: read timeout only)")
    a("--workers", help="processes sharing the listening port (default 1); with the memory store they "
                        "share their limits in shared memory")
    a("--takeover", action="store_true", help="start beside a running edge on the same --listen and --admin "
                                              "ports (a zero-downtime upgrade: then TERM the old one); without "
                                              "it, a port another edge serves refuses the start")
    a("--cpu-affinity", help="auto (default: each process pinned to one CPU) | off | CPU list, e.g. 0,1")
    a("--drain-timeout", help="seconds in-flight requests may take to finish after SIGTERM (default 30)")
    a("--grace", help="seconds between SIGTERM (/readyz fails at once) and closing the listener (default 0)")
    a("--max-connections", help="concurrent client connections (default 1024); at the cap the longest-idle "
                                "keep-alive one is closed for a new one")
    a("--running-threads", help="connection threads doing work at once, e.g. 32 for hundreds of connections "
                                "(default 0: no bound); the others wait in arrival order, out of the GIL's "
                                "crowd (a thread blocked elsewhere over 50 ms gives its place up)")
    a("--allow-underscores", action="store_true",
      help="forward request header names containing '_' (default: dropped, as nginx does)")
    a("--header-timeout", help="seconds to receive a request head (default 10) -> 408")
    a("--body-timeout", help="seconds between reads of a request body (default 30) -> 408")
    a("--body-min-rate", help="bytes/s a request body must average beyond --body-timeout (default 8192; "
                              "0 off) -> 408")
    a("--send-timeout", help="seconds a client may take to accept each write of a response (default 60)")
    a("--keepalive-timeout", help="seconds an idle client connection is kept (default 75)")
    a("--max-body-size", help="bytes (default 10485760) -> 413")
    a("--request-buffering", help="on (default): a request body is read whole (memory, then a temp file) "
                                  "before a backend connection is taken | off: bodies over 64 KiB stream")
    a("--buffer-memory", help="bytes all request and response buffers may hold in memory together "
                              "(default 67108864); past it they go to temp files")
    a("--temp-dir", help="directory of the buffers' temp files (default: the system temp dir)")
    a("--tls-cert", help="PEM certificate (chain) file: the listener speaks HTTPS (with --tls-key)")
    a("--tls-key", help="PEM private key file for --tls-cert")
    a("--tls-min-version", help="TLSv1.2 (default) | TLSv1.3")
    a("--tls-ciphers", help="OpenSSL cipher list for TLS 1.2 (default: Python's secure defaults)")
    a("--tls-client-ca", help="PEM CA file: mutual TLS, clients must present a certificate it signed "
                              "([tls] client_auth = \"optional\" to serve clients without one)")
    a("--ca-file", help="PEM CA bundle that https:// backends are verified against (default: system CAs)")
    a("--tunnel-idle-timeout", help="seconds an upgraded (WebSocket) connection may be silent both ways "
                                    "(default 300)")
    a("--upgrades", help="Upgrade protocols tunnelled to backends, comma separated (default websocket; "
                         "'' for none)")
    a("--limit", help="N/PERIOD for every key, e.g. 100/s, 600/m, 50/10s (default: no limiting)")
    a("--key-limit", action="append", help="key:NAME=N/PERIOD or ip:ADDRESS=N/PERIOD override, repeatable "
                                           "(a bare address is an ip:, anything else a key:)")
    a("--algorithm", help="token-bucket (default) | fixed-window | sliding-log | sliding-counter")
    a("--store", help="memory (default) | redis://[USER:PASS@]HOST:PORT/DB | rediss://... (TLS) | "
                      "redis+unix:///PATH.sock[?db=N] | redis-sentinel://H:P,.../MASTER | redis-cluster://H:P,... "
                      "(the password: better in env EDGE_REDIS_PASSWORD or [limits] redis_password_file)")
    a("--redis-timeout", help="seconds per Redis call before --on-store-error applies (default 0.05)")
    a("--on-store-error", help="fail-open (default: allow) | fail-closed (503) | local (in-process limiter)")
    a("--ipv6-prefix", help="IPv6 clients are limited per prefix of this length (default 64; 0 or 128: "
                            "per address)")
    a("--max-delay", help="seconds an over-limit request may be held (its slot reserved) instead of refused "
                          "(default 0: off; nginx's limit_req delay); every store and algorithm")
    a("--max-in-flight", help="concurrent requests per client identity (default 0: off; nginx's limit_conn) "
                              "-> 429 with Retry-After: 1")
    a("--limit-status", help="status of a rate-limit rejection (default 429; e.g. 503): "
                             + ", ".join(map(str, sorted(REJECT_STATUSES))))
    a("--trusted-proxies", help="CIDR,... whose X-Forwarded-For is believed (default none)")
    a("--admin", help="HOST:PORT for /metrics and /status (default off)")
    a("--request-id-response", action="store_true",
      help="send the request id (X-Request-Id) back on every response, replacing a backend's own (default "
           "off: it goes to the backend and the access log only)")
    a("--access-log", help="file path, or - for stderr (default off)")
    a("--access-log-format", help="text (default) | json: one JSON object per line")
    a("--check", action="store_true", help="validate the configuration, print one line per problem, "
                                           "exit 0 or 2; starts nothing")
    a("--demo", action="store_true", help="start three built-in identity backends and balance over them")
    return p


# Numeric flags take the kind their TOML key has: one table, no twin to keep in step.
_FLAG_KINDS = {name: kind for section in _SECTIONS.values() for name, kind in section.values()
               if isinstance(kind, Num) or kind == "onoff"}


def _from_flags(ns: argparse.Namespace, problems: list[str]) -> dict:
    out: dict = {}
    for name, value in vars(ns).items():
        flag = "--" + name.replace("_", "-")
        if name == "config":
            continue
        try:
            if name in ("listen", "admin"):
                out[name] = parse_hostport(value, flag)
            elif name == "backends":
                out[name] = parse_backends_flag(value)
            elif name in _FLAG_KINDS:
                out[name] = _typed(value, _FLAG_KINDS[name], flag)
            elif name == "key_limit":
                pairs = []
                for item in value:
                    k, sep, rate = item.rpartition("=")
                    if not sep or not k:
                        raise ConfigError(f"--key-limit: expected KEY=N/PERIOD, got {item!r}")
                    pairs.append((k, rate))
                out["key_limits"] = tuple(pairs)
            elif name == "retry_on":
                out[name] = _typed(value, "retryon", flag)
            elif name in ("trusted_proxies", "upgrades"):
                out[name] = tuple(x for x in value.split(",") if x.strip())
            else:
                out[name] = value
        except ConfigError as e:
            problems.extend(e.problems)
    return out


def _values_may_start_with_dash(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--limit -5/s` -> `--limit=-5/s`: argparse would take -5/s for an option and say "expected one
    argument"; as a value it gets the clear range error from the table instead."""
    takes_value = {o for a in parser._actions if a.option_strings and a.nargs is None for o in a.option_strings}
    known = {o for a in parser._actions for o in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if tok in takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and argv[i + 1].split("=", 1)[0] not in known:
            out.append(f"{tok}={argv[i + 1]}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def load(argv: list[str] | None = None) -> Config:
    """Flags over file over defaults, then the checks that span several keys. Raises ConfigError with
    every problem found (one line each), not only the first."""
    parser = build_argparser()
    ns = parser.parse_args(_values_may_start_with_dash(list(sys.argv[1:] if argv is None else argv), parser))
    problems: list[str] = []
    values: dict = {}
    path = getattr(ns, "config", None)
    if path:
        values.update(read_file(path, problems))
    values.update(_from_flags(ns, problems))
    try:
        values["keys"] = _known_keys(values)
    except ConfigError as e:
        problems.extend(e.problems)
        values.pop("keys", None)
    cfg = replace(Config(), config_path=path, **values)
    later = validate(cfg)
    # not "none configured" as well when the backends (or the whole file) could not be read
    if any(p.startswith(("--backends", "backends", "--config")) for p in problems):
        later = [p for p in later if not p.startswith("backends: none configured")]
    problems += later
    if problems:
        raise ConfigError(*problems)
    return replace(cfg, upgrades=check_upgrades(cfg.upgrades))   # normalised (lower case, a set)


def check_upgrades(values) -> frozenset:
    out = set()
    for v in values:
        t = str(v).strip().lower() if isinstance(v, str) else None
        if not t or not t.isascii() or t.encode().translate(None, _TOKEN_CHARS):
            raise ConfigError(f"server.upgrades: not a protocol name: {v!r} (e.g. \"websocket\")")
        out.add(t)
    return frozenset(out)


_TOKEN_CHARS = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"


def check_tls(c: Config) -> None:
    if bool(c.tls_cert) != bool(c.tls_key):
        raise ConfigError("tls: cert and key go together (--tls-cert FILE --tls-key FILE)")
    from lb.http.tls import CLIENT_AUTH, MIN_VERSIONS
    if c.tls_min_version not in MIN_VERSIONS:
        raise ConfigError(f"tls.min_version: {c.tls_min_version!r} is not one of {', '.join(MIN_VERSIONS)} "
                          f"(TLS 1.0 and 1.1 are not offered)")
    if c.tls_client_auth not in CLIENT_AUTH:
        raise ConfigError(f"tls.client_auth: {c.tls_client_auth!r} is not one of {', '.join(CLIENT_AUTH)}")
    if not c.tls_cert and (c.tls_certificates or c.tls_client_ca or c.tls_strict_sni):
        raise ConfigError("tls: certificates, strict_sni and client_ca need the default certificate "
                          "(--tls-cert/--tls-key, [tls] cert/key)")
    if c.tls_client_auth != "require" and not c.tls_client_ca:
        raise ConfigError("tls.client_auth: needs tls.client_ca (the CA client certificates are checked against)")
    if c.tls_client_crl and not c.tls_client_ca:
        raise ConfigError("tls.client_crl: needs tls.client_ca (the CA whose revocations it lists)")
    if c.tls_cert:
        tls_listener(c)          # every pair must load, and the client CA and CRL must be usable
    if c.ca_file:
        import ssl
        try:
            ssl.create_default_context(cafile=c.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"upstream.ca_file: cannot use {c.ca_file}: {getattr(e, 'strerror', None) or e}") from None


def tls_listener(c: Config):
    """The listener's SSLContext for this configuration, read from disk (ConfigError when it cannot serve)."""
    from lb.http.tls import listener_context
    return listener_context(CertSpec(c.tls_cert, c.tls_key), c.tls_certificates, c.tls_strict_sni,
                            ciphers=c.tls_ciphers, min_version=c.tls_min_version, client_ca=c.tls_client_ca,
                            client_auth=c.tls_client_auth, client_crl=c.tls_client_crl)


def _known_keys(values: dict) -> tuple:
    """[[keys]] tables, then the api_keys_file's (read now: a reload re-reads it)."""
    from lb.limiting.keys import check_unique, parse_keys, parse_tiers, read_keys_file
    try:
        tiers = parse_tiers(dict(values.get("tiers", ())), "limits.tiers")
        keys = parse_keys(values.get("keys", []), tiers, "keys")
        if values.get("api_keys_file"):
            keys += read_keys_file(values["api_keys_file"], tiers)
        check_unique(keys)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return keys


def _is_ip(host: str) -> bool:
    from lb.upstream.resolve import is_address
    return is_address(host)


def validate(c: Config) -> list[str]:
    """Checks across keys; every problem found, one line each."""
    bad: list[str] = []

    def check(fn, *args):
        try:
            fn(*args)
        except ConfigError as e:
            bad.extend(e.problems)

    if c.strategy not in STRATEGIES:
        bad.append(f"strategy: {c.strategy!r} is not one of {', '.join(STRATEGIES)}")
    if c.algorithm not in ALGORITHMS:
        bad.append(f"algorithm: {c.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    if not all(isinstance(n, str) and n and n.isprintable() and not set(n) & set("&=? ") for n in c.log_redact_params):
        bad.append(f"server.log_redact_params: expected a list of query parameter names, got {list(c.log_redact_params)!r}")
    if c.access_log_format not in ACCESS_LOG_FORMATS:
        bad.append(f"access_log_format: {c.access_log_format!r} is not one of {', '.join(ACCESS_LOG_FORMATS)}")
    if not c.backends and not c.demo:
        bad.append("backends: none configured (use --backends URL,... or [[backends]], or --demo)")
    if c.resolver is not None and c.resolver != "system":
        parts = split_hostport(c.resolver)
        if parts is None or not parts[1].isdigit() or not 0 < int(parts[1]) <= 65535 or not _is_ip(parts[0]):
            bad.append(f"upstream.resolver: expected \"system\" or IP:PORT of a DNS server (e.g. \"127.0.0.1:53\"), "
                       f"got {c.resolver!r}")
    seen = set()
    for b in c.backends:
        if b.url in seen:
            bad.append(f"backends: {b.url} is listed twice")
        seen.add(b.url)
    if not c.health_path.startswith("/"):
        bad.append(f"health.path: must start with '/', got {c.health_path!r}")
    if c.health_timeout is not None and c.health_timeout >= c.health_interval:
        bad.append(f"health.timeout: must be shorter than the interval ({c.health_interval:g}), "
                   f"got {c.health_timeout:g}")
    if c.limit is not None:
        check(check_rate, c.limit, "limits.default")
    for k, rate in c.key_limits:
        check(check_rate, rate, f"limits.keys.{k}")
    if c.key_limits and c.limit is None:
        bad.append("limits.keys: per-key limits need a default limit (--limit / limits.default)")
    if c.store != "memory":
        try:
            logs.hide(redis_url.parse(c.store, **redis_files(c)).password)  # one line, never the password
        except ValueError as e:
            bad.append(str(e) if str(e).startswith(("store", "redis_", "the Redis")) else f"store: {e}")
    elif any(redis_files(c).values()):
        bad.append("limits.redis_*_file: only apply to a Redis store (limits.store)")
    if c.on_store_error not in STORE_ERROR_POLICIES:
        bad.append(f"limits.on_store_error: {c.on_store_error!r} is not one of {', '.join(STORE_ERROR_POLICIES)}")
    check(check_cidrs, c.trusted_proxies, "trusted_proxies")
    check(_validate_limits, c)
    check(_validate_shaping, c)
    # workers > 1 with the memory store: the workers share one table in shared memory (limiter.shm)
    if c.cpu_affinity not in ("auto", "off"):
        try:
            cpus = [int(x) for x in c.cpu_affinity.split(",")]
            if not cpus or min(cpus) < 0:
                raise ValueError
        except ValueError:
            bad.append(f"cpu_affinity: expected auto, off or a list of CPU numbers like 0,1; got {c.cpu_affinity!r}")
    check(check_tls, c)
    check(check_upgrades, c.upgrades)
    check(admin_token, c)
    for h in c.admin_allowed_hosts:
        if not isinstance(h, str) or not h or any(ch in h for ch in " /:@[]"):
            bad.append(f"admin.allowed_hosts: expected host names like \"edge-1.example.internal\", got {h!r}")
    if c.temp_dir is not None and not (os.path.isdir(c.temp_dir) and os.access(c.temp_dir, os.W_OK | os.X_OK)):
        bad.append(f"server.temp_dir: not a writable directory: {c.temp_dir!r}")
    if c.workers > 1 and c.demo:
        bad.append("workers: --demo runs its backends inside the edge; use --workers 1 with --demo")
    return bad


def _validate_shaping(c: Config) -> None:
    """Delay mode, costs, in-flight limits and the rejection status: where each can be exact."""
    if c.limit_status not in REJECT_STATUSES:
        raise ConfigError(f"limits.status: {c.limit_status} is not one of {', '.join(map(str, sorted(REJECT_STATUSES)))}")


def _validate_limits(c: Config) -> None:
    """Rules, known keys, overrides and the allowlist: each entry names its kind and makes sense."""
    from lb.limiting.identity import kind_name
    if c.unknown_keys not in UNKNOWN_KEYS:
        raise ConfigError(f"limits.unknown_keys: {c.unknown_keys!r} is not one of {', '.join(UNKNOWN_KEYS)}")
    names = {k.name for k in c.keys}
    seen: dict[str, tuple[str, str]] = {}
    for k, rate in c.key_limits:
        try:
            ident = kind_name(k, c.ipv6_prefix)
        except ValueError as e:
            raise ConfigError(f"limits.keys: {k!r}: {e}") from None
        if ident in seen:        # the last would silently win: the operator meant one of them
            raise ConfigError(f"limits.keys: {seen[ident][0]!r}={seen[ident][1]} and {k!r}={rate} both set {ident}'s "
                              f"limit (--key-limit / [limits.keys]); keep one")
        seen[ident] = (k, rate)
        if c.keys and ident.startswith("key:") and ident[4:] not in names:
            raise ConfigError(f"limits.keys: {k!r}: with known keys, an override names a key in [[keys]] "
                              f"or api_keys_file (known: {', '.join(sorted(names))})")
    for e in c.exempt:
        if not isinstance(e, str):
            raise ConfigError(f"limits.exempt: expected strings like \"10.0.0.0/8\" or \"key:NAME\", got {e!r}")
        if e.startswith("key:"):
            if e[4:] not in names:
                raise ConfigError(f"limits.exempt: {e!r} is not a known key (exempt keys must be listed in "
                                  f"[[keys]] or api_keys_file, or anyone could claim the name)")
        else:
            check_cidrs([e[3:] if e.startswith("ip:") else e], "limits.exempt")
    for r in c.rules:
        if r.limit is not None:
            check_rate(r.limit, f"rules ({r.name}).limit")
