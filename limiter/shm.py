"""The shared-memory store: one limit per key across the worker processes of one edge, no Redis.

nginx's limit_req_zone model.  The supervisor creates an Arena BEFORE it forks the workers: an anonymous
shared mmap (MAP_SHARED, so every forked worker sees the same bytes) holding a fixed table of fixed-size
slots, and an unlinked temporary file whose byte ranges are the stripe locks.  Every worker's
ShmStore decides on that table with the algorithm's own step() -- the same functions as the memory and
Redis stores, no second copy of any rule; only the state's packing into bytes is new (CODECS).

Table: `stripes` independent open-addressing tables of `slots // stripes` slots; a key (a 14-byte BLAKE2b
digest of limiter id + client key, so several limiters share one arena, then 2 bytes of the limiter id's
own digest, its tag: /status counts each limiter's keys by it) lives in the stripe its digest names, in
the first reusable of PROBE slots from either of its two home slots.  A slot: digest (16 bytes; zero: never used),
expires_at (double), the state's bytes.

Locks, across processes and threads: a decision holds its stripe's threading.Lock (the threads of one
process) and then an exclusive fcntl record lock on byte <stripe> of the lock file (the processes).
The kernel drops a process's record locks when it dies, so **a worker killed while holding a lock
does not wedge the others**: the next taker gets the lock at once.  The clock is read under both locks,
as in the memory store.  What a kill can leave behind is at most one half-written slot (the state is
written with one struct.pack_into, a memcpy of a few dozen bytes): one key decided on a torn state
until its state expires -- never a wedged table.

Bounded: the table never grows.  The eviction rule is the memory store's: a slot whose state has
expired (expires_at <= now: it behaves exactly like a fresh key) is reused first; when every slot a
new key may use holds live state, the key is refused with a TableFullDecision (the edge answers 503),
and no live state is ever overwritten, so a flood cannot reset a limited key's quota.  Slots are never
emptied (a reused slot keeps probe chains whole), so a lookup stops at a never-used slot or after PROBE.
"Every slot a new key may use" is the PROBE slots from each of its two homes, not the whole table:
unlike the memory store, a new key can be refused while reclaimable slots exist elsewhere (open
addressing keeps a lookup to at most 2 x PROBE slots).  Filling a table with distinct live keys, the
first refusal came at 72.6% full (100,000 slots; 69.0% of 10,000) with two homes, taking the free slot
nearer its home; with one home, as before, at 38.3% (45.4%) (bench/shm_bench.py --fill).  One log line when
it happens (then at most one a minute per process); counted in `.full` (lb_limiter_table_full_total).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import struct
import tempfile
import threading
from time import monotonic
from time import time as _time

from limiter.algorithms import FixedWindow, SlidingCounter, SlidingLog, TokenBucket
from limiter.memory import TableFullDecision

log = logging.getLogger("edge")

PROBE = 16  # slots examined for a key, from its home slot (linear probing inside its stripe)
_HEAD = struct.Struct("=16sd")  # digest, expires_at
_EMPTY = bytes(16)
_new = tuple.__new__


class _Codec:
    """A state <-> bytes, in a fixed size per algorithm (the sliding log: its limit's worth of doubles)."""

    def __init__(self, fmt: str, decode, encode):
        self.struct = struct.Struct(fmt)
        self.size = self.struct.size
        self.decode = decode
        self.encode = encode


def _codec(algorithm) -> _Codec:
    if isinstance(algorithm, TokenBucket):
        return _Codec("=dd", lambda v: v, lambda s: s)
    if isinstance(algorithm, FixedWindow):
        return _Codec("=qq", lambda v: v, lambda s: s)
    if isinstance(algorithm, SlidingCounter):
        return _Codec("=qqq", lambda v: v, lambda s: s)
    if isinstance(algorithm, SlidingLog):
        n = getattr(algorithm, "max_entries", algorithm.limit)  # delay mode logs ahead (limiter.shaping)
        pad = (0.0,) * n
        return _Codec(f"=q{n}d", lambda v: list(v[1 : 1 + v[0]]), lambda s: (len(s), *s, *pad[len(s) :]))
    raise ValueError(f"no shared-memory layout for {algorithm!r}")


def state_size(algorithm) -> int:
    """Bytes of state one slot needs for this algorithm (and limit)."""
    return _codec(algorithm).size


class Arena:
    """The shared table: create it in the parent, before fork; every child's ShmStore uses it."""

    def __init__(self, slots: int = 100_000, state_bytes: int = 24, stripes: int = 64):
        if slots < stripes:
            stripes = max(1, slots)
        self.stripes = stripes
        self.per_stripe = slots // stripes
        self.slots = self.per_stripe * stripes
        self.state_bytes = state_bytes
        self.slot_size = _HEAD.size + state_bytes
        self.mem = mmap.mmap(-1, self.slots * self.slot_size)  # anonymous, MAP_SHARED: survives fork shared
        fd, path = tempfile.mkstemp(prefix="edge-shm-locks-")
        os.unlink(path)  # only the inherited descriptor keeps it: nothing to clean up
        os.ftruncate(fd, stripes)
        self.lock_fd = fd
        self.pid = os.getpid()
        self._tlocks = tuple(threading.Lock() for _ in range(stripes))
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self):
        self._tlocks = tuple(threading.Lock() for _ in range(self.stripes))  # a parent's held lock stays behind

    @property
    def bytes(self) -> int:
        return len(self.mem)

    def close(self):
        self.mem.close()
        os.close(self.lock_fd)


class ShmStore:
    """allow(key, now=None) for one algorithm, with state in an Arena shared by forked processes."""

    def __init__(self, algorithm, arena: Arena | None = None, *, name: str | None = None, clock=_time):
        if arena is None:
            raise ValueError("the shared-memory store needs an Arena created before fork (limiter.shm.Arena)")
        codec = _codec(algorithm)
        if codec.size > arena.state_bytes:
            raise ValueError(
                f"{algorithm!r} needs {codec.size} bytes of state per key; the shared table "
                f"holds {arena.state_bytes} (created at start-up; restart to resize)"
            )
        self.algorithm = algorithm
        self.limit = algorithm.limit
        self.arena = arena
        self.max_keys = arena.slots
        self.full = 0
        self._said_full = -1e18
        self._id = (name or f"{algorithm.name}:{algorithm.limit}/{algorithm.window!r}").encode() + b"\0"
        self.tag = hashlib.blake2b(self._id, digest_size=2).digest()  # the last 2 bytes of each of its slots' digest
        self._codec = codec
        self._step = algorithm.step
        self._expires = algorithm.expires_at
        self._clock = clock

    def _where(self, key):
        """(digest, stripe, first slot index of the stripe, the key's two home offsets in the stripe)."""
        a = self.arena
        digest = hashlib.blake2b(self._id + str(key).encode(), digest_size=14).digest() + self.tag
        h = int.from_bytes(digest[:8], "little")
        stripe = h % a.stripes
        per = a.per_stripe
        return digest, stripe, stripe * per, ((h >> 16) % per, int.from_bytes(digest[8:16], "little") % per)

    def _find(self, digest, base, homes, now, taken=()):
        """Under the stripe's locks: (offset, state) of the key's slot -- its own, else the first
        reusable one (never used, or idle and not in `taken`) -- or (None, None) when only live slots
        are left in its two probe ranges.  Two ranges ("two choices") rather than one: with one range
        of 16, linear probing's clusters refused the first new key at 38% of a 100,000-slot table."""
        a = self.arena
        mem, size, per = a.mem, a.slot_size, a.per_stripe
        free, depth = None, PROBE
        n = PROBE if PROBE < per else per
        for home in homes:
            for i in range(n):
                off = (base + (home + i) % per) * size
                tag, expires = _HEAD.unpack_from(mem, off)
                if tag == digest:
                    codec = self._codec
                    return off, codec.decode(codec.struct.unpack_from(mem, off + _HEAD.size))
                if tag == _EMPTY:
                    if i < depth and off not in taken:
                        free, depth = off, i
                    break  # a never-used slot ends every chain
                if i < depth and expires <= now and off not in taken:
                    free, depth = off, i  # idle: reusable, but the key may still be further on
        return free, None  # the reusable slot nearest its home: the range with more room takes it

    def _full(self):
        self.full += 1
        w = self.algorithm.window
        t = monotonic()
        if t - self._said_full >= 60.0:  # one line, then at most one a minute (per process)
            self._said_full = t
            a = self.algorithm
            log.warning(
                "limiter key table full: %s %d/%gs: every slot a new key may take (%d from each of its two homes) "
                "holds a live state of the shared table (%d slots); new keys there get 503 until one "
                "expires; raise max_keys if these are real clients (%d refused so far in this process)",
                a.name,
                a.limit,
                a.window,
                PROBE,
                self.arena.slots,
                self.full,
            )
        return _new(TableFullDecision, (False, self.limit, 0, w, w))

    def _write(self, off, digest, new):
        mem = self.arena.mem
        _HEAD.pack_into(mem, off, digest, self._expires(new))
        self._codec.struct.pack_into(mem, off + _HEAD.size, *self._codec.encode(new))

    def allow(self, key, now: float | None = None):
        a = self.arena
        digest, stripe, base, homes = self._where(key)
        with a._tlocks[stripe]:
            fcntl.lockf(a.lock_fd, fcntl.LOCK_EX, 1, stripe)
            try:
                if now is None:
                    now = self._clock()  # under the key's locks, as in the memory store
                off, state = self._find(digest, base, homes, now)
                if off is None:
                    return self._full()
                new, decision = self._step(state, now)
                self._write(off, digest, new)
                return decision
            finally:
                fcntl.lockf(a.lock_fd, fcntl.LOCK_UN, 1, stripe)

    def peek(self, key, now: float | None = None):
        """(held, Decision): what allow(key, now) would answer, without writing the slot."""
        a = self.arena
        digest, stripe, base, home = self._where(key)
        with a._tlocks[stripe]:
            fcntl.lockf(a.lock_fd, fcntl.LOCK_EX, 1, stripe)
            try:
                if now is None:
                    now = self._clock()
                off, state = self._find(digest, base, home, now)
                return state is not None, self._step(state, now)[1]
            finally:
                fcntl.lockf(a.lock_fd, fcntl.LOCK_UN, 1, stripe)

    def __len__(self):
        """Slots holding a live state of any limiter on this arena (a scan; for tests and /status)."""
        a, now, n = self.arena, self._clock(), 0
        for i in range(a.slots):
            tag, expires = _HEAD.unpack_from(a.mem, i * a.slot_size)
            n += tag != _EMPTY and expires > now
        return n

    def held(self, max_age: float = 1.0) -> int:
        """Slots holding a live state of this limiter, by its tag (limiters whose 2-byte tags collide,
        1 in 65,536 per pair, count together); from a census of the whole table taken at most every
        max_age seconds per process (a scan of every slot), shared by the limiters on the arena."""
        a, now = self.arena, self._clock()
        census = getattr(a, "census", None)
        if census is None or not 0 <= now - census[0] < max_age:
            counts: dict[bytes, int] = {}
            mem, size = a.mem, a.slot_size
            for i in range(a.slots):
                digest, expires = _HEAD.unpack_from(mem, i * size)
                if expires > now and digest != _EMPTY:
                    t = digest[14:]
                    counts[t] = counts.get(t, 0) + 1
            census = a.census = (now, counts)  # type: ignore[attr-defined]
        return census[1].get(self.tag, 0)

    def __repr__(self):
        return f"ShmStore({self.algorithm!r}, slots={self.arena.slots})"


def allow_all_shm(checks, now: float | None = None):
    """limiter.compose.allow_all for ShmStores on one arena: every involved stripe's locks (threads,
    then processes), each set in stripe order so two requests never deadlock, held from the first look
    to the commit; the same all-or-nothing rule as the memory store (compose's docstring)."""
    arena = checks[0][0].arena
    if any(lim.arena is not arena for lim, _, _ in checks):
        raise ValueError("allow_all: shared-memory stores on different arenas")
    where = [lim._where(key) for lim, key, _ in checks]
    stripes = sorted({w[1] for w in where})
    for st in stripes:
        arena._tlocks[st].acquire()
    locked = []
    try:
        for st in stripes:
            fcntl.lockf(arena.lock_fd, fcntl.LOCK_EX, 1, st)
            locked.append(st)
        if now is None:
            now = checks[0][0]._clock()  # under the locks
        taken: set[int]
        admitted, trials, taken = True, [], set()
        for (lim, _key, enforce), (digest, _, base, homes) in zip(checks, where):
            off, state = lim._find(digest, base, homes, now, taken)
            if off is None:
                new, d = None, lim._full()
            else:
                taken.add(off)
                new, d = lim._step(state, now)  # decoded afresh: nothing is written before the commit
            trials.append((off, digest, new, d))
            if enforce and not d[0]:
                admitted = False
        if admitted:
            for (lim, _, _), (off, digest, new, d) in zip(checks, trials):
                if d[0] and off is not None:
                    lim._write(off, digest, new)
        return admitted, [t[3] for t in trials]
    finally:
        for st in reversed(locked):
            fcntl.lockf(arena.lock_fd, fcntl.LOCK_UN, 1, st)
        for st in reversed(stripes):
            arena._tlocks[st].release()
