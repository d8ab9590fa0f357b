"""Several limits decided together for one request: all or nothing.

    admitted, decisions = allow_all([(limiter, key, enforce), ...], now)

`admitted` is True when every *enforcing* check admits (checks with enforce=False -- shadow/dry-run
limits -- are decided and reported but never veto).  What is spent:

* admitted: every check that admitted on its own spends (a dry-run check that would have rejected
  spends nothing, exactly as if it were enforcing and its rejection had been overruled);
* rejected: NOTHING is spent, in any check.  A request refused by one limit does not eat into the
  others -- nginx's limit_req with several zones behaves the same way (it looks every zone up without
  accounting and accounts only when all pass).  Envoy spends in every descriptor instead; we do not,
  because (a) an attacker held back by a per-IP or login guard would otherwise keep draining a shared
  global ceiling for everyone else, and (b) a client told "Retry-After: N" by the most restrictive
  rejecting limit then really is admitted at N: the limits that admitted are still unspent.

Atomic across checks: the memory store holds every involved stripe lock at once (taken in one global
order, so two requests can never deadlock: limiter.memory.allow_all_memory), the shared-memory store the same with its cross-process
locks (limiter.shm.allow_all_shm); the Redis store runs all checks as ONE script
(limiter.redis.multi).  One check goes straight to limiter.allow (the common case, no overhead).
Other stores are decided one check after another (see the end of allow_all).
"""

from __future__ import annotations

from limiter.memory import MemoryStore, allow_all_memory


def allow_all(checks, now: float | None = None):
    """checks: sequence of (limiter, key, enforce). Returns (admitted, [Decision per check]).

    now=None: the stores' clock, read as late as they read it for one key (memory: under the locks).
    """
    if len(checks) == 1:
        lim, key, enforce = checks[0]
        d = lim.allow(key) if now is None else lim.allow(key, now)
        return (d.allowed or not enforce), [d]
    kinds = {type(lim) for lim, _, _ in checks}
    if kinds == {MemoryStore}:
        return allow_all_memory(checks, now)
    from limiter.shm import ShmStore, allow_all_shm

    if kinds == {ShmStore}:  # --workers N with the memory store
        return allow_all_shm(checks, now)
    from limiter.redis.store import RedisStore  # only when a Redis store is in use

    if kinds == {RedisStore} and len({lim.link for lim, _, _ in checks}) == 1:
        from limiter.redis.multi import allow_all_redis

        return allow_all_redis(checks, checks[0][0].clock() if now is None else now)
    # Any other store (or a mix): one decision after another -- correct per limit, but neither atomic
    # across limits nor all-or-nothing (a limit that admitted spends even when another rejects, as
    # Envoy's descriptors do). A store that can do better gets its own branch above.
    ds = [lim.allow(key) if now is None else lim.allow(key, now) for lim, key, _ in checks]
    return all(d.allowed for d, (_, _, e) in zip(ds, checks) if e), ds
