"""Raw TCP backends for the framing tests: real sockets on 127.0.0.1, scripted byte for byte.

The framing tests need backends that misbehave on command (answer early, die inside a head, stream an
endless chunked body, stop reading) and one that records exactly what arrived, parsed by the book and
nothing else (so a request hidden inside another shows up as an extra request). An HTTP library would
normalise exactly what these tests look at, so these are plain sockets, one thread per connection.
"""

from __future__ import annotations

import socket
import threading


class RawServer:
    """Accepts on a free port; each connection runs handler(sock, server) on its own thread."""

    def __init__(self, handler):
        self.handler = handler
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(128)
        self.port = self.lsock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                s, _ = self.lsock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                self.socks.append(s)
            threading.Thread(target=self._run, args=(s,), daemon=True).start()

    def _run(self, s):
        try:
            self.handler(s, self)
        except OSError:
            pass
        finally:
            s.close()

    def close(self):
        self.closed = True
        self.lsock.close()
        for s in list(self.socks):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Unparseable(Exception):
    pass


class ConnReader:
    def __init__(self, s: socket.socket):
        self.s, self.buf = s, b""

    def fill(self) -> bool:
        d = self.s.recv(65536)
        self.buf += d
        return bool(d)

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if len(self.buf) > 65536 or not self.fill():
                raise EOFError
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self.fill():
                raise EOFError
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def head(self) -> bytes | None:
        while b"\r\n\r\n" not in self.buf:
            if not self.fill():
                if self.buf:
                    raise EOFError
                return None
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        return head


def read_request(r: ConnReader):
    """(method, target, [(name, value)], body) by RFC 9112, strictly; None at a clean EOF."""
    head = r.head()
    if head is None:
        return None
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise Unparseable(lines[0])
    headers = []
    for ln in lines[1:]:
        name, colon, value = ln.partition(b":")
        if not colon or not name or name != name.strip():
            raise Unparseable(ln)
        headers.append((name.decode("latin-1"), value.strip().decode("latin-1")))
    te = [v.lower() for k, v in headers if k.lower() == "transfer-encoding"]
    cl = [v for k, v in headers if k.lower() == "content-length"]
    if te and cl:
        raise Unparseable(b"CL and TE")
    if te:
        if te != ["chunked"]:
            raise Unparseable(b"TE " + te[0].encode())
        body = b""
        while True:
            size_s = r.line().split(b";")[0]
            if not size_s or size_s.strip(b"0123456789abcdefABCDEF"):
                raise Unparseable(b"chunk size " + size_s)
            size = int(size_s, 16)
            if size == 0:
                while r.line():
                    pass
                break
            body += r.exact(size)
            if r.exact(2) != b"\r\n":
                raise Unparseable(b"chunk end")
    elif cl:
        if len(set(cl)) != 1 or not cl[0].isdigit():
            raise Unparseable(b"CL")
        body = r.exact(int(cl[0]))
    else:
        body = b""
    return parts[0].decode("latin-1"), parts[1].decode("latin-1"), headers, body


class RecordingBackend(RawServer):
    """Records every request it parses, per connection, and answers 200 naming the request's target:
    a response that reaches the wrong client shows it. A request it cannot parse is recorded as
    ('UNPARSEABLE', ...) and the connection closed."""

    def __init__(self):
        self.requests: list[tuple] = []
        super().__init__(self._serve)

    def _serve(self, s, _server):
        r = ConnReader(s)
        while True:
            try:
                req = read_request(r)
            except Unparseable as e:
                with self.lock:
                    self.requests.append(("UNPARSEABLE", str(e), [], b""))
                s.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            except EOFError:
                return
            if req is None:
                return
            with self.lock:
                self.requests.append(req)
            body = f"target={req[1]} len={len(req[3])}\n".encode()
            s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    def take(self) -> list[tuple]:
        with self.lock:
            out, self.requests = self.requests, []
        return out
