"""Instructions of Pipeline.limit alone (memory token bucket, X-Api-Key), n requests; ROOT env = checkout."""
import os, sys
root = os.environ.get("ROOT", ".")
sys.path.insert(0, root)
from lb.http.framing import Request
from lb.proxy.exchange import Exchange
from lb.proxy.pipeline import Pipeline
from lb.limiting.stage import LimitStage
from lb.ops.metrics import Metrics
from lb.limiting.keys import draw_label_secret
draw_label_secret()
class E: pass
e = E(); e.limiter = LimitStage("1000000/s"); e.metrics = Metrics()
if os.environ.get("NOLIMIT"): e.limiter = None
p = Pipeline(e)
req = Request.__new__(Request)
for s in Request.__slots__:
    try: setattr(req, s, None)
    except Exception: pass
distinct = os.environ.get("DISTINCT")
req.api_key = b"bench-unlimited"
n = int(sys.argv[1])
xs = [Exchange(req, 0.0) for _ in range(n)]
for x in xs: x.client_ip = "127.0.0.1"
lim = p.limit
for x in xs:
    lim(x, None, True)
print(xs[-1].rl, xs[-1].key)
