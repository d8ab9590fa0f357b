"""The limiters a LimitStage is made of, built once per limit and shared by every rule that names it.

A reload hands over the replaced stage's limiters (`old`): an unchanged limit keeps its state, and its
in-flight table keeps the requests in flight. The cache's names are the limits' identities (and, for
the built-in rule, the Redis keys' prefixes), so they must not change.
"""

from __future__ import annotations

from typing import Any

from lb.limiting.rules import BUILTIN
from limiter import build, parse_rate
from limiter.concurrency import InFlight


class Limiters:
    def __init__(self, algorithm: str, store: str, max_delay: float, inflight_ttl: float, inflight_table, old, options):
        self.algorithm, self.store, self.max_delay = algorithm, store, max_delay
        self.inflight_ttl, self.inflight_table = inflight_ttl, inflight_table
        self.old = old or {}
        self.options = options
        self.cache: dict[str, Any] = {}  # limiters of several kinds (memory, Redis, shm) and in-flight tables

    def _reused(self, key: str) -> bool:
        if key not in self.cache and key in self.old:
            self.cache[key] = self.old[key]
        return key in self.cache

    def rate(self, rate: str, algo: str | None = None, rule: str = BUILTIN, cost: int = 1, delay: float | None = None):
        """The limiter of `rate` (N/PERIOD) for `rule`, with the stage's algorithm and max_delay by default."""
        algo = self.algorithm if algo is None else algo
        delay = self.max_delay if delay is None else delay
        n, period = parse_rate(rate)
        # The built-in rule keeps its old names (and Redis keys); each [[rules]] table has its own.
        key = f"{n}/{period}" if rule == BUILTIN and algo == self.algorithm else f"{rule}:{algo}:{n}/{period}"
        key += (f"+cost{cost}" if cost != 1 else "") + (f"+delay{delay!r}" if delay else "")
        if not self._reused(key):
            store = self.store
            prefix: dict[str, Any] = (
                {"prefix": f"edge:{algo}:{key}:" if rule == BUILTIN else f"edge:rule:{key}:"}
                if store != "memory"
                else {}
            )
            self.cache[key] = build(
                algo, limit=n, window=period, store=store, cost=cost, max_delay=delay, **prefix, **self.options
            )
        return self.cache[key]

    def inflight(self, n: int, rule: str = BUILTIN):
        """The table of at most `n` requests in flight per key for `rule`."""
        key = f"inflight:{rule}:{n}"
        if not self._reused(key):
            if self.store in ("memory", "shm"):
                from limiter import concurrency  # --workers: the table the supervisor shared

                self.cache[key] = (
                    concurrency.ShmInFlight(n, self.inflight_table, name=key)
                    if self.inflight_table is not None
                    else InFlight(n)
                )
            else:
                from limiter.concurrency import RedisInFlight

                self.cache[key] = RedisInFlight(
                    n,
                    self.store,
                    prefix=f"edge:inflight:{rule}:",
                    ttl=self.inflight_ttl,
                    **{k: v for k, v in self.options.items() if k != "max_keys"},
                )
        return self.cache[key]
