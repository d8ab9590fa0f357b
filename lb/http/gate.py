"""A bound on how many connection threads do work at once, served in order (issue 31, item 2).

Thread per connection, hundreds of connections: every thread whose socket has bytes competes for the GIL,
and CPython hands the GIL to whichever waiter the OS wakes, not to the one waiting longest. At -c512 the
edge spent twice the CPU per request switching among them and some requests waited seconds. With the
gate, at most `n` threads run between two waits for a socket; the others sleep on their own lock, in
arrival order, and are not in the GIL's crowd at all.

A thread holds its slot from the moment its socket had bytes (Reader.fill) to the next time it waits for
a socket: its work on one request, not its idle time. A holder that blocks somewhere else for longer
than `stuck` (a connect to a dead backend, a slow client's send, a tunnel, a delay-mode hold, a slow
Redis) loses its slot to the next waiter, so nothing blocked can starve the others: it runs over the
bound until its next wait, as every thread did before.
"""

from __future__ import annotations

import threading
from collections import deque
from time import monotonic, sleep

_get_ident = threading.get_ident


class Gate:
    __slots__ = ("n", "stuck", "holders", "members", "waiters", "urgent", "lock", "handoffs", "stolen", "watchdog")

    def __init__(self, n: int, stuck: float = 0.05):
        self.n = n
        self.stuck = stuck
        self.holders: dict[int, float] = {}  # thread ident -> when it took its slot
        self.members: set[int] = set()  # the connection threads (join/part): only they are gated
        self.waiters: deque = deque()  # (thread ident, its lock), in arrival order: new requests
        # Threads in the middle of a request (a backend's answer arrived, a body's next piece): served
        # before any new request. Each holds a pooled backend connection, maybe a spool; queued behind
        # hundreds of new requests they would starve the pool itself (503s: all connections busy).
        self.urgent: deque = deque()
        self.lock = threading.Lock()
        self.handoffs = 0  # slots passed to a waiter (it had to wait)
        self.stolen = 0  # slots taken from a holder blocked elsewhere
        self.watchdog: threading.Thread | None = None  # frees stuck slots; started on the first wait

    def enter(self, urgent: bool = True) -> None:
        """Take a slot, waiting in order if none is free (urgent: among the requests under way, served
        first; else among the new ones). Holding one already: nothing to do. A waiter sleeps on its own
        lock, untimed: hundreds of timed waits would each wake for nothing."""
        me = _get_ident()
        if not self.waiters and not self.urgent and len(self.holders) < self.n:
            # No lock when nobody waits (the common case below the bound; the lock cost ~15% of the CPU per
            # request at -c32): dict operations are atomic under the GIL, and two threads passing here
            # together overshoot the bound by one for a moment, which a soft bound allows.
            self.holders[me] = monotonic()
            return
        with self.lock:
            if me in self.holders:
                return
            if len(self.holders) < self.n and not self.waiters and not self.urgent:
                self.holders[me] = monotonic()
                return
            w = threading.Lock()
            w.acquire()
            (self.urgent if urgent else self.waiters).append((me, w))
            # A holder may have left between our look and the append (leave looks for waiters unlocked):
            # its slot is free and nobody would hand it over until the watchdog's next round.
            self._hand_over(monotonic())
            if self.watchdog is None:
                self.watchdog = threading.Thread(target=self._watch, name="gate-watchdog", daemon=True)
                self.watchdog.start()
        w.acquire()  # released by whoever registered us in holders (leave, _watch)

    def _watch(self) -> None:
        """Every `stuck` seconds, while some wait: a holder blocked elsewhere longer than that gives its slot
        to the longest waiter (its own leave() later finds nothing to give back), and a free slot goes too."""
        while True:
            sleep(self.stuck)
            if not self.waiters and not self.urgent:
                continue
            now = monotonic()
            with self.lock:
                for ident, since in list(self.holders.items()):
                    if not self.waiters and not self.urgent:
                        break
                    if now - since > self.stuck and self.holders.pop(ident, None) is not None:
                        self.stolen += 1  # (pop: the holder may be leaving right now, unlocked)
                        self._hand_over(now)
                self._hand_over(now)  # a slot freed while its waiter was queuing (leave's unlocked check)

    def _hand_over(self, now: float) -> None:
        """Free slots to the longest waiters (under self.lock)."""
        while (self.urgent or self.waiters) and len(self.holders) < self.n:
            ident, w = (self.urgent or self.waiters).popleft()
            self.holders[ident] = now
            self.handoffs += 1
            w.release()

    def leave(self) -> bool:
        """Give the slot back (to the longest waiter, if any), before a wait for a socket. True when this
        thread is a member, which then enters again once its socket answered (Reader.fill)."""
        me = _get_ident()
        if me not in self.members:
            return False  # a health probe's thread, the admin's...: never gated
        if self.holders.pop(me, None) is not None and (self.urgent or self.waiters):
            with self.lock:
                self._hand_over(monotonic())
        # (a waiter queued just after that check: the next leave, or the watchdog, hands it the free slot)
        return True

    def join(self) -> None:
        """This thread serves a connection: gated from its first read on."""
        self.members.add(_get_ident())

    def part(self) -> None:
        """The connection is done: its slot (if it holds one) goes to the next waiter."""
        self.leave()
        self.members.discard(_get_ident())

    def running(self) -> int:
        return len(self.holders)

    def waiting(self) -> int:
        return len(self.waiters) + len(self.urgent)


current: Gate | None = None  # the process's gate (EdgeServer installs it); None: no bound


def step_aside() -> Gate | None:
    """A connection thread about to wait on a lock (a backend connection's line): its slot goes to the
    next waiter, and it enters again (among the requests under way) with what it returns. Holding its
    slot there, a few such threads stopped the whole edge: the connections they waited for belonged to
    threads queued at the gate for a slot, freed only by the watchdog's round (issue 31, -c512)."""
    g = current
    return g if g is not None and g.leave() else None


def install(gate: Gate | None) -> None:
    global current
    current = gate
