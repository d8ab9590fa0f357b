"""The Redis store: per-key state for one algorithm in a Redis server, shared by every edge process.

Division of labour (why the rules still live in one place):

* The check-and-consume is ONE server-side operation: a Lua script per algorithm (lua/*.lua, run with EVALSHA;
  on NOSCRIPT, e.g. after a restart or SCRIPT FLUSH, it is loaded again and rerun transparently).  The
  script reads the key's state, applies the algorithm's admission rule -- the same float expressions
  as limiter.algorithms, over the same state shapes -- writes the new state with its TTL, and returns
  whether it admitted plus the state it read (the "pre-state"), as ONE bulk string "<0|1>[ <state>]".
* The Decision's fields are then computed here by the algorithm's own Python step(pre_state, now):
  step is pure, so on the state the script saw it reproduces the script's verdict and yields exactly
  the remaining/reset/retry_after the memory store would report (the ulp-exact retry_after search of
  the sliding counter is not duplicated in Lua).  Every call cross-checks the two verdicts; a
  disagreement is counted in `drift` (and raises when `strict`), and the shared behavioural suite
  (tests/test_limiter.py) runs on both stores.

State in Redis (floats written with %.17g, which round-trips every double exactly):

    token-bucket     STRING "tokens stamp"                 (TokenBucket state)
    fixed-window     STRING "k count"                      (FixedWindow state)
    sliding-counter  STRING "k prev cur"                   (SlidingCounter state)
    sliding-log      ZSET   score = expiry instant e = t + W, member "<e>#<i>" (i disambiguates equal e)

Key: <prefix>{<client key>} -- the hash tag puts every key of one client in one Redis Cluster slot.
TTL: PEXPIRE ceil((algorithm.expires_at(new_state) - now) * 1000) + grace ms, on every write.  From
expires_at on, a state behaves exactly like a missing key, so expiring late never changes a decision;
the grace (default 1 s) keeps it from expiring early when edge clocks differ by a few ms.

Time: the caller's `now` (see docs/redis.md for why not the server's TIME).

Transport: limiter.redis.link (connections, the pool, the circuit breaker shared by every store on the
same Redis, one per URL per process; the lean call path is described there).  While the breaker is
open the failure policy decides: fail-open (admit), fail-closed (deny with unavailable=True: the edge
answers 503) or local (an in-process MemoryStore of the same algorithm).
"""

from __future__ import annotations

import logging
import math
from time import monotonic, time

from redis.exceptions import RedisError

from limiter.algorithms import Decision, FixedWindow, SlidingCounter, SlidingLog, TokenBucket
from limiter.memory import MemoryStore
from limiter.redis.connect import link_for
from limiter.redis.link import RedisLink, _Script, call_error
from limiter.redis.scripts import lua
from limiter.redis.url import parse

log = logging.getLogger("edge")

POLICIES = ("fail-open", "fail-closed", "local")
_new = tuple.__new__


class FailOpenDecision(Decision):
    """Admitted by the fail-open policy while Redis is unavailable."""

    __slots__ = ()
    unavailable = False
    degraded = True


class UnavailableDecision(Decision):
    """Denied by the fail-closed policy: the edge answers 503, not 429."""

    __slots__ = ()
    unavailable = True
    degraded = True


class LocalDecision(Decision):
    """Decided by the local (in-process) fallback limiter while Redis is unavailable."""

    __slots__ = ()
    unavailable = False
    degraded = True


class DriftError(AssertionError):
    """The Lua script and the Python algorithm disagreed on a verdict (a bug: they must mirror)."""


# ------------------------------------------------------------------------------------ the scripts
# In limiter/redis/lua/, each file saying its ARGV and its reply; common.lua opens every decision script.

_COMMON = lua("common.lua")
TOKEN_BUCKET = _COMMON + lua("token_bucket.lua")
FIXED_WINDOW = _COMMON + lua("fixed_window.lua")
SLIDING_COUNTER = _COMMON + lua("sliding_counter.lua")
SLIDING_LOG = _COMMON + lua("sliding_log.lua")


# Each takes the state part of the script's reply (bytes after "<0|1> "; None if the key was missing).


def _tb_state(raw):
    if raw is None:
        return None
    a, b = raw.split()
    return float(a), float(b)


def _fw_state(raw):
    if raw is None:
        return None
    a, b = raw.split()
    return int(float(a)), int(b)


def _sc_state(raw):
    if raw is None:
        return None
    a, b, c = raw.split()
    return int(float(a)), int(b), int(c)


def _sl_state(raw):
    parts = raw.split()
    n = int(parts[0])
    if not n:
        return None
    first = float(parts[1])
    if n == 1:
        return [first]
    # The pruned log's decision-relevant facts are its length, oldest and newest expiry: step() on this
    # stand-in (same length, same ends, sorted) decides and reports exactly as on the real log.
    log_ = [float(parts[2])] * n
    log_[0] = first
    return log_


PEEK_GET = lua("peek_get.lua")
PEEK_LOG = lua("peek_log.lua")

# algorithm class -> the read-only peek script (after the store's constants) for those whose reply format
# is not the base one's (limiter.redis.shaping's sliding log)
_PEEKS: dict = {}

_SCRIPTS = {
    TokenBucket: (TOKEN_BUCKET, _tb_state, lambda a: (a.capacity, a.per_token, a.rate)),
    FixedWindow: (FIXED_WINDOW, _fw_state, lambda a: (a.window, a.limit)),
    SlidingCounter: (SLIDING_COUNTER, _sc_state, lambda a: (a.window, a.limit)),
    SlidingLog: (SLIDING_LOG, _sl_state, lambda a: (a.window, a.limit)),
}


# ---------------------------------------------------------------------------------------- the store


class RedisStore:
    """allow(key, now) for one algorithm, with state held in Redis (one Lua script call per decision).

    url: redis://, rediss://, redis-sentinel:// or redis-cluster:// (limiter.redis.url); password_file,
    ca_file, cert_file, key_file: the [limits] redis_* settings.
    """

    def __init__(
        self,
        algorithm,
        url: str,
        *,
        prefix: str | None = None,
        timeout: float = 0.05,
        pool_size: int = 64,
        on_error: str = "fail-open",
        retry_interval: float = 0.5,
        ttl_grace: float = 1.0,
        max_keys: int = 100_000,
        password_file: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        clock=time,
        deny_cache: int = 10_000,
    ):
        if on_error not in POLICIES:
            raise ValueError(f"on_error must be one of {', '.join(POLICIES)}; got {on_error!r}")
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size <= 0:
            raise ValueError(f"pool_size must be a positive integer, got {pool_size!r}")
        if prefix is None:
            prefix = f"rl:{algorithm.name}:{algorithm.limit}/{algorithm.window!r}:"
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix must not contain '{{' or '}}' (the client key is the hash tag): {prefix!r}")
        if isinstance(deny_cache, bool) or not isinstance(deny_cache, int) or deny_cache < 0:
            raise ValueError(f"deny_cache must be an integer >= 0 (0: off), got {deny_cache!r}")
        if not (ttl_grace >= 0):
            raise ValueError(f"ttl_grace must be >= 0 seconds, got {ttl_grace!r}")
        try:
            lua, self._state, args = _SCRIPTS[type(algorithm)]
        except KeyError:
            raise ValueError(f"no Redis script for {algorithm!r}") from None
        target = parse(url, password_file=password_file, ca_file=ca_file, cert_file=cert_file, key_file=key_file)
        self.algorithm = algorithm
        self.limit = algorithm.limit
        self.url = target.display  # never the password
        self.prefix = prefix
        self.on_error = on_error
        self.link = link_for(target, timeout, pool_size, retry_interval)
        self._route = self.link.route
        # One server (not a cluster, whose route() picks the key's node): allow() skips the call.
        self._node = self.link if type(self.link).route is RedisLink.route else None
        # The configuration is baked into this limiter's copy of the script (a local ARGV shadowing the
        # real one; one SHA per configuration), so each call sends only the key and now.
        consts = [str(math.ceil(ttl_grace * 1000)), *(repr(float(x)) for x in args(algorithm))]
        self.head = "local ARGV = {ARGV[1], %s}\n" % ", ".join(f"'{c}'" for c in consts)
        self.lua = self.head + lua
        self.script = _Script(self.lua)
        self._step = algorithm.step
        # A parser whose stand-in state is exact for what a denial needs but not after the step admitted
        # (the shaped sliding log's: the log's middle is not in the reply) keeps only denials.
        self._keeps_admissions = getattr(self._state, "exact_after_admission", True)
        self.clock = clock
        self.max_keys = max_keys
        # on_error="local": one in-process limiter per Redis server that failed (a cluster has several),
        # created on its first fallback, dropped by the first decision that reaches that server again --
        # whichever store's call it was that found the server back (every store checks its own).
        self._locals: dict[RedisLink, MemoryStore] = {}
        self.deny_cache = deny_cache
        self._denied: dict = {}  # key -> (the state Redis holds while it can only deny, its server, its outages then)
        self.answered_locally = 0  # denials answered from _denied, without a round trip
        self.degraded = 0  # decisions made by the failure policy
        self.drift = 0  # Lua and Python verdicts disagreed (must stay 0)
        self.strict = False  # raise DriftError instead of counting (tests)

    def key(self, key: str) -> str:
        return f"{self.prefix}{{{key}}}"

    def peek(self, key, now: float | None = None):
        """(held, Decision): what allow(key, now) would answer, from the state Redis holds now, which a
        read-only script returns (nothing is written). Raises the store's error when it does not answer."""
        if now is None:
            now = self.clock()
        k = f"{self.prefix}{{{key}}}".encode()
        if not hasattr(self, "_peek"):
            peek = _PEEKS.get(type(self.algorithm))  # a script whose reply needs the constants
            self._peek = _Script(
                self.head + peek if peek else PEEK_LOG if isinstance(self.algorithm, SlidingLog) else PEEK_GET
            )
        reply = self._route(k).evalsha(self._peek, k, now)
        state = self._state(reply[2:] or None)
        if type(state) is list:
            state = state.copy()
        return state is not None, self._step(state, now)[1]

    def allow(self, key, now: float | None = None):
        if now is None:
            # Read as late as possible, just before the call.  There is no lock to read it under: the
            # order that counts is the order the scripts run in Redis, across connections and edges --
            # out-of-order instants cost what docs/redis.md ("Time") measures.
            now = self.clock()
        k = f"{self.prefix}{{{key}}}".encode()
        node = self._node or self._route(k)
        # The denial cache.  After a decision that left the key unable to admit anything more (a denial,
        # or an admission with remaining 0) we keep the state Redis then held.  Until that state's own
        # next-admission instant nothing can be admitted for the key anywhere (other edges can only
        # deny, which changes no threshold), so the algorithm's step() on the kept state gives exactly
        # the Decision Redis would: the verdict, Remaining 0, the same Reset, Retry-After counted down.
        # The first instant step() would admit, the call goes to Redis.  Per-algorithm argument in
        # docs/redis.md ("Denials answered locally").  An entry is only used while its server is up and
        # has not been down since (it may have come back empty); while down, the failure policy decides.
        state = self._denied.get(key)
        if state is not None:
            state, server, outages = state
            # the same server (a cluster slot may have moved to another node, e.g. its promoted replica,
            # which may lack the last writes) and no outage of it since
            if server is node and node.up and outages == node.outages:
                if type(state) is list:
                    state = state.copy()  # step() prunes a sliding log in place; the kept one stays whole
                _, d = self._step(state, now)
                if not d.allowed:
                    self.answered_locally += 1
                    return d
        if node.up or node.may_try():
            try:
                reply = node.evalsha(self.script, k, now)
            except RedisError as e:
                # a redirected call names the server that actually failed
                failed = getattr(e, "node", None) or node
                if call_error(e):  # OOM, a script error: this call failed, the server is up
                    failed.call_failed(e)
                else:
                    failed.failed(e)
            else:
                if not node.up:
                    node.succeeded()
                if self._locals:  # this server answers again: its local counts are stale
                    self._locals.pop(node, None)
                new, d = self._step(self._state(reply[2:] or None), now)
                if d.allowed != (reply[0] == 49):  # b"1..."
                    if state is not None:
                        self._denied.pop(key, None)
                    return self._drifted(key, now, reply, d)
                if d.remaining or (d.allowed and not self._keeps_admissions):
                    if state is not None:
                        self._denied.pop(key, None)
                elif self.deny_cache:
                    denied = self._denied
                    if len(denied) >= self.deny_cache and key not in denied:
                        denied.clear()  # bounded; forgetting costs round trips, never a wrong answer
                    denied[key] = (new, node, node.outages)
                return d
        return self._fallback(key, now, node)

    # The denial cache for several limits decided together (limiter.redis.multi); allow() inlines the
    # same two steps on its hot path.
    def _cached_denial(self, key, node, now):
        """The Decision Redis would give when the cache knows it is a denial (no round trip), else None."""
        entry = self._denied.get(key)
        if entry is not None:
            state, server, outages = entry
            if server is node and node.up and outages == node.outages:
                _, d = self._step(state.copy() if type(state) is list else state, now)
                if not d.allowed:
                    return d
        return None

    def _remember(self, key, state_held, d, node) -> None:
        """After a round trip: keep state_held (what Redis now holds for key) when it cannot admit (d, its
        decision, left nothing remaining); forget the key's entry otherwise.  state_held None: unknown."""
        if d.remaining or state_held is None or (d.allowed and not self._keeps_admissions):
            if self._denied:
                self._denied.pop(key, None)
        elif self.deny_cache:
            denied = self._denied
            if len(denied) >= self.deny_cache and key not in denied:
                denied.clear()  # bounded; forgetting costs round trips, never a wrong answer
            denied[key] = (state_held, node, node.outages)

    def _fallback(self, key, now, node):
        self.degraded += 1
        policy = self.on_error
        if policy == "fail-open":
            a = self.algorithm
            return _new(FailOpenDecision, (True, self.limit, self.limit - 1, a.window, 0.0))
        if policy == "fail-closed":
            wait = max(0.0, node.retry_at - monotonic())
            return _new(UnavailableDecision, (False, self.limit, 0, wait, wait))
        local = self._locals.get(node)
        if local is None:
            local = self._locals.setdefault(node, MemoryStore(self.algorithm, max_keys=self.max_keys))
        return _new(LocalDecision, local.allow(key, now))

    def _drifted(self, key, now, reply, d):
        """Lua and step() disagree: the verdict of the script, whose state is the one written, stands
        (with step()'s durations, Remaining 0); counted, logged once, raised when strict."""
        self.drift += 1
        msg = (
            f"RedisStore drift: Lua {'admitted' if reply[0] == 49 else 'denied'} but {self.algorithm!r}.step "
            f"{'admitted' if d.allowed else 'denied'} key={key!r} now={now!r} reply={reply!r}"
        )
        if self.strict:
            raise DriftError(msg)
        if self.drift == 1:
            log.error("%s (logged once; counted in .drift; the script's verdict stands)", msg)
        if reply[0] == 49:
            return _new(Decision, (True, self.limit, 0, d.reset, 0.0))
        wait = d.retry_after or d.reset or self.algorithm.window
        return _new(Decision, (False, self.limit, 0, max(d.reset, wait), wait))

    @property
    def failures(self) -> int:
        return self.link.failures

    def __repr__(self):
        return f"RedisStore({self.algorithm!r}, {self.url!r}, prefix={self.prefix!r}, on_error={self.on_error!r})"
