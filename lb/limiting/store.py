"""The limiter store at start-up: one PING with the configured credentials, one clear line about it;
and (at start and on reload) one about its memory policy.

    limiter store redis://cache:6379/0: reachable (PING 0.4 ms)
    limiter store redis://cache:6379/0: wrong password or user (WRONGPASS ...)
    limiter store redis://cache:6379/0: maxmemory 1048576 bytes, maxmemory-policy allkeys-lru evicts any key: ...

The target (and its password: URL, redis_password_file or EDGE_REDIS_PASSWORD) comes from
limiter.redis.url, which owns that; its `display` never carries a secret, and the line is redacted once
more on its way to the log (lb.logs).
"""

from __future__ import annotations

import os
from time import monotonic

from lb.logs import redact
from limiter.redis import url as redis_url


def redis_files(c) -> dict:
    """The [limits] redis_*_file settings, as limiter.redis_url.parse / RedisStore keyword arguments."""
    pw_file = os.path.expandvars(c.redis_password_file) if c.redis_password_file else None  # ${CREDENTIALS_DIRECTORY}
    return {
        "password_file": pw_file,
        "ca_file": c.redis_ca_file,
        "cert_file": c.redis_cert_file,
        "key_file": c.redis_key_file,
    }


def _client(cfg, target, timeout: float, host=None, port=None):
    import redis

    t = max(cfg.redis_timeout, timeout)
    if host is None:
        host, port = target.hosts[0] if target.hosts else ("", 0)  # redis+unix: no hosts
    kw = target.connection_kwargs(host, port)
    if target.tls:
        kw["ssl"] = True
    if "path" in kw:
        kw["unix_socket_path"] = kw.pop("path")
    return redis.Redis(socket_timeout=t, socket_connect_timeout=t, **kw)


def _servers(cfg, target, timeout: float) -> list[tuple[str | None, int | None, str]]:
    """The servers whose memory policy matters: (host, port, how to name it in the line).  One Redis:
    itself; Sentinel: the master the first answering sentinel names; Cluster: the seed nodes."""
    if target.kind == "single":
        return [(None, None, "")]
    if target.kind == "cluster":
        return [(h, p, f" node {h}:{p}") for h, p in target.hosts]
    import redis
    from redis.exceptions import RedisError

    for h, p in target.hosts:  # the sentinels are asked without credentials (limiter.redis.sentinel)
        c = redis.Redis(host=h, port=p, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            addr = c.sentinel_get_master_addr_by_name(target.master)
        except RedisError:
            continue
        finally:
            c.close()
        if isinstance(addr, (tuple, list)) and addr:  # (host, port); None when it knows no master
            host = addr[0].decode() if isinstance(addr[0], bytes) else addr[0]
            return [(host, int(addr[1]), f" master {host}:{int(addr[1])}")]
    return []


def memory_policy(cfg, timeout: float = 1.0) -> list[tuple[int, str]]:
    """(log level, line) per server about its maxmemory and maxmemory-policy (CONFIG GET), read at start
    and on reload: every limiter key has a TTL, so allkeys-* AND volatile-* may evict a limited client's
    state -- and an evicted key starts again with a fresh quota (a 40k-key flood under volatile-lru
    evicted 65,613 keys).  noeviction keeps every key; when full, the scripts that would write fail and
    the failure policy decides those requests only.  [] for the memory store."""
    if cfg.store == "memory":
        return []
    import logging

    from redis.exceptions import RedisError

    target = redis_url.parse(cfg.store, **redis_files(cfg))
    out = []
    for host, port, which in _servers(cfg, target, timeout):
        name = f"limiter store {target.display}{which}"
        client = _client(cfg, target, timeout, host, port)
        try:
            got = {}
            for k in ("maxmemory", "maxmemory-policy"):
                got.update(client.config_get(k))
        except RedisError as e:  # CONFIG renamed or disabled (managed Redis), NOPERM, unreachable
            out.append(
                (
                    logging.WARNING,
                    (
                        f"{name}: cannot read maxmemory-policy (CONFIG GET: {redact(str(e)) or type(e).__name__}); "
                        "make sure it is noeviction: an evicting policy can reset a limited client "
                        '(docs/redis.md, "Memory")'
                    ),
                )
            )
            continue
        finally:
            client.close()
        policy, maxmemory = got.get("maxmemory-policy", "?"), int(got.get("maxmemory", 0) or 0)
        size = f"maxmemory {maxmemory} bytes" if maxmemory else "maxmemory 0 (no limit)"
        if maxmemory and (policy.startswith("allkeys-") or policy.startswith("volatile-")):
            what = "any key" if policy.startswith("allkeys-") else "keys with a TTL, which every limiter key has"
            out.append(
                (
                    logging.WARNING,
                    (
                        f"{name}: {size}, maxmemory-policy {policy} evicts {what}: a limited client whose state is "
                        "evicted gets a fresh quota. Use noeviction (when full, only the requests whose script "
                        "would write go to the failure policy) and size maxmemory for the keys (docs/redis.md, "
                        '"Memory")'
                    ),
                )
            )
        else:
            out.append((logging.INFO, f"{name}: {size}, maxmemory-policy {policy}: no limiter key is evicted"))
    return out


def check(cfg, timeout: float = 1.0) -> tuple[bool, str]:
    """(reachable and authenticated, the line to log). Memory store: (True, "")."""
    if cfg.store == "memory":
        return True, ""
    from redis.exceptions import AuthenticationError, RedisError, ResponseError

    target = redis_url.parse(cfg.store, **redis_files(cfg))
    name = f"limiter store {target.display}"
    if target.kind != "single":
        return True, ""  # the store refuses these at start-up itself, with its own line
    client = _client(cfg, target, timeout)
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
