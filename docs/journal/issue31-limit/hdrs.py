import os, sys, random
sys.path.insert(0, os.environ["ROOT"])
from lb.limiting.stage import LimitStage
from lb.limiting.keys import draw_label_secret
draw_label_secret()
class R: pass
rnd = random.Random(7)
out = []
for rate in ["5/s", "3/m", "1000000/s", "2/1.5s", "100/10s", "7/h", "1/ms"]:
    st = LimitStage(rate)
    now = 1.7e9 + rnd.random()
    for i in range(3000):
        req = R(); req.api_key = rnd.choice([None, b"k1", b"k2", b"k" * 300])
        ip = rnd.choice(["192.0.2.1", "2001:db8::1", "2001:db8::2:1"])
        now += rnd.choice([0.0, 1e-7, 0.01, 0.2, 0.5, 1.0, 2.0, 30.0, 0.999, 1.001])
        v = st.check(req, ip, now=now)
        out.append((rate, i, v.status, v.reason, v.headers, v.label, v.rejected, v.admitted, v.limited_by))
import hashlib, pickle
print(len(out), hashlib.sha256(repr(out).encode()).hexdigest())
