"""Buffers that let a slow peer cost memory or disk instead of a backend connection (nginx's
proxy_buffering and proxy_request_buffering): bytes go to memory, then to an unlinked temp file.

  Budget   the process's cap on buffer memory, shared by every Spool (past it, a spool goes to its file)
  Spool    a FIFO of bytes: memory first (up to MEMORY per spool, within the budget), then a temp file
           (up to file_cap bytes; 0 = never to disk). write() says False when it cannot take the data:
           the caller streams instead (the backend waits on the client, as without buffering).
  SpooledBody  a request body read whole into a Spool: replayable (attempt() may send it twice)

A temp file is tempfile.TemporaryFile (mode 0600, never visible under a name: O_TMPFILE or unlinked at
once), so a crash leaves nothing behind and close() -- on every path -- frees the disk at once.
"""

from __future__ import annotations

import errno
import io
import os
import tempfile
import threading

MEMORY = 262144  # the most one spool holds in memory before its file takes the rest


class Budget:
    """Buffer memory in use across the process, against a cap read per call (a reload may change it),
    and the temp files open (both shown on /metrics)."""

    __slots__ = ("used", "files", "lock")

    def __init__(self):
        self.used = 0
        self.files = 0
        self.lock = threading.Lock()

    def take(self, n: int, cap: int) -> bool:
        with self.lock:
            if self.used + n > cap:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self.lock:
            self.used -= n


class SpoolError(OSError):
    """The temp file could not be written (ENOSPC, EFBIG, EIO...): the caller decides what it means."""


class Spool:
    """Bytes in order: content = mem[moff:] + file[rpos:wpos]. New data goes to the file whenever the file
    holds unread data (order) or memory cannot take it; a drained file is reused from offset 0."""

    __slots__ = ("budget", "cap", "file_cap", "temp_dir", "mem", "moff", "held", "file", "fd", "rpos", "wpos", "error")

    def __init__(self, budget: Budget, cap: int, file_cap: int, temp_dir: str | None = None):
        self.budget, self.cap, self.file_cap, self.temp_dir = budget, cap, file_cap, temp_dir
        self.mem = bytearray()
        self.moff = 0  # read offset into mem (compacted when mem drains)
        self.held = 0  # bytes of the budget this spool holds
        self.file: io.FileIO | None = None
        self.fd = -1
        self.rpos = self.wpos = 0
        self.error: OSError | None = None  # why the file failed, once it did (the caller logs it)

    def __len__(self) -> int:
        return len(self.mem) - self.moff + self.wpos - self.rpos

    def write(self, data) -> bool:
        """Take all of data, or none of it (False: memory and file are full, or the file failed)."""
        n = len(data)
        if self.rpos == self.wpos and len(self.mem) + n <= MEMORY:
            if len(self.mem) + n <= self.held or self.budget.take(len(self.mem) + n - self.held, self.cap):
                self.held = max(self.held, len(self.mem) + n)
                self.mem += data
                return True
        return self._to_file(data)

    def _to_file(self, data) -> bool:
        if self.error is not None or self.wpos + len(data) > self.file_cap:
            return False
        try:
            if self.file is None:
                self.file = tempfile.TemporaryFile(dir=self.temp_dir, buffering=0)
                self.fd = self.file.fileno()
                with self.budget.lock:
                    self.budget.files += 1
            view = memoryview(data)
            pos = self.wpos
            while view:
                k = os.pwrite(self.fd, view, pos)
                pos += k
                view = view[k:]
        except OSError as e:
            # Nothing of data counts as written (wpos unchanged): the caller still has all of it.
            self.error = e
            return False
        self.wpos = pos
        return True

    def read(self, n: int) -> bytes:
        """Up to n bytes from the front (b"" when empty); memory comes before the file."""
        mem = self.mem
        if self.moff < len(mem):
            end = self.moff + n
            with memoryview(mem) as view:
                data = bytes(view[self.moff : end])  # one copy, not a slice and then its copy
            if end >= len(mem):
                mem.clear()  # keeps its allocation (and its budget) for the next write
                self.moff = 0
            else:
                self.moff = end
            return data
        if self.rpos < self.wpos:
            data = os.pread(self.fd, min(n, self.wpos - self.rpos), self.rpos)
            if not data:
                raise SpoolError(errno.EIO, "temp file shorter than written")
            self.rpos += len(data)
            if self.rpos == self.wpos:
                self.rpos = self.wpos = 0  # drained: reuse the file from the start
            return data
        return b""

    def close(self) -> None:
        """Give the memory back and close (so free) the temp file. Safe to call twice."""
        if self.held:
            self.budget.give(self.held)
            self.held = 0
        self.mem = bytearray()
        self.moff = 0
        if self.file is not None:
            f, self.file, self.fd = self.file, None, -1
            self.rpos = self.wpos = 0
            with self.budget.lock:
                self.budget.files -= 1
            f.close()


class SpooledBody:
    """A request body read whole (request buffering): sent from the start on every try, so it may be
    replayed (a stale keep-alive connection, a retry) like a small body held as bytes."""

    __slots__ = ("spool", "size")

    def __init__(self, spool: Spool):
        self.spool, self.size = spool, len(spool)

    def __len__(self) -> int:
        return self.size

    def pieces(self, piece: int = 262144):
        """The body from its first byte, in pieces (memory, then the file by pread: no shared offset)."""
        s = self.spool
        mem = s.mem
        for i in range(0, len(mem), piece):
            yield mem[i : i + piece]
        pos = 0
        while pos < s.wpos:
            data = os.pread(s.fd, min(piece, s.wpos - pos), pos)
            if not data:
                raise SpoolError(errno.EIO, "temp file shorter than written")
            pos += len(data)
            yield data

    def close(self) -> None:
        self.spool.close()
