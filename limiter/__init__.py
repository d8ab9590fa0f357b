"""Rate limiting for the edge: four algorithms behind one interface.

    from limiter import build
    lim = build("sliding-counter", limit=100, window=10.0)
    d = lim.allow("client-key", now=1234.5)     # Decision(allowed, limit, remaining, reset, retry_after)

The algorithms (limiter.algorithms) are pure arithmetic over (state, now); a store holds the state
per key (limiter.memory today).  This package knows nothing about HTTP and never reads a clock.
"""

from __future__ import annotations

import re

from limiter.algorithms import ALGORITHMS, MAX_COUNT, MIN_WINDOW, Decision, TokenBucket
from limiter.memory import MemoryStore
from limiter.redis.url import SCHEMES as REDIS_SCHEMES
from limiter.shaping import shaped

__all__ = ["ALGORITHMS", "Decision", "build", "parse_rate", "MemoryStore"]


def build(
    algorithm: str,
    limit: int,
    window: float,
    *,
    store: str = "memory",
    burst=None,
    max_keys: int = 100_000,
    clock=None,
    cost: int = 1,
    max_delay: float = 0.0,
    **redis_options,
):
    """A limiter with allow(key, now=None) -> Decision (now None: the store reads `clock` itself, under
    the key's lock where it has one).

    algorithm  one of ALGORITHMS: token-bucket, fixed-window, sliding-log, sliding-counter
    limit      N requests per window (token bucket: refill N per window, capacity N unless burst=)
    window     the period in seconds
    store      "memory"; "shm" (limiter.shm: shared by forked workers); or redis://, rediss://, redis-sentinel://, redis-cluster:// (limiter.redis.url;
               limiter.redis.store: state shared by every edge)
    burst      token-bucket only: bucket capacity, apart from N
    max_keys   hard cap on keys holding state in memory (idle keys are evicted long before; when only
               live state is left a new key is refused, see limiter.memory)
    clock      the clock allow(key) reads when no `now` is passed (default time.time)
    cost       units each request spends (default 1; more than the limit is refused: it could never pass)
    max_delay  seconds an over-limit request may be held instead of rejected (0: off); a held request's
               Decision has .delay (limiter.shaping); every store, every algorithm
    redis_options  Redis stores only: prefix, timeout, pool_size, on_error, retry_interval, ttl_grace,
               password_file, ca_file, cert_file, key_file (see limiter.redis_store.RedisStore)
    """
    try:
        cls = ALGORITHMS[algorithm]
    except (KeyError, TypeError):
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}") from None
    if burst is not None and cls is not TokenBucket:
        raise ValueError(f"burst only applies to algorithm token-bucket, not {algorithm!r}")
    algo = shaped(cls(limit, window, burst) if cls is TokenBucket else cls(limit, window), cost, max_delay)
    if algo.__class__ is not cls and store not in ("memory", "shm"):
        from limiter.redis import shaping as redis_shaping  # noqa: F401  (registers its scripts with the Redis store)
    if store == "shm":  # limiter.shm: the table the supervisor shared with its workers before fork
        from limiter.shm import ShmStore

        return ShmStore(
            algo,
            redis_options.pop("shm_arena", None),
            name=redis_options.pop("prefix", None),
            **({"clock": clock} if clock else {}),
            **redis_options,
        )
    if store == "memory":
        if redis_options:
            raise ValueError(f"options {', '.join(sorted(redis_options))} only apply to store='redis://...'")
        return MemoryStore(algo, max_keys=max_keys, **({"clock": clock} if clock else {}))
    if isinstance(store, str) and store.partition("://")[0] in REDIS_SCHEMES:
        from limiter.redis.store import RedisStore  # imports redis only when it is used

        return RedisStore(algo, store, max_keys=max_keys, **({"clock": clock} if clock else {}), **redis_options)
    from limiter.redis.url import parse

    parse(store)  # raises the one-line reason (never echoing a password)
    raise AssertionError("unreachable")


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE = re.compile(r"\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*(ms|s|m|h|d)\s*")


def parse_rate(text: str) -> tuple[int, float]:
    """'100/s' -> (100, 1.0); also '100/m', '5/h', '10/10s', '3/500ms', '1000/d', '2/1.5s'."""
    m = _RATE.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(
            f"rate must look like N/UNIT or N/<number>UNIT with UNIT one of ms, s, m, h, d "
            f"(e.g. '100/s', '10/10s', '3/500ms'); got {text!r}"
        )
    count = int(m.group(1))
    if count <= 0:
        raise ValueError(f"rate {text!r}: the request count must be a positive integer")
    if count > MAX_COUNT:
        raise ValueError(f"rate {text!r}: the request count must be at most 2^53 - 1 = {MAX_COUNT}")
    period = float(m.group(2) or 1.0) * _UNITS[m.group(3)]
    if period <= 0.0:
        raise ValueError(f"rate {text!r}: the period must be positive")
    if period < MIN_WINDOW:
        raise ValueError(f"rate {text!r}: the period must be at least 1ms")
    return count, period
