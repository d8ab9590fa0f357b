"""A gRPC server (grpcio, not ours) for the HTTP/2 tests: python -m tests.grpc_backend --name N [--port P].

Methods on /test.Echo/ (raw bytes, no protobuf needed): Unary (answers "NAME:request", trailing metadata
x-served-by), ServerStream (request "k" -> k messages), ClientStream (the messages joined), Bidi (each
message echoed as it arrives), Fail (NOT_FOUND with trailing metadata), Slow (sleeps the ms it is sent).
grpc.health.v1.Health answers SERVING, or NOT_SERVING after /test.Echo/Sick.
"""

import argparse
import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default="g")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    name = a.name.encode()
    hs = health.HealthServicer()
    hs.set("", health_pb2.HealthCheckResponse.SERVING)

    def unary(req, ctx):
        ctx.set_trailing_metadata((("x-served-by", a.name),))
        return name + b":" + req

    def server_stream(req, ctx):
        for i in range(int(req)):
            yield b"%s:%d" % (name, i)

    def client_stream(it, ctx):
        return b"|".join(it)

    def bidi(it, ctx):
        for m in it:
            yield name + b":" + m

    def fail(req, ctx):
        ctx.set_trailing_metadata((("x-why", "because"),))
        ctx.abort(grpc.StatusCode.NOT_FOUND, "no such thing")

    def slow(req, ctx):
        time.sleep(int(req) / 1000)
        return b"late"

    cancelled = [0]

    def watch(req, ctx):
        # Messages until the call ends; a cancellation (the client's RST_STREAM, passed on) is counted.
        ctx.add_callback(lambda: cancelled.__setitem__(0, cancelled[0] + (not ctx.is_active() and 1)))
        i = 0
        while ctx.is_active():
            yield b"%d" % i
            i += 1
            time.sleep(0.01)

    def cancels(req, ctx):
        return b"%d" % cancelled[0]

    def sick(req, ctx):
        hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        return b"ok"

    ident = dict(request_deserializer=None, response_serializer=None)
    handlers = {"Unary": grpc.unary_unary_rpc_method_handler(unary, **ident),
                "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream, **ident),
                "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream, **ident),
                "Bidi": grpc.stream_stream_rpc_method_handler(bidi, **ident),
                "Fail": grpc.unary_unary_rpc_method_handler(fail, **ident),
                "Slow": grpc.unary_unary_rpc_method_handler(slow, **ident),
                "Sick": grpc.unary_unary_rpc_method_handler(sick, **ident),
                "Watch": grpc.unary_stream_rpc_method_handler(watch, **ident),
                "Cancels": grpc.unary_unary_rpc_method_handler(cancels, **ident)}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", handlers),))
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port(f"127.0.0.1:{a.port}")
    server.start()
    # SIGTERM: a graceful stop (GOAWAY, the calls in flight finish), as a gRPC server's orchestrator does
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.stop, args=(10,)).start())
    print(f"listening 127.0.0.1:{port} name={a.name}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
