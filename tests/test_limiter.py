"""The limiter's shared behavioural suite: runs against every store in tests/limiter_stores.STORES.

Injected clock everywhere (now is an argument); nothing sleeps.
"""

import math
import random
import threading

import pytest

from limiter import ALGORITHMS, Decision, build, parse_rate
from tests.limiter_stores import make  # noqa: F401  (the store-parametrised fixture)

ALL = sorted(ALGORITHMS)
BEFORE = -math.inf


def just_before(t):
    return math.nextafter(t, BEFORE)


def replay(make, algorithm, limit, window, history, **kw):
    """A fresh limiter fed the same (key, now) history; returns it and the last decision."""
    lim = make(algorithm, limit, window, **kw)
    d = None
    for key, now in history:
        d = lim.allow(key, now)
    return lim, d


def test_algorithm_names_are_the_contract():
    assert set(ALGORITHMS) == {"token-bucket", "fixed-window", "sliding-log", "sliding-counter"}


@pytest.mark.parametrize("algorithm", ALL)
def test_decision_shape(make, algorithm):
    d = make(algorithm, 3, 10.0).allow("k", 100.0)
    assert isinstance(d, Decision)
    assert (d.allowed, d.limit, d.remaining, d.retry_after) == (True, 3, 2, 0.0)
    assert type(d.allowed) is bool and type(d.limit) is int and type(d.remaining) is int
    assert type(d.reset) is float and type(d.retry_after) is float and d.reset > 0


# 1. A burst of exactly the capacity/limit passes, the next is denied, and retry_after is exact.
@pytest.mark.parametrize("algorithm", ["token-bucket", "fixed-window"])
@pytest.mark.parametrize("now", [1000.0, 1003.7, 1009.999])
def test_burst_of_capacity_then_denied_with_exact_retry_after(make, algorithm, now):
    lim = make(algorithm, 10, 10.0)
    ds = [lim.allow("c", now) for _ in range(10)]
    assert all(d.allowed for d in ds)
    assert [d.remaining for d in ds] == list(range(9, -1, -1))
    d = lim.allow("c", now)
    assert not d.allowed and d.remaining == 0 and d.retry_after > 0
    t = now + d.retry_after
    assert not lim.allow("c", just_before(t)).allowed
    assert not lim.allow("c", t - 1e-6).allowed
    assert lim.allow("c", t).allowed
    if algorithm == "token-bucket":
        assert d.retry_after == pytest.approx(1.0)  # one token refills in window / N seconds
    else:
        assert t == pytest.approx(math.floor(now / 10.0) * 10.0 + 10.0)  # the next window


def test_token_bucket_burst_option_sets_capacity_apart_from_rate(make):
    lim = make("token-bucket", 10, 10.0, burst=3)  # capacity 3, refill 1 token/s
    assert [lim.allow("c", 50.0).allowed for _ in range(4)] == [True, True, True, False]
    d = lim.allow("c", 50.0)
    assert d.retry_after == 1.0 and d.reset == 3.0 and d.limit == 10
    assert lim.allow("c", 51.0).allowed and not lim.allow("c", 51.0).allowed
    # idle long enough: capacity 3, never more
    assert [lim.allow("c", 1000.0).allowed for _ in range(4)] == [True, True, True, False]


# 2. The window-straddling burst.
def test_fixed_window_admits_2n_across_a_boundary_token_bucket_does_not(make):
    n, w = 10, 10.0
    end_of_window = 1010.0 - 0.001
    start_of_next = 1010.0
    fixed = make("fixed-window", n, w)
    bucket = make("token-bucket", n, w)
    admitted = {"fixed": 0, "bucket": 0}
    for t in [end_of_window] * n + [start_of_next] * n:
        admitted["fixed"] += fixed.allow("c", t).allowed
        admitted["bucket"] += bucket.allow("c", t).allowed
    assert admitted["fixed"] == 2 * n  # 2N inside 1 ms, let alone one window length
    assert admitted["bucket"] == n  # full bucket emptied; 1 ms refills 0.001 tokens


# 3 (behavioural part). Sliding log and counter on the same suite.
@pytest.mark.parametrize("algorithm", ["sliding-log", "sliding-counter"])
def test_sliding_never_admits_more_than_n_at_a_boundary(make, algorithm):
    lim = make(algorithm, 10, 10.0)
    ok = sum(lim.allow("c", t).allowed for t in [1009.999] * 10 + [1010.0] * 10)
    assert ok == 10


@pytest.mark.parametrize("algorithm", ["sliding-log", "sliding-counter"])
def test_sliding_steady_rate_at_the_limit_is_admitted(make, algorithm):
    lim = make(algorithm, 10, 10.0)
    # one request per second (= N/W) plus a margin: all admitted, forever
    assert all(lim.allow("c", 1000.0 + i * 1.0001).allowed for i in range(200))


@pytest.mark.parametrize("algorithm", ["sliding-log", "sliding-counter"])
def test_sliding_recovers_gradually_not_at_a_boundary(make, algorithm):
    lim = make(algorithm, 10, 10.0)
    for _ in range(10):
        assert lim.allow("c", 1001.0).allowed
    d = lim.allow("c", 1005.0)
    assert not d.allowed
    assert not lim.allow("c", 1010.0).allowed  # fixed window would reset here
    t = 1005.0 + d.retry_after
    assert 1010.0 < t <= 1011.0
    assert not lim.allow("c", just_before(t)).allowed
    assert lim.allow("c", t).allowed


def test_sliding_log_retry_after_is_when_the_oldest_leaves(make):
    lim = make("sliding-log", 3, 10.0)
    for t in (100.0, 102.5, 104.0):
        assert lim.allow("c", t).allowed
    d = lim.allow("c", 105.0)
    assert not d.allowed and d.retry_after == 5.0 and d.reset == 9.0
    assert not lim.allow("c", just_before(110.0)).allowed
    d = lim.allow("c", 110.0)  # t=100 has left: (110-10, 110] no longer holds it
    assert d.allowed and d.remaining == 0 and d.reset == 10.0


def test_sliding_counter_follows_its_weighted_estimate(make):
    lim = make("sliding-counter", 10, 10.0)
    for _ in range(8):
        assert lim.allow("c", 1005.0).allowed  # window [1000, 1010): cur = 8
    # at 1012.5: prev 8 weighted 0.75 = 6, so 3 more fit (6 + 3 = 9 < 10, 6 + 4 = 10 is not < 10)
    ds = [lim.allow("c", 1012.5) for _ in range(5)]
    assert [d.allowed for d in ds] == [True, True, True, True, False]
    assert [d.remaining for d in ds[:4]] == [3, 2, 1, 0]
    # denied with estimate 6 + 4 = 10: the weight must fall to below 6/8, i.e. strictly after 1012.5
    t = 1012.5 + ds[-1].retry_after
    assert t == math.nextafter(1012.5, math.inf)
    assert lim.allow("c", t).allowed


# 6. Exactness of retry_after, remaining and reset for all four, on random histories.
def _random_history(rng, n, w, length):
    t = 1000.0 + rng.random() * w
    hist = []
    for _ in range(length):
        t += rng.choice([0.0, 0.0, rng.random() * w / n, rng.random() * w / 4, rng.random() * w])
        hist.append(("c", t))
    return hist


@pytest.mark.parametrize("algorithm", ALL)
def test_retry_remaining_reset_are_exact_on_random_histories(make, algorithm):
    rng = random.Random(algorithm)
    n, w = 5, 3.0
    kw = {"burst": 7} if algorithm == "token-bucket" else {}
    capacity = 7 if algorithm == "token-bucket" else n
    checked = {"retry": 0, "remaining": 0, "reset": 0}
    for _ in range(250):
        hist = _random_history(rng, n, w, rng.randint(1, 25))
        _, d = replay(make, algorithm, n, w, hist, **kw)
        now = hist[-1][1]
        if not d.allowed:
            t = now + d.retry_after
            lim, _ = replay(make, algorithm, n, w, hist, **kw)
            assert not lim.allow("c", just_before(t)).allowed
            assert lim.allow("c", t).allowed
            checked["retry"] += 1
        else:
            assert d.retry_after == 0.0
            lim, _ = replay(make, algorithm, n, w, hist, **kw)
            more = [lim.allow("c", now).allowed for _ in range(capacity + 1)]
            assert more == [True] * d.remaining + [False] * (capacity + 1 - d.remaining)
            checked["remaining"] += 1
        # reset: the whole quota (capacity in a row) is available at now + reset, not before
        t = now + d.reset
        lim, _ = replay(make, algorithm, n, w, hist, **kw)
        assert all(lim.allow("c", t).allowed for _ in range(capacity))
        assert not lim.allow("c", t).allowed
        if d.reset > 0:
            lim, _ = replay(make, algorithm, n, w, hist, **kw)
            before = t - 1e-9
            assert not all(lim.allow("c", before).allowed for _ in range(capacity))
        checked["reset"] += 1
    assert checked["retry"] >= 40 and checked["remaining"] >= 40, checked


# 4. Keys are independent.
@pytest.mark.parametrize("algorithm", ALL)
def test_keys_are_independent(make, algorithm):
    lim = make(algorithm, 5, 10.0)
    for _ in range(5):
        assert lim.allow("greedy", 100.0).allowed
    assert not lim.allow("greedy", 100.0).allowed
    d = lim.allow("polite", 100.0)
    assert d.allowed and d.remaining == 4
    assert not lim.allow("greedy", 100.5).allowed


# 5. Concurrency: 16 threads, one key, one instant: exactly N admitted.
@pytest.mark.parametrize("algorithm", ALL)
def test_sixteen_threads_on_one_key_admit_exactly_n(make, algorithm):
    n = 1000
    lim = make(algorithm, n, 60.0)
    admitted = []
    start = threading.Barrier(16)

    def hammer():
        start.wait()
        admitted.append(sum(lim.allow("hot", 5000.0).allowed for _ in range(200)))

    threads = [threading.Thread(target=hammer) for _ in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sum(admitted) == n  # 3200 attempts, exactly N admitted
    assert not lim.allow("hot", 5000.0).allowed


# Bad parameters.
@pytest.mark.parametrize(
    "args, kw, words",
    [
        (("nope", 10, 1.0), {}, ["algorithm", "token-bucket", "fixed-window", "sliding-log", "sliding-counter"]),
        (("fixed-window", 0, 1.0), {}, ["limit", "positive integer"]),
        (("fixed-window", -3, 1.0), {}, ["limit"]),
        (("fixed-window", 2.5, 1.0), {}, ["limit"]),
        (("fixed-window", True, 1.0), {}, ["limit"]),
        (("sliding-log", 10, 0), {}, ["window", "positive"]),
        (("sliding-log", 10, -1.0), {}, ["window"]),
        (("sliding-log", 10, math.inf), {}, ["window", "finite"]),
        (("sliding-log", 10, math.nan), {}, ["window"]),
        (("sliding-log", 10, "soon"), {}, ["window"]),
        (("token-bucket", 10, 1.0), {"burst": 0}, ["burst", "positive integer"]),
        (("fixed-window", 10, 1.0), {"burst": 5}, ["burst", "token-bucket"]),
        (("fixed-window", 10, 1.0), {"store": "mongo://x"}, ["store", "memory"]),
        (("fixed-window", 10, 1.0), {"max_keys": 0}, ["max_keys"]),
    ],
)
def test_bad_parameters_raise_valueerror_naming_them(args, kw, words):
    with pytest.raises(ValueError) as e:
        build(*args, **kw)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("100/s", (100, 1.0)),
        ("100/m", (100, 60.0)),
        ("5/h", (5, 3600.0)),
        ("10/10s", (10, 10.0)),
        ("3/500ms", (3, 0.5)),
        ("7/1.5s", (7, 1.5)),
        (" 20 / 2m ", (20, 120.0)),
        ("1000/d", (1000, 86400.0)),
    ],
)
def test_parse_rate(text, expected):
    assert parse_rate(text) == expected


@pytest.mark.parametrize("text", ["", "100", "100/", "/s", "0/s", "-1/s", "1.5/s", "10/0s", "10/x", "10/sec", None])
def test_parse_rate_rejects_with_a_clear_message(text):
    with pytest.raises(ValueError, match=r"rate"):
        parse_rate(text)
