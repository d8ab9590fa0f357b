"""A CI-sized soak (bench/soak.py runs the long one): every good request answered, with its own body,
while slowloris connections are cut off, backends die and come back, and the Redis behind the limiter
is killed and restarted; resources return to where they started."""

from bench.soak import THREAD_CACHE, run


def test_soak_loses_nothing_and_gives_everything_back(own_redis):
    def restart_redis():
        own_redis.kill()
        own_redis.start()

    r = run(seconds=15, clients=3, slowloris=30, chaos_every=3.0, redis_restart=restart_redis,
            extra_edge_args=("--limit", "1000000/s", "--store", own_redis.url, "--on-store-error", "fail-open"))
    print("\n[soak]", r)
    assert r["edge_alive"] and r["tracebacks"] == 0
    assert r["sent"] > 300
    assert r["lost"] == 0, r                   # every request got an answer...
    assert r["mismatched"] == 0, r             # ...its own, once
    assert set(r["answered"]) <= {200, 502, 503, 504}, r["answered"]   # 5xx only while a backend was dying
    assert r["answered"][200] >= 0.9 * r["sent"], r["answered"]
    assert r["backend_restarts"] >= 3 and r["redis_restarts"] >= 1
    assert r["slowloris_cut"] > 0 and r["slowloris_held_max"] >= 20
    assert r["end"]["threads"] <= r["start"]["threads"] + 5 + THREAD_CACHE   # (the threads kept parked)
    assert r["end"]["fds"] <= r["start"]["fds"] + 10
    assert r["end"]["rss_mb"] <= r["start"]["rss_mb"] + 30
