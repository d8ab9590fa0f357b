"""The rate-limit stage of the pipeline: which limiter applies to a key, and the response headers.

The limiter package decides (it knows nothing of HTTP); this module turns a Decision into the
X-RateLimit-* / Retry-After headers every response carries when limiting is on.
"""

from __future__ import annotations

import math

from limiter import build, parse_rate


class LimitStage:
    """A default limiter for every key, plus one per distinct override rate."""

    def __init__(self, default: str, overrides=(), algorithm: str = "token-bucket", store: str = "memory",
                 reuse: dict | None = None, **store_options):
        """reuse: the limiters of the stage this one replaces (reload): an unchanged rate keeps its state."""
        self.algorithm = algorithm
        self.store = store
        self.options = tuple(sorted(store_options.items()))
        old = reuse or {}
        cache: dict[str, object] = {}

        def limiter_for(rate: str):
            n, period = parse_rate(rate)
            key = f"{n}/{period}"
            if key not in cache and key in old:
                cache[key] = old[key]
            if key not in cache:
                cache[key] = build(algorithm, limit=n, window=period, store=store,
                                   **({"prefix": f"edge:{algorithm}:{key}:"} if store != "memory" else {}),
                                   **store_options)
            return cache[key]

        self.default = limiter_for(default)
        self.overrides = {k: limiter_for(rate) for k, rate in overrides}
        self.limiters = cache

    def check(self, key: str, match: str, now: float | None = None):
        lim = self.overrides.get(match, self.default)
        if now is None:
            return lim.allow(key)  # the store reads the clock itself, under the key's lock
        return lim.allow(key, now)


def headers(d) -> bytes:
    """X-RateLimit-* for any response; Retry-After too when the request was rejected."""
    reset = max(0, math.ceil(d.reset))
    out = b"X-RateLimit-Limit: %d\r\nX-RateLimit-Remaining: %d\r\nX-RateLimit-Reset: %d\r\n" % (
        d.limit, d.remaining, reset)
    if not d.allowed:
        out += b"Retry-After: %d\r\n" % max(1, math.ceil(d.retry_after))
    return out
