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
from limiter.redis.store import FailOpenDecision
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
        # its script prunes (ZREMRANGEBYSCORE, a write OOM never refuses: it frees) before it adds,
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
    from limiter.redis.store import RedisStore
    algo = FixedWindow(3, 1.0)
    algo.window = 1e-6
    lim = RedisStore(algo, redis_server.url, prefix=f"drift:{uuid.uuid4().hex}:", deny_cache=0)
    assert sum(lim.allow("k", 1e12).allowed for _ in range(20)) == 3
    assert lim.drift > 0  # still counted (and logged once): a disagreement is a bug to look at


@pytest.mark.parametrize("rate, words", [("9007199254740992/s", "at most 2^53 - 1"),
                                         ("3/0.001ms", "at least 1ms"), ("1/0.5ms", "at least 1ms")])
def test_rates_whose_arithmetic_is_not_exact_in_a_double_are_refused_naming_the_key(rate, words):
    from limiter import parse_rate
    from lb.config.load import check_rate
    from lb.errors import ConfigError
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


# -------------------------------------------------- instants out of order: 4 processes x 16 threads

HAMMER = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[1])
from limiter import build
url, prefix, seconds, proc = sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
algorithms = ["token-bucket", "fixed-window", "sliding-log", "sliding-counter"]
lims = {a: build(a, 100, 0.5, store=url, prefix=f"{prefix}{a}:", timeout=2.0) for a in algorithms}
for lim in lims.values():
    lim.strict = True
    lim.allow("warm-up", 1.0)  # connected, scripts loaded
print("ready", flush=True)
start = float(sys.stdin.readline())  # the parent's go, once every process is ready
admitted = {a: [] for a in algorithms}
lock = threading.Lock()
def hammer(tid):
    # every thread reads the wall clock on its own, outside any lock: instants reach Redis out of order.
    # Instants are seconds since `start` (plus 1000), distinct per thread by a few picoseconds.
    offset = 1000.0 + (proc * 16 + tid) * 1e-11
    mine = {a: [] for a in algorithms}
    while time.time() < start:
        time.sleep(0.001)
    while True:
        for a in algorithms:
            now = time.time() - start
            if now > seconds:
                with lock:
                    for b in algorithms:
                        admitted[b].extend(mine[b])
                return
            now += offset
            if lims[a].allow("hot", now).allowed:
                mine[a].append(repr(now))
ts = [threading.Thread(target=hammer, args=(i,)) for i in range(16)]
[t.start() for t in ts]
[t.join() for t in ts]
print(json.dumps({"admitted": admitted, "degraded": sum(l.degraded for l in lims.values())}))
"""


def _writes(server, prefix, stop, out):
    """Every write our scripts made, in the order Redis made them, from MONITOR: ("SET", key, value
    fields...) and ("ZADD", key, score).  The state written carries the instant each script judged its
    request at (the token bucket's stamp, the windows' index, the log's expiry = instant + W)."""
    c = server.client()
    with c.monitor() as m:
        out.append("ready")
        while not stop.is_set():
            try:
                cmd = m.next_command()["command"].split()
            except redis.exceptions.TimeoutError:
                continue        # nothing written for the client's socket timeout (after the hammering: stop)
            if len(cmd) > 2 and cmd[0] in ("SET", "ZADD") and cmd[1].startswith(prefix) and cmd[1].endswith("{hot}"):
                out.append((cmd[1][len(prefix):].split(":")[0], cmd[0], *cmd[2:]))


def test_instants_out_of_order_never_admit_more_than_the_rule_by_the_instant_the_script_used(own_redis):
    """4 processes x 16 threads on one key per algorithm, N = 100 per 0.5 s, for 1.5 s, each thread
    reading the clock itself (instants reach Redis out of order).  Each admission is placed at the
    instant its script judged it, read back from the state it wrote (MONITOR): its own instant, or the
    key's newest one when it arrived late (time never runs backwards for a key).  The sliding log then
    admits at most N in EVERY trailing window (before: up to 119 by its own instants, which is what the
    old script judged by); the fixed window and the sliding counter at most N in each window; the token
    bucket at most C + (b - a) * rate in any span [a, b] (GCRA)."""
    import json
    import subprocess
    import sys
    import threading
    import time
    from bisect import bisect_left, bisect_right
    from tests.support import ROOT, wait_until

    prefix, n, w, seconds = "ooo:", 100, 0.5, 1.5
    writes, stop = [], threading.Event()
    mon = threading.Thread(target=_writes, args=(own_redis, prefix, stop, writes), daemon=True)
    mon.start()
    wait_until(lambda: writes, 5.0)
    procs = [subprocess.Popen([sys.executable, "-c", HAMMER, str(ROOT), own_redis.url, prefix, str(seconds), str(i)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    for p in procs:  # every process up, connected and its scripts loaded before anyone starts
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    start = time.time() + 0.2
    for p in procs:
        p.stdin.write(f"{start!r}\n")
        p.stdin.flush()
    admitted = {}
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and not err, err
        r = json.loads(out)
        assert r["degraded"] == 0
        for a, ts in r["admitted"].items():
            admitted[a] = admitted.get(a, 0) + len(ts)
    c = own_redis.client()
    wait_until(lambda: c.set("ooo:end", 1) and sum(1 for x in writes[1:] if x[0] == "token-bucket")
               >= admitted["token-bucket"], 10.0)  # MONITOR has handed over the last writes
    stop.set()
    mon.join(10)
    worst = {}
    for a in ("token-bucket", "fixed-window", "sliding-log", "sliding-counter"):
        mine = [x[1:] for x in writes[1:] if x[0] == a]
        if a == "token-bucket":  # SET "tokens stamp": one per admission, stamp = the instant used
            us = sorted(float(x[2]) for x in mine)
            assert len(us) == admitted[a]
            over = max(j - i + 1 - (n + (us[j] - us[i]) * n / w) for i in range(len(us)) for j in range(i, len(us)))
            worst[a] = round(over, 6)
            assert over <= 1e-6, (a, over)
        elif a == "sliding-log":  # ZADD expiry: one per admission, expiry = the instant used + W
            es = sorted(float(x[1]) for x in mine)
            assert len(es) == admitted[a]
            worst[a] = max(bisect_right(es, e) - bisect_left(es, e - w + 1e-9) for e in es)
            assert worst[a] <= n, (a, worst[a])
        else:  # SET "k count" / "k prev cur": the window each admission was counted in
            per = {}
            last = None
            for x in mine:
                k, cur = x[1], int(x[-3])
                if (k, cur) != last:  # a sliding-counter denial may rewrite (roll) without counting
                    per[k] = max(per.get(k, 0), cur)
                last = (k, cur)
            worst[a] = max(per.values())
            assert sum(per.values()) == admitted[a] or a == "sliding-counter"
            assert worst[a] <= n, (a, per)
    print("admitted", admitted, "worst window", worst)


# ------------------------------------------------------------- maxmemory-policy, read at start and reload

@pytest.mark.parametrize("policy, warned", [("allkeys-lru", "evicts any key"), ("volatile-ttl", "keys with a TTL"),
                                            ("noeviction", None)])
def test_the_edge_reads_maxmemory_policy_and_warns_when_it_can_evict_limiter_keys(policy, warned):
    from lb.config.load import load
    from lb.limiting.store import memory_policy
    server = RedisServer(extra=("--maxmemory", "64mb", "--maxmemory-policy", policy)).start()
    try:
        [(level, line)] = memory_policy(load(["--backends", "http://127.0.0.1:9", "--store", server.url]))
    finally:
        server.stop()
    assert f"maxmemory 67108864 bytes, maxmemory-policy {policy}" in line
    if warned:
        assert level == logging.WARNING and warned in line and "fresh quota" in line, line
    else:
        assert level == logging.INFO and "no limiter key is evicted" in line, line


def test_config_renamed_away_is_said_once_not_fatal():
    from lb.config.load import load
    from lb.limiting.store import memory_policy
    server = RedisServer(extra=("--rename-command", "CONFIG", "")).start()
    try:
        [(level, line)] = memory_policy(load(["--backends", "http://127.0.0.1:9", "--store", server.url]))
    finally:
        server.stop()
    assert level == logging.WARNING and "cannot read maxmemory-policy" in line and "noeviction" in line, line


def test_the_edge_logs_the_policy_at_start_and_on_reload():
    import signal
    from tests.support import Edge
    server = RedisServer(extra=("--maxmemory", "64mb", "--maxmemory-policy", "volatile-lru")).start()
    try:
        edge = Edge("--backends", "http://127.0.0.1:9", "--limit", "5/s", "--store", server.url)
        try:
            edge.wait_log(r"maxmemory-policy volatile-lru evicts keys with a TTL")
            server.client().config_set("maxmemory-policy", "noeviction")
            edge.signal(signal.SIGHUP)
            edge.wait_log(r"maxmemory-policy noeviction: no limiter key is evicted")
        finally:
            edge.stop()
    finally:
        server.stop()


def test_a_shaped_log_with_instants_out_of_order_admits_at_most_n_units_in_every_trailing_window(redis_server):
    """Issue 29: the sliding log with a cost or a delay on Redis, instants up to 50 ms late (read outside
    any lock; injected, seeded): by each request's own run instant (now, or now + delay when held), every
    trailing window holds at most N units.  The script keeps entries for the TTL grace past their expiry,
    so a late instant still sees every entry of its window (pruned at now, 3-4 units over N here)."""
    import random
    from bisect import bisect_left, bisect_right
    from limiter import build
    rnd = random.Random(29)
    worst = 0
    for trial in range(40):
        cost, w = rnd.randint(1, 4), 0.2
        n = rnd.randint(cost, 12)
        max_delay = rnd.choice([0.0, 0.1]) if cost > 1 else 0.05   # cost 1, no delay: the base log's rule
        red = build("sliding-log", limit=n, window=w, cost=cost, max_delay=max_delay, store=redis_server.url,
                    prefix=f"test:shaped-ooo:{trial}:", timeout=2.0, deny_cache=0)
        red.strict = True
        runs, t = [], 1000.0
        for _ in range(400):
            t += rnd.expovariate(3 * n / w)
            now = t - rnd.uniform(0, 0.05)
            d = red.allow("k", now)
            if d.allowed:
                runs += [now + getattr(d, "delay", 0.0)] * cost
        runs.sort()
        worst = max(worst, max(bisect_right(runs, x) - bisect_left(runs, x - w + 1e-9) for x in runs) - n)
    assert worst <= 0, worst
