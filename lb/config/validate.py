"""The checks a value cannot make alone: across keys (cert goes with key, health.timeout shorter than the
interval, overrides name known keys, ...), against the environment (the admin token, the TLS files load),
and the words a setting takes (its `choices` in lb/config/schema.py). Every problem found, one line each.
"""

from __future__ import annotations

import os

from lb import logs
from lb.config.schema import REJECT_STATUSES, SETTINGS, Config
from lb.errors import ConfigError
from lb.http.tls import CertSpec
from lb.limiting.store import redis_files  # noqa: F401  (load.py's door)
from lb.netaddr import network, split_hostport
from limiter.redis import url as redis_url


def check_rate(value: str, key: str) -> str:
    from limiter import parse_rate  # the limiter owns the N/PERIOD grammar

    if str(value).lstrip().startswith("-"):
        raise ConfigError(f"{key}: N in N/PERIOD must be a whole number >= 1, got {value!r}")
    try:
        parse_rate(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    return value


ENV_ADMIN_TOKEN = "EDGE_ADMIN_TOKEN"


def admin_token(c: "Config") -> bytes | None:
    """The token admin writes need: env EDGE_ADMIN_TOKEN or the first line of [admin] token_file (one
    source, as for the Redis password: two would leave an operator guessing which one is in force).
    None: writes are off. Raises ConfigError."""
    env = os.environ.get(ENV_ADMIN_TOKEN)
    if env is not None and c.admin_token_file:
        raise ConfigError(f"admin.token_file: set it or the environment variable {ENV_ADMIN_TOKEN}, not both")
    if c.admin_token_file:
        path = os.path.expandvars(c.admin_token_file)  # ${CREDENTIALS_DIRECTORY}
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
    if not all(0x21 <= ch <= 0x7E for ch in token):
        raise ConfigError("admin token: printable ASCII without blanks (it travels in an Authorization header)")
    return token


def check_cidrs(values, key: str) -> tuple[str, ...]:
    out = []
    for v in values:
        try:
            out.append(str(network(str(v).strip())))  # ::ffff:10.0.0.0/104 is shown as 10.0.0.0/8
        except ValueError:
            raise ConfigError(f"{key}: not an address or CIDR: {v!r}") from None
    return tuple(out)


def check_upgrades(values) -> frozenset:
    out = set()
    for v in values:
        t = str(v).strip().lower() if isinstance(v, str) else None
        if not t or not t.isascii() or t.encode().translate(None, _TOKEN_CHARS):
            raise ConfigError(f'server.upgrades: not a protocol name: {v!r} (e.g. "websocket")')
        out.add(t)
    return frozenset(out)


_TOKEN_CHARS = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"


def check_tls(c: Config) -> None:
    if bool(c.tls_cert) != bool(c.tls_key):
        raise ConfigError("tls: cert and key go together (--tls-cert FILE --tls-key FILE)")
    from lb.http.tls import CLIENT_AUTH, MIN_VERSIONS

    if c.tls_min_version not in MIN_VERSIONS:
        raise ConfigError(
            f"tls.min_version: {c.tls_min_version!r} is not one of {', '.join(MIN_VERSIONS)} "
            f"(TLS 1.0 and 1.1 are not offered)"
        )
    if c.tls_client_auth not in CLIENT_AUTH:
        raise ConfigError(f"tls.client_auth: {c.tls_client_auth!r} is not one of {', '.join(CLIENT_AUTH)}")
    if not c.tls_cert and (c.tls_certificates or c.tls_client_ca or c.tls_strict_sni):
        raise ConfigError(
            "tls: certificates, strict_sni and client_ca need the default certificate "
            "(--tls-cert/--tls-key, [tls] cert/key)"
        )
    if c.tls_client_auth != "require" and not c.tls_client_ca:
        raise ConfigError("tls.client_auth: needs tls.client_ca (the CA client certificates are checked against)")
    if c.tls_client_crl and not c.tls_client_ca:
        raise ConfigError("tls.client_crl: needs tls.client_ca (the CA whose revocations it lists)")
    if c.tls_cert:
        tls_listener(c)  # every pair must load, and the client CA and CRL must be usable
    if c.ca_file:
        import ssl

        try:
            ssl.create_default_context(cafile=c.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"upstream.ca_file: cannot use {c.ca_file}: {getattr(e, 'strerror', None) or e}"
            ) from None


def tls_listener(c: Config):
    """The listener's SSLContext for this configuration, read from disk (ConfigError when it cannot serve)."""
    from lb.http.tls import listener_context

    assert c.tls_cert is not None and c.tls_key is not None  # called with [tls] cert set; validate() pairs the key
    return listener_context(
        CertSpec(c.tls_cert, c.tls_key),
        c.tls_certificates,
        c.tls_strict_sni,
        ciphers=c.tls_ciphers,
        min_version=c.tls_min_version,
        client_ca=c.tls_client_ca,
        client_auth=c.tls_client_auth,
        client_crl=c.tls_client_crl,
        http2=c.http2,
    )


def _is_ip(host: str) -> bool:
    from lb.upstream.resolve import is_address

    return is_address(host)


def choice_problems(c: Config) -> list[str]:
    """A setting with `choices` holds one of them (checked once flags and file are merged)."""
    out = []
    for s in SETTINGS:
        value = getattr(c, s.name)
        if s.choices and value not in s.choices:
            out.append(f"{s.label or s.toml[0]}: {value!r} is not one of {', '.join(s.choices)}")
    return out


def validate(c: Config) -> list[str]:
    """Checks across keys; every problem found, one line each."""
    bad: list[str] = []

    def check(fn, *args):
        try:
            fn(*args)
        except ConfigError as e:
            bad.extend(e.problems)

    bad += choice_problems(c)
    if not all(isinstance(n, str) and n and n.isprintable() and not set(n) & set("&=? ") for n in c.log_redact_params):
        bad.append(
            f"server.log_redact_params: expected a list of query parameter names, got {list(c.log_redact_params)!r}"
        )
    if not c.backends and not c.demo:
        bad.append("backends: none configured (use --backends URL,... or [[backends]], or --demo)")
    if c.resolver is not None and c.resolver != "system":
        parts = split_hostport(c.resolver)
        if parts is None or not parts[1].isdigit() or not 0 < int(parts[1]) <= 65535 or not _is_ip(parts[0]):
            bad.append(
                f'upstream.resolver: expected "system" or IP:PORT of a DNS server (e.g. "127.0.0.1:53"), '
                f"got {c.resolver!r}"
            )
    seen = set()
    for b in c.backends:
        if b.url in seen:
            bad.append(f"backends: {b.url} is listed twice")
        seen.add(b.url)
    if not c.health_path.startswith("/"):
        bad.append(f"health.path: must start with '/', got {c.health_path!r}")
    if c.health_timeout is not None and c.health_timeout >= c.health_interval:
        bad.append(
            f"health.timeout: must be shorter than the interval ({c.health_interval:g}), got {c.health_timeout:g}"
        )
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
            bad.append(f'admin.allowed_hosts: expected host names like "edge-1.example.internal", got {h!r}')
    if c.temp_dir is not None and not (os.path.isdir(c.temp_dir) and os.access(c.temp_dir, os.W_OK | os.X_OK)):
        bad.append(f"server.temp_dir: not a writable directory: {c.temp_dir!r}")
    if c.workers > 1 and c.demo:
        bad.append("workers: --demo runs its backends inside the edge; use --workers 1 with --demo")
    if c.pools or c.routes or any(getattr(r, "route", None) for r in c.rules):
        from lb.config import routes  # [[pools]], [[routes]] and a rule's match.route, across tables

        bad += routes.validate(c)
    return bad


def _validate_shaping(c: Config) -> None:
    """Delay mode, costs, in-flight limits and the rejection status: where each can be exact."""
    if c.limit_status not in REJECT_STATUSES:
        raise ConfigError(
            f"limits.status: {c.limit_status} is not one of {', '.join(map(str, sorted(REJECT_STATUSES)))}"
        )


def _validate_limits(c: Config) -> None:
    """Rules, known keys, overrides and the allowlist: each entry names its kind and makes sense."""
    from lb.limiting.identity import kind_name

    names = {k.name for k in c.keys}
    seen: dict[str, tuple[str, str]] = {}
    for k, rate in c.key_limits:
        try:
            ident = kind_name(k, c.ipv6_prefix)
        except ValueError as e:
            raise ConfigError(f"limits.keys: {k!r}: {e}") from None
        if ident in seen:  # the last would silently win: the operator meant one of them
            raise ConfigError(
                f"limits.keys: {seen[ident][0]!r}={seen[ident][1]} and {k!r}={rate} both set {ident}'s "
                f"limit (--key-limit / [limits.keys]); keep one"
            )
        seen[ident] = (k, rate)
        if c.keys and ident.startswith("key:") and ident[4:] not in names:
            raise ConfigError(
                f"limits.keys: {k!r}: with known keys, an override names a key in [[keys]] "
                f"or api_keys_file (known: {', '.join(sorted(names))})"
            )
    for entry in c.exempt:
        if not isinstance(entry, str):
            raise ConfigError(f'limits.exempt: expected strings like "10.0.0.0/8" or "key:NAME", got {entry!r}')
        if entry.startswith("key:"):
            if entry[4:] not in names:
                raise ConfigError(
                    f"limits.exempt: {entry!r} is not a known key (exempt keys must be listed in "
                    f"[[keys]] or api_keys_file, or anyone could claim the name)"
                )
        else:
            check_cidrs([entry[3:] if entry.startswith("ip:") else entry], "limits.exempt")
    for r in c.rules:
        if r.limit is not None:
            check_rate(r.limit, f"rules ({r.name}).limit")
