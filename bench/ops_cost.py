"""What issue 14's operability adds to each request, per call, in microseconds (best of 5 runs).

    taskset -c 1 python3 -m bench.ops_cost

The pieces: a request id (made, or a client's checked), the metrics record (now with a per-backend
upstream histogram too), and the access-log enqueue (the writer thread formats later). Compare with a
request's whole cost through the edge (~150-300 us here, README "Performance").
"""

from __future__ import annotations

import os
import sys
import tempfile
import timeit
from types import SimpleNamespace

from lb.ops.accesslog import AccessLog
from lb.ops.metrics import Metrics
from lb.proxy.pipeline import _REQUEST_ID, new_request_id

N = 100_000


def main() -> int:
    m = Metrics()
    log = AccessLog(os.path.join(tempfile.mkdtemp(), "access.log"), "json")
    req = SimpleNamespace(method=b"GET", target=b"/some/path?q=1")
    x = SimpleNamespace(req=req, backend=SimpleNamespace(url="http://127.0.0.1:9001"), key="key:#5d41402abc4b",
                        request_id=b"6f1c0a5e" * 4, client_ip="10.0.0.5", bytes_sent=220, upstream_seconds=0.0007,
                        tries=1, limited_by="")
    cases = [
        ("new_request_id()", new_request_id),
        ("client X-Request-Id check", lambda: _REQUEST_ID.fullmatch(b"client-id-1234567890")),
        ("metrics.backend_done (2 histograms)", lambda: m.backend_done("http://127.0.0.1:9001", 200, 0.0008, 0.0007)),
        ("access_log.record (enqueue)", lambda: log.record(x, 200, 0.0008)),
    ]
    total = 0.0
    for name, fn in cases:
        us = min(timeit.repeat(fn, number=N, repeat=5)) / N * 1e6
        total += us
        print(f"{name:40s} {us:6.2f} us")
    print(f"{'sum':40s} {total:6.2f} us per request")
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
