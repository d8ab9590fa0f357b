"""Connection threads kept for the next connection (MySQL's thread_cache_size, Apache's spare threads).

A thread whose connection ended parks on its own lock, at most `size` of them; a new connection goes to
the last one parked (its stack is the warmest) by a lock release, ~17 µs here, where starting a thread
costs ~60 µs of CPU (~120 through threading.Thread). With none parked a thread is started, by _thread and
without waiting for it to run: threading.Thread.start() waits for the new thread's bootstrap, which queues
for the GIL behind every busy connection (at -c512 the accept loop took 1-2 s to start 512 threads).

threading knows nothing of these threads; see lb/proxy/edge.py for what that asks of the code they run.
A fork keeps none of them (only the forking thread goes on in the child): the child starts with none parked.
"""

from __future__ import annotations

import _thread
import logging
import os
from collections.abc import Callable

log = logging.getLogger("edge")


class _Parked:
    __slots__ = ("wake", "job")

    def __init__(self) -> None:
        self.wake = _thread.allocate_lock()
        self.wake.acquire()  # held while parked: the hand-off releases it
        self.job: tuple | None = None  # (fn, args), or None: end


class ThreadCache:
    """run(fn, *args) on a parked thread, or a new one; fn returns when its connection is done."""

    def __init__(self, size: int = 0):
        self.size = size
        self.parked: list[_Parked] = []
        self._lock = _thread.allocate_lock()
        os.register_at_fork(after_in_child=self._forget)

    def run(self, fn: Callable, *args) -> None:
        """Raises RuntimeError ("can't start new thread") when none is parked and none can start."""
        with self._lock:
            p = self.parked.pop() if self.parked else None
        if p is None:
            # The job in a list that _serve empties: _thread holds a thread's arguments until the thread
            # ends, and they would pin its first connection (socket, address, the server) for good.
            _thread.start_new_thread(self._serve, ([fn, args],))
        else:
            p.job = (fn, args)
            p.wake.release()

    def resize(self, size: int) -> None:
        """At most `size` parked from now on; those beyond it end."""
        with self._lock:
            self.size = size
            extra, self.parked = self.parked[size:], self.parked[:size]
        for p in extra:
            p.wake.release()  # job None: the thread ends

    def _serve(self, first: list) -> None:
        fn, args = first
        first.clear()
        p = None
        while True:
            try:
                fn(*args)
            except BaseException as e:  # fn handles its own errors (Exception); anything else ends the thread
                log.error("a connection thread ended on %r", e)
                return
            fn = args = None  # a parked thread holds nothing of its last connection
            with self._lock:
                if len(self.parked) >= self.size:
                    return
                p = p or _Parked()
                self.parked.append(p)
            p.wake.acquire()
            job, p.job = p.job, None
            if job is None:
                return
            fn, args = job
            job = None  # (nor, parked again, the job it was handed)

    def _forget(self) -> None:
        self._lock = _thread.allocate_lock()
        self.parked = []
