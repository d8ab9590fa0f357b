"""grpc_rate.py PORT SECONDS THREADS: unary calls/s on one channel (THREADS callers at once)."""
import sys, threading, time
import grpc
port, secs, n = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
ch = grpc.insecure_channel(f"127.0.0.1:{port}")
u = ch.unary_unary("/test.Echo/Unary")
u(b"warm", timeout=10)
counts = [0] * n
end = time.monotonic() + secs
def run(i):
    while time.monotonic() < end:
        u(b"x", timeout=10)
        counts[i] += 1
ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
[t.start() for t in ts]; [t.join() for t in ts]
print(f"{sum(counts)} calls in {secs:g}s: {sum(counts)/secs:.0f} calls/s")
