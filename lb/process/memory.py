"""Giving memory back: after a burst of large bodies the process's RSS returns near its idle value.

Why it does not on its own: glibc's malloc keeps freed memory in its arenas (one per thread that
allocated, up to 8 per CPU) and only returns the top of the main heap; and after the first large block
(a 1 MiB body) is freed, its mmap threshold rises so later ones come from the arenas too. A run of 1 MiB
responses left the edge at 55-80 MB where it idled at 29, for good. malloc_trim(0) hands every arena's
free pages back (madvise), keeping the allocations that are live.

Fewer arenas first (limit_arenas, before the connection threads start): two instead of sixteen on this
2-CPU box. Connection threads allocate under the GIL, so they hardly ever contend for an arena, while
each extra arena keeps its own scattered free pages that trimming cannot give back (about 1 MB each
after the 1 MiB run; with two arenas RSS came back within 20% of idle, with sixteen 30% above).

The Trimmer looks at RSS once a `interval` (one read of /proc/self/statm) and trims only when RSS has
moved by more than `slack` since the last trim: an idle or steady edge costs one small read a second, a
busy one at most one trim a second (each a few hundred µs with a few arenas, holding each arena's lock
briefly while it walks it). Not glibc (musl, macOS): nothing to do, no thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

log = logging.getLogger("edge")

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident set (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _malloc_trim():
    """glibc's malloc_trim(size_t) -> int, or None when the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


def limit_arenas(n: int = 2) -> bool:
    """Cap glibc's malloc arenas at n (unless MALLOC_ARENA_MAX says otherwise). True when set."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_ARENA_MAX, n) == 1


class Trimmer:
    """A daemon thread returning freed heap to the system when RSS moved by more than `slack` bytes."""

    def __init__(self, interval: float = 1.0, slack: int = 4 << 20):
        self.interval = interval
        self.slack = slack
        self.trims = 0
        self._trim = _malloc_trim()
        self._stop = threading.Event()
        self._floor = rss_bytes()  # RSS after the last trim (or at start)

    def start(self) -> "Trimmer":
        if self._trim is not None and self._floor:
            threading.Thread(target=self._run, name="malloc-trim", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> bool:
        """One look: trim if RSS moved more than slack from where the last trim left it. True when it trimmed."""
        rss = rss_bytes()
        # Either way: growth is freed memory to come, and a drop (connection threads ending, their
        # stacks unmapped) is when what they freed in the arenas can go too.
        if abs(rss - self._floor) <= self.slack:
            return False
        self._trim(0)
        self.trims += 1
        self._floor = rss_bytes()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # never let housekeeping take the process down; say it once
                log.exception("malloc_trim housekeeping stopped")
                return


def start_trimmer() -> Trimmer:
    return Trimmer().start()
