"""lb/proxy/threadcache.py: connection threads parked for the next connection, at most `size` of them."""

from __future__ import annotations

import _thread
import gc
import os
import sys
import threading
import weakref

from lb.proxy.threadcache import ThreadCache
from tests.support import wait_until


class Jobs:
    """Each job records the thread it ran on, then waits for its release (a connection in progress)."""

    def __init__(self):
        self.ran: list[int] = []
        self.tids: set[int] = set()
        self.go = threading.Semaphore(0)
        self.lock = threading.Lock()

    def job(self, tag):
        with self.lock:
            self.ran.append(_thread.get_ident())
            self.tids.add(threading.get_native_id())
        self.go.acquire()

    def alive(self) -> int:
        """How many of the threads that ran a job are still there (by OS id: other tests' threads come
        and go in this process, so the process's count is no measure)."""
        return len(self.tids & {int(t) for t in os.listdir("/proc/self/task")})


def _parked(cache, n):
    wait_until(lambda: len(cache.parked) == n, timeout=5, what=f"{n} threads parked")


def test_a_thread_whose_job_ended_parks_and_takes_the_next_one():
    cache, jobs = ThreadCache(4), Jobs()
    cache.run(jobs.job, "a")
    jobs.go.release()
    _parked(cache, 1)
    cache.run(jobs.job, "b")
    assert cache.parked == []
    wait_until(lambda: len(jobs.ran) == 2, timeout=5, what="the second job ran")
    assert jobs.ran[0] == jobs.ran[1], "the parked thread took it"
    jobs.go.release()
    _parked(cache, 1)


def test_at_most_size_park_and_the_rest_end():
    cache, jobs = ThreadCache(2), Jobs()
    for i in range(6):
        cache.run(jobs.job, i)
    wait_until(lambda: len(jobs.ran) == 6, timeout=5, what="six jobs running")
    assert len(set(jobs.ran)) == 6, "six at once: six threads"
    for _ in range(6):
        jobs.go.release()
    _parked(cache, 2)
    wait_until(lambda: jobs.alive() == 2, timeout=5, what="four threads ended")


def test_resize_ends_the_parked_threads_beyond_it_and_zero_keeps_none():
    cache, jobs = ThreadCache(3), Jobs()
    for i in range(3):
        cache.run(jobs.job, i)
    for _ in range(3):
        jobs.go.release()
    _parked(cache, 3)
    cache.resize(1)
    assert len(cache.parked) == 1
    wait_until(lambda: jobs.alive() == 1, timeout=5, what="two parked threads ended")
    cache.resize(0)
    wait_until(lambda: jobs.alive() == 0, timeout=5, what="none kept")
    cache.run(jobs.job, "after")        # none parked: a new thread, which ends after its job
    jobs.go.release()
    wait_until(lambda: len(jobs.ran) == 4 and jobs.alive() == 0, timeout=5,
               what="the job ran and its thread ended")


def test_a_job_that_raises_ends_its_thread_and_parks_nothing(caplog):
    cache = ThreadCache(2)
    ran = threading.Event()
    tid = []

    def boom():
        tid.append(threading.get_native_id())
        ran.set()
        raise SystemExit

    cache.run(boom)
    assert ran.wait(5)
    wait_until(lambda: str(tid[0]) not in os.listdir("/proc/self/task"), timeout=5, what="its thread ended")
    assert "a connection thread ended on SystemExit()" in caplog.text
    assert cache.parked == []


def test_a_forked_child_starts_with_none_parked():
    cache, jobs = ThreadCache(2), Jobs()
    cache.run(jobs.job, "a")
    jobs.go.release()
    _parked(cache, 1)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:        # the child: the parked thread did not come along; a job must start a new one
        try:
            ok = not cache.parked
            done = threading.Event()
            cache.run(done.set)
            ok = ok and done.wait(5)
            os.write(w, b"ok" if ok else b"no")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 2)
    os.waitpid(pid, 0)
    os.close(r)
    assert got == b"ok"


class _Conn:
    """Stands for a connection's socket (weakly referenceable, as socket.socket is)."""


def test_a_parked_thread_keeps_nothing_of_the_connections_it_served():
    # A parked thread must not pin its connections' sockets, addresses or the server they were run for:
    # not the first (the arguments its thread was started with), not the last (the job it was handed).
    cache, done = ThreadCache(1), threading.Semaphore(0)

    def job(conn):
        done.release()

    refs = []
    for _ in range(3):  # the first on a new thread, the others handed to it parked
        conn = _Conn()
        refs.append(weakref.ref(conn))
        cache.run(job, conn)
        del conn
        assert done.acquire(timeout=5)
        _parked(cache, 1)
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
    cache.resize(0)


def test_runs_from_many_threads_racing_resizes_lose_no_job_and_leak_no_thread():
    # The accept loop, the extra listeners (lb/process/handover.py) and a reload's resize, all at once:
    # every job runs exactly once, no thread ever runs two at a time (parked twice), and once the cache is
    # emptied every thread it started has ended. Jobs that raise end their thread (the unparked path).
    producers, per, sizes = 4, 400, (0, 1, 3, 8, 2)
    cache = ThreadCache(4)
    total = producers * per
    lock = threading.Lock()
    ran: list[int] = []
    busy: set[int] = set()
    twice: list[int] = []
    tids: set[int] = set()  # the OS's ids of the threads the jobs ran on (not the process's count: other
    # tests' threads come and go meanwhile)
    all_ran = threading.Event()

    def job(n):
        me = _thread.get_ident()
        with lock:
            if me in busy:
                twice.append(me)
            busy.add(me)
            tids.add(threading.get_native_id())
        with lock:
            busy.discard(me)
            ran.append(n)
            if len(ran) == total:
                all_ran.set()
        if n % 97 == 0:
            raise SystemExit  # (a stray exception: its thread ends, unparked)

    stop = threading.Event()

    def resizer():
        i = 0
        while not stop.is_set():
            cache.resize(sizes[i % len(sizes)])
            i += 1

    def produce(k):
        for i in range(per):
            cache.run(job, k * per + i)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the GIL changes hands between any two bytecodes, nearly: races show
    try:
        r = threading.Thread(target=resizer, daemon=True)
        r.start()
        ps = [threading.Thread(target=produce, args=(k,), daemon=True) for k in range(producers)]
        for p in ps:
            p.start()
        for p in ps:
            p.join(30)
        finished = all_ran.wait(20)
        stop.set()
        r.join(5)
    finally:
        sys.setswitchinterval(switch)
    with lock:
        got = sorted(ran)
    assert finished, f"{total - len(got)} of {total} jobs never ran"
    assert got == list(range(total)), "a job ran twice or not at all"
    assert not twice, "a thread ran two jobs at once"
    cache.resize(0)

    def alive():
        return tids & {int(t) for t in os.listdir("/proc/self/task")}

    wait_until(lambda: not alive(), timeout=10, what="every cache thread ended")
    assert cache.parked == []
