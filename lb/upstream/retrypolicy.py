"""Which failed tries are tried again elsewhere (--retry-on), and how long to wait first.

A value object, like urllib3's Retry: the conditions, the backoff, and should_retry() -- pure, so every
combination is unit-tested; lb/proxy/forward.py asks it and does the rest (the budget, the pick, the sleep).

  connect   the backend could not be reached: nothing was sent, so any method, at once (the edge's
            behaviour before --retry-on, and its default).
  reset     the backend closed the connection before a complete response head.
  timeout   no response head within the read timeout (or [upstream] per_try_timeout).
  5xx, 502, 503, 504   the backend answered with that status (5xx: any of 500-599).

Everything but `connect` may have reached the backend's application, so it is retried only for an
idempotent method (RFC 9110 9.2.2; TRACE left out, as Envoy and HAProxy do) whose body the edge still
has whole (bytes or a spooled body, never one streamed from the client), and only while nothing of the
response has reached the client. Those retries wait first: Envoy's full-jitter exponential backoff,
uniform(0, min(cap, base * 2**n)) for the n-th retry (0-based), so a pool that fails at once is not hit
again by every client in the same millisecond.
"""

from __future__ import annotations

import random
from email.utils import parsedate_to_datetime
from time import time

CONDITIONS = ("connect", "reset", "timeout", "5xx", "502", "503", "504")
REPLAYABLE_METHODS = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE"})
RETRY_AFTER_MAX = 300.0  # a Retry-After keeps a backend out at most this long (a typo must not cost a day)


def parse_conditions(text) -> tuple[str, ...]:
    """'connect,503' (or a list) -> ('connect', '503'); ValueError naming what is not a condition."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        c = str(item).strip().lower()
        if not c:
            continue
        if c not in CONDITIONS:
            raise ValueError(f"unknown retry condition {item!r} (one of {', '.join(CONDITIONS)})")
        if c not in out:
            out.append(c)
    return tuple(out)


class RetryPolicy:
    __slots__ = ("on", "statuses", "base", "cap", "rng")

    def __init__(self, on=("connect",), base: float = 0.025, cap: float = 0.25, rng=None):
        self.on = frozenset(parse_conditions(on))
        # The statuses retried, as ints: one set lookup per response when any is configured.
        self.statuses = (
            frozenset(range(500, 600)) if "5xx" in self.on else frozenset(int(c) for c in self.on if c.isdigit())
        )
        self.base, self.cap = base, cap
        self.rng = rng or random.random  # () -> float in [0, 1)

    def condition(self, kind: str, status: int | None = None) -> str | None:
        """The configured condition a failed try meets: kind is UpstreamFailed's (connect, reset,
        timeout, protocol, ...) or "status" for a complete response head with `status`."""
        if kind == "status":
            if status in self.statuses:
                return "5xx" if "5xx" in self.on and str(status) not in self.on else str(status)
            return None
        return kind if kind in self.on and kind in ("connect", "reset", "timeout") else None

    def should_retry(
        self, kind: str, status: int | None, method: bytes, replayable: bool, sent_to_client: bool
    ) -> str | None:
        """The condition this try is retried for, or None. The budget and a backend not yet tried are
        the caller's to find."""
        cond = self.condition(kind, status)
        if cond is None or cond == "connect":
            return cond  # nothing reached the backend: any method, any body
        if sent_to_client or not replayable or method not in REPLAYABLE_METHODS:
            return None
        return cond

    def backoff(self, n: int) -> float:
        """Seconds to wait before the n-th (0-based) retry that is not a connect failure's."""
        return self.rng() * min(self.cap, self.base * (2 ** min(n, 30)))


def retry_after(value: bytes, now: float | None = None) -> float | None:
    """A Retry-After header (delta-seconds or an HTTP-date) as seconds from now, at most
    RETRY_AFTER_MAX; None when it is not one."""
    v = value.strip()
    try:
        if v.isdigit():
            secs = float(int(v))
        else:
            secs = parsedate_to_datetime(v.decode("latin-1")).timestamp() - (time() if now is None else now)
    except (ValueError, TypeError, OverflowError, IndexError):
        return None
    return max(0.0, min(RETRY_AFTER_MAX, secs))
