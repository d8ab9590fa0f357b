"""The Redis store under memory pressure and concurrency (issue 29, item 4), on real redis-servers:
an OOM reply fails one call, not the store; the maxmemory policy is read and warned about; instants
reach the scripts out of order and no algorithm admits more than its rule allows by the instant the
script used; configurations whose arithmetic Lua and Python would do differently are refused.
"""

import logging
import re

import pytest
import redis

from limiter import build
from limiter.compose import allow_all
from limiter.redis_store import FailOpenDecision
from tests.redis_server import RedisServer


@pytest.fixture
def full_redis():
    """A redis-server with maxmemory 4mb (a few MB above an empty server) and noeviction: once fill()ed,
    every write is refused (OOM) and nothing is evicted."""
    server = RedisServer(extra=("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")).start()
    yield server
    server.stop()


def fill(server):
    """Fill it: big values until Redis refuses one, then maxmemory lowered just under what it uses, so
    that the few hundred bytes a refused write frees cannot let the next small write in."""
    c = server.client()
    i = 0
    while True:
        i += 1
        try:
            c.set(f"fill:{i}", "x" * 2000)
        except redis.exceptions.OutOfMemoryError:
            break
    c.config_set("maxmemory", c.info("memory")["used_memory"] - 65536)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        c.set("probe", "1")


@pytest.mark.parametrize("algorithm", ["token-bucket", "fixed-window", "sliding-log", "sliding-counter"])
def test_an_oom_reply_fails_that_call_only_and_a_limited_key_stays_limited(full_redis, algorithm, caplog):
    caplog.set_level(logging.WARNING, logger="edge")
    lim = build(algorithm, 3, 60.0, store=full_redis.url, prefix=f"oom:{algorithm}:", timeout=1.0,
                on_error="fail-open", deny_cache=0)  # no cache: every decision below is Redis's
    lim.strict = True
    assert [lim.allow("limited", 100.0).allowed for _ in range(4)] == [True, True, True, False]
    fill(full_redis)
    d = lim.allow("newcomer", 100.0)  # its first write is refused: this call's policy admits it
    if algorithm == "sliding-log":
        # its script's first command, ZREMRANGEBYSCORE, is a write that OOM never refuses (it frees),
        # and Redis lets a script that has written go on writing: the log keeps deciding, exactly
        assert type(d) is not FailOpenDecision and d.allowed
    else:
        assert type(d) is FailOpenDecision
    assert lim.link.up, "an OOM reply opened the breaker: every key would go to the failure policy"
    # the very next call reaches Redis, which still holds the limited key's state (a denial writes nothing)
    for _ in range(3):
        d = lim.allow("limited", 100.5)
        assert not d.allowed and not getattr(d, "degraded", False), d
    lines = [r.getMessage() for r in caplog.records if "a call failed" in r.getMessage()]
    if algorithm != "sliding-log":
        assert lim.link.call_errors >= 1
        assert len(lines) == 1 and "OutOfMemoryError" in lines[0], lines
    assert not [r for r in caplog.records if "unavailable" in r.getMessage()]


def test_several_limits_in_one_call_under_oom_fail_that_request_only(full_redis):
    a = build("fixed-window", 2, 60.0, store=full_redis.url, prefix="oomm:a:", timeout=1.0, deny_cache=0)
    b = build("token-bucket", 5, 60.0, store=full_redis.url, prefix="oomm:b:", timeout=1.0, deny_cache=0)
    for _ in range(2):
        assert allow_all([(a, "c", True), (b, "c", True)], 10.0)[0]
    fill(full_redis)
    ok, ds = allow_all([(a, "new", True), (b, "new", True)], 10.0)
    assert ok and all(type(d) is FailOpenDecision for d in ds)
    assert a.link.up
    ok, ds = allow_all([(a, "c", True), (b, "c", True)], 10.5)
    assert not ok and not getattr(ds[0], "degraded", False)


# ------------------------------------------------------------------ Lua and Python must not disagree

def test_when_lua_and_python_disagree_the_state_written_decides(redis_server):
    """A window index above 2^53 (3 per 0.001 ms at now = 1e12, which the configuration now refuses, so
    the algorithm is bent by hand): Lua's doubles and Python's ints disagree.  Before, Python's verdict
    won and 20 of 20 were admitted at a limit of 3; the script's (whose state is what Redis holds) wins."""
    import uuid
    from limiter.algorithms import FixedWindow
    from limiter.redis_store import RedisStore
    algo = FixedWindow(3, 1.0)
    algo.window = 1e-6
    lim = RedisStore(algo, redis_server.url, prefix=f"drift:{uuid.uuid4().hex}:", deny_cache=0)
    assert sum(lim.allow("k", 1e12).allowed for _ in range(20)) == 3
    assert lim.drift > 0  # still counted (and logged once): a disagreement is a bug to look at


@pytest.mark.parametrize("rate, words", [("9007199254740992/s", "at most 2^53 - 1"),
                                         ("3/0.001ms", "at least 1ms"), ("1/0.5ms", "at least 1ms")])
def test_rates_whose_arithmetic_is_not_exact_in_a_double_are_refused_naming_the_key(rate, words):
    from limiter import parse_rate
    from lb.config import ConfigError, check_rate
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_rate(rate)
    with pytest.raises(ConfigError, match=r"^limits\.keys\.acme: .*" + re.escape(words)):
        check_rate(rate, "limits.keys.acme")
    assert parse_rate("9007199254740991/s") == (2**53 - 1, 1.0) and parse_rate("1/1ms") == (1, 0.001)


@pytest.mark.parametrize("kwargs, words", [(dict(limit=2**53, window=1.0), "limit must be at most"),
                                           (dict(limit=3, window=0.0005), "window must be at least 1 ms"),
                                           (dict(limit=3, window=1.0, burst=2**60), "burst must be at most")])
def test_build_refuses_them_too(kwargs, words):
    algorithm = "token-bucket" if "burst" in kwargs else "fixed-window"
    with pytest.raises(ValueError, match=words):
        build(algorithm, **kwargs)
