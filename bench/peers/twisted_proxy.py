"""Twisted's ReverseProxyResource as the edge's peer in bench/peers.py.

    python twisted_proxy.py LISTEN_PORT BACKEND_PORT     # prints "listening 127.0.0.1:PORT"

Twisted's own reverse proxy: one upstream connection per request (its ProxyClient speaks HTTP/1.0), no pool.
"""

import sys

from twisted.internet import reactor
from twisted.web import proxy, server


def main() -> None:
    port, backend = int(sys.argv[1]), int(sys.argv[2])
    site = server.Site(proxy.ReverseProxyResource("127.0.0.1", backend, b""))
    site.noisy = False
    reactor.listenTCP(port, site, interface="127.0.0.1", backlog=1024)
    print(f"listening 127.0.0.1:{port}", flush=True)
    reactor.run()


if __name__ == "__main__":
    main()
