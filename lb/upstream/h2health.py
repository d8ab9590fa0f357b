"""Active health checks of an h2c:// backend, over HTTP/2 by prior knowledge on a fresh connection.

[health] protocol = "http" (default): GET health_path, a 2xx passes (as for HTTP/1.1 backends).
[health] protocol = "grpc": grpc.health.v1.Health/Check for the server as a whole (service ""), and only
SERVING passes: a gRPC server answers every path with HTTP 200, so its HTTP status says nothing.
"""

from __future__ import annotations

import socket
from time import monotonic

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from lb.netaddr import hostport

CHECK = b"/grpc.health.v1.Health/Check"
EMPTY_REQUEST = b"\x00\x00\x00\x00\x00"  # a gRPC message frame: not compressed, length 0 (service "")
SERVING = b"\x08\x01"  # HealthCheckResponse{status: SERVING}


def probe(b, path: str, timeout: float, grpc: bool) -> tuple[bool, str]:
    deadline = monotonic() + timeout
    s = None
    try:
        s = socket.create_connection((b.spec.address or b.spec.host, b.spec.port), timeout=timeout)
        c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        c.initiate_connection()
        fields = [
            (b":method", b"POST" if grpc else b"GET"),
            (b":scheme", b"http"),
            (b":path", CHECK if grpc else path.encode()),
            (b":authority", hostport(b.spec.host, b.spec.port).encode()),
            (b"user-agent", b"edge-health"),
        ]
        if grpc:
            fields += [(b"content-type", b"application/grpc"), (b"te", b"trailers")]
        c.send_headers(1, fields, end_stream=not grpc)
        if grpc:
            c.send_data(1, EMPTY_REQUEST, end_stream=True)
        s.sendall(c.data_to_send())
        status, body, meta = None, b"", {}
        while True:
            s.settimeout(max(deadline - monotonic(), 0.001))
            data = s.recv(65536)
            if not data:
                return False, "closed without a response"
            for ev in c.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    meta = dict(ev.headers)
                    status = int(meta.get(b":status", b"0"))
                    if not grpc:
                        return 200 <= status < 300, f"HTTP/2 {status}"
                elif isinstance(ev, h2.events.DataReceived):
                    body += ev.data
                    c.acknowledge_received_data(ev.flow_controlled_length, 1)
                    if len(body) > 65536:
                        return False, "health answer too large"
                elif isinstance(ev, h2.events.TrailersReceived):
                    meta.update(dict(ev.headers))
                elif isinstance(ev, h2.events.StreamEnded):
                    code = meta.get(b"grpc-status")
                    if code != b"0":
                        return False, f"grpc-status {code.decode() if code else 'missing'}" + (
                            f" ({meta[b'grpc-message'].decode('latin-1')})" if b"grpc-message" in meta else ""
                        )
                    return body[5:] == SERVING, "SERVING" if body[5:] == SERVING else "NOT_SERVING"
                elif isinstance(ev, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                    return False, "the backend reset the check" + (
                        "" if grpc else ' (a gRPC server? [health] protocol = "grpc")'
                    )
            out = c.data_to_send()
            if out:
                s.sendall(out)
    except socket.timeout:
        return False, f"timeout after {timeout:g}s"
    except h2.exceptions.ProtocolError as e:
        return False, f"invalid HTTP/2: {e}"
    except OSError as e:
        return False, e.strerror or str(e) or type(e).__name__
    finally:
        if s is not None:
            s.close()
