"""Store URLs: one parser for every Redis topology, and the one place the secret and the TLS files come in.

    redis://[USER[:PASSWORD]@]HOST:PORT[/DB]                        one Redis
    rediss://[USER[:PASSWORD]@]HOST:PORT[/DB]                       one Redis over TLS
    redis-sentinel://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...]/MASTER[/DB]
    redis-cluster://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...]      seed nodes (a cluster has db 0 only)
    redis+unix://[USER[:PASSWORD]@]/PATH/redis.sock[?db=N]          one Redis on this host, its unix socket
    unix://...                                                      the same (redis-py's spelling)

The password comes from exactly one of: the URL, `[limits] redis_password_file` (its first line), or the
environment variable EDGE_REDIS_PASSWORD.  Two sources are refused: silently preferring one would leave an
operator debugging the other.  With Sentinel the credentials are the master's (the sentinels are asked
without them).  A Target's repr and `display` never contain the password; nothing here logs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import unquote

SCHEMES = ("redis", "rediss", "redis-sentinel", "redis-cluster", "redis+unix", "unix")
ENV_PASSWORD = "EDGE_REDIS_PASSWORD"


@dataclass(frozen=True)
class Target:
    kind: str  # "single", "sentinel" or "cluster"
    hosts: tuple[tuple[str, int], ...]  # the server, the sentinels, or the cluster's seed nodes
    db: int = 0
    master: str | None = None  # sentinel: the monitored master's name
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    socket: str | None = None  # redis+unix://: the socket's path (hosts is empty)

    @property
    def display(self) -> str:
        """The URL without credentials: what logs, /status and errors may show."""
        if self.socket:
            return f"redis+unix://{self.socket}" + (f"?db={self.db}" if self.db else "")
        scheme = {
            "single": "rediss" if self.tls else "redis",
            "sentinel": "redis-sentinel",
            "cluster": "redis-cluster",
        }[self.kind]
        hosts = ",".join(f"{_host(h)}:{p}" for h, p in self.hosts)
        if self.kind == "sentinel":
            return f"{scheme}://{hosts}/{self.master}" + (f"/{self.db}" if self.db else "")
        if self.kind == "cluster":
            return f"{scheme}://{hosts}"
        return f"{scheme}://{hosts}/{self.db}"

    def connection_kwargs(self, host: str | None, port: int | None) -> dict:
        """redis-py Connection / SSLConnection keyword arguments for one server of this target (a unix
        socket's target has no host nor port)."""
        if self.socket:
            return dict(path=self.socket, db=self.db, username=self.username, password=self.password)
        kw = dict(host=host, port=port, db=self.db, username=self.username, password=self.password)
        if self.tls:
            kw.update(
                ssl_ca_certs=self.ca_file,
                ssl_certfile=self.cert_file,
                ssl_keyfile=self.key_file,
                ssl_cert_reqs="required",
                ssl_check_hostname=True,
            )
        return kw


def _host(h: str) -> str:
    return f"[{h}]" if ":" in h else h


def _hostport(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:6379
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{_redact(url)}: expected HOST:PORT, got {text!r}")
    return host, int(port)


def redact(url: str) -> str:
    """The store URL as the start-up line, /status and the store metric label show it: the password,
    read as the parser reads it (up to the LAST '@', whatever it contains: '/', '@', a space), is ***."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}:***@{host}" if colon else f"{scheme}://***@{host}"  # a lone field is the password


def _redact(url: str) -> str:
    """The same URL in an error message: without its userinfo at all."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url


def _read_password_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.readline().rstrip("\r\n")
    except OSError as e:
        raise ValueError(f"redis_password_file: cannot read {path}: {e.strerror or e}") from None
    if not secret:
        raise ValueError(f"redis_password_file: {path} is empty (its first line is the password)")
    return secret


def _check_file(path: str | None, what: str) -> None:
    if path is not None and not os.access(path, os.R_OK):
        raise ValueError(f"{what}: cannot read {path}")


def parse(
    url: str,
    *,
    password_file: str | None = None,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    environ=None,
) -> Target:
    """A store URL (and the [limits] secret/TLS settings) -> Target.  ValueError: one line, no secret."""
    if not isinstance(url, str):
        raise ValueError(f"store URL must be a string, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"store: expected memory, {', '.join(s + '://' for s in SCHEMES)}; got {_redact(url)!r}")
    socket = None
    if scheme in ("redis+unix", "unix"):
        rest, socket = _unix_socket(scheme, rest, url)
    username, password, rest = _userinfo(rest)
    path = ""
    if "/" in rest:
        rest, _, path = rest.partition("/")
    if "?" in path or "?" in rest:
        raise ValueError(f"{_redact(url)}: query options are not supported (use the [limits] redis_* keys)")
    hosts = () if socket else tuple(_hostport(h, url) for h in rest.split(",")) if rest else ()
    if not hosts and not socket:
        raise ValueError(f"{_redact(url)}: no HOST:PORT")
    master, db = _master_and_db(scheme, path, url)
    if len(hosts) > 1 and scheme in ("redis", "rediss"):
        raise ValueError(
            f"{_redact(url)}: one HOST:PORT for {scheme}:// (several: redis-cluster:// or redis-sentinel://)"
        )
    tls = scheme == "rediss"
    _check_tls_files(url, tls, ca_file, cert_file, key_file)
    password = _password(password, password_file, os.environ if environ is None else environ)
    kind = {"redis-sentinel": "sentinel", "redis-cluster": "cluster"}.get(scheme, "single")
    return Target(kind, hosts, db, master, tls, username, password, ca_file, cert_file, key_file, socket)


def _unix_socket(scheme: str, rest: str, url: str) -> tuple[str, str]:
    """[USER[:PASSWORD]@]/PATH.sock[?db=N]: a path, not HOST:PORT -> (rest rewritten as [USERINFO@]unix/DB, path)."""
    rest, _, query = rest.partition("?")
    socket = rest.rpartition("@")[2]
    if not socket.startswith("/"):
        raise ValueError(f"{_redact(url)}: expected an absolute socket path, e.g. {scheme}:///run/redis.sock")
    qdb = query[3:] if query.startswith("db=") else None
    if (query and qdb is None) or (qdb is not None and not qdb.isdigit()):
        raise ValueError(f"{_redact(url)}: the only option is ?db=N (a number)")
    return rest[: len(rest) - len(socket)] + f"unix/{qdb or 0}", socket  # parsed by parse() like HOST/DB


def _userinfo(rest: str) -> tuple[str | None, str | None, str]:
    """[USER[:PASSWORD]@]REST -> (username, password, REST)."""
    userinfo, at, rest = rest.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
        if not colon and user:  # redis://SECRET@host: the lone field is the password (redis-py's reading)
            username, password = None, unquote(user)
    return username, password, rest


def _master_and_db(scheme: str, path: str, url: str) -> tuple[str | None, int]:
    """The URL's path: [/MASTER] for redis-sentinel://, then [/DB] (none for a cluster)."""
    parts = [p for p in path.split("/") if p] if path else []
    master, db = None, 0
    if scheme == "redis-sentinel":
        if not parts:
            raise ValueError(f"{_redact(url)}: the master's name is missing (redis-sentinel://H:P,.../MASTER)")
        master, parts = unquote(parts[0]), parts[1:]
    if parts:
        if scheme == "redis-cluster" or len(parts) > 1 or not parts[0].isdigit():
            raise ValueError(
                f"{_redact(url)}: expected /DB (a number)"
                if scheme != "redis-cluster"
                else f"{_redact(url)}: a cluster has no database number (it has db 0 only)"
            )
        db = int(parts[0])
    return master, db


def _check_tls_files(url: str, tls: bool, ca_file, cert_file, key_file) -> None:
    if (ca_file or cert_file or key_file) and not tls:
        raise ValueError(f"redis_ca_file/redis_cert_file/redis_key_file apply to rediss:// only, not {_redact(url)}")
    if bool(cert_file) != bool(key_file):
        raise ValueError("redis_cert_file and redis_key_file go together (a client certificate and its key)")
    _check_file(ca_file, "redis_ca_file")
    _check_file(cert_file, "redis_cert_file")
    _check_file(key_file, "redis_key_file")


def _password(password: str | None, password_file: str | None, environ) -> str | None:
    """The one place the password is given: the URL, redis_password_file, or the environment."""
    sources = [
        s
        for s, present in (
            ("the store URL", password is not None),
            ("redis_password_file", password_file is not None),
            (ENV_PASSWORD, bool(environ.get(ENV_PASSWORD))),
        )
        if present
    ]
    if len(sources) > 1:
        raise ValueError(f"the Redis password is given twice ({' and '.join(sources)}); give it in one place")
    if password_file is not None:
        return _read_password_file(password_file)
    if password is None and environ.get(ENV_PASSWORD):
        return environ[ENV_PASSWORD]
    return password
