"""Accuracy: the sliding log is exact; the sliding counter approximates it; properties via hypothesis.

Figures are printed (pytest -s shows them) and recorded in docs/limiter.md.
"""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from limiter import ALGORITHMS, build
from limiter.harness import max_in_window


def max_in_trailing_window(times, window):
    """The most admitted instants s with a - window < s <= a over all a: the harness's checker
    (the limiter's float rule, s counts at a iff a < s + window), on sorted instants."""
    return max_in_window(sorted(times), window)


def brute_force_max(times, window):
    return max((sum(1 for s in times if s <= a and a < s + window) for a in times), default=0)


def admitted(algorithm, limit, window, trace):
    lim = build(algorithm, limit, window)
    return [t for t in trace if lim.allow("k", t).allowed]


def poisson_trace(seed, rate, duration, start=1000.0):
    rng = random.Random(seed)
    t, out = start, []
    while True:
        t += rng.expovariate(rate)
        if t >= start + duration:
            return out
        out.append(t)


def on_off_trace(limit, window, burst_s, silence_s, duration, factor=3.0, start=1000.0):
    """factor x the sustained rate (limit/window) for burst_s, then silence_s, repeated."""
    step = window / (limit * factor)
    out, t0 = [], start
    while t0 < start + duration:
        t = t0
        while t < t0 + burst_s:
            out.append(t)
            t += step
        t0 += burst_s + silence_s
    return out


def test_checker_agrees_with_brute_force():
    rng = random.Random(7)
    for _ in range(200):
        times = sorted(rng.choice([0.0, 0.5, 1.0, 1.5, 2.0, 3.0]) + rng.random() * 0.01 for _ in range(rng.randint(1, 30)))
        assert max_in_trailing_window(times, 1.0) == brute_force_max(times, 1.0)


@pytest.mark.parametrize("load", [0.5, 1.0, 3.0, 10.0])
def test_sliding_log_never_exceeds_n_in_any_trailing_window(load):
    n, w = 20, 2.0
    trace = poisson_trace(f"log-{load}", load * n / w, 200 * w)
    ok = admitted("sliding-log", n, w, trace)
    assert max_in_trailing_window(ok, w) <= n
    if load >= 3:
        assert max_in_trailing_window(ok, w) == n


@settings(max_examples=150, deadline=None)
@given(
    limit=st.integers(1, 8),
    window=st.sampled_from([0.1, 1.0, 2.5, 10.0, 3.3]),
    gaps=st.lists(st.one_of(st.just(0.0), st.floats(0.0, 12.0, allow_nan=False)), min_size=1, max_size=80),
)
def test_property_sliding_log_never_admits_more_than_n(limit, window, gaps):
    t, trace = 1000.0, []
    for g in gaps:
        t += g
        trace.append(t)
    ok = admitted("sliding-log", limit, window, trace)
    assert max_in_trailing_window(ok, window) <= limit
    # and it is not stricter than it must be: a denied request had N admitted in its trailing window
    lim = build("sliding-log", limit, window)
    for s in trace:
        if not lim.allow("k", s).allowed:
            assert sum(1 for a in ok if a <= s and s < a + window) == limit


@settings(max_examples=100, deadline=None)
@given(
    algorithm=st.sampled_from(sorted(ALGORITHMS)),
    limit=st.integers(1, 6),
    window=st.sampled_from([0.3, 1.0, 7.0, 60.0]),
    gaps=st.lists(st.one_of(st.just(0.0), st.floats(0.0, 20.0, allow_nan=False)), min_size=1, max_size=40),
)
def test_property_retry_after_is_exact_for_the_pure_step(algorithm, limit, window, gaps):
    """Pure step: after any history, a denial's now + retry_after is allowed and the float before is not."""
    algo = ALGORITHMS[algorithm](limit, window)
    copy = (lambda s: list(s)) if algorithm == "sliding-log" else (lambda s: s)
    state, now = None, 5000.0
    for g in gaps:
        now += g
        before = copy(state) if state is not None else None
        state, d = algo.step(state, now)
        if not d.allowed:
            t = now + d.retry_after
            assert not algo.step(copy(before), math.nextafter(t, -math.inf))[1].allowed
            assert algo.step(copy(before), t)[1].allowed
        assert d.remaining >= 0 and d.reset >= d.retry_after >= 0.0


ACCURACY_N, ACCURACY_W = 100, 10.0


@pytest.mark.parametrize("load", [0.5, 0.9, 1.0, 1.2, 3.0, 10.0])
def test_sliding_counter_admits_within_3_percent_of_the_log(load):
    n, w = ACCURACY_N, ACCURACY_W
    windows = 300 if load <= 1.2 else 100
    trace = poisson_trace(f"acc-{load}", load * n / w, windows * w)
    log = admitted("sliding-log", n, w, trace)
    counter = admitted("sliding-counter", n, w, trace)
    diff = (len(counter) - len(log)) / len(log)
    over = max_in_trailing_window(counter, w)
    print(
        f"\n[counter vs log] poisson {load:>4}x limit ({n}/{w:g}s), {len(trace)} requests over {windows} windows: "
        f"log {len(log)}, counter {len(counter)} ({diff:+.2%}), counter worst trailing window {over} (limit {n})"
    )
    assert abs(diff) <= 0.03


def test_sliding_counter_over_admits_more_on_an_on_off_profile():
    n, w = 100, 2.0
    # The harness's profile: 3x the sustained rate (150/s) for 2 s, then 4 s silence, each burst starting
    # 1 s before a window boundary.  The counter assumes the previous window's requests were spread
    # evenly over it; here they all sit in its last second, so it over-admits after the boundary.
    trace = on_off_trace(n, w, burst_s=2.0, silence_s=4.0, duration=600.0, start=1001.0)
    log = admitted("sliding-log", n, w, trace)
    counter = admitted("sliding-counter", n, w, trace)
    diff = (len(counter) - len(log)) / len(log)
    over = max_in_trailing_window(counter, w)
    print(
        f"\n[counter vs log] on/off 3x for 2 s, 4 s silence, bursts 1 s before a boundary ({n}/{w:g}s), "
        f"{len(trace)} requests: log {len(log)}, counter {len(counter)} ({diff:+.2%}), "
        f"counter worst trailing window {over} (limit {n}, {over / n - 1:+.0%})"
    )
    assert max_in_trailing_window(log, w) <= n
    assert over > n  # the approximation shows: more than N inside one trailing window
    assert diff > 0.03  # and over-admits by more than on the random traces
