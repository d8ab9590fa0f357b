"""bench/peers.py's Twisted peer: twisted.web.proxy.ReverseProxyResource on 127.0.0.1:LISTEN -> BACKEND.

    python3 bench/peers/twisted_proxy.py LISTEN BACKEND
"""
import sys

from twisted.internet import reactor
from twisted.web import proxy, server

listen, backend = int(sys.argv[1]), int(sys.argv[2])
reactor.listenTCP(listen, server.Site(proxy.ReverseProxyResource("127.0.0.1", backend, b"")), interface="127.0.0.1")
reactor.run()
