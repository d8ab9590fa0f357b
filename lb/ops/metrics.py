"""Counters, gauges and histograms, rendered in the Prometheus text format for the admin port.

One lock, taken once per request: cheaper than a lock per counter, and exact (tests compare these
numbers with the backends' own counts). State is kept as samples keyed by (family, labels) so a
snapshot is plain data: with --workers N each worker publishes its snapshot on a unix socket and
worker 0's /metrics sums them (one scrape target, however many workers; lb/process/app.py).

A worker that dies and is restarted comes back with its counters at zero. Summed naively, the sum
would drop by the dead worker's total and Prometheus's rate()/increase() would take the drop for a
reset of the whole sum (counting every survivor's total again). So the summing side keeps, per worker
index, the last snapshot it saw and that process's identity (pid, start time): a new identity retires
the old incarnation's counters and histograms into an accumulator added to every later sum (Carry).
The summed counters stay monotonic across a worker's restart; the per-worker series
(lb_worker_requests_total{worker}) and the gauges start over, as one process's would. The scraped
worker itself dying loses the accumulator: a genuine reset, as any restarted scrape target's.

Adding a metric: name it in FAMILIES (type, help), then `metrics.inc("lb_x_total", backend=url)`,
`metrics.add_gauge("lb_x", +1)` or a histogram via `observe_into`. Label values must be bounded
(backend URLs, status classes, rule names): never a client key or a path.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from bisect import bisect_left

from lb import __version__
from lb.limiting.rules import BUILTIN
from lb.ops.fanout import serve_unix
from lb.upstream.retrypolicy import CONDITIONS as RETRY_CONDITIONS

# Seconds. Proxy latencies live between ~0.2 ms and a backend's timeout.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

FAMILIES = {
    "lb_requests_total": ("counter", "Requests sent to each backend (answered or failed)."),
    "lb_backend_responses_total": ("counter", "Backend responses relayed, by backend and status class."),
    "lb_upstream_errors_total": ("counter", "Backend failures: connect, reset, timeout, protocol, pool."),
    "lb_edge_responses_total": ("counter", "Responses the edge produced itself, by status (499: the client left)."),
    "lb_rate_limited_total": (
        "counter",
        'Rejections by rule (dry_run="true": would have rejected; a request '
        "refused by two rules counts under both -- requests answered 429: "
        "lb_edge_responses_total).",
    ),
    "lb_rate_limit_admitted_total": (
        "counter",
        "Requests each rule applied to that were admitted (a dry-run rule: "
        "that it would have admitted); beside lb_rate_limited_total.",
    ),
    "lb_rate_limit_exempt_total": ("counter", "Requests let through unlimited by [limits] exempt."),
    "lb_delayed_total": ("counter", "Over-limit requests held (--max-delay) and then forwarded."),
    "lb_delayed_refused_total": ("counter", "Over-limit requests refused because max_delayed were already held."),
    "lb_unavailable_total": ("counter", "Requests answered 503 because no backend was healthy."),
    "lb_limiter_errors_total": ("counter", "Limiter store failures (the configured failure policy applied)."),
    "lb_refused_connections_total": ("counter", "Client connections refused at max_connections (503, closed)."),
    "lb_idle_connections_closed_total": (
        "counter",
        "Idle keep-alive client connections closed to make room for a new one at max_connections.",
    ),
    "lb_retries_total": (
        "counter",
        "Tries that failed (--retry-on) and were retried on another backend, by the failed one.",
    ),
    "lb_dns_resolutions_total": (
        "counter",
        "Resolutions of DNS-named backends ([upstream] resolver), by result (ok, failed).",
    ),
    "lb_dns_addresses": ("gauge", "Addresses a DNS-named backend resolves to now: each is a backend."),
    "lb_overflow_total": (
        "counter",
        "Requests answered 503 at once by the pool's circuit breaker, by the cap (max_requests, max_pending).",
    ),
    "lb_pool_requests_in_flight": (
        "gauge",
        "Requests in flight to the pool, counted by its circuit breaker (when max_requests is set).",
    ),
    "lb_pool_pending": ("gauge", "Requests waiting for a pooled backend connection."),
    "lb_retries_by_condition_total": (
        "counter",
        "Tries retried on another backend, by the --retry-on condition "
        "they met (connect, reset, timeout, 5xx, 502, 503, 504).",
    ),
    "lb_retry_budget_exhausted_total": ("counter", "Retries not made because the retry budget was spent."),
    "lb_hedges_total": (
        "counter",
        "Hedged requests (--hedge-after): second copies sent, by result (won: the hedge "
        "answered first; lost: the first backend did; failed: the hedge's try failed).",
    ),
    "lb_hedges_skipped_total": (
        "counter",
        "Hedges not sent though due, by reason (budget: the retry budget was "
        "spent; max_requests: the pool's circuit breaker was at its cap).",
    ),
    "lb_ejections_total": ("counter", "Times a backend was ejected by passive health (consecutive failures)."),
    "lb_route_requests_total": (
        "counter",
        "Requests a [[routes]] table matched, by route and the pool it chose (configured names only).",
    ),
    "lb_route_denied_total": ("counter", "Requests refused 403 by a route's allow/deny, by route."),
    "lb_route_unavailable_total": (
        "counter",
        "Requests answered 503 because none of the route's pools had anyone in rotation, by route.",
    ),
    "lb_ejection_returns_total": ("counter", "Times a backend came back from an ejection."),
    "lb_admin_actions_total": ("counter", "Admin API actions on a backend (drain, enable)."),
    "lb_health_probes_total": ("counter", "Active health probes of each backend, by result (pass, fail)."),
    "lb_backend_transitions_total": (
        "counter",
        "Changes of a backend's state as /status shows it, by the state entered (UP, DOWN, EJECTED, DRAINED).",
    ),
    "lb_tunnels_total": ("counter", "Upgraded connections opened (backend answered 101)."),
    "lb_tunnel_bytes_total": ("counter", "Bytes carried by tunnels, by direction."),
    "lb_tls_handshake_failures_total": (
        "counter",
        "TLS connections that never completed a handshake "
        "(timeout, refused protocol version, plain HTTP on the HTTPS port).",
    ),
    "lb_tls_client_certs_total": (
        "counter",
        "Completed handshakes with mutual TLS on, by whether the client "
        "presented a verified certificate (client_cert), and its subject "
        "when a rule names it (match.client_cert_subject; else other).",
    ),
    "lb_http2_connections_total": ("counter", "Client connections that spoke HTTP/2 (prior knowledge or ALPN h2)."),
    "lb_http2_streams_total": (
        "counter",
        "HTTP/2 streams by outcome: served, refused (REFUSED_STREAM: "
        "max_concurrent_streams, or the workers all busy), reset by client.",
    ),
    "lb_http2_goaways_total": (
        "counter",
        "HTTP/2 connections ended by the edge's GOAWAY for the peer's "
        "behaviour, by reason (floods, rapid reset, protocol errors).",
    ),
    "lb_requests_by_protocol_total": (
        "counter",
        "Requests answered, by the protocol the client spoke (HTTP/1.0, HTTP/1.1, HTTP/2): one per access-log line.",
    ),
    "lb_worker_requests_total": ("counter", "Requests answered by each worker process (balance check)."),
    "lb_backend_up": ("gauge", "1 when the backend passes its active health checks (with workers: in every one)."),
    "lb_backend_in_rotation": ("gauge", "1 when the backend takes new requests: up, not ejected, not drained."),
    "lb_backend_ejected": ("gauge", "1 while passive health checks keep the backend out (in any worker)."),
    "lb_backend_drained": ("gauge", "1 while the admin API keeps the backend out (drain)."),
    "lb_retries_in_flight": ("gauge", "Requests holding a retry slot of the budget now."),
    "lb_retries_in_flight_peak": ("gauge", "The most requests that ever held a retry slot at once."),
    "lb_upstream_active": ("gauge", "Requests being forwarded now (the retry budget's base)."),
    "lb_backend_inflight": ("gauge", "Requests in flight to the backend."),
    "lb_client_connections": ("gauge", "Client connections open now."),
    "lb_idle_client_connections": (
        "gauge",
        "Client connections waiting between requests now (keep-alive; nginx's stub_status 'Waiting').",
    ),
    "lb_delayed_in_flight": ("gauge", "Requests being held by delay mode now."),
    "lb_tunnels_open": ("gauge", "Upgraded connections (WebSocket) open now."),
    "lb_buffer_memory_bytes": ("gauge", "Memory request and response buffers hold now (capped by buffer_memory)."),
    "lb_buffer_temp_files": ("gauge", "Buffers' temp files open now (request bodies, responses read ahead)."),
    "lb_limiter_store_up": ("gauge", "1 when the limiter's Redis store answers, 0 while its failure policy applies."),
    "lb_limiter_keys": (
        "gauge",
        "Keys holding state in a rule's in-process key table (the memory store; at most "
        "max_keys per limiter, summed over workers), by rule.",
    ),
    "lb_limiter_table_full_total": (
        "counter",
        "New keys refused (503) because the key table held only states "
        "that would decide differently from a fresh key, by rule.",
    ),
    "lb_workers": ("gauge", "Worker processes whose numbers are summed here."),
    "lb_build_info": ("gauge", "Always 1; the labels say which edge and Python this is."),
    "edge_build_info": ("gauge", "Deprecated, the same as lb_build_info (kept for dashboards written before)."),
    "process_cpu_seconds_total": ("counter", "User and system CPU time, summed over the edge's processes."),
    "process_resident_memory_bytes": ("gauge", "Resident memory, summed over the edge's processes."),
    "process_open_fds": ("gauge", "Open file descriptors, summed over the edge's processes."),
    "process_threads": ("gauge", "Threads, summed over the edge's processes."),
    "process_start_time_seconds": ("gauge", "Start time of the oldest process, seconds since the epoch."),
    "lb_request_duration_seconds": (
        "histogram",
        "Time from request head to the last byte relayed, by status "
        'class (code="2xx"; a 429 is 4xx, a client gone 499 4xx).',
    ),
    "lb_upstream_duration_seconds": ("histogram", "Per backend: from sending the request to the last response byte."),
}
# Gauges whose sum over workers means nothing: the most pessimistic (or the earliest) value wins.
_MERGE_MIN = {"lb_backend_up", "lb_backend_in_rotation", "lb_limiter_store_up", "process_start_time_seconds"}
_MERGE_MAX = {"edge_build_info", "lb_build_info", "lb_backend_ejected", "lb_backend_drained"}


def _esc(v) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**kv) -> tuple:
    return tuple(kv.items())


# The request histogram's keys by status class, made once: (family, labels) as _observe takes them.
CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
_DURATION = {i: ("lb_request_duration_seconds", (("code", c),)) for i, c in enumerate(CLASSES, 1)}
# Every series a backend, a rule or an edge status has from the start (rate() alerts need a series at 0).
_UPSTREAM_KINDS = ("connect", "reset", "timeout", "protocol", "pool")
_EDGE_CODES = ("400", "413", "429", "499", "502", "503", "504")
TRANSITIONS = ("UP", "DOWN", "EJECTED", "DRAINED")
# The protocol counter's keys, made once, by the request line's version (the parsers accept no other).
_PROTOCOL = {
    v: ("lb_requests_by_protocol_total", (("protocol", v.decode()),)) for v in (b"HTTP/1.0", b"HTTP/1.1", b"HTTP/2")
}


def _duration(status: int) -> tuple[str, tuple]:
    return _DURATION.get(status // 100) or ("lb_request_duration_seconds", (("code", f"{status // 100}xx"),))


def _done_record(m: "Metrics", backend: str, status: int, version: bytes | None) -> list:
    """Metrics.backend_done's record for (backend, status, version): [how many, the duration histogram,
    the upstream histogram, the counter keys the count belongs to]. The count is added to those counters
    when they are read (Metrics._counters): per request, one int, not three dict updates."""
    b = (("backend", backend),)
    keys: tuple = (("lb_requests_total", b), ("lb_backend_responses_total", (b[0], ("code", f"{status // 100}xx"))))
    if version is not None:  # (backend_done for Edge.record too: the request's protocol, answered()'s counter)
        keys += (_PROTOCOL.get(version) or _PROTOCOL[b"HTTP/1.1"],)
    with m.lock:
        hists, c = m.hists, m.counters
        for k in keys:
            c.setdefault(k, 0)  # (the series is there, as after a first increment)
        rec = [
            0,
            hists.setdefault(_duration(status), [[0] * (len(BUCKETS) + 1), 0.0]),
            hists.setdefault(("lb_upstream_duration_seconds", b), [[0] * (len(BUCKETS) + 1), 0.0]),
            keys,
        ]
        m._done[(backend, status, version)] = rec  # (under the lock: _counters reads the records)
    return rec


def _counters(m: "Metrics") -> dict:
    """m's counters with backend_done's counts in (under m.lock)."""
    c = dict(m.counters)
    for rec in m._done.values():
        n = rec[0]
        if n:
            for k in rec[3]:
                c[k] += n
    return c


class TopKeys:
    """The most rejected clients, by their log label (never a raw API key), for /status and the dashboard.

    Bounded: at CAP labels the lower half is dropped (one sort per CAP/2 new labels), so a flood of
    rotating keys costs memory and time in proportion to CAP, not to the keys; a label that falls out
    starts again from 0 (the counts are a lower bound, exact for a client that keeps being rejected).
    Called under Metrics.lock."""

    CAP = 512

    def __init__(self):
        self.counts: dict[str, int] = {}

    def count(self, label: str, n: int = 1) -> None:
        c = self.counts
        if label not in c and len(c) >= self.CAP:
            kept = sorted(c.items(), key=lambda kv: kv[1], reverse=True)[: self.CAP // 2]
            c.clear()
            c.update(kept)
        c[label] = c.get(label, 0) + n

    def top(self, n: int = 10) -> list:
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def top_keys(snaps, n: int = 10) -> list[dict]:
    """The top rejected labels over workers' snapshots (each has "top": [[label, count], ...])."""
    acc = TopKeys()
    acc.CAP = 1 << 30
    for s in snaps:
        for label, c in s.get("top", ()):
            acc.count(label, c)
    return [{"key": k, "rejected": c} for k, c in acc.top(n)]


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.counters: dict[tuple[str, tuple], float] = {}
        self.gauges: dict[tuple[str, tuple], float] = {}  # set by other modules (tunnels ...)
        # [[bucket counts..., +Inf], sum]; the count is the buckets' sum (one each), taken at snapshot
        self.hists: dict[tuple[str, tuple], list] = {}
        self.started = time.time()
        for name in (
            "lb_rate_limit_exempt_total",
            "lb_unavailable_total",
            "lb_limiter_errors_total",
            "lb_tls_handshake_failures_total",
            "lb_tunnels_total",
        ):
            self.counters[(name, ())] = 0
        for d in ("upstream", "downstream"):
            self.counters[("lb_tunnel_bytes_total", (("direction", d),))] = 0
        self.gauges[("lb_tunnels_open", ())] = 0
        for code in _EDGE_CODES:
            self.counters[("lb_edge_responses_total", (("code", code),))] = 0
        for cond in RETRY_CONDITIONS:
            self.counters[("lb_retries_by_condition_total", (("condition", cond),))] = 0
        for k in _PROTOCOL.values():
            self.counters[k] = 0
        for k in _DURATION.values():
            self.hists[k] = [[0] * (len(BUCKETS) + 1), 0.0]  # there from the start
        self.retry_budget = None  # RetryBudget, for its gauges (read at scrape time)
        self.breaker = None  # Breaker (lb/upstream/breaker.py), likewise
        self._done: dict = {}  # backend_done's records, by (backend, status, version) (_done_record)
        self.carry = Carry()  # with workers: the numbers of workers that restarted
        self.top = TopKeys()  # the most rejected clients (limit_outcome)
        self._admitted_keys: dict = {}  # rule name -> its admitted counter's key (made once)
        self._builtin_admitted = 0  # admitted(None)'s count, not yet in self.counters (_settle)
        self._route_keys: dict = {}  # (route, pool) -> its lb_route_requests_total key

    # -- recording (with self.lock held in the _ helpers) --------------------------------------------

    def _inc(self, name: str, labels: tuple = (), n: float = 1) -> None:
        k = (name, labels)
        self.counters[k] = self.counters.get(k, 0) + n

    def _observe(self, name: str, labels: tuple, seconds: float) -> None:
        h = self.hists.get((name, labels))
        if h is None:
            h = self.hists[(name, labels)] = [[0] * (len(BUCKETS) + 1), 0.0]
        h[0][bisect_left(BUCKETS, seconds)] += 1
        h[1] += seconds

    def inc(self, name: str, n: float = 1, **labels) -> None:
        """Any counter in FAMILIES, e.g. inc("lb_retries_total", backend=url)."""
        with self.lock:
            self._inc(name, _labels(**labels), n)

    def by_label(self, name: str, label: str) -> dict:
        """A counter family's values by one label, e.g. {"503": 4} (this process's, for /status)."""
        with self.lock:
            _settle(self)
            return {dict(labels).get(label, ""): v for (n, labels), v in _counters(self).items() if n == name}

    def add_gauge(self, name: str, delta: float, **labels) -> None:
        """A gauge kept by events, e.g. add_gauge("lb_x_open", +1) when an x opens."""
        k = (name, _labels(**labels))
        with self.lock:
            self.gauges[k] = self.gauges.get(k, 0) + delta

    def backend_done(
        self, backend: str, status: int, seconds: float, upstream: float | None = None, version: bytes | None = None
    ) -> None:
        """A backend's response relayed: lb_requests_total, lb_backend_responses_total and the two histograms
        (and, with the request's version, answered()'s protocol counter: Edge.logged then, not record).
        What it records into is made once per (backend, status, version) -- a count added to the
        counters when they are read, and the two histograms themselves (a histogram's list, once made, is
        never replaced) -- and written here, not through _inc and _observe."""
        rec = self._done.get((backend, status, version))
        if rec is None:
            rec = _done_record(self, backend, status, version)
        if upstream is None:
            upstream = seconds
        lock = self.lock
        lock.acquire()  # (acquire/release, not `with`: once per request, and `with` costs twice as much)
        try:
            rec[0] += 1
            h = rec[1]
            h[0][bisect_left(BUCKETS, seconds)] += 1
            h[1] += seconds
            h = rec[2]
            h[0][bisect_left(BUCKETS, upstream)] += 1
            h[1] += upstream
        finally:
            lock.release()

    def upstream_error(self, backend: str, kind: str, status: int, seconds: float) -> None:
        with self.lock:
            self._inc("lb_requests_total", (("backend", backend),))
            self._inc("lb_upstream_errors_total", (("backend", backend), ("kind", kind)))
            self._inc("lb_edge_responses_total", (("code", str(status)),))
            self._observe(*_duration(status), seconds)

    def client_failed(self, backend: str | None, status: int, seconds: float) -> None:
        """The client failed a request (gone: 499, nginx's code; or its body was bad or too slow), counted
        against the backend's requests when it had reached one."""
        with self.lock:
            if backend is not None:
                self._inc("lb_requests_total", (("backend", backend),))
            self._inc("lb_edge_responses_total", (("code", str(status)),))
            self._observe(*_duration(status), seconds)

    def edge_answered(self, status: int, seconds: float, *, limited=False, unavailable=False) -> None:
        with self.lock:
            self._inc("lb_edge_responses_total", (("code", str(status)),))
            if unavailable:
                self._inc("lb_unavailable_total")
            self._observe(*_duration(status), seconds)

    def answered(self, version: bytes) -> None:
        """A request's outcome is known (Edge.record): counted by the protocol the client spoke."""
        k = _PROTOCOL.get(version) or _PROTOCOL[b"HTTP/1.1"]
        lock = self.lock
        lock.acquire()  # (acquire/release rather than `with`: half the cost, once per request)
        try:
            self.counters[k] += 1
        finally:
            lock.release()

    def tunnel_opened(self) -> None:
        with self.lock:
            self.gauges[("lb_tunnels_open", ())] += 1
            self._inc("lb_tunnels_total")

    def tunnel_closed(self, to_backend: int, to_client: int) -> None:
        with self.lock:
            self.gauges[("lb_tunnels_open", ())] -= 1
            self._inc("lb_tunnel_bytes_total", (("direction", "upstream"),), to_backend)
            self._inc("lb_tunnel_bytes_total", (("direction", "downstream"),), to_client)

    def tls_client_cert(self, present: bool, subject: str | None = None) -> None:
        """subject: a subject some rule names (lower case), else None ("other": labels stay bounded)."""
        labels = (("client_cert", "yes"), ("subject", subject or "other")) if present else (("client_cert", "no"),)
        with self.lock:
            self._inc("lb_tls_client_certs_total", labels)

    def tls_failed(self) -> None:
        with self.lock:
            self._inc("lb_tls_handshake_failures_total")

    def try_failed(self, backend: str, kind: str | None, condition: str = "connect") -> None:
        """One try that failed and was retried elsewhere: the backend's error (kind; None when it
        answered with a status the retry policy names), not a response of ours."""
        b = (("backend", backend),)
        with self.lock:
            self._inc("lb_requests_total", b)
            if kind is not None:
                self._inc("lb_upstream_errors_total", (("backend", backend), ("kind", kind)))
            self._inc("lb_retries_total", b)
            self._inc("lb_retries_by_condition_total", (("condition", condition),))

    def declare_routes(self, routes) -> None:
        """The routes in force ((name, pool names)): their counters are shown from 0."""
        with self.lock:
            for name, pools in routes:
                for p in pools:
                    self.counters.setdefault(("lb_route_requests_total", _labels(route=name, pool=p)), 0)
                for fam in ("lb_route_denied_total", "lb_route_unavailable_total"):
                    self.counters.setdefault((fam, _labels(route=name)), 0)

    def route_chosen(self, route: str, pool: str) -> None:
        """lb_route_requests_total, once per routed request: its key made once per (route, pool)."""
        k = self._route_keys.get((route, pool))
        if k is None:
            k = self._route_keys[(route, pool)] = ("lb_route_requests_total", _labels(route=route, pool=pool))
        with self.lock:
            self._inc(*k)

    def ejection(self, backend: str, returned: bool = False) -> None:
        self.inc("lb_ejection_returns_total" if returned else "lb_ejections_total", backend=backend)

    def admin_action(self, backend: str, action: str) -> None:
        self.inc("lb_admin_actions_total", backend=backend, action=action)

    def declare_rules(self, rules) -> None:
        """The limit rules in force, (name, dry_run): each one's counters are shown from 0."""
        with self.lock:
            for name, dry in rules:
                self.counters.setdefault(
                    ("lb_rate_limited_total", (("rule", name), ("dry_run", "true" if dry else "false"))), 0
                )
                self.counters.setdefault(("lb_rate_limit_admitted_total", (("rule", name),)), 0)

    def declare_backends(self, urls) -> None:
        """The backends in force (at start, after a reload): their labelled series are shown from 0."""
        with self.lock:
            c, z = self.counters, 0
            for url in urls:
                b = (("backend", url),)
                for name in _BACKEND_COUNTERS:
                    c.setdefault((name, b), z)
                for cls in CLASSES[1:]:
                    c.setdefault(("lb_backend_responses_total", (b[0], ("code", cls))), z)
                for kind in _UPSTREAM_KINDS:
                    c.setdefault(("lb_upstream_errors_total", (b[0], ("kind", kind))), z)
                for action in ("drain", "enable"):
                    c.setdefault(("lb_admin_actions_total", (b[0], ("action", action))), z)
                for result in ("pass", "fail"):
                    c.setdefault(("lb_health_probes_total", (b[0], ("result", result))), z)
                for to in TRANSITIONS:
                    c.setdefault(("lb_backend_transitions_total", (b[0], ("to", to))), z)
                self.hists.setdefault(("lb_upstream_duration_seconds", b), [[0] * (len(BUCKETS) + 1), 0.0])

    def top_now(self, n: int = 50) -> list:
        with self.lock:
            return self.top.top(n)

    def probe(self, backend: str, passed: bool) -> None:
        self.inc("lb_health_probes_total", backend=backend, result="pass" if passed else "fail")

    def transition(self, backend: str, to: str) -> None:
        self.inc("lb_backend_transitions_total", backend=backend, to=to)

    def admitted(self, rules=None) -> None:
        """The common case of limit_outcome: an admitted request, the rules that applied to it. None: the
        built-in rule alone (the common configuration's, every request): counted in an int, not in the
        dict (hashing its tuple key twice cost more than the rest), and settled into it when read."""
        lock = self.lock
        lock.acquire()  # (as in answered)
        try:
            if rules is None:
                self._builtin_admitted += 1
                return
            keys, c = self._admitted_keys, self.counters
            for n in rules:
                k = keys.get(n)
                if k is None:
                    k = keys[n] = ("lb_rate_limit_admitted_total", (("rule", n),))
                c[k] = c.get(k, 0) + 1
        finally:
            lock.release()

    def limit_outcome(self, rejected, dry, exempt: bool, admitted=(), label: str | None = None) -> None:
        """Rules that rejected a request, dry-run rules that would have, or an exempt client; admitted:
        the rules that applied to an admitted request. label: the rejected client, for the top list."""
        with self.lock:
            for n in admitted:
                self._inc("lb_rate_limit_admitted_total", (("rule", n),))
            if rejected and label:
                self.top.count(label)
            for n in rejected:
                self._inc("lb_rate_limited_total", (("rule", n), ("dry_run", "false")))
            for n in dry:
                self._inc("lb_rate_limited_total", (("rule", n), ("dry_run", "true")))
            if exempt:
                self._inc("lb_rate_limit_exempt_total")

    def limiter_error(self) -> None:
        with self.lock:
            self._inc("lb_limiter_errors_total")

    # -- snapshots: plain data, summed over workers ---------------------------------------------------

    def snapshot(self, live: dict | None = None, worker: int | None = None) -> dict:
        """This process's samples; live: gauges read now {(name, labels): value}, plus counters kept
        elsewhere (refused connections) under the same form."""
        with self.lock:
            _settle(self)
            c = [[n, list(map(list, labels)), v] for (n, labels), v in _counters(self).items()]
            g = [[n, list(map(list, labels)), v] for (n, labels), v in self.gauges.items()]
            h = [[n, list(map(list, labels)), list(x[0]), x[1], sum(x[0])] for (n, labels), x in self.hists.items()]
        for (n, labels), v in (live or {}).items():
            (c if FAMILIES[n][0] == "counter" else g).append([n, list(map(list, labels)), v])
        g += [[n, [], v] for n, v in process_sample(self.started).items() if FAMILIES[n][0] == "gauge"]
        c += [[n, [], v] for n, v in process_sample(self.started).items() if FAMILIES[n][0] == "counter"]
        build = [["version", __version__], ["python", sys.version.split()[0]]]
        g += [["lb_build_info", build, 1], ["edge_build_info", build, 1]]
        rb = self.retry_budget
        if rb is not None:
            c.append(["lb_retry_budget_exhausted_total", [], rb.refused])
            g += [
                ["lb_retries_in_flight", [], rb.retrying],
                ["lb_retries_in_flight_peak", [], rb.peak],
                ["lb_upstream_active", [], rb.active],
            ]
        br = self.breaker
        if br is not None:
            c += [["lb_overflow_total", [["limit", k]], v] for k, v in br.overflow.items()]
            g += [["lb_pool_requests_in_flight", [], br.requests], ["lb_pool_pending", [], br.pending]]
        served = sum(x[4] for x in h if x[0] == "lb_request_duration_seconds")
        return {
            "worker": worker,
            "id": [os.getpid(), self.started],
            "c": c,
            "g": g,
            "h": h,
            "served": served,
            "top": self.top_now(),
        }

    def render(self, live: dict | None = None, others=(), worker: int | None = None) -> str:
        """Prometheus text exposition format 0.0.4: this process (worker N) plus the other workers' snapshots."""
        snaps = [self.snapshot(live, worker), *others]
        return render(merge(snaps, self.carry.fold(snaps) if worker is not None else None))


# the counters every backend shows from 0 (declare_backends), beside its labelled families
_BACKEND_COUNTERS = ("lb_requests_total", "lb_retries_total", "lb_ejections_total", "lb_ejection_returns_total")
_BUILTIN_ADMITTED = ("lb_rate_limit_admitted_total", (("rule", BUILTIN),))


def _settle(m: Metrics) -> None:
    """(m.lock held) admitted(None)'s count into m.counters, before they are read."""
    n = m._builtin_admitted
    if n:
        m._builtin_admitted = 0
        m.counters[_BUILTIN_ADMITTED] = m.counters.get(_BUILTIN_ADMITTED, 0) + n


class Carry:
    """What the sum over workers keeps of workers that are gone (only touched on a scrape).

    Why the summed counters stay monotonic across a worker's restart: each live worker's counters only
    grow; a dead incarnation contributes its last snapshot seen here, which is at most its final value
    and never changes again (retired); the new incarnation starts at >= 0. So the sum after the restart
    is >= the sum last shown. A worker left out of one scrape (restarting, or too slow to answer)
    stands in with its last snapshot for the same reason. Gauges are not carried: a dead process's
    connections or in-flight requests are not there any more.
    """

    def __init__(self):
        self.lock = threading.Lock()  # concurrent scrapes (ThreadingHTTPServer)
        self.last: dict = {}  # worker index -> its last snapshot seen
        self.retired = {"c": {}, "h": {}}

    def fold(self, snaps: list[dict]) -> dict:
        """Notes this scrape's snapshots; returns the counters and histograms to add to their sum."""
        with self.lock:
            present = set()
            for s in snaps:
                i = s.get("worker")
                prev = self.last.get(i)
                if prev is not None and prev.get("id") != s.get("id"):
                    _add(self.retired, prev)  # a new incarnation: the old one's numbers stay
                self.last[i] = s
                present.add(i)
            out = {
                "c": dict(self.retired["c"]),
                "h": {k: [list(v[0]), v[1], v[2]] for k, v in self.retired["h"].items()},
            }
            for i, s in self.last.items():
                if i not in present:
                    _add(out, s)
            return out


def _add(acc: dict, s: dict) -> None:
    """Adds snapshot s's counters and histograms into acc ({"c": {key: v}, "h": {key: [buckets, sum, count]}})."""
    counters, hists = acc["c"], acc["h"]
    for n, labels, v in s["c"]:
        k = (n, tuple(map(tuple, labels)))
        counters[k] = counters.get(k, 0) + v
    for n, labels, b, total, count in s["h"]:
        k = (n, tuple(map(tuple, labels)))
        cur = hists.setdefault(k, [[0] * len(b), 0.0, 0])
        cur[0] = [x + y for x, y in zip(cur[0], b)]
        cur[1] += total
        cur[2] += count


def merge(snaps: list[dict], carried: dict | None = None) -> dict:
    """The sum of the snapshots; carried: counters and histograms of workers gone (Carry.fold)."""
    acc = {"c": dict(carried["c"]) if carried else {}, "h": dict(carried["h"]) if carried else {}}
    gauges: dict = {}
    for s in snaps:
        _add(acc, s)
        for n, labels, v in s["g"]:
            k = (n, tuple(map(tuple, labels)))
            if k not in gauges:
                gauges[k] = v
            elif n in _MERGE_MIN:
                gauges[k] = min(gauges[k], v)
            elif n in _MERGE_MAX:
                gauges[k] = max(gauges[k], v)
            else:
                gauges[k] += v
    counters, hists = acc["c"], acc["h"]
    if len(snaps) > 1 or snaps[0].get("worker") is not None:
        for s in snaps:
            counters[("lb_worker_requests_total", (("worker", str(s["worker"])),))] = s["served"]
    gauges[("lb_workers", ())] = len(snaps)
    return {"c": counters, "g": gauges, "h": hists}


def _num(v) -> str:
    return str(v) if isinstance(v, int) else f"{v:.6f}".rstrip("0").rstrip(".") if v == v else "NaN"


def render(m: dict) -> str:
    out: list[str] = []
    w = out.append
    for name, (kind, help_) in FAMILIES.items():
        src = m["h"] if kind == "histogram" else m["c"] if kind == "counter" else m["g"]
        samples = sorted((labels, v) for (n, labels), v in src.items() if n == name)
        w(f"# HELP {name} {help_}")
        w(f"# TYPE {name} {kind}")
        for labels, v in samples:
            lab = ",".join(f'{k}="{_esc(x)}"' for k, x in labels)
            if kind != "histogram":
                w(f"{name}{{{lab}}} {_num(v)}" if lab else f"{name} {_num(v)}")
                continue
            counts, total, count = v
            sep = "," if lab else ""
            acc = 0
            for le, n in zip(BUCKETS, counts):
                acc += n
                w(f'{name}_bucket{{{lab}{sep}le="{le}"}} {acc}')
            w(f'{name}_bucket{{{lab}{sep}le="+Inf"}} {count}')
            w(f"{name}_sum{{{lab}}} {total:.6f}" if lab else f"{name}_sum {total:.6f}")
            w(f"{name}_count{{{lab}}} {count}" if lab else f"{name}_count {count}")
    return "\n".join(out) + "\n"


def process_sample(started: float) -> dict:
    """process_* for this process from /proc (Linux), as prometheus_client's process collector names them."""
    t = os.times()
    out = {
        "process_cpu_seconds_total": round(t.user + t.system, 3),
        "process_start_time_seconds": started,
        "process_threads": threading.active_count(),
    }
    try:
        with open("/proc/self/statm") as f:
            out["process_resident_memory_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        out["process_open_fds"] = len(os.listdir("/proc/self/fd"))
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    out["process_threads"] = int(line.split()[1])  # OS threads, not only Python's
    except OSError:
        pass
    return out


# -- workers: each publishes its snapshot on a unix socket; worker 0 gathers them ---------------------


def publish(path: str, snapshot) -> socket.socket:
    """Serve snapshot() as JSON to whoever connects to the unix socket at path (worker 0's admin)."""
    return serve_unix(path, lambda conn: conn.sendall(json.dumps(snapshot()).encode()), "metrics snapshot")


def gather(paths, timeout: float = 3.0) -> list[dict]:
    """The other workers' snapshots; a worker that is restarting is left out of this scrape."""
    out = []
    for p in paths:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(p)
                data = bytearray()
                while chunk := s.recv(65536):
                    data += chunk
            out.append(json.loads(data))
        except (OSError, ValueError):
            continue
    return out
