# usage: python3 cmp_step.py NEW_CHECKOUT OLD_CHECKOUT
import random, sys, importlib.util
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
old = load(sys.argv[2] + "/limiter/algorithms.py", "old_alg"); new = load(sys.argv[1] + "/limiter/algorithms.py", "new_alg")
rnd = random.Random(1)
n = 0
for trial in range(3000):
    limit = rnd.choice([1, 2, 3, 5, 10, 100, 1000, 10**6, 2**53 - 1])
    window = rnd.choice([0.001, 0.5, 1.0, 3.0, 60.0, 3600.0, 0.37])
    burst = rnd.choice([None, 1, 2, 7, limit])
    a, b = old.TokenBucket(limit, window, burst), new.TokenBucket(limit, window, burst)
    now = rnd.choice([0.0, 1e9, 1.7e9 + rnd.random(), 1e12])
    sa = sb = None
    for i in range(60):
        now += rnd.choice([0.0, 0.0, 5e-324, 1e-9, window / limit * rnd.random(), window * rnd.random(), window * 3, -0.01 if rnd.random() < 0.05 else 0.0, 1e-7])
        sa, da = a.step(sa, now); sb, db = b.step(sb, now)
        assert sa == sb and tuple(da) == tuple(db) and type(sa[0]) is type(sb[0]), (limit, window, burst, now, sa, sb, da, db)
        n += 1
print("ok", n)
