"""The floor of the edge's model in bench/peers.py: the least a thread-per-connection Python proxy can do.

    python floor_threads.py LISTEN_PORT BACKEND_PORT     # prints "listening 127.0.0.1:PORT"

No parsing, no checks, no pool: each client connection gets its own backend connection and a thread that
relays one recv each way (a small request and nginx's `return 200` answer fit one read). Not a proxy
anyone should run -- a measure of what threads, the GIL and four system calls per request cost, so the
edge's figure can be split into the model's share and its own work.
"""

import socket
import sys
import threading


def serve(c: socket.socket, backend: int) -> None:
    u = socket.create_connection(("127.0.0.1", backend))
    for s in (c, u):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    recv, send, urecv, usend = c.recv, c.sendall, u.recv, u.sendall
    try:
        while True:
            data = recv(65536)
            if not data:
                break
            usend(data)
            send(urecv(65536))
    finally:
        c.close()
        u.close()


def main() -> None:
    port, backend = int(sys.argv[1]), int(sys.argv[2])
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(4096)
    print(f"listening 127.0.0.1:{port}", flush=True)
    while True:
        c, _ = ls.accept()
        threading.Thread(target=serve, args=(c, backend), daemon=True).start()


if __name__ == "__main__":
    main()
