"""The application log (stderr): a level and a UTC timestamp on every line, `worker N:` in a worker,
and no credential in any line, whoever wrote it.

    2026-12-01T09:48:13.120Z WARNING edge: worker 1: backend http://10.0.0.7:80 DOWN: ...

Redaction happens in the formatter, after the message is built, so a URL passed as an argument by any
module (the Redis store's own lines included) is covered: `redis://user:secret@host` -> `redis://user:***@host`.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import sys
import threading
import time

# scheme://[user[:password]@]host: the userinfo's password part (or a lone token, Redis's AUTH-only form).
# The password runs to the LAST '@' before a space, as the store URL's parser (and urllib) read it: an
# unescaped '/' or '@' in it is still the password, never shown.
_URL_SECRET = re.compile(r"(\b[a-z][a-z0-9+.-]*://)([^:@/\s]*):(\S*)@", re.I)
_URL_TOKEN = re.compile(r"(\bredis[a-z+-]*://)([^:\s]+)@", re.I)


# The URL pattern cannot tell where a password with a blank in it starts (`redis://:pa ss@host`); its
# literal text can. Only such passwords are hidden by their text: starring out every occurrence of an
# ordinary one ("wrong", "redis") would garble lines that never held it. lb.config.load registers each store
# password it validates (URL, redis_password_file or EDGE_REDIS_PASSWORD).
_SECRETS: set[str] = set()
_BLANK = re.compile(r"\s")


def hide(secret: str | None) -> None:
    """Never show `secret` in a log line (from now on, in this process and the workers it forks)."""
    if secret and _BLANK.search(secret):
        _SECRETS.add(secret)


def redact(text: str) -> str:
    """Any URL's password (and a registered one with a blank) replaced by ***; use it for every line
    that might hold a store URL."""
    for s in _SECRETS:
        if s in text:
            text = text.replace(s, "***")
    text = _URL_SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}:***@" if m.group(3) else m.group(0), text)
    return _URL_TOKEN.sub(r"\1***@", text)


class Formatter(logging.Formatter):
    converter = time.gmtime  # type: ignore[assignment]  # (called with the record's time, as the base's is)

    def __init__(self, worker: int | None = None):
        super().__init__("%(asctime)s.%(msecs)03dZ %(levelname)s edge: %(message)s", "%Y-%m-%dT%H:%M:%S")
        self.prefix = f"worker {worker}: " if worker is not None else ""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if self.prefix:
            head, sep, rest = line.partition(" edge: ")
            line = f"{head}{sep}{self.prefix}{rest}"
        return redact(line)


def setup(worker: int | None = None) -> None:
    """(Re)configure the root logger on stderr; called again in each worker with its number."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(Formatter(worker))
    root.addHandler(h)
    root.setLevel(logging.INFO)


def say(line: str, worker: int | None = None, level: str = "ERROR") -> None:
    """One line on stderr in the log format, before (or without) logging being set up."""
    rec = logging.LogRecord("edge", getattr(logging, level), "", 0, line, None, None)
    sys.stderr.write(Formatter(worker).format(rec) + "\n")
    sys.stderr.flush()


# -- reopening stderr after logrotate moved it (SIGUSR1 / SIGHUP) ----------------------------------

_stderr_path: str | None = None


def remember_stderr() -> None:
    """If stderr is a regular file, note its name now: after `mv`, /proc would name the new one."""
    global _stderr_path
    try:
        if stat.S_ISREG(os.fstat(2).st_mode):
            _stderr_path = os.readlink("/proc/self/fd/2")
    except OSError:
        _stderr_path = None


def reopen_stderr() -> bool:
    """Point fd 2 at a fresh file of the remembered name (logrotate's create/move dance)."""
    if not _stderr_path:
        return False
    try:
        a, b = os.stat(_stderr_path), os.fstat(2)
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
            return False  # not moved: keep the description the workers share (and its offset)
    except OSError:
        pass  # moved away and not recreated: open a new one
    try:
        fd = os.open(_stderr_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    except OSError as e:
        logging.getLogger("edge").error("cannot reopen stderr %s: %s", _stderr_path, e.strerror)
        return False
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)
    return True


# -- lines a client can cause -----------------------------------------------------------------------


class ClientFaults:
    """Log lines whose number a client decides (malformed requests, bad handshakes): a flood of them
    must not fill the disk, while one now and then is still seen. The first of a quiet spell is a
    WARNING at once; the next `burst` within `every` seconds are INFO lines; the rest are only counted,
    and when the window ends one WARNING says how many there were and the last one (then a new window
    opens, so at most one WARNING per `every` seconds). The access log still has every request.

    schedule(delay, fn) runs fn later (a timer thread; injected in the tests).
    """

    def __init__(
        self, logger: logging.Logger, every: float = 10.0, burst: int = 5, schedule=None, what: str = "client errors"
    ):
        self.log, self.every, self.burst, self.what = logger, every, burst, what
        self.schedule = schedule or _timer
        self.lock = threading.Lock()
        self.open = False  # a window is running (its summary is scheduled)
        self.count = 0  # faults in this window (after the one that opened it)
        self.last = ""
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self.lock = threading.Lock()  # a worker starts with no window (the timer stayed behind)
        self.open, self.count, self.last = False, 0, ""

    def __call__(self, msg: str, *args) -> None:
        with self.lock:
            if not self.open:
                self.open = True
                self.count = 0
                self.schedule(self.every, self.flush)
                level = logging.WARNING
            else:
                self.count += 1
                self.last = msg % args if args else msg
                if self.count > self.burst:
                    return
                level = logging.INFO
        self.log.log(level, msg, *args)

    def flush(self) -> None:
        """The window's end: its summary if there was anything after the first, and a new window."""
        with self.lock:
            n, last = self.count, self.last
            self.count = 0
            if not n:
                self.open = False
                return
            self.schedule(self.every, self.flush)
        self.log.warning(
            "%d more %s in the last %g s (%d not logged; last: %s)",
            n,
            self.what,
            self.every,
            max(0, n - self.burst),
            last,
        )


def _timer(delay: float, fn) -> None:
    # Not threading.Timer: a thread made without daemon= asks threading for its maker's Thread, and a
    # connection thread (started by _thread: lb/proxy/edge.py) would then be registered there for good.
    def later() -> None:
        time.sleep(delay)
        fn()

    threading.Thread(target=later, name="client-faults", daemon=True).start()


# The edge's client-caused lines (lb/proxy/edge.py, lb/proxy/forward.py): one window for all of them.
client_fault = ClientFaults(logging.getLogger("edge"))
