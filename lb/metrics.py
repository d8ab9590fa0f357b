"""Counters and a latency histogram, rendered in the Prometheus text format for the admin port.

One lock, taken once per request in record(): cheaper than a lock per counter, and exact (tests
compare these numbers with the backends' own counts).
"""

from __future__ import annotations

import threading
from bisect import bisect_left

# Seconds. Proxy latencies live between ~0.2 ms and a backend's timeout.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.backend_requests: dict[str, int] = {}
        self.backend_responses: dict[tuple[str, str], int] = {}   # (backend, status class)
        self.upstream_errors: dict[tuple[str, str], int] = {}     # (backend, kind)
        self.edge_responses: dict[int, int] = {}                  # statuses the edge answered itself
        self.rate_limited: dict[tuple[str, str], int] = {}         # (rule, dry_run "true"/"false")
        self.exempt = 0
        self.unavailable = 0
        self.limiter_errors = 0
        self.tls_failures = 0                                     # handshakes that did not complete
        self.ejections: dict[tuple[str, str], int] = {}         # (family, backend)
        self.admin_actions: dict[tuple[str, str], int] = {}     # (backend, "drain" | "enable")
        self.retries: dict[str, int] = {}                       # backend retried *from* -> count
        self.retry_budget = None                                # RetryBudget, for its gauges
        self.tunnels_open = 0                                     # upgraded connections (WebSocket) now
        self.tunnels_total = 0
        self.tunnel_bytes = [0, 0]                                # client->backend, backend->client
        self.hist = [0] * (len(BUCKETS) + 1)
        self.hist_sum = 0.0
        self.hist_count = 0

    def observe(self, seconds: float) -> None:
        # called with self.lock held
        self.hist[bisect_left(BUCKETS, seconds)] += 1
        self.hist_sum += seconds
        self.hist_count += 1

    def backend_done(self, backend: str, status: int, seconds: float) -> None:
        cls = f"{status // 100}xx"
        with self.lock:
            self.backend_requests[backend] = self.backend_requests.get(backend, 0) + 1
            k = (backend, cls)
            self.backend_responses[k] = self.backend_responses.get(k, 0) + 1
            self.observe(seconds)

    def upstream_error(self, backend: str, kind: str, status: int, seconds: float) -> None:
        with self.lock:
            self.backend_requests[backend] = self.backend_requests.get(backend, 0) + 1
            k = (backend, kind)
            self.upstream_errors[k] = self.upstream_errors.get(k, 0) + 1
            self.edge_responses[status] = self.edge_responses.get(status, 0) + 1
            self.observe(seconds)

    def edge_answered(self, status: int, seconds: float, *, limited=False, unavailable=False) -> None:
        with self.lock:
            self.edge_responses[status] = self.edge_responses.get(status, 0) + 1
            if unavailable:
                self.unavailable += 1
            self.observe(seconds)

    def tunnel_opened(self) -> None:
        with self.lock:
            self.tunnels_open += 1
            self.tunnels_total += 1

    def tunnel_closed(self, to_backend: int, to_client: int) -> None:
        with self.lock:
            self.tunnels_open -= 1
            self.tunnel_bytes[0] += to_backend
            self.tunnel_bytes[1] += to_client

    def tls_failed(self) -> None:
        with self.lock:
            self.tls_failures += 1

    def declare_rules(self, rules) -> None:
        """The limit rules in force, (name, dry_run): each one's counter is shown from 0."""
        with self.lock:
            for name, dry in rules:
                self.rate_limited.setdefault((name, "true" if dry else "false"), 0)

    def limit_outcome(self, rejected, dry, exempt: bool) -> None:
        """Rules that rejected a request, dry-run rules that would have, or an exempt client."""
        with self.lock:
            for n in rejected:
                k = (n, "false")
                self.rate_limited[k] = self.rate_limited.get(k, 0) + 1
            for n in dry:
                k = (n, "true")
                self.rate_limited[k] = self.rate_limited.get(k, 0) + 1
            if exempt:
                self.exempt += 1

    def limiter_error(self) -> None:
        with self.lock:
            self.limiter_errors += 1

    def try_failed(self, backend: str, kind: str) -> None:
        """One try that failed and was retried elsewhere: the backend's error, not a response of ours."""
        with self.lock:
            self.backend_requests[backend] = self.backend_requests.get(backend, 0) + 1
            k = (backend, kind)
            self.upstream_errors[k] = self.upstream_errors.get(k, 0) + 1
            self.retries[backend] = self.retries.get(backend, 0) + 1

    def ejection(self, backend: str, returned: bool = False) -> None:
        with self.lock:
            k = ("lb_ejection_returns_total" if returned else "lb_ejections_total", backend)
            self.ejections[k] = self.ejections.get(k, 0) + 1

    def admin_action(self, backend: str, action: str) -> None:
        with self.lock:
            k = (backend, action)
            self.admin_actions[k] = self.admin_actions.get(k, 0) + 1

    def render(self, backends) -> str:
        """Prometheus text exposition format 0.0.4."""
        with self.lock:
            req = dict(self.backend_requests)
            resp = dict(self.backend_responses)
            errs = dict(self.upstream_errors)
            edge = dict(self.edge_responses)
            limited, unavailable, lim_err = dict(self.rate_limited), self.unavailable, self.limiter_errors
            exempt = self.exempt
            tls_failures = self.tls_failures
            ejections, actions, retries = dict(self.ejections), dict(self.admin_actions), dict(self.retries)
            t_open, t_total, t_bytes = self.tunnels_open, self.tunnels_total, list(self.tunnel_bytes)
            hist, hsum, hcount = list(self.hist), self.hist_sum, self.hist_count
        out = []
        w = out.append
        w("# HELP lb_requests_total Requests sent to each backend (answered or failed).")
        w("# TYPE lb_requests_total counter")
        for b in backends:
            w(f'lb_requests_total{{backend="{_esc(b.url)}"}} {req.get(b.url, 0)}')
        w("# HELP lb_backend_responses_total Backend responses relayed, by status class.")
        w("# TYPE lb_backend_responses_total counter")
        for (b, cls), n in sorted(resp.items()):
            w(f'lb_backend_responses_total{{backend="{_esc(b)}",code="{cls}"}} {n}')
        w("# HELP lb_upstream_errors_total Backend failures: connect, reset, timeout, protocol.")
        w("# TYPE lb_upstream_errors_total counter")
        for (b, kind), n in sorted(errs.items()):
            w(f'lb_upstream_errors_total{{backend="{_esc(b)}",kind="{kind}"}} {n}')
        w("# HELP lb_edge_responses_total Responses the edge produced itself, by status.")
        w("# TYPE lb_edge_responses_total counter")
        for code, n in sorted(edge.items()):
            w(f'lb_edge_responses_total{{code="{code}"}} {n}')
        w("# HELP lb_rate_limited_total Rejections by rule (dry_run=\"true\": would have rejected; a request "
          "refused by two rules counts under both -- requests answered 429: lb_edge_responses_total).")
        w("# TYPE lb_rate_limited_total counter")
        for (rule, dry), n in sorted(limited.items()):
            w(f'lb_rate_limited_total{{rule="{_esc(rule)}",dry_run="{dry}"}} {n}')
        w("# HELP lb_rate_limit_exempt_total Requests let through unlimited by [limits] exempt.")
        w("# TYPE lb_rate_limit_exempt_total counter")
        w(f"lb_rate_limit_exempt_total {exempt}")
        w("# HELP lb_unavailable_total Requests answered 503 because no backend was healthy.")
        w("# TYPE lb_unavailable_total counter")
        w(f"lb_unavailable_total {unavailable}")
        w("# HELP lb_limiter_errors_total Limiter store failures (the configured failure policy applied).")
        w("# TYPE lb_limiter_errors_total counter")
        w(f"lb_limiter_errors_total {lim_err}")
        w("# HELP lb_tls_handshake_failures_total TLS connections that never completed a handshake "
          "(timeout, refused protocol version, plain HTTP on the HTTPS port).")
        w("# TYPE lb_tls_handshake_failures_total counter")
        w(f"lb_tls_handshake_failures_total {tls_failures}")
        w("# HELP lb_tunnels_open Upgraded connections (WebSocket) open now.")
        w("# TYPE lb_tunnels_open gauge")
        w(f"lb_tunnels_open {t_open}")
        w("# HELP lb_tunnels_total Upgraded connections opened (backend answered 101).")
        w("# TYPE lb_tunnels_total counter")
        w(f"lb_tunnels_total {t_total}")
        w("# HELP lb_tunnel_bytes_total Bytes carried by tunnels, by direction.")
        w("# TYPE lb_tunnel_bytes_total counter")
        w(f'lb_tunnel_bytes_total{{direction="upstream"}} {t_bytes[0]}')
        w(f'lb_tunnel_bytes_total{{direction="downstream"}} {t_bytes[1]}')
        w("# HELP lb_backend_up 1 when the backend passes its active health checks.")
        w("# TYPE lb_backend_up gauge")
        for b in backends:
            w(f'lb_backend_up{{backend="{_esc(b.url)}"}} {1 if b.up else 0}')
        w("# HELP lb_backend_in_rotation 1 when the backend takes new requests: up, not ejected, not drained.")
        w("# TYPE lb_backend_in_rotation gauge")
        for b in backends:
            w(f'lb_backend_in_rotation{{backend="{_esc(b.url)}"}} {1 if b.in_rotation else 0}')
        w("# HELP lb_backend_ejected 1 while passive health checks keep the backend out.")
        w("# TYPE lb_backend_ejected gauge")
        for b in backends:
            w(f'lb_backend_ejected{{backend="{_esc(b.url)}"}} {1 if b.ejected else 0}')
        w("# HELP lb_backend_drained 1 while the admin API keeps the backend out (drain).")
        w("# TYPE lb_backend_drained gauge")
        for b in backends:
            w(f'lb_backend_drained{{backend="{_esc(b.url)}"}} {1 if b.drained else 0}')
        for family, what in (("lb_ejections_total", "ejected by passive health (consecutive failures)"),
                             ("lb_ejection_returns_total", "back from an ejection")):
            w(f"# HELP {family} Times a backend was {what}.")
            w(f"# TYPE {family} counter")
            for (f, b), n in sorted(ejections.items()):
                if f == family:
                    w(f'{family}{{backend="{_esc(b)}"}} {n}')
        w("# HELP lb_admin_actions_total Admin API actions on a backend (drain, enable).")
        w("# TYPE lb_admin_actions_total counter")
        for (b, action), n in sorted(actions.items()):
            w(f'lb_admin_actions_total{{backend="{_esc(b)}",action="{action}"}} {n}')
        w("# HELP lb_retries_total Tries that failed to connect and were retried on another backend, by the failed one.")
        w("# TYPE lb_retries_total counter")
        for b, n in sorted(retries.items()):
            w(f'lb_retries_total{{backend="{_esc(b)}"}} {n}')
        rb = self.retry_budget
        if rb is not None:
            w("# HELP lb_retry_budget_exhausted_total Retries not made because the retry budget was spent.")
            w("# TYPE lb_retry_budget_exhausted_total counter")
            w(f"lb_retry_budget_exhausted_total {rb.refused}")
            w("# HELP lb_retries_in_flight Requests holding a retry slot of the budget now.")
            w("# TYPE lb_retries_in_flight gauge")
            w(f"lb_retries_in_flight {rb.retrying}")
            w("# HELP lb_retries_in_flight_peak The most requests that ever held a retry slot at once.")
            w("# TYPE lb_retries_in_flight_peak gauge")
            w(f"lb_retries_in_flight_peak {rb.peak}")
            w("# HELP lb_upstream_active Requests being forwarded now (the retry budget's base).")
            w("# TYPE lb_upstream_active gauge")
            w(f"lb_upstream_active {rb.active}")
        w("# HELP lb_backend_inflight Requests in flight to the backend.")
        w("# TYPE lb_backend_inflight gauge")
        for b in backends:
            w(f'lb_backend_inflight{{backend="{_esc(b.url)}"}} {b.inflight}')
        w("# HELP lb_request_duration_seconds Time from request head to the last byte relayed.")
        w("# TYPE lb_request_duration_seconds histogram")
        acc = 0
        for le, n in zip(BUCKETS, hist):
            acc += n
            w(f'lb_request_duration_seconds_bucket{{le="{le}"}} {acc}')
        w(f'lb_request_duration_seconds_bucket{{le="+Inf"}} {hcount}')
        w(f"lb_request_duration_seconds_sum {hsum:.6f}")
        w(f"lb_request_duration_seconds_count {hcount}")
        return "\n".join(out) + "\n"
