"""What the edge tells its operator (issue 14): configuration refused in one line and --check, start-up
failures that say why, workers that fail loudly, logs an SRE can use (levels, UTC, request ids, JSON,
reopen), no secrets in them, metrics worth scraping (checked with prometheus_client's parser), /healthz
and /readyz, systemd's watchdog. The process's life (reload, drain, workers) is tests/test_lifecycle.py."""

import http.client
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from lb.config import load as config
from lb.config.kinds import Num, OnOff
from lb.config.schema import SETTINGS
from lb.errors import ConfigError
from tests.support import PY, ROOT, Edge, free_port, raw, request, wait_until

LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (INFO|WARNING|ERROR) edge: ")


def run_edge(*args, env=None, timeout=30):
    return subprocess.run([PY, "edge.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


class NotifySocket:
    """A unix datagram socket standing in for systemd's $NOTIFY_SOCKET: every message, in order."""

    def __init__(self, tmp_path):
        self.path = str(tmp_path / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)
        self.got: list[str] = []

    def poll(self) -> list[str]:
        while self.sock.fileno() >= 0:
            try:
                self.got.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                break
        return self.got

    def count(self, word: str) -> int:
        return sum(1 for m in self.poll() if word in m.split("\n"))

    def close(self):
        self.sock.close()


# ------------------------------------------------------------------------------------ configuration

NUMERIC = sorted(s.name for s in SETTINGS if isinstance(s.kind, (Num, OnOff)))


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("bad", ["nan", "inf", "-1", "1e30"])
def test_every_number_is_finite_and_in_range_flag_and_file(name, bad, tmp_path):
    """One table checks them all: the flag and the TOML key give the same error naming the key."""
    s = next(s for s in SETTINGS if s.name == name)
    flag = s.flag
    if flag in config.build_argparser()._option_string_actions:    # a few keys are file-only (max_keys)
        with pytest.raises(ConfigError) as e:
            config.load(["--backends", "http://127.0.0.1:9", f"{flag}={bad}"])
        assert len(e.value.problems) == 1 and e.value.problems[0].startswith(flag + ":"), e.value.problems
    section, key = s.toml[0].split(".")
    f = tmp_path / "edge.toml"
    value = {"nan": "nan", "inf": "inf", "-1": "-1", "1e30": "1e30"}[bad]
    f.write_text(f'[[backends]]\nurl = "http://127.0.0.1:9"\n[{section}]\n{key} = {value}\n')
    with pytest.raises(ConfigError) as e:
        config.load(["--config", str(f)])
    assert e.value.problems[0].startswith(f"{section}.{key}:"), e.value.problems


def test_a_negative_value_parses_as_a_value_and_gets_a_range_error():
    p = run_edge("--backends", "http://127.0.0.1:9", "--limit", "-5/s")
    assert p.returncode == 2 and "expected one argument" not in p.stderr
    assert "-5/s" in p.stderr and "must be a whole number >= 1" in p.stderr
    p = run_edge("--backends", "http://127.0.0.1:9", "--read-timeout", "-3")
    assert p.returncode == 2 and "--read-timeout: must be a finite number >= 0.001" in p.stderr


def test_check_reports_every_problem_one_line_each_and_starts_nothing(tmp_path):
    port = free_port()
    f = tmp_path / "edge.toml"
    f.write_text(f'listen = "999.1.1.1:{port}"\naccess_log = "{tmp_path}/no/such/dir/access.log"\n'
                 '[[backends]]\nurl = "http://127.0.0.1:9"\n'
                 '[health]\ninterval = nan\n[upstream]\nread_timeout = inf\n'
                 '[server]\nkeepalive_timeout = -2\n'
                 '[limits]\ndefault = "5/s"\nstore = "redis://:hunter2@127.0.0.1:notaport/0"\n')
    started = time.monotonic()
    p = run_edge("--check", "--config", str(f))
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert all(LINE.match(x) and "configuration error: " in x for x in lines), lines
    text = p.stderr
    for needle in ("health.interval: must be a finite number >= 0.001", "upstream.read_timeout: must be a finite",
                   "server.keepalive_timeout: must be a finite", "store: redis://127.0.0.1:notaport/0"):
        assert sum(needle in x for x in lines) == 1, (needle, lines)
    assert "hunter2" not in text                       # the store URL's password is never printed
    assert time.monotonic() - started < 15
    # the parse-level problems come first; fix them and the environment checks speak
    f.write_text(f'listen = "999.1.1.1:{port}"\naccess_log = "{tmp_path}/no/such/dir/access.log"\n'
                 '[[backends]]\nurl = "http://127.0.0.1:9"\n')
    p = run_edge("--check", "--config", str(f))
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert f"listen 999.1.1.1:{port}: " in lines[0]
    assert f"access_log {tmp_path}/no/such/dir/access.log: No such file or directory" in lines[1]
    with socket.socket() as s:                         # nothing was bound
        s.bind(("127.0.0.1", port))
    f.write_text('[[backends]]\nurl = "http://127.0.0.1:9"\n')
    p = run_edge("--check", "--config", str(f))
    assert p.returncode == 0 and "configuration OK" in p.stdout and not p.stderr


def test_start_up_failures_name_what_failed(tmp_path):
    p = run_edge("--backends", "http://127.0.0.1:9", "--access-log", "/nonexistent-dir/x.log")
    assert p.returncode == 1
    assert "cannot start: --access-log /nonexistent-dir/x.log: No such file or directory" in p.stderr
    p = run_edge("--backends", "http://127.0.0.1:9", "--listen", "999.1.1.1:8080")
    assert p.returncode == 1 and "cannot start: --listen 999.1.1.1:8080: " in p.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = run_edge("--backends", "http://127.0.0.1:9", "--admin", f"127.0.0.1:{port}")
    assert p.returncode == 1 and f"cannot start: --admin 127.0.0.1:{port}: Address already in use" in p.stderr
    assert "Traceback" not in p.stderr


# ------------------------------------------------------------------------------------------- workers

def test_a_worker_that_cannot_start_is_reported_and_the_supervisor_exits_1_without_ready(tmp_path):
    notify = NotifySocket(tmp_path)
    try:
        p = run_edge("--backends", "http://127.0.0.1:9", "--workers", "2", "--listen", "127.0.0.1:0",
                     "--access-log", str(tmp_path / "missing" / "a.log"), env={"NOTIFY_SOCKET": notify.path},
                     timeout=60)
        assert p.returncode == 1, p.stderr
        assert f"worker 0: cannot start: --access-log {tmp_path}/missing/a.log: No such file or directory" \
            in p.stderr
        assert re.search(r"worker \d \(pid \d+\) failed to start \(status 1\): cannot start: --access-log", p.stderr)
        assert "giving up" in p.stderr
        assert notify.count("READY=1") == 0            # systemd never thought it healthy
    finally:
        notify.close()


def test_workers_ready_once_all_listen_one_stopping_and_every_worker_line_is_labelled(backends, tmp_path):
    notify = NotifySocket(tmp_path)
    e = Edge("--backends", backends[0].url, "--workers", "2", env={"NOTIFY_SOCKET": notify.path,
                                                                    "WATCHDOG_USEC": "400000"})
    try:
        e.signal(signal.SIGHUP)                        # during start-up: must not kill a worker
        e.wait_log(r"all 2 workers ready")
        wait_until(lambda: notify.count("READY=1") == 1, timeout=10, what="READY=1")
        e.wait_log(r"SIGHUP: reloading 2 workers")     # the early HUP, passed on once all were ready
        wait_until(lambda: e.log().count("reloaded: 1 backends") == 2, timeout=10, what="both reloaded")
        wait_until(lambda: notify.count("WATCHDOG=1") >= 2, timeout=10, what="watchdog pings")
        assert request(e.port, "GET", "/").status == 200
        e.signal(signal.SIGTERM)
        wait_until(lambda: not e.alive(), timeout=20, what="supervisor exit")
        assert e.popen.returncode == 0
    finally:
        e.stop()
        notify.poll()
        notify.close()
    assert notify.count("READY=1") == 1 and notify.count("STOPPING=1") == 1, notify.got
    assert "failed to start" not in e.log() and "exited" not in e.log()
    for line in e.log().splitlines():
        assert LINE.match(line), line
        if "listening on 127.0.0.1" in line and "workers" not in line or "reloaded" in line:
            assert re.search(r" edge: worker \d: ", line), line


def test_the_watchdog_pings_while_the_accept_loop_runs(backends, tmp_path):
    notify = NotifySocket(tmp_path)
    e = Edge("--backends", backends[0].url, env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"})
    try:
        wait_until(lambda: notify.count("WATCHDOG=1") >= 3, timeout=10, what="three watchdog pings")
        e.signal(signal.SIGSTOP)                       # a wedged process: no pings
        try:
            before = notify.count("WATCHDOG=1")
            time.sleep(0.6)                            # measuring an absence: longer than the ping period
            assert notify.count("WATCHDOG=1") == before
        finally:
            e.signal(signal.SIGCONT)
    finally:
        e.stop()
        notify.close()


# ---------------------------------------------------------------------------------------------- logs

def test_json_access_log_fields_request_ids_and_no_api_key(backends, tmp_path):
    path = tmp_path / "access.log"
    e = Edge("--backends", backends[0].url, "--access-log", str(path), "--access-log-format", "json",
             "--limit", "2/m", "--key-limit", "vip=5/m", "--request-id-response")
    forged = "secret 999 GET /forged 200 http://evil 0.01ms"
    try:
        a = request(e.port, "GET", "/echo/a", {"X-Api-Key": forged, "X-Request-Id": "client-id-1"})
        b = request(e.port, "GET", "/echo/b", {"X-Request-Id": "bad id\twith tab"})
        request(e.port, "GET", "/c", {"X-Api-Key": forged})
        c = request(e.port, "GET", "/d", {"X-Api-Key": forged})          # 429: the third of 2/m
        bad = raw(e.port, b"GET /x HTTP/1.1\r\nHost: h\r\nBad Header\r\n\r\n")
        wait_until(lambda: path.exists() and len(path.read_text().splitlines()) == 5, timeout=10,
                   what="five access-log lines")
    finally:
        e.stop()
    assert a.header("X-Request-Id") == "client-id-1"                       # kept: well formed
    assert json.loads(a.body)["headers"].count(["X-Request-Id", "client-id-1"]) == 1   # the backend got it
    rid_b = b.header("X-Request-Id")
    assert re.fullmatch(r"[0-9a-f]{32}", rid_b)                           # replaced: malformed
    assert ["X-Request-Id", rid_b] in json.loads(b.body)["headers"]
    assert not any(k.lower() == "x-request-id" and v != rid_b for k, v in json.loads(b.body)["headers"])
    assert c.status == 429 and c.header("X-Request-Id")
    assert bad.startswith(b"HTTP/1.1 400") and b"X-Request-Id: " in bad
    text = path.read_text()
    assert "secret" not in text and "evil" not in text
    rows = [json.loads(x) for x in text.splitlines()]
    fields = ["time", "request_id", "client_ip", "key", "method", "path", "status", "bytes_sent", "upstream",
              "upstream_seconds", "seconds", "tries", "limited_by", "host", "user_agent", "bytes_received",
              "upstream_status"]
    assert all(list(r) == fields for r in rows), rows[0]
    # Each line is written after its response went out, so two requests on two connections may be
    # logged in either order: find each by its path (the refused one has none of its own).
    (refused,) = [r for r in rows if r["status"] == 400]
    by_path = {r["path"]: r for r in rows if r is not refused}
    one, two, three, four = (by_path[p] for p in ("/echo/a", "/echo/b", "/c", "/d"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", one["time"])
    assert one["request_id"] == "client-id-1" and two["request_id"] == rid_b
    assert all(r["client_ip"] == "127.0.0.1" for r in rows)             # always, key or not
    assert one["key"] == three["key"] == four["key"] and re.fullmatch(r"#[0-9a-f]{12}", one["key"])
    assert two["key"] is None
    assert (one["status"], one["upstream"], one["tries"], one["limited_by"]) == (200, backends[0].url, 1, None)
    assert len(a.body) < one["bytes_sent"] < len(a.body) + 1024      # head and body
    assert four["bytes_sent"] > 0
    assert 0 < one["upstream_seconds"] <= one["seconds"]
    assert (four["status"], four["upstream"], four["upstream_seconds"], four["limited_by"]) == (429, None, None,
                                                                                               "default")
    assert refused["status"] == 400 and refused["client_ip"] == "127.0.0.1" and refused["method"] == "-"


def test_text_access_log_escapes_what_the_client_controls(backends, tmp_path):
    path = tmp_path / "access.log"
    e = Edge("--backends", backends[0].url, "--access-log", str(path))
    try:
        raw(e.port, b'GET /a"b\\c%20d HTTP/1.1\r\nHost: h\r\nX-Api-Key: k 200 GET /forged\r\nConnection: close\r\n\r\n')
        # bytes above 0x7f as the client sent them (nginx passes them on too), and a path over the
        # log's 2,048 bytes: cut, and said to be cut
        raw(e.port, b"GET /caf\xc3\xa9\xff HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        raw(e.port, b"GET /" + b"L" * 3000 + b" HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        wait_until(lambda: path.exists() and path.read_text().count("\n") == 3, timeout=10, what="3 lines")
    finally:
        e.stop()
    lines = path.read_text().splitlines()
    assert '"GET /caf\\xc3\\xa9\\xff"' in lines[1], lines[1]
    assert '"GET /' + "L" * 2047 + '..."' in lines[2]
    line = lines[0]
    assert '"GET /a\\x22b\\x5cc%20d"' in line and "/forged" not in line
    assert line.count('"') == 2                        # only the quotes around the request line
    assert re.fullmatch(r"\S+Z 127\.0\.0\.1 \"GET \S+\" 200 \d+ http://\S+ \d\.\d{6} \d\.\d{6} rid=[0-9a-f]{32} "
                        r"key=#[0-9a-f]{12} tries=1 limited_by=- host=h ua=- bytes_received=\d+ upstream_status=200",
                        line), line


def _escape_byte_by_byte(raw: bytes, limit: int = 2048) -> str:
    """The rule, spelled out: printable ASCII minus space, quote and backslash stay; the rest is \\xHH."""
    out = "".join(chr(b) if 0x21 <= b <= 0x7E and b not in (0x22, 0x5C) else f"\\x{b:02x}" for b in raw[:limit])
    return out + ("..." if len(raw) > limit else "")


def test_the_escape_fast_path_gives_what_the_rule_gives():
    import random

    from lb.ops.accesslog import escape
    rnd = random.Random(7)
    cases = [bytes([b]) for b in range(256)] + [b"", b"/api/items?page=2", b"a" * 2048, b"a" * 2049, b"a" * 2047 + b" "]
    cases += [bytes(rnd.choice(b"ab/ \"\\\x7f\x80%") for _ in range(rnd.randint(0, 40))) for _ in range(2000)]
    for data in cases:
        assert escape(data) == _escape_byte_by_byte(data), data
        text = data.decode("latin-1")           # a str is escaped as its UTF-8 bytes
        assert escape(text) == _escape_byte_by_byte(text.encode("utf-8")), text
    assert escape("caf\u00e9 ok", 4) == "caf\\xc3..."


def test_the_access_log_time_is_right_across_seconds():
    from lb.ops.accesslog import _stamp
    t = 1764600000.0
    for ts in (t, t + 0.999, t + 1.0, t - 0.001, t + 0.5, t + 86400.25, t + 0.5):
        assert _stamp(ts) == time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts * 1000) % 1000:03d}Z"


def test_closing_the_access_log_writes_every_line_queued_before_it(tmp_path):
    """The writer batches lines; close() (shutdown, reload) returns only when all of them are written:
    nothing accepted is dropped on the way out."""
    from lb.ops.accesslog import AccessLog
    path = tmp_path / "a.log"
    log = AccessLog(str(path))
    for i in range(20000):
        log.refusal("127.0.0.1", 400, f"bad-{i}")
    log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 20000 and "<bad-19999>" in lines[-1]
    assert not log.thread.is_alive()


def test_the_writer_survives_a_reopen_whose_old_file_fails_to_close(tmp_path, caplog):
    """Disk full, then logrotate frees space and sends USR1: the line stuck in the old file's buffer
    makes its close() raise. The writer must log that and go on with the new file."""
    from lb.ops.accesslog import AccessLog
    caplog.set_level(logging.ERROR, logger="edge")
    path = tmp_path / "a.log"
    log = AccessLog(str(path))
    real = log.file
    log.file = open("/dev/full", "a", buffering=1, encoding="utf-8")   # the disk filled up (ENOSPC)
    real.close()
    log.refusal("127.0.0.1", 400, "while-full")
    wait_until(lambda: "No space left" in caplog.text, 5, what="the write error logged")
    log.reopen()                                                        # logrotate's postrotate
    log.refusal("127.0.0.1", 400, "after-reopen")
    log.reopen()                                                        # and once more (a later rotation)
    log.refusal("127.0.0.1", 400, "after-second-reopen")
    try:
        wait_until(lambda: path.exists() and "after-second-reopen" in path.read_text(), 5,
                   what="a line in the file reopened twice")
        assert "after-reopen" in path.read_text()     # the old code lost this one too (until the next reopen)
    finally:
        alive = log.thread.is_alive()
        log.close(1)
    assert alive


_STDERR_WRITER = r"""
import sys
from lb.ops.accesslog import AccessLog
n, tag = int(sys.argv[1]), sys.argv[2]
log = AccessLog("-")
for i in range(n):
    log.refusal("127.0.0.1", 400, f"{tag}-{i:06d}-" + "x" * 120)
log.close()
"""


def test_workers_sharing_a_stderr_pipe_never_split_a_line(tmp_path):
    """--workers N with access_log = "-" (a container, journald): every worker writes to the same pipe.
    A write of at most PIPE_BUF (4096) bytes is atomic on a pipe, a longer one is not: a batch goes to a
    pipe in writes of whole lines of at most PIPE_BUF, so another writer never lands inside a line."""
    r, w = os.pipe()
    n = 20000
    procs = [subprocess.Popen([PY, "-c", _STDERR_WRITER, str(n), tag], cwd=ROOT, stderr=w,
                              stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL) for tag in ("aa", "bb")]
    os.close(w)
    out = bytearray()
    with os.fdopen(r, "rb", buffering=0) as f:
        while chunk := f.read(4096):
            out += chunk
            time.sleep(0.0005)       # a reader a little slower than the writers: the pipe fills
    for p in procs:
        p.wait(30)
    lines = out.decode("latin-1").splitlines()
    good = re.compile(r'^\S+Z 127\.0\.0\.1 "- <(aa|bb)-\d{6}-x{120}>" 400 - - - 0\.000000 rid=- key=- tries=0 '
                      r"limited_by=- host=- ua=- bytes_received=- upstream_status=-$")
    bad = [ln for ln in lines if not good.match(ln)]
    assert not bad and len(lines) == 2 * n, (len(bad), len(lines), bad[:3])


def test_a_full_batch_is_not_followed_by_a_pause(tmp_path, monkeypatch):
    """After a write of BATCH lines more are waiting: a pause there would cap the writer at BATCH / GATHER
    lines per second, and close() could give up (its 5 s) with lines still queued. GATHER scaled up to
    0.5 s: a backlog of twelve batches is still all written by close()."""
    from lb.ops import accesslog
    monkeypatch.setattr(accesslog, "GATHER", 0.5)
    path = tmp_path / "a.log"
    log = accesslog.AccessLog(str(path))
    n = 12 * accesslog.BATCH
    for i in range(n):
        log.refusal("127.0.0.1", 400, f"bad-{i}")
    log.close()             # default timeout 5 s
    written = len(path.read_text().splitlines())
    assert written == n, f"close() returned with {n - written} of {n} lines unwritten"


def test_a_line_queued_just_after_the_close_is_still_written(tmp_path):
    """A request that took the access log just before a reload swapped it out queues its line after the
    old log's stop sentinel: the writer gives such lines one more gathering period instead of dropping
    them. Shown by queueing the sentinel, then a line, as that race does."""
    from lb.ops.accesslog import AccessLog
    path = tmp_path / "a.log"
    log = AccessLog(str(path))
    log.refusal("127.0.0.1", 400, "before")
    log.q.put(None)                      # what close() queues
    log.refusal("127.0.0.1", 400, "straggler")
    log.thread.join(5)
    assert not log.thread.is_alive()
    text = path.read_text()
    assert "<before>" in text and "<straggler>" in text, text


def test_usr1_and_hup_reopen_the_access_log_and_stderr_after_a_move(backends, tmp_path):
    path = tmp_path / "access.log"
    e = Edge("--backends", backends[0].url, "--access-log", str(path))
    try:
        request(e.port, "GET", "/one")
        wait_until(lambda: path.exists() and "/one" in path.read_text(), timeout=5, what="first line")
        os.rename(path, tmp_path / "access.log.1")
        moved_err = e.log_path + ".1"
        os.rename(e.log_path, moved_err)
        e.signal(signal.SIGUSR1)
        wait_until(lambda: Path(e.log_path).exists() and "logs reopened" in e.log(), timeout=5,
                   what="stderr reopened at its old name")
        request(e.port, "GET", "/two")
        wait_until(lambda: path.exists() and "/two" in path.read_text(), timeout=5, what="a new access.log")
        assert "/two" not in (tmp_path / "access.log.1").read_text()
        os.rename(path, tmp_path / "access.log.2")
        e.signal(signal.SIGHUP)
        e.wait_log("reloaded")
        request(e.port, "GET", "/three")
        wait_until(lambda: path.exists() and "/three" in path.read_text(), timeout=5, what="HUP reopened it")
        assert e.alive()
    finally:
        e.stop()


# ------------------------------------------------------------------------------------------- secrets

def test_the_redis_password_never_reaches_a_log_line_and_comes_from_env_or_file(backends, own_redis, tmp_path):
    own_redis.client().config_set("requirepass", "s3cret-pw")
    # 1. in the URL (discouraged), store down: the unreachable line shows the URL redacted
    e = Edge("--backends", backends[0].url, "--limit", "5/s", "--store", "redis://:s3cret-pw@127.0.0.1:1/0",
             "--redis-timeout", "0.2")
    try:
        e.wait_log(r"limiter store redis://127\.0\.0\.1:1/0: unreachable .*fail-open: starting anyway")
        request(e.port, "GET", "/")
        e.wait_log(r"limiter store .* unavailable")
    finally:
        e.stop()
    assert "s3cret-pw" not in e.log()
    # 2. wrong password from the environment: one clear line
    e = Edge("--backends", backends[0].url, "--limit", "5/s", "--store", own_redis.url,
             env={"EDGE_REDIS_PASSWORD": "wrong"})
    try:
        e.wait_log(r"limiter store redis://127\.0\.0\.1:\d+/0: wrong password")
    finally:
        e.stop()
    # 3. the right one from a file ([limits] redis_password_file): reachable, and the limit holds
    pw = tmp_path / "redis-password"
    pw.write_text("s3cret-pw\n")
    f = tmp_path / "edge.toml"
    f.write_text(f'[[backends]]\nurl = "{backends[0].url}"\n[limits]\ndefault = "2/m"\nstore = "{own_redis.url}"\n'
                 f'redis_password_file = "{pw}"\nredis_timeout = 1\n')
    e = Edge("--config", str(f), "--admin", "127.0.0.1:0")
    try:
        e.wait_log(r"limiter store redis://127\.0\.0\.1:\d+/0: reachable")
        assert [request(e.port, "GET", "/", {"X-Api-Key": "k"}).status for _ in range(3)] == [200, 200, 429]
        assert request(e.admin_port, "GET", "/readyz").status == 200
        assert "s3cret" not in request(e.admin_port, "GET", "/status").body.decode()
    finally:
        e.stop()
    assert "s3cret" not in e.log()


def test_fail_closed_is_not_ready_until_the_store_answers(backends, tmp_path):
    from tests.redis_server import RedisServer
    notify = NotifySocket(tmp_path)
    port = free_port()
    e = Edge("--backends", backends[0].url, "--limit", "5/s", "--store", f"redis://127.0.0.1:{port}/0",
             "--on-store-error", "fail-closed", "--redis-timeout", "0.2", "--admin", "127.0.0.1:0",
             env={"NOTIFY_SOCKET": notify.path})
    server = None
    try:
        e.wait_log(r"unreachable .*fail-closed: not reporting ready until it answers")
        r = request(e.admin_port, "GET", "/readyz")
        assert r.status == 503 and b"limiter store" in r.body
        assert notify.count("READY=1") == 0
        server = RedisServer(port).start()
        wait_until(lambda: notify.count("READY=1") == 1, timeout=15, what="READY=1 once the store answers")
        assert request(e.admin_port, "GET", "/readyz").status == 200
        assert request(e.admin_port, "GET", "/healthz").status == 200
    finally:
        e.stop()
        notify.close()
        if server:
            server.stop()


# ------------------------------------------------------------------------------- metrics and health

def test_metrics_parse_and_carry_what_an_sre_scrapes(backends):
    from prometheus_client.parser import text_string_to_metric_families
    e = Edge("--backends", ",".join(b.url for b in backends[:2]), "--admin", "127.0.0.1:0", "--limit", "3/m",
             "--max-connections", "1")
    try:
        held = http.client.HTTPConnection("127.0.0.1", e.port, timeout=10)   # the one allowed connection
        assert [request(e.port, "GET", "/", {"X-Api-Key": "k"}, conn=held).status for _ in range(4)] == \
            [200, 200, 200, 429]
        # idle after its 429, it gives way to a new connection, which (yet to send its first request,
        # so not idle) holds the slot: the next one is refused
        def hold_slot():
            s = socket.create_connection(("127.0.0.1", e.port), timeout=0.3)
            try:
                s.recv(1)            # a refusal comes at once (held may not be marked idle yet)
            except socket.timeout:
                return s
            s.close()
        fresh = wait_until(hold_slot, timeout=5, what="the idle connection giving way")
        wait_until(lambda: raw(e.port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n").startswith(b"HTTP/1.1 503"),
                   timeout=5, what="a refused connection")
        text = request(e.admin_port, "GET", "/metrics").body.decode()
        held.close()
        fresh.close()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
    finally:
        e.stop()

    def val(fam, **lab):
        return sum(s.value for s in fams[fam].samples if all(s.labels.get(k) == v for k, v in lab.items()))

    up = [s for s in fams["lb_upstream_duration_seconds"].samples if s.name.endswith("_count")]
    assert {s.labels["backend"] for s in up} <= {b.url for b in backends} and sum(s.value for s in up) == 3
    assert fams["lb_upstream_duration_seconds"].type == "histogram"
    assert val("lb_backend_responses", code="2xx") == 3
    assert val("lb_rate_limited", rule="default", dry_run="false") == 1
    assert val("lb_refused_connections") >= 1 and val("lb_client_connections") >= 1
    assert val("lb_idle_connections_closed") == 1
    assert val("process_resident_memory_bytes") > 1e6 and val("process_open_fds") > 3
    assert val("process_threads") >= 2 and val("process_cpu_seconds") > 0
    assert math.isclose(val("process_start_time_seconds"), time.time(), abs_tol=300)
    info = fams["edge_build_info"].samples[0]
    assert info.value == 1 and info.labels["python"].startswith("3.")
    for fam in ("lb_retries", "lb_ejections", "lb_tunnels", "lb_tunnels_open", "lb_limiter_store_up"):
        assert fam in fams                              # declared, for the failover/tunnel/store work


# ------------------------------------------------------------------------------------------- reload


# ------------------------------------------------------------------------------------------- systemd


def test_request_ids_differ_across_forked_workers():
    """Request ids come from a per-process generator (no system call per request): each forked worker
    reseeds it, or every worker would hand out the same sequence of ids."""
    from lb.proxy.pipeline import new_request_id
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, new_request_id())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(r, 64)
    os.close(r)
    os.close(w)
    assert re.fullmatch(rb"[0-9a-f]{32}", child)
    assert child != new_request_id()


# ------------------------------------------------------------ more configuration refused in one line

@pytest.mark.parametrize("content, why", [
    (b"listen = \"\xd0\x28\"\n", "not UTF-8"),                       # a binary or Latin-1 file
    (b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),  # tomllib recurses
], ids=["latin1", "deep"])
def test_check_of_an_unreadable_toml_file_is_one_line_not_a_traceback(tmp_path, content, why):
    path = tmp_path / "edge.toml"
    path.write_bytes(content)
    p = subprocess.run([PY, "edge.py", "--check", "--config", str(path), "--backends", "http://127.0.0.1:1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(lines) == 1, p.stderr[-2000:]
    assert f"--config {path}: not valid TOML: {why}" in lines[0]


@pytest.mark.parametrize("where, value", [
    ("server.header_timeout", "1e-300"), ("server.send_timeout", "0.0005"), ("upstream.read_timeout", "1e-9"),
    ("limits.redis_timeout", "5e-324"), ("server.drain_timeout", "1e-300"), ("server.body_min_rate", "1e-300"),
])
def test_an_absurdly_small_timeout_is_refused_with_its_key_named(tmp_path, where, value):
    """`header_timeout = 1e-300` passed validation (> 0): no timeout anyone means, and every head a 408.
    Durations start at 1 ms (0 stays "none" where it was), a body rate at 1 byte/s."""
    from tests.support import config_error
    section, key = where.split(".")
    conf = tmp_path / "edge.toml"
    conf.write_text(f'[[backends]]\nurl = "http://127.0.0.1:9"\n[{section}]\n{key} = {value}\n')
    line = config_error("--check", "--config", str(conf))
    assert f"{where}: must be " in line and float(line.rsplit("got ", 1)[1].strip("'")) == float(value), line
    flag = "--" + key.replace("_", "-")
    line = config_error("--check", "--backends", "http://127.0.0.1:9", flag, value)
    assert f"{flag}: must be " in line and ">= " in line, line
