"""Milestone 4, the spec's acceptance line:

    "Rate limiter, in process — unit tests (injected clock) pass for token bucket and fixed window,
    including: burst of capacity allowed then denial; and the window-straddling 2×limit burst that fixed
    window admits but token bucket doesn't."

limiter.build(...).allow(key, now): the clock is the `now` argument, nothing sleeps. The full suite for
every algorithm and store is tests/test_limiter.py; these are the line's two cases, stated directly.
"""

from __future__ import annotations

import math

import pytest

from limiter import build

pytestmark = pytest.mark.acceptance

N, W = 10, 10.0                    # 10 requests per 10 s: capacity 10, one token a second


@pytest.mark.parametrize("algorithm", ["token-bucket", "fixed-window"])
def test_a_burst_of_capacity_is_allowed_then_denied(algorithm):
    lim = build(algorithm, N, W)
    now = 1003.7                   # anywhere inside a window
    burst = [lim.allow("client", now) for _ in range(N)]
    assert all(d.allowed for d in burst) and [d.remaining for d in burst] == list(range(N - 1, -1, -1))
    denied = lim.allow("client", now)
    assert not denied.allowed and denied.remaining == 0 and denied.retry_after > 0
    # denied until exactly retry_after later (the injected clock makes that checkable to the float)
    t = now + denied.retry_after
    assert not lim.allow("client", math.nextafter(t, -math.inf)).allowed
    assert lim.allow("client", t).allowed


def test_the_window_straddling_2x_burst_fixed_window_admits_token_bucket_does_not():
    fixed, bucket = build("fixed-window", N, W), build("token-bucket", N, W)
    end_of_window, start_of_next = 1010.0 - 0.001, 1010.0   # the fixed windows start at multiples of W
    instants = [end_of_window] * N + [start_of_next] * N    # 2N requests inside 1 ms
    admitted = {"fixed-window": sum(fixed.allow("c", t).allowed for t in instants),
                "token-bucket": sum(bucket.allow("c", t).allowed for t in instants)}
    assert admitted == {"fixed-window": 2 * N,   # a full quota on each side of the boundary
                        "token-bucket": N}       # its full bucket, then 1 ms refills 0.001 of a token
