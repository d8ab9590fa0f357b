"""Several Redis limits of one request in ONE script call: one round trip, atomic across the limits.

The script is assembled from the per-algorithm scripts each RedisStore already runs (store.lua: its
algorithm's body with its constants baked in) -- no Lua is copied.  Each body becomes a local function
whose `redis` is a proxy: reads go to Redis at once, writes (SET, ZADD, PEXPIRE, ZREMRANGEBYSCORE) are
queued.  After every body has returned its verdict, the queued writes run only if every enforcing limit
admitted (limiter.compose's all-or-nothing rule; the sliding log prunes only when it admits: a prune at
a vetoed request's instant could hide entries from a later-arriving, earlier instant).  The reply is the bodies' replies joined by newlines, and each
limit's Decision is computed from its part by its own algorithm's step(), exactly as RedisStore.allow
does for one.

One script (one SHA) per combination of limits that apply together; built on first use and cached.
The call rides on the link's evalsha(script, key, now) unchanged (limiter/redis/link.py): evalsha sends
`script.head + <key> + <now>`, so the per-call head below carries EVALSHA, the SHA, numkeys and every
key but the last, and `key` is the last one (a link that routes by key routes by that one).

Redis Cluster hook (limiter/redis/cluster.py's ClusterLink has it): a link whose keys can live in
different slots defines `split_keys(keys) -> [[index, ...], ...]`, one group per slot; each group then runs as its own script,
atomic within its slot only (a request's keys do not share a hash tag: a global rule's key is the same
for every client, an ip rule's differs per client).  A single Redis (and Sentinel) is one group.
"""

from __future__ import annotations

import threading

from redis.exceptions import RedisError

from limiter.algorithms import Decision
from limiter.redis.link import _Script, call_error
from limiter.redis.scripts import lua

_PROXY = lua("multi_proxy.lua")

_scripts: dict[tuple, _Script] = {}
_scripts_lock = threading.Lock()


def build_lua(stores, enforce) -> str:
    """The Lua text deciding stores[i] (on KEYS[i]) together; enforce[i]: whether it may veto."""
    parts = [_PROXY]
    for i, store in enumerate(stores, 1):
        parts.append(f"local function limit{i}(KEYS, ARGV, redis)\n{store.lua}\nend\n")
    for i, on in enumerate(enforce, 1):
        parts.append(f"out[{i}] = limit{i}({{KEYS[{i}]}}, ARGV, proxy)\n")
        if on:
            parts.append(f"if string.byte(out[{i}], 1) ~= 49 then admitted = false end\n")
    parts.append(
        "if admitted then\n  for _, w in ipairs(writes) do rcall(unpack(w)) end\nend\nreturn table.concat(out, '\\n')\n"
    )
    return "".join(parts)


def script_for(stores, enforce) -> _Script:
    sig = tuple((s.script.sha, e) for s, e in zip(stores, enforce))
    script = _scripts.get(sig)
    if script is None:
        with _scripts_lock:
            script = _scripts.get(sig)
            if script is None:
                script = _scripts[sig] = _Script(build_lua(stores, enforce))
    return script


class NotAsked(Decision):
    """A limit of a request rejected from another limit's denial cache: not decided (and nothing spent)."""

    __slots__ = ()


class _Call:
    """A script plus this call's keys but the last, in the shape RedisLink.evalsha packs (a _Script:
    head, text, sha -- what a NOSCRIPT reload needs)."""

    __slots__ = ("head", "text", "sha")

    def __init__(self, script: _Script, keys: list[bytes]):
        head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$%d\r\n%d\r\n" % (
            4 + len(keys),
            script.sha.encode(),
            len(str(len(keys))),
            len(keys),
        )
        for k in keys[:-1]:
            head += b"$%d\r\n%s\r\n" % (len(k), k)
        self.head = head
        self.text = script.text
        self.sha = script.sha


def allow_all_redis(checks, now: float):
    """limiter.compose.allow_all for RedisStores sharing one link."""
    link = checks[0][0].link
    split = getattr(link, "split_keys", None)
    keys = [lim.key(key).encode() for lim, key, _ in checks]
    groups = split(keys) if split is not None else [range(len(checks))]
    admitted, decisions = True, [None] * len(checks)
    for group in groups:
        part = [checks[i] for i in group]
        ok, ds = _one_call(link, part, [keys[i] for i in group], now)
        admitted = admitted and ok
        for i, d in zip(group, ds):
            decisions[i] = d
    return admitted, decisions


def _one_call(link, checks, keys, now):
    stores = [lim for lim, _, _ in checks]
    node = link.route(keys[-1])  # one server owns them all (see split_keys above)
    # The stores' denial caches (RedisStore, "denials answered locally"): when one enforcing limit is
    # known to deny, the script would reject and write nothing -- answer without the round trip. Only
    # the limits the cache knows are reported; the others were not asked (NotAsked). (Per group: on a
    # cluster, the other slots' groups are called as before -- docs/rules.md.)
    known = [lim._cached_denial(key, node, now) if lim._denied else None for lim, key, _ in checks]
    if any(d is not None and e for d, (_, _, e) in zip(known, checks)):
        for d, lim in zip(known, stores):
            if d is not None:
                lim.answered_locally += 1
        return False, [
            d if d is not None else tuple.__new__(NotAsked, (True, lim.limit, 0, 0.0, 0.0))
            for d, lim in zip(known, stores)
        ]
    if node.up or node.may_try():
        script = script_for(stores, [e for _, _, e in checks])
        try:
            reply = node.evalsha(_Call(script, keys), keys[-1], now)
        except RedisError as e:
            failed = getattr(e, "node", None) or node  # a redirected call names the server that failed
            if call_error(e):  # OOM, a script error: this call, not the server
                failed.call_failed(e)
            else:
                failed.failed(e)
        else:
            if not node.up:
                node.succeeded()
            admitted, decisions, states = True, [], []
            for (lim, key, enforce), raw in zip(checks, reply.split(b"\n")):
                if lim._locals:  # this server answers again: its local counts are stale
                    lim._locals.pop(node, None)
                new, d = lim._step(lim._state(raw[2:] or None), now)
                if d.allowed != (raw[0] == 49):  # the script's verdict stands; what it wrote is unknown
                    d, new = lim._drifted(key, now, raw, d), None
                if enforce and not d.allowed:
                    admitted = False
                decisions.append(d)
                states.append(new)
            for (lim, key, _), new, d in zip(checks, states, decisions):
                # What Redis holds now: the new state if this limit spent (admitted request) or denied
                # (a denial writes nothing that matters); the pre-state, unknown here, if it admitted a
                # request another limit rejected.
                lim._remember(key, new if new is not None and (admitted or not d.allowed) else None, d, node)
            return admitted, decisions
    return _fallback(checks, now, node)


def _fallback(checks, now, node):
    """Redis unavailable: the stores' failure policy (every store of one edge has the same)."""
    if checks[0][0].on_error == "local":  # all or nothing on the in-process fallback limiters too
        from limiter.memory import MemoryStore, allow_all_memory
        from limiter.redis.store import LocalDecision

        local = []
        for lim, key, enforce in checks:
            lim.degraded += 1
            store = lim._locals.get(node)
            if store is None:
                store = lim._locals.setdefault(node, MemoryStore(lim.algorithm, max_keys=lim.max_keys))
            local.append((store, key, enforce))
        ok, ds = allow_all_memory(local, now)
        return ok, [tuple.__new__(LocalDecision, d) for d in ds]
    decisions = [lim._fallback(key, now, node) for lim, key, _ in checks]
    return all(d.allowed for d, (_, _, e) in zip(decisions, checks) if e), decisions
