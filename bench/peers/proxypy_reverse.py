"""proxy.py (2.4) as a reverse proxy for bench/peers.py: every path to the backend in PEER_BACKEND.

Loaded with `--enable-reverse-proxy --plugins proxypy_reverse.ToBackend` (this directory on PYTHONPATH).
"""

import os

from proxy.http.server import ReverseProxyBasePlugin


class ToBackend(ReverseProxyBasePlugin):
    def routes(self):
        return [(r"/.*$", [os.environ["PEER_BACKEND"].encode()])]
