"""The rate-limit stage of the pipeline: who is asking, which limits apply, the verdict and the headers.

Limits come from two places, decided together (limiter.compose: a request is admitted only when every
applying enforcing limit admits it, and a rejected request spends nothing in any of them):

* the built-in per-identity rule "default" (`--limit`, `[limits] default`): one limiter per rate, the
  identity's override (`[limits.keys]`, `--key-limit`, kind-named: "key:NAME" / "ip:ADDR"), else its
  known key's tier, else the default;
* every `[[rules]]` table whose match fits the request (lb/limiting/rules.py), keyed by its own `key`.

The X-RateLimit-* headers and Retry-After describe the most restrictive applying enforcing limit:
when admitted, the one with the least remaining (ties: the longest reset); when rejected, the
rejecting one with the latest retry time. So a client that sends while Remaining > 0 and otherwise
waits Reset (or Retry-After) seconds is never refused. Dry-run rules never reject and never show in
the headers; their would-be rejections are reported in `limited_by` (as "NAME:dry_run") and counted.

The limiter package decides (it knows nothing of HTTP); this module only speaks HTTP around it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from time import sleep
from typing import NamedTuple

from lb import netaddr
from lb.limiting import views
from lb.limiting.identity import MAX_KEY, ip_key, kind_name
from lb.limiting.keys import KeyRegistry, KeySpec, key_label
from lb.limiting.limiters import Limiters
from lb.limiting.rules import BUILTIN, Matcher, normalize_path
from limiter.algorithms import Decision
from limiter.compose import allow_all
from limiter.shaping import Delayed

log = logging.getLogger("edge")


class Verdict:
    """What the stage decided for one request, for the pipeline, the access log and the metrics."""

    __slots__ = (
        "status",
        "reason",
        "headers",
        "label",
        "key_name",
        "limited_by",
        "rejected",
        "dry",
        "degraded",
        "exempt",
        "delay",
        "slots",
        "admitted",
    )

    def __init__(self, label: str):
        self.status = 0  # 0: go on; else answer it (400, 401, 429, 503)
        self.reason = ""
        self.headers = b""  # X-RateLimit-* (and Retry-After), RateLimit-* when enabled
        self.label = label  # the identity as logs may show it: never a raw API key
        self.key_name: str | None = None  # a known key's configured name
        self.limited_by = ""  # "rule,rule:dry_run" -- the access log's limited_by
        self.rejected: tuple[str, ...] = ()  # names of enforcing rules that rejected
        self.dry: tuple[str, ...] = ()  # names of dry-run rules that would have rejected
        self.degraded = False  # a store failure policy decided
        self.exempt = False
        self.delay = 0.0  # admitted, to be held this long first (delay mode)
        self.slots: list | None = None  # in-flight slots taken: [(table, slot)], given back by release()
        self.admitted = ()  # names of the rules that applied to an admitted request


class Admitted:
    """The common verdict, built for the common configuration (LimitStage.only): admitted by the one
    limit, nothing held, no failure policy. It answers as a Verdict would; the pipeline knows it by its
    type and reads only label and headers."""

    __slots__ = ("label", "headers")
    status = 0
    reason = ""
    key_name = None
    limited_by = ""
    rejected: tuple[str, ...] = ()
    dry: tuple[str, ...] = ()
    degraded = False
    exempt = False
    delay = 0.0
    slots = None
    admitted = (BUILTIN,)

    def __init__(self, label: str, headers: bytes):
        self.label, self.headers = label, headers


def release(slots) -> None:
    """Give back a request's in-flight slots (the pipeline's one finally). Never raises."""
    for table, slot in slots:
        try:
            table.release(slot)
        except Exception:  # a slot lost here expires (Redis) or is a bug; the request is done
            log.exception("in-flight slot not released")


class Holds:
    """Requests held by delay mode right now, at most `cap` (each holds its connection's thread).
    Kept by the pipeline, not the stage, so a reload does not reset the count."""

    __slots__ = ("n", "lock")

    def __init__(self):
        self.n = 0
        self.lock = threading.Lock()

    def hold(self, delay: float, cap: int, metrics, wait=sleep) -> bool:
        """wait(delay) (the request's slot is already reserved; the proxy's wait raises ClientGone when the
        client leaves meanwhile); False at once when `cap` are held."""
        with self.lock:
            if self.n >= cap:
                metrics.inc("lb_delayed_refused_total")
                return False
            self.n += 1
        metrics.inc("lb_delayed_total")
        metrics.add_gauge("lb_delayed_in_flight", +1)
        try:
            wait(delay)
        finally:
            with self.lock:
                self.n -= 1
            metrics.add_gauge("lb_delayed_in_flight", -1)
        return True


class Rule:
    """A [[rules]] table made live: its matcher and its limiter."""

    __slots__ = ("spec", "name", "kind", "header", "match", "limiter", "enforce", "rate", "algorithm", "inflight")

    def __init__(self, spec, limiter, algorithm, inflight=None):
        self.spec = spec
        self.name = spec.name
        self.kind = spec.key if not spec.key.startswith("header:") else "header"
        self.header = spec.header
        self.match = Matcher(spec)
        self.limiter = limiter
        self.enforce = not spec.dry_run
        self.rate = spec.limit
        self.algorithm = algorithm
        self.inflight = inflight  # limiter.concurrency table (max_in_flight), or None


class SharedTables(NamedTuple):
    """What the workers of --workers N share with the memory store: created by the supervisor before it
    forks (lb/process/supervisor.py), handed to each worker's App; empty in a single process."""

    limits: object = None  # limiter.shm.Arena: every limit's counters (store "shm")
    inflight: object = None  # limiter.concurrency.SharedTable: the requests in flight per key


class LimitStage:
    def __init__(
        self,
        default: str | None,
        overrides=(),
        algorithm: str = "token-bucket",
        store: str = "memory",
        reuse: dict | None = None,
        *,
        rules=(),
        keys=(),
        unknown_keys: str = "as-ip",
        exempt=(),
        ietf_headers: bool = False,
        ipv6_prefix: int = 64,
        max_delay: float = 0.0,
        max_delayed: int = 256,
        max_in_flight: int = 0,
        status: int = 429,
        inflight_ttl: float = 360.0,
        inflight_table=None,
        **store_options,
    ):
        """reuse: the limiters of the stage this one replaces (reload): an unchanged limit keeps its state
        (its in-flight tables too: a reload does not forget the requests in flight). inflight_table: the
        workers' shared one (SharedTables.inflight), for the memory store; None: this process counts alone."""
        self.algorithm = algorithm
        self.store = store
        self.options = tuple(sorted(store_options.items()))
        made = Limiters(algorithm, store, max_delay, inflight_ttl, inflight_table, reuse, store_options)
        limiter_for, inflight_for = made.rate, made.inflight
        self.default = limiter_for(default) if default else None
        self.ipv6_prefix = ipv6_prefix  # IPv6 clients are keyed by this prefix (identity.ip_key)
        self.overrides = {kind_name(k, ipv6_prefix): limiter_for(rate) for k, rate in overrides}
        self.registry = KeyRegistry(keys) if keys else None
        self.tiers = {k.name: limiter_for(k.limit) for k in keys if k.limit}
        self.reject_unknown = unknown_keys == "reject"
        nets, names = [], set()
        for e in exempt:
            if e.startswith("key:"):
                names.add(e)
            else:
                nets.append(netaddr.network(e[3:] if e.startswith("ip:") else e))  # mapped: its IPv4 net
        self.exempt_nets, self.exempt_names = tuple(nets), frozenset(names)
        self.rules = tuple(
            Rule(
                s,
                limiter_for(s.limit, s.algorithm or algorithm, s.name, s.cost, 0.0 if s.dry_run else max_delay)
                if s.limit
                else None,
                s.algorithm or algorithm,
                inflight_for(s.max_in_flight, s.name) if s.max_in_flight else None,
            )
            for s in rules
        )
        self.inflight = inflight_for(max_in_flight) if max_in_flight else None
        self.max_delay, self.max_delayed = max_delay, max_delayed
        self.status_code = status
        self.ietf = ietf_headers
        self.limiters = made.cache
        # The common configuration, one limit for every client and nothing else to decide (no override,
        # known key, exempt entry, rule, in-flight cap or IETF header): check() takes its short way.
        plain = not (self.overrides or keys or exempt or self.rules or self.inflight or ietf_headers)
        self.only = self.default if plain else None
        # admit()'s last admitted headers: (decision, remaining, reset above, reset at most, limit, bytes)
        self.shown: tuple = (None, None, 0.0, 0.0, None, b"")

    @property
    def declared(self) -> list[tuple[str, bool]]:
        """(rule name, dry_run) of every rule in force, the built-in one first."""
        builtin = (
            [(BUILTIN, False)] if self.default is not None or self.overrides or self.tiers or self.inflight else []
        )
        return builtin + [(r.name, not r.enforce) for r in self.rules]

    # -- what it shows operators (lb/limiting/views.py): /status, the key table, GET /limits/KEY ----------

    def status(self) -> list[dict]:
        return views.rules_status(self)

    def table(self) -> dict:
        return views.key_table(self)

    def peek(self, who: str = "", api_key: bytes | None = None, now: float | None = None) -> tuple[int, dict]:
        return views.peek(self, who, api_key, now)

    # -- one request ----------------------------------------------------------------------------------

    def identify(self, api_key: bytes | None, ip: str) -> tuple[str | None, str, KeySpec | None]:
        """(identity or None when refused, label for logs, the known key's spec or None)."""
        if api_key is None:
            ident = ip_key(ip, self.ipv6_prefix)
            return ident, ident, None
        if len(api_key) > MAX_KEY:
            raise ValueError(f"X-Api-Key longer than {MAX_KEY} bytes")
        if self.registry is None:
            seen = _unregistered.get(api_key)
            if seen is None:
                if len(_unregistered) >= _UNREGISTERED_MAX:
                    _unregistered.clear()  # a key-rotating client costs a hash per key, as before
                seen = _unregistered[api_key] = ("key:" + api_key.decode("latin-1"), key_label(api_key), None)
            return seen
        known = self.registry.lookup(api_key)
        if known is not None:
            ident = "key:" + known.name
            return ident, ident, known
        if self.reject_unknown:
            return None, key_label(api_key), None
        ident = ip_key(ip, self.ipv6_prefix)  # an unknown key is no key at all: limited by its IP
        return ident, ident, None

    def check(self, req, ip: str, now: float | None = None, route: str | None = None) -> Verdict | Admitted:
        """route: the name of the [[routes]] table the request matched (a rule's match.route), or None.
        An Admitted when the one limit of the common configuration admits it (the same answer a Verdict
        would give, without building one)."""
        v = self.admit(req, ip, now, route)
        return Admitted(*v) if isinstance(v, tuple) else v

    def admit(self, req, ip: str, now: float | None = None, route: str | None = None) -> Verdict | tuple[str, bytes]:
        """check() for the pipeline: (label, headers) when the one limit of the common configuration admits
        the request (nothing else to say), else the Verdict."""
        lim = self.only
        if lim is None:
            return self._check(req, ip, now, route)
        api_key = req.api_key
        if api_key is None:
            ident = label = ip_key(ip, self.ipv6_prefix)
        else:
            seen = _unregistered.get(api_key)
            if seen is None:  # a key's first request (or one too long): its identity made the long way
                return self._check(req, ip, now, route)
            ident, label, _ = seen
        d = lim.allow(ident) if now is None else lim.allow(ident, now)
        if type(d) is Decision and d[0]:  # admitted, not held, no failure policy: nothing else to say
            # the last admitted headers when they read the same (an idle client's do, every time)
            shown = self.shown
            if d is shown[0] or (d[2] == shown[1] and shown[2] < d[3] <= shown[3] and d[1] == shown[4]):
                return label, shown[5]
            self.shown = shown = _shown(d)
            return label, shown[5]
        v = Verdict(label)
        _decide_one(v, d, [BUILTIN], self.status_code)
        return v

    def _check(self, req, ip: str, now: float | None, route: str | None) -> Verdict:
        try:
            ident, label, known = self.identify(req.api_key, ip)
        except ValueError as e:
            v = Verdict("-")
            v.status, v.reason = 400, str(e)
            return v
        v = Verdict(label)
        if known is not None:
            v.key_name = known.name
        if ident is None:
            v.status, v.reason = 401, "unknown API key"
            return v
        if (self.exempt_names and ident in self.exempt_names) or (self.exempt_nets and self.ip_exempt(ip)):
            v.exempt = True
            return v
        checks, rules = [], []
        conc = None
        if self.inflight is not None:
            conc = [(self.inflight, ident, True, BUILTIN)]
        lim = self.overrides.get(ident) if self.overrides else None
        if lim is None:
            lim = self.tiers.get(known.name) if known is not None and self.tiers else None
            if lim is None:
                lim = self.default
        if lim is not None:
            checks.append((lim, ident, True))
            rules.append(BUILTIN)
        if self.rules:
            path = _Lazy(req.target)
            for r in self.rules:
                if r.match(req, path, route):
                    key = self._rule_key(r, req, ip, ident)
                    if key is None:
                        v.status, v.reason = 400, f"more than one {r.header.decode()} header"
                        return v
                    if r.limiter is not None:
                        checks.append((r.limiter, key, r.enforce))
                        rules.append(r.name)
                    if r.inflight is not None:
                        conc = (conc or []) + [(r.inflight, key, r.enforce, r.name)]
        # In-flight slots first: a request refused for concurrency spends no rate (its slots are given back
        # when the rate refuses it instead).
        if conc is not None and not self._take_slots(v, conc):
            return v
        if checks:
            self._decide(v, checks, rules, now)
            if v.status and v.slots:
                release(v.slots)
                v.slots = None
        return v

    def _take_slots(self, v: Verdict, conc) -> bool:
        """One in-flight slot per applying concurrency limit, all or none; False: refused (v says why)."""
        taken, dry = [], []
        for table, key, enforce, name in conc:
            slot = table.acquire(key)
            if slot is not None:
                taken.append((table, slot))
            elif enforce:
                release(taken)
                v.status, v.reason = self.status_code, "too many requests in flight"
                # the binding limit is this one (the rates were not asked): its N, none left, again in 1 s
                v.headers = (
                    b"X-RateLimit-Limit: %d\r\nX-RateLimit-Remaining: 0\r\nX-RateLimit-Reset: 1\r\n"
                    b"Retry-After: 1\r\n" % table.limit
                )
                v.rejected, v.limited_by = (name,), name + ":in_flight"
                return False
            else:
                dry.append(name)
        if dry:
            v.dry, v.limited_by = tuple(dry), ",".join(n + ":in_flight:dry_run" for n in dry)
        v.slots = taken or None
        return True

    def _decide(self, v: Verdict, checks, rules, now) -> None:
        if len(checks) == 1 and checks[0][2] and not self.ietf:
            # The common case, one enforcing limit: what _verdict decides for it, without its lists.
            lim, key, _ = checks[0]
            _decide_one(v, lim.allow(key) if now is None else lim.allow(key, now), rules, self.status_code)
            return
        admitted, decisions = allow_all(checks, now)  # now=None: the store reads its clock (under its lock)
        self._verdict(v, admitted, checks, rules, decisions)
        if admitted and self.max_delay:
            # several limits holding: the request runs when the last of them has its turn (the others'
            # slots, reserved earlier, are then a little early: see docs/limiter.md, delay mode)
            v.delay = max((d.delay for d in decisions if type(d) is Delayed), default=0.0)

    def ip_exempt(self, ip: str) -> bool:
        try:
            a = netaddr.ip(ip)
        except ValueError:
            return False
        return any(a in n for n in self.exempt_nets)

    def _rule_key(self, r: Rule, req, ip: str, ident: str) -> str | None:
        """The key a rule counts this request under; None when the header it keys on is repeated (a
        client could otherwise present one value to the limiter and another to the backend)."""
        kind = r.kind
        if kind == "ip":
            return ip_key(ip, self.ipv6_prefix)
        if kind == "api-key":
            return ident
        if kind == "global":
            return "*"
        if kind == "client-cert":
            # The verified subject (a partner keeps its bucket across a reissued certificate), hashed like a
            # header; a request without a certificate is limited as its client, as a missing header is.
            cert = req.client_cert
            if cert is not None and cert.subject:
                return "c:" + hashlib.blake2b(cert.subject.encode(), digest_size=16).hexdigest()
            return ip_key(ip, self.ipv6_prefix)
        found = None
        for _, lname, value in req.headers:
            if lname == r.header:
                if found is not None:
                    return None
                found = value
        if found:
            # Hashed: any length in, a fixed-size key out, and no header value (a token?) in Redis.
            return "h:" + hashlib.blake2b(found, digest_size=16).hexdigest()
        return ip_key(ip, self.ipv6_prefix)  # a missing header is the client, never one shared bucket

    def _verdict(self, v: Verdict, admitted: bool, checks, rules, decisions) -> None:
        rejected, dry, shown, unavailable = [], [], None, False
        for (_lim, _key, enforce), name, d in zip(checks, rules, decisions):
            if getattr(d, "degraded", False):
                v.degraded = True
            if not enforce:
                if not d.allowed:
                    dry.append(name)
                continue
            if admitted:
                if shown is None or (d.remaining, d.reset) < (shown.remaining, shown.reset):
                    shown = d
            elif not d.allowed:
                rejected.append(name)
                if getattr(d, "unavailable", False):
                    unavailable = True
                if shown is None or (d.retry_after, d.reset) > (shown.retry_after, shown.reset):
                    shown = d
        v.rejected, v.dry = tuple(rejected), v.dry + tuple(dry)
        if admitted:
            v.admitted = tuple(name for name, d in zip(rules, decisions) if d.allowed)
        if rejected or dry:
            v.limited_by = ",".join(rejected + [n + ":dry_run" for n in dry] + ([v.limited_by] if v.limited_by else []))
        if shown is not None:
            v.headers = headers(shown)
            if self.ietf:
                v.headers += _ietf(checks, rules, decisions, shown)
        if not admitted:
            v.status, v.reason = (
                (503, "rate limiter unavailable") if unavailable else (self.status_code, "rate limit exceeded")
            )


def _ietf(checks, rules, decisions, shown) -> bytes:
    """draft-ietf-httpapi-ratelimit-headers: every applying enforcing policy; the binding one first."""
    items = sorted(
        ((d is not shown, name, lim, d) for (lim, _, e), name, d in zip(checks, rules, decisions) if e),
        key=lambda t: t[0],
    )
    policy = ", ".join(
        f'"{name}";q={lim.limit};w={max(1, math.ceil(lim.algorithm.window))}' for _, name, lim, _ in items
    )
    state = ", ".join(f'"{name}";r={d.remaining};t={max(0, math.ceil(d.reset))}' for _, name, _, d in items)
    return b"RateLimit-Policy: %s\r\nRateLimit: %s\r\n" % (policy.encode(), state.encode())


def _shown(d) -> tuple:
    """LimitStage.shown for an admitted decision d: its headers, with the resets that read the same."""
    reset = math.ceil(d[3])  # the header says max(0, reset): any reset in (reset - 1, reset], or <= 0
    return (d, d[2], reset - 1.0 if reset > 0 else -math.inf, float(reset) if reset > 0 else 0.0, d[1], headers(d))


def _decide_one(v: Verdict, d, rules, status_code: int) -> None:
    """v from the decision d of the one enforcing limit that applied (rules: its name)."""
    v.headers = headers(d)
    if getattr(d, "degraded", False):  # a store's failure policy decided (fail-open admits)
        v.degraded = True
    if d.allowed:
        v.admitted = rules
        if type(d) is Delayed:
            v.delay = d.delay
        return
    v.rejected, v.limited_by = (rules[0],), rules[0]
    v.status, v.reason = (
        (503, "rate limiter unavailable") if getattr(d, "unavailable", False) else (status_code, "rate limit exceeded")
    )


# An unregistered X-Api-Key's identity and log label, by key: the label is a keyed hash, computed once
# per key rather than per request. Bounded: emptied when full.
_unregistered: dict = {}
_UNREGISTERED_MAX = 4096


class _Lazy:
    """The request's normalised path, computed at most once and only if a rule asks for it."""

    __slots__ = ("target", "path")
    path: bytes | None

    def __init__(self, target: bytes):
        self.target, self.path = target, None

    def __call__(self) -> bytes:
        if self.path is None:
            self.path = normalize_path(self.target)
        return self.path


def headers(d) -> bytes:
    """X-RateLimit-* for any response; Retry-After too when the request was rejected."""
    # (conditionals, not max(): on every response, and the builtin's call costs more than the rest)
    reset = math.ceil(d.reset)
    out = b"X-RateLimit-Limit: %d\r\nX-RateLimit-Remaining: %d\r\nX-RateLimit-Reset: %d\r\n" % (
        d.limit,
        d.remaining,
        reset if reset > 0 else 0,
    )
    if not d.allowed:
        retry = math.ceil(d.retry_after)
        out += b"Retry-After: %d\r\n" % (retry if retry > 1 else 1)
    return out
