"""The limiter store at start-up: one PING with the configured credentials, one clear line about it.

    limiter store redis://cache:6379/0: reachable (PING 0.4 ms)
    limiter store redis://cache:6379/0: wrong password or user (WRONGPASS ...)

The target (and its password: URL, redis_password_file or EDGE_REDIS_PASSWORD) comes from
limiter.redis_url, which owns that; its `display` never carries a secret, and the line is redacted once
more on its way to the log (lb.logs).
"""

from __future__ import annotations

from time import monotonic

from limiter import redis_url

from .config import redis_files
from .logs import redact


def check(cfg, timeout: float = 1.0) -> tuple[bool, str]:
    """(reachable and authenticated, the line to log). Memory store: (True, "")."""
    if cfg.store == "memory":
        return True, ""
    import redis
    from redis.exceptions import AuthenticationError, RedisError, ResponseError
    target = redis_url.parse(cfg.store, **redis_files(cfg))
    name = f"limiter store {target.display}"
    if target.kind != "single":
        return True, ""           # the store refuses these at start-up itself, with its own line
    t = max(cfg.redis_timeout, timeout)
    kw = target.connection_kwargs(*(target.hosts[0] if target.hosts else ("", 0)))   # redis+unix: no hosts
    if target.tls:
        kw["ssl"] = True
    if "path" in kw:
        kw["unix_socket_path"] = kw.pop("path")
    client = redis.Redis(socket_timeout=t, socket_connect_timeout=t, **kw)
    try:
        start = monotonic()
        client.ping()
        return True, f"{name}: reachable (PING {(monotonic() - start) * 1000:.1f} ms)"
    except (AuthenticationError, ResponseError) as e:
        text = redact(str(e))
        if "NOAUTH" in text or "required" in text.lower():
            return False, f"{name}: needs a password ({text}); set EDGE_REDIS_PASSWORD or redis_password_file"
        if "WRONGPASS" in text or "invalid" in text.lower() or isinstance(e, AuthenticationError):
            return False, f"{name}: wrong password or user ({text})"
        return False, f"{name}: {text}"
    except RedisError as e:
        return False, f"{name}: unreachable ({redact(str(e)) or type(e).__name__})"
    finally:
        client.close()
