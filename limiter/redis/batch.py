"""Batched round trips: concurrent decisions on one Redis ride together, without ever waiting to.

A caller leads a round trip ("flight") of its own as long as fewer than `flights` are out: it sends at
once, so an idle edge sends each decision alone exactly as before -- nothing is ever held back to wait
for company.  A caller arriving while every flight is out joins a queue.  When a flight lands, the
oldest queued caller is woken to lead the next one and takes the whole queue with it: one write of N
pipelined EVALSHAs, N replies read back to back, one connection.  So batches form only under load,
their size is whatever arrived during one round trip, and a queued caller waits at most for the
flight in the air plus its own.

Each call stays its own script run on its own key (atomic per key, as before); a batch only shares
the socket writes and reads -- on a busy 2-core box the syscalls, wake-ups and Redis' per-read cost
that dominate a decision.  Per call, NOSCRIPT is handled inside the flight and a script error is that
call's alone; a connection failure fails the calls of that flight (each then meets the breaker and
the failure policy as a single call would).

A landed flight wakes all its callers at once. Woken one after another instead (each woken caller waking
the next), they made fewer context switches at saturation (3.4 per request against 4.4), but each hop
waited for the GIL alone: behind one thread that takes the GIL back after every short system call (a
large body being relayed), a flight of 32 callers took seconds to wake where all at once take
milliseconds (docs/performance.md, thirteenth stop).

A caller interrupted while it sleeps (a signal handler's exception, in a program's main thread) still
waits for its wake-up and raises afterwards: one woken to lead the next flight carries it first, or the
flight's slot, and every caller queued after it, would be lost.
"""

from __future__ import annotations

import threading
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError


class Call:
    """One EVALSHA waiting for its reply: `cmd` (packed bytes) of `script`; `reply` or `error` set by the
    flight that carried it."""

    __slots__ = ("script", "cmd", "reply", "error", "lead", "done", "asking", "woken")

    def __init__(self, script, cmd: bytes):
        self.script = script
        self.cmd = cmd
        self.reply: Any = None  # the script's reply as RESP gives it (bytes, an int, a list)
        self.error: Exception | None = None
        self.lead = False  # woken to lead the next flight rather than with a result
        self.asking = False  # cmd starts with ASKING (a cluster slot in migration): its +OK comes first
        self.done: Any = None  # a held Lock, only for a call that queues (a leader never sleeps on it)
        self.woken = False  # set just before done is released: the wake-up came (see _wait)

    def queue(self) -> None:
        done = self.done = threading.Lock()
        done.acquire()


class Batcher:
    """call(script, cmd) -> reply, through at most `flights` concurrent round trips made by fly(calls)."""

    def __init__(self, fly, flights: int, alone=None):
        self._fly = fly
        # alone(script, cmd) -> reply: a flight of one call made without a Call or a list (the common case);
        # it returns NOT_SENT, having sent nothing, when it cannot (no idle connection, one to reconnect).
        self._alone = alone
        self.flights = flights
        self._lock = threading.Lock()
        self._queue: list[Call] = []
        self._out = 0  # flights in the air (or about to take off)
        self.trips = 0  # round trips made
        self.calls = 0  # calls carried: calls / trips is the mean batch size

    def call(self, script, cmd: bytes):
        # (acquire/release, not `with`: this runs for every decision, and `with` costs twice as much; the
        # bodies are plain list and int operations that cannot raise)
        lock = self._lock
        lock.acquire()
        if self._out < self.flights:
            self._out += 1
            lock.release()
            if self._alone is not None:
                try:
                    r = self._alone(script, cmd)
                except BaseException:
                    self._land(1)
                    raise
                if r is not NOT_SENT:
                    self._land(1)
                    return r
            c = Call(script, cmd)
            batch = [c]
            pending = None
        else:
            c = Call(script, cmd)
            c.queue()
            self._queue.append(c)
            lock.release()
            pending = _wait(c)  # a flight landed: with our reply, or handing us the next flight
            if not c.lead:
                if pending is not None:
                    raise pending
                if c.error is not None:
                    raise c.error
                return c.reply
            batch = [c]
        blew_up = None  # what fly() raised, if it raised: the cause in every unanswered call's error
        try:
            if c.lead:  # (inside the try: its finally hands the flight's slot on whatever happens)
                with lock:
                    batch += self._queue
                    self._queue.clear()
            self._fly(batch)
        except BaseException as e:
            blew_up = e
            raise
        finally:
            self._land(len(batch))
            if c.reply is None and c.error is None:  # fly() itself blew up
                c.error = _failed(blew_up)
            if len(batch) > 1:
                for other in batch[1:]:
                    if other.reply is None and other.error is None:
                        other.error = _failed(blew_up)
                    other.woken = True
                    other.done.release()
        if c.lead and pending is not None:
            raise pending
        if c.error is not None:
            raise c.error
        return c.reply

    def _land(self, carried: int) -> None:
        """A flight is down: counted, and its slot passed to the oldest waiter (who leads the next)."""
        lock = self._lock
        lock.acquire()
        self.trips += 1
        self.calls += carried
        if self._queue:
            nxt = self._queue.pop(0)
            nxt.lead = True
            nxt.woken = True
            nxt.done.release()
        else:
            self._out -= 1
        lock.release()


def _failed(cause: BaseException | None) -> RedisConnectionError:
    """The error of a call its flight did not answer, with what the flight raised as its cause (a bug in
    the flight must not pass for a Redis outage in the logs)."""
    e = RedisConnectionError("the round trip carrying this call failed" + (f": {cause!r}" if cause else ""))
    e.__cause__ = cause
    return e


def _wait(c: Call) -> BaseException | None:
    """Sleep until a flight wakes c, even through an exception raised meanwhile, and return that exception
    (None: none) for the caller to raise once its part is done. The exception may come inside the wait
    (the lock not taken) or just after it (taken): `woken`, set before the release, tells which."""
    pending = None
    while True:
        try:
            c.done.acquire()
            return pending
        except BaseException as e:
            pending = e
            if c.woken:
                return pending


NOT_SENT = object()  # alone()'s "nothing sent: make an ordinary flight"
