"""An open-loop, constant-rate HTTP/1.1 load generator: the fallback for machines without wrk2.

    python -m wrk.loadgen -t2 -c50 -d30s -R1000 --latency -H 'X-Api-Key: k1' http://127.0.0.1:8080/
    python wrk/loadgen.py  ...same flags...      --json result.json

Flags follow wrk2: -t THREADS (here: worker *processes*), -c CONNECTIONS (split among them), -d DURATION
(30, 30s, 2m, 1h), -R RATE (requests/s in total; 2k works; -R 0 = closed loop, see below), -H 'Name: value'
(repeatable), --latency (full percentile list), --timeout (per request, default 2s). Extras: --json FILE,
--method, --body.

How it measures (the reason it exists):
- Request i of worker k has an intended send time  start + k/R + i*T/R  (the workers' streams interleave
  into one evenly spaced stream of R req/s). Latency is measured from that intended time to the last byte
  of the response, as wrk2 does, so a stall is charged to every request that should have been sent
  during it (no coordinated omission).
- A fixed set of -c keep-alive connections, one request in flight on each. When a request is due and no
  connection is free it waits for one; its latency still counts from the intended time. A connection the
  server closes is reopened for the next request (counted as a reconnect).
- Each worker is one process with one epoll loop over non-blocking sockets, pre-built request bytes and a
  minimal response parser (status line, headers to CRLFCRLF, Content-Length / chunked / until-close body).
  Latencies are kept exactly (an array of floats per worker) and merged at the end.
- Accounting: every scheduled request that was handed to a connection is "sent" and ends as exactly one
  of: a response (counted by status) or an error (connect, read, write, timeout). So
  sent == sum(status counts) + sum(errors). Requests still due when the window closed are "unsent".
- Keeping up: the run "kept up" when the achieved rate (responses / duration) is at least 99% of -R and
  the send lag (actual minus intended send time) has p99 <= 10 ms. Otherwise a WARNING line says which.
- -R 0: closed loop (each connection sends its next request as soon as the previous response is in);
  latency is then from the actual send. Only for measuring the maximum throughput.

Timer resolution: epoll waits in whole milliseconds, so sends are late by up to ~1 ms (wrk2's event
loop has the same granularity); the "Send lag" line shows by how much, and it is part of the latency.
"""

from __future__ import annotations

import argparse
import array
import errno
import gc
import json
import math
import multiprocessing
import os
import re
import select
import shlex
import signal
import socket
import sys
import time
from collections import deque
from urllib.parse import urlsplit

if __package__ in (None, ""):
    # `python wrk/loadgen.py`: make `wrk` importable the same way `-m` does.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from wrk.report import JSON_PERCENTILES, KEEP_UP_LAG_MS, KEEP_UP_RATE, KEEP_UP_RULE, format_report  # noqa: E402


# Connection states. A connection slot with no socket is "disconnected" and sits in its own queue.
IDLE, CONNECTING, BUSY = 0, 1, 2
# Body framing of the response being read.
M_HEAD, M_LEN, M_CHUNKED, M_CLOSE = 0, 1, 2, 3

EPOLLIN, EPOLLOUT = select.EPOLLIN, select.EPOLLOUT


# ---------------------------------------------------------------------------------------------- flags

def parse_duration(text: str) -> float:
    """wrk-style durations: 30, 30s, 1.5m, 2h, 500ms."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"bad duration {text!r} (e.g. 10s, 1m)")
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]
    return float(m.group(1)) * scale


def parse_metric(text: str) -> float:
    """wrk-style counts: 100, 2k, 1.5M."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"bad number {text!r} (e.g. 200, 2k)")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]


def parse_header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"bad header {text!r} (expected 'Name: value')")
    return name.strip(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m wrk.loadgen",
        description="Open-loop constant-rate HTTP/1.1 load generator (wrk2-compatible flags; "
                    "latency measured from each request's intended send time).")
    p.add_argument("-t", "--threads", type=lambda s: int(parse_metric(s)), default=1,
                   help="worker processes (default 1)")
    p.add_argument("-c", "--connections", type=lambda s: int(parse_metric(s)), default=10,
                   help="keep-alive connections in total (default 10)")
    p.add_argument("-d", "--duration", type=parse_duration, default=10.0, help="e.g. 10s, 1m (default 10s)")
    p.add_argument("-R", "--rate", type=parse_metric, default=None,
                   help="requests per second in total (required; 0 = closed loop, max throughput)")
    p.add_argument("-H", "--header", type=parse_header, action="append", default=[],
                   help="'Name: value', repeatable")
    p.add_argument("--latency", action="store_true", help="print the full percentile list")
    p.add_argument("--timeout", type=parse_duration, default=2.0, help="per-request timeout (default 2s)")
    p.add_argument("--json", metavar="FILE", help="also write the full result as JSON ('-' = stdout)")
    p.add_argument("--method", default="GET")
    p.add_argument("--body", default=None, help="request body (sent with Content-Length)")
    p.add_argument("url")
    return p


def build_request(url: str, method: str = "GET", headers=(), body: str | bytes | None = None
                  ) -> tuple[str, int, bytes]:
    """(host, port, request bytes) for an http:// URL."""
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"only http://host[:port]/path URLs are supported, not {url!r}")
    port = u.port or 80
    target = (u.path or "/") + (f"?{u.query}" if u.query else "")
    hdrs = list(headers)
    if not any(k.lower() == "host" for k, _ in hdrs):
        hdrs.insert(0, ("Host", u.netloc))
    data = body.encode() if isinstance(body, str) else body
    if data is not None and not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in hdrs):
        hdrs.append(("Content-Length", str(len(data))))
    head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs) + "\r\n"
    return u.hostname, port, head.encode("latin-1") + (data or b"")


# --------------------------------------------------------------------------------------------- worker

class _Conn:
    __slots__ = ("sock", "fd", "state", "buf", "intended", "sent_at", "status", "keep", "mode", "remaining",
                 "cpos", "wpending")

    def __init__(self):
        self.sock = None
        self.fd = -1
        self.state = IDLE
        self.buf = b""
        self.intended = self.sent_at = 0.0
        self.status = 0
        self.keep = True
        self.mode = -1          # -1: still reading the header block
        self.remaining = 0
        self.cpos = 0
        self.wpending = b""


def _tight_timer_slack() -> None:
    """Linux lets a sleeping thread wake up to 50 us late (timer slack); ask for 1 us so sends leave on time.
    Best effort: without it sends are a little later, which the send-lag line shows."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)       # PR_SET_TIMERSLACK, in nanoseconds
    except Exception:
        pass


class _BadResponse(Exception):
    pass


def _worker(cfg: dict, pipe) -> None:
    """One worker process: pre-connect, say ready, wait for the common start time, run, send results."""
    stop: list[int] = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))  # Ctrl-C: end the window early, still report
    try:
        pipe.send(("result", _run_worker(cfg, pipe, stop)))
    except BaseException as e:  # report, don't hang the parent
        import traceback
        pipe.send(("crash", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _run_worker(cfg: dict, pipe, stop: list) -> dict:
    addr = (cfg["host"], cfg["port"])
    req: bytes = cfg["request"]
    req_len = len(req)
    head_request = cfg["method"].upper() == "HEAD"
    rate = cfg["rate"]                  # this worker's share; 0 = closed loop
    open_loop = rate > 0
    interval = 1.0 / rate if open_loop else 0.0
    timeout = cfg["timeout"]
    mono = time.monotonic

    ep = select.epoll()
    fdmap: dict[int, _Conn] = {}
    idle: deque[_Conn] = deque()
    down: deque[_Conn] = deque()
    slots = [_Conn() for _ in range(cfg["connections"])]

    lat = array.array("d")
    lag = array.array("d")
    statuses: dict[int, int] = {}
    errors = {"connect": 0, "read": 0, "write": 0, "timeout": 0}
    counters = {"sent": 0, "reconnects": 0, "bytes_read": 0}

    def new_socket() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    # Pre-connect every slot (blocking, bounded) so the first requests do not pay for the handshake.
    for c in slots:
        s = new_socket()
        s.settimeout(min(timeout, 5.0))
        try:
            s.connect(addr)
        except OSError:
            s.close()
            down.append(c)       # not an error yet: the request that finds this slot will try again
            continue
        s.setblocking(False)
        c.sock, c.fd = s, s.fileno()
        fdmap[c.fd] = c
        ep.register(c.fd, EPOLLIN)
        idle.append(c)
    _tight_timer_slack()
    gc.disable()      # the loop makes no reference cycles; a collector pause would be charged as latency
    pipe.send(("ready", len(idle)))
    start = pipe.recv()
    cpu0 = time.process_time()
    delay = start - mono()
    if delay > 0:
        time.sleep(delay)

    def drop(c: _Conn) -> None:
        """Close the slot's socket; the slot waits in `down` for the next request."""
        if c.sock is not None:
            fdmap.pop(c.fd, None)
            try:
                ep.unregister(c.fd)
            except OSError:
                pass
            c.sock.close()
            c.sock = None
            c.fd = -1
        c.state = IDLE
        c.buf = b""
        c.wpending = b""
        down.append(c)

    def fail(c: _Conn, kind: str) -> None:
        errors[kind] += 1
        drop(c)

    def write(c: _Conn) -> None:
        c.mode = -1
        c.buf = b""
        c.state = BUSY
        try:
            n = c.sock.send(req)
        except BlockingIOError:
            n = 0
        except OSError:
            fail(c, "write")
            return
        if n < req_len:
            c.wpending = req[n:]
            ep.modify(c.fd, EPOLLIN | EPOLLOUT)

    def connect(c: _Conn) -> None:
        s = new_socket()
        s.setblocking(False)
        rc = s.connect_ex(addr)
        if rc not in (0, errno.EINPROGRESS):
            s.close()
            errors["connect"] += 1
            c.state = IDLE
            down.append(c)
            return
        c.sock, c.fd = s, s.fileno()
        fdmap[c.fd] = c
        if rc == 0:
            counters["reconnects"] += 1
            ep.register(c.fd, EPOLLIN)
            write(c)
        else:
            c.state = CONNECTING
            ep.register(c.fd, EPOLLOUT)

    def complete(c: _Conn, now: float) -> None:
        lat.append(now - c.intended)
        st = c.status
        statuses[st] = statuses.get(st, 0) + 1
        if c.keep:
            c.state = IDLE
            c.buf = b""
            idle.append(c)
        else:
            drop(c)

    def parse(c: _Conn, buf: bytes) -> bool:
        """Consume buf (everything unread of this response); True when the response is complete."""
        while c.mode < 0:
            he = buf.find(b"\r\n\r\n")
            if he < 0:
                if len(buf) > 65536:
                    raise _BadResponse("header block over 64 KiB")
                c.buf = buf
                return False
            if buf[:5] != b"HTTP/" or buf[12:13] not in (b" ", b"\r"):
                raise _BadResponse("not an HTTP/1.x status line")
            try:
                status = int(buf[9:12])
            except ValueError:
                raise _BadResponse("bad status code") from None
            head = buf[:he].lower()
            bs = he + 4
            if 100 <= status < 200 and status != 101:   # interim response (100 Continue): skip it
                buf = buf[bs:]
                continue
            c.status = status
            if head[5:8] == b"1.0":
                c.keep = b"\r\nconnection: keep-alive" in head
            else:
                c.keep = b"\r\nconnection: close" not in head
            if head_request or status in (204, 304):
                c.mode = M_HEAD
                return True
            if b"\r\ntransfer-encoding:" in head and b"chunked" in head:   # wins over Content-Length
                c.mode = M_CHUNKED
                c.cpos = bs
                break
            k = head.find(b"\r\ncontent-length:")
            if k >= 0:
                eol = head.find(b"\r\n", k + 17)
                try:
                    n = int(head[k + 17:eol] if eol > 0 else head[k + 17:])
                except ValueError:
                    raise _BadResponse("bad Content-Length") from None
                c.mode = M_LEN
                c.buf = b""
                c.remaining = n - (len(buf) - bs)
                return c.remaining <= 0
            c.mode = M_CLOSE          # no framing: the body ends when the server closes
            c.keep = False
            c.buf = b""
            return False
        mode = c.mode
        if mode == M_LEN:
            c.remaining -= len(buf)
            return c.remaining <= 0
        if mode == M_CHUNKED:
            pos = c.cpos
            while True:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                try:
                    size = int(buf[pos:eol].split(b";", 1)[0], 16)
                except ValueError:
                    raise _BadResponse("bad chunk size") from None
                if size == 0:         # last chunk, then optional trailers, then an empty line
                    if buf[eol + 2:eol + 4] == b"\r\n" or buf.find(b"\r\n\r\n", eol) >= 0:
                        return True
                    break
                nxt = eol + 2 + size + 2
                if len(buf) < nxt:
                    break
                pos = nxt
            c.cpos = pos
            c.buf = buf
            return False
        return False                  # M_CLOSE: complete at EOF

    open_start = start + cfg["phase"]
    end = start + cfg["duration"]
    intended_total = (max(0, math.ceil((cfg["duration"] - cfg["phase"]) / interval - 1e-9))
                      if open_loop else 0)
    i = 0
    next_t = open_start
    next_check = start + 0.05
    poll = ep.poll
    epfd = ep.fileno()
    wait = select.select
    recv_size = 65536
    drain_deadline = None
    ended_at = None

    while True:
        now = mono()
        if stop and end > now:
            end = now                 # Ctrl-C: close the window now, then drain as usual
            intended_total = min(intended_total, i)
        # Hand every due request to a free connection (or one to reopen); the rest wait, still due.
        while idle or down:
            if open_loop:
                if next_t > now or i >= intended_total or now >= end:
                    break             # not due yet, or the window has closed: what is left is unsent
                t_int = next_t
                i += 1
                next_t = open_start + i * interval
            else:
                if now >= end:
                    break
                t_int = now
            c = idle.popleft() if idle else down.popleft()
            c.intended = t_int
            c.sent_at = now
            lag.append(now - t_int)
            counters["sent"] += 1
            if c.sock is None:
                connect(c)
                if not open_loop and c.sock is None:
                    break             # closed loop, refused at once: retry on the next turn, not in a spin
            else:
                write(c)

        # How long may we sleep?
        if open_loop and i < intended_total and now < end:
            to = max(0.0, next_t - now) if (idle or down) else 0.05
        elif not open_loop and now < end:
            to = min(0.05, end - now)
        else:
            if ended_at is None:
                ended_at = now
                drain_deadline = now + timeout + 0.1
            if not any(c.state != IDLE for c in slots) or now > drain_deadline:
                break
            to = 0.05
        if now >= next_check:         # per-request timeouts, checked every 50 ms
            next_check = now + 0.05
            for c in slots:
                if c.state != IDLE and now - c.sent_at > timeout:
                    fail(c, "timeout")
        to = min(to, max(0.0, next_check - now))

        # epoll_wait sleeps in whole milliseconds (up to ~1 ms late at every send); select() on the
        # epoll fd sleeps in microseconds, then poll(0) collects what is ready.
        if to > 0 and not wait((epfd,), (), (), to)[0]:
            continue
        for fd, ev in poll(0):
            c = fdmap.get(fd)
            if c is None:
                continue
            st = c.state
            if st == CONNECTING:
                err = c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    fail(c, "connect")
                    continue
                counters["reconnects"] += 1
                ep.modify(fd, EPOLLIN)
                write(c)
                continue
            if ev & EPOLLOUT and c.wpending:
                try:
                    n = c.sock.send(c.wpending)
                except BlockingIOError:
                    n = 0
                except OSError:
                    fail(c, "write")
                    continue
                c.wpending = c.wpending[n:]
                if not c.wpending:
                    ep.modify(fd, EPOLLIN)
                if not ev & (EPOLLIN | select.EPOLLERR | select.EPOLLHUP):
                    continue
            try:
                data = c.sock.recv(recv_size)
            except BlockingIOError:
                continue
            except OSError:
                if st == BUSY:
                    fail(c, "read")
                else:
                    drop(c)
                continue
            if not data:
                if st == BUSY:
                    if c.mode == M_CLOSE:
                        complete(c, mono())     # keep is False: drops the socket
                    else:
                        fail(c, "read")         # closed before the response was whole
                else:
                    drop(c)                     # idle keep-alive connection closed: reopen on demand
                continue
            counters["bytes_read"] += len(data)
            if st != BUSY:
                drop(c)                         # bytes nobody asked for: this connection is confused
                continue
            try:
                done = parse(c, c.buf + data if c.buf else data)
            except _BadResponse:
                fail(c, "read")
                continue
            if done:
                complete(c, mono())

    window = end - start
    for c in slots:
        if c.state != IDLE:           # still in flight when the drain gave up
            fail(c, "timeout")
    for c in slots:
        if c.sock is not None:
            c.sock.close()
    ep.close()
    return {
        "latencies": lat.tobytes(),
        "lags": lag.tobytes(),
        "statuses": statuses,
        "errors": errors,
        "sent": counters["sent"],
        "intended": intended_total if open_loop else None,
        "reconnects": counters["reconnects"],
        "bytes_read": counters["bytes_read"],
        "window": window,
        "cpu_s": time.process_time() - cpu0,
        "wall_s": mono() - start,
    }


# ------------------------------------------------------------------------------------------- the run

def _percentile(sorted_vals, p: float):
    """Nearest rank: the smallest value with at least p% of the values at or below it (as HdrHistogram)."""
    n = len(sorted_vals)
    if not n:
        return None
    k = max(0, math.ceil(p / 100.0 * n - 1e-9) - 1)
    return sorted_vals[min(k, n - 1)]


def run(url: str, threads: int = 1, connections: int = 10, duration: float = 10.0, rate: float | None = 0,
        headers=(), timeout: float = 2.0, method: str = "GET", body=None, command: str | None = None) -> dict:
    """Run one load test and return the result dict (the same thing --json writes)."""
    if threads < 1 or connections < threads:
        raise ValueError("need threads >= 1 and connections >= threads")
    rate = float(rate or 0)
    if rate < 0 or duration <= 0:
        raise ValueError("rate must be >= 0 and duration > 0")
    host, port, request = build_request(url, method, headers, body)
    ctx = multiprocessing.get_context("fork")
    workers = []
    for k in range(threads):
        cfg = {
            "host": host, "port": port, "request": request, "method": method,
            "connections": connections // threads + (1 if k < connections % threads else 0),
            "rate": rate / threads, "phase": k / rate if rate else 0.0,
            "duration": duration, "timeout": timeout,
        }
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(cfg, child), daemon=True, name=f"loadgen-{k}")
        proc.start()
        child.close()
        workers.append((proc, parent))
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # workers stop on Ctrl-C; we collect
    try:
        preconnected = 0
        for proc, pipe in workers:
            if not pipe.poll(min(timeout, 5.0) * connections + 10):
                raise RuntimeError("a worker did not get ready")
            tag, val = pipe.recv()
            if tag != "ready":
                raise RuntimeError(f"worker failed before the start:\n{val}")
            preconnected += val
        start = time.monotonic() + 0.05
        for _, pipe in workers:
            pipe.send(start)
        parts = []
        for proc, pipe in workers:
            if not pipe.poll(duration + timeout + 30):
                raise RuntimeError("a worker did not report in time")
            tag, val = pipe.recv()
            if tag != "result":
                raise RuntimeError(f"worker crashed:\n{val}")
            parts.append(val)
    finally:
        for proc, pipe in workers:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        signal.signal(signal.SIGINT, old_int)
    return _merge(parts, url=url, threads=threads, connections=connections, duration=duration, rate=rate,
                  method=method, preconnected=preconnected, command=command)


def _merge(parts: list[dict], **meta) -> dict:
    lat = array.array("d")
    lag = array.array("d")
    statuses: dict[int, int] = {}
    errors = {"connect": 0, "read": 0, "write": 0, "timeout": 0}
    for p in parts:
        lat.frombytes(p["latencies"])
        lag.frombytes(p["lags"])
        for k, v in p["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
        for k, v in p["errors"].items():
            errors[k] += v
    rate = meta["rate"]
    open_loop = rate > 0
    window = max(p["window"] for p in parts)
    completed = len(lat)
    sent = sum(p["sent"] for p in parts)
    achieved = completed / window if window > 0 else 0.0
    slat = sorted(lat)
    slag = sorted(lag)
    ms = lambda v: None if v is None else round(v * 1000.0, 4)  # noqa: E731
    latency_ms = {k: ms(_percentile(slat, p)) for k, p in JSON_PERCENTILES.items()}
    if completed:
        mean = math.fsum(slat) / completed
        var = math.fsum((x - mean) ** 2 for x in slat) / completed
        sd = math.sqrt(var)
        within = sum(1 for x in slat if abs(x - mean) <= sd) / completed
        latency_ms.update(mean=ms(mean), stdev=ms(sd), within_stdev_pct=round(within * 100, 2))
    else:
        latency_ms.update(mean=None, stdev=None, within_stdev_pct=None)
    lag_ms = {k: ms(_percentile(slag, p)) for k, p in (("p50", 50.0), ("p99", 99.0), ("max", 100.0))}
    if open_loop:
        reasons = []
        if achieved < KEEP_UP_RATE * rate:
            reasons.append(f"achieved {achieved:.2f} req/s of {rate:.2f} requested ({achieved / rate:.1%})")
        if lag_ms["p99"] is not None and lag_ms["p99"] > KEEP_UP_LAG_MS:
            reasons.append(f"send lag p99 {lag_ms['p99']:.2f} ms > {KEEP_UP_LAG_MS:g} ms "
                           f"(every connection busy, or the generator short of CPU)")
        kept_up = not reasons
    else:
        reasons, kept_up = [], None
    admitted = sum(v for k, v in statuses.items() if k != 429)
    cpu = sum(p["cpu_s"] for p in parts)
    return {
        "tool": "wrk.loadgen",
        "format": 1,
        "command": meta["command"],
        "url": meta["url"],
        "method": meta["method"],
        "threads": meta["threads"],
        "connections": meta["connections"],
        "preconnected": meta["preconnected"],
        "mode": "open" if open_loop else "closed",
        "intended_rate": rate if open_loop else None,
        "duration_s": round(window, 6),
        "requested_duration_s": meta["duration"],
        "intended_requests": sum(p["intended"] for p in parts) if open_loop else None,
        "sent": sent,
        "unsent": (sum(p["intended"] for p in parts) - sent) if open_loop else None,
        "completed": completed,
        "achieved_rate": round(achieved, 3),
        "requests_per_sec": round(achieved, 3),
        "status": {str(k): statuses[k] for k in sorted(statuses)},
        "errors": errors,
        "admitted": admitted,
        "admitted_per_sec": round(admitted / window, 3) if window > 0 else 0.0,
        "latency_ms": latency_ms,
        "latency_from": "intended send time" if open_loop else "actual send time",
        "send_lag_ms": lag_ms,
        "kept_up": kept_up,
        "kept_up_rule": KEEP_UP_RULE if open_loop else "n/a (closed loop)",
        "not_kept_up_because": reasons,
        "reconnects": sum(p["reconnects"] for p in parts),
        "bytes_read": sum(p["bytes_read"] for p in parts),
        "generator_cpu_s": round(cpu, 3),
        "generator_cpu_pct_of_core": round(100 * cpu / window, 1) if window > 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    if a.rate is None:
        print("error: -R RATE is required (requests/s in total; -R 0 for a closed-loop max-throughput run)",
              file=sys.stderr)
        return 2
    command = "python -m wrk.loadgen " + " ".join(shlex.quote(x) for x in argv)
    try:
        r = run(a.url, threads=a.threads, connections=a.connections, duration=a.duration, rate=a.rate,
                headers=a.header, timeout=a.timeout, method=a.method, body=a.body, command=command)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(r, full_latency=a.latency), flush=True)
    if a.json:
        text = json.dumps(r, indent=2)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
