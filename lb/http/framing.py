"""Strict HTTP/1.1 framing for both sides of the proxy: a buffered socket reader with deadlines, the
request-head and response-head parsers, and body framing (Content-Length, chunked).

Why our own and not http.server/http.client's: they parse headers through the email package (slow on
the per-request path), accept framing that a backend could read differently (request smuggling), and
cannot bound a head that arrives one byte at a time. Everything here is plain bytes; no logging.
"""

from __future__ import annotations

import re
import socket
import struct
from email.utils import formatdate
from http import HTTPStatus
from time import monotonic, time
from typing import TYPE_CHECKING

from lb.errors import ClientGone, HttpError, UpstreamError
from lb.http import gate
from lb.http.chunked import CHUNK, END, NEED, TRAILER, ChunkedDecoder

if TYPE_CHECKING:
    from lb.http.tls import ClientCert

CRLF = b"\r\n"

# Limits (nginx: large_client_header_buffers 4 8k; HAProxy: tune.bufsize 16k, 101 headers).
MAX_REQUEST_LINE = 8192
MAX_HEADER_LINE = 8192
MAX_HEAD = 65536
MAX_HEADERS = 100
MAX_CHUNK_LINE = 1024
MAX_TRAILERS = 32  # trailer lines of a chunked request body (all dropped)

# Connection-level headers: never forwarded in either direction (RFC 9110 7.6.1), nor any header that
# Connection names. Keep-Alive and Proxy-* are the de-facto additions.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-authorization",
    }
)

# A response's fields the edge never relays as the backend wrote them (relay(), and the 101 of a tunnel):
# hop-by-hop ones, the framing (the edge writes its own), and -- only where the edge writes its own --
# X-Request-Id (--request-id-response) and the rate-limit fields, which replace the backend's (plus any
# X-RateLimit-* name: a prefix, checked apart). Otherwise the backend's X-Request-Id passes untouched.
NOT_RELAYED = HOP_BY_HOP | {b"content-length"}
NOT_RELAYED_IETF = NOT_RELAYED | {b"ratelimit", b"ratelimit-policy"}
NOT_RELAYED_RID = NOT_RELAYED | {b"x-request-id"}
NOT_RELAYED_RID_IETF = NOT_RELAYED_IETF | {b"x-request-id"}


def not_relayed(rl: bytes, rid: bytes = b"") -> frozenset:
    """NOT_RELAYED, with the IETF RateLimit fields when the edge writes those ([limits] ietf_headers) and
    X-Request-Id when it writes its own (rid: the exchange's X-Request-Id line, empty when it writes none)."""
    # find, not `in`: CPython 3.11's bytes `in` first tries its operand as an int, raising and clearing a
    # TypeError each time (1,800 instructions, 1.5% of a request's, callgrind), where find() is a search.
    ietf = rl.find(b"\nRateLimit: ") >= 0
    if rid:
        return NOT_RELAYED_RID_IETF if ietf else NOT_RELAYED_RID
    return NOT_RELAYED_IETF if ietf else NOT_RELAYED


# What a Connection token may never remove (RFC 9112 6.1, 7.6.1 of 9110 notwithstanding): the message's
# own framing, which the edge writes itself from what it parsed, and Host.
NOT_NOMINABLE = frozenset({b"content-length", b"transfer-encoding", b"host"})

# tchar (RFC 9110 5.6.2): the bytes a method or header name may contain.
_TCHAR = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# Control bytes other than HTAB may not appear in a head at all; CR and LF only as CRLF (checked apart).
_CTL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# Every byte but those: head.translate(None, _NOT_CTL) leaves only the controls (a third of the regex's time).
_NOT_CTL = bytes(c for c in range(256) if not _CTL.match(bytes([c])))
_TARGET_BAD = re.compile(rb"[\x00-\x20\x7f]")
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)\Z")
# A Host is an authority (RFC 9110 7.2): no blanks, no path, no userinfo (nginx refuses '/' and '\\').
_HOST_BAD = re.compile(rb"[\x00-\x20\x7f/\\@?#,]")
# A CR not followed by LF, or an LF not preceded by CR: a line end two parsers may read differently.
_BARE_EOL = re.compile(rb"\r(?!\n)|(?<!\r)\n")

# The one-pass head parsers' fast path. A head whose first line is plain (origin-form, HTTP/1.0 or 1.1, a
# status code and a printable reason) and whose every field line is `Name: value` exactly as a rebuild would
# write it (a tchar name, one space, a value of visible bytes, blanks and HTAB with no blank at either end)
# is checked by one regex -- and with it all that _check_bytes and the line-by-line checks would check: no
# bare CR or LF, no control byte, at most MAX_HEADERS lines -- and then kept as it came: relayed from slices,
# its fields read where they are, no object per line. Anything else (folding, blanks around a value, an
# empty value, a long line, a malformed line, a bad byte, an absolute-form target...) takes the line-by-line
# path, which gives the same answer or names the error. Possessive quantifiers: no backtracking.
_TCHARS = rb"!#$%&'*+\-.^_`|~0-9A-Za-z"
_CANON_FIELDS = (
    rb"(?:\r\n[" + _TCHARS + rb"]++: [^\x00-\x20\x7f][\t\x20-\x7e\x80-\xff]*+(?<![ \t])){0,%d}+" % MAX_HEADERS
)
_FAST_REQUEST = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Z]++) (/[\x21-\x7e\x80-\xff]*+) (HTTP/1\.[01])" + _CANON_FIELDS)
_FAST_RESPONSE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: [\t\x20-\x7e\x80-\xff]*+)?" + _CANON_FIELDS)
# The fields a parser or a relay acts on, found where they are, in the lowercased head (bytes.lower: ASCII
# only, the same offsets; a case-blind pattern is half as fast again). Names match whole (': ' follows);
# the value runs to the line's end (a canonical head's values hold no CR), read by the same pass.
_HOP = (
    rb"connection|keep-alive|proxy-connection|transfer-encoding|te|trailer|upgrade|proxy-authenticate|"
    rb"proxy-authorization|content-length|close"
)
_REQUEST_ONLY = (
    rb"host|expect|x-api-key|x-request-id|x-forwarded-for|x-forwarded-proto|x-forwarded-host|"
    rb"x-forwarded-client-cert|cookie"
)
_RESPONSE_ONLY = rb"ratelimit|ratelimit-policy|x-request-id"
_REQUEST_SPECIAL = re.compile(rb"\r\n(" + _HOP + rb"|" + _REQUEST_ONLY + rb"): [^\r]*+")
_RESPONSE_SPECIAL = re.compile(
    rb"\r\n(" + _HOP + rb"|" + _RESPONSE_ONLY + rb"|x-ratelimit-[" + _TCHARS.lower() + rb"]*): [^\r]*+"
)
# The names each pattern finds (but X-RateLimit-*): a Connection token outside them is a field the fast
# path did not locate, so a head naming one is written line by line (lb/http/plan.py).
REQUEST_NAMES = frozenset((_HOP + b"|" + _REQUEST_ONLY).split(b"|"))
RESPONSE_NAMES = frozenset((_HOP + b"|" + _RESPONSE_ONLY).split(b"|"))
# A field name with an underscore (upstream_head drops those unless told not to): before the line's colon.
UNDERSCORE_NAME = re.compile(rb"\r\n[^:_\r\n]*_")


def _spans(pattern: re.Pattern, head: bytes, start: int) -> list[tuple[int, int, bytes, bytes]]:
    """The fields of a canonical head that `pattern` names, in order, as (start, end, lowercase name,
    value): the span is the line with the CRLF before it."""
    out = []
    for m in pattern.finditer(head.lower(), start):
        s, e = m.span()
        lname = m[1]
        out.append((s, e, lname, head[s + len(lname) + 4 : e]))  # the value: after CRLF, name, ': '
    return out


_TIMEVAL = struct.Struct("@ll")
_UNSET = -1.0  # Reader.applied before any timeout was set


def _timeval(seconds: float | None) -> bytes:
    if seconds is None:
        return _TIMEVAL.pack(0, 0)  # 0 = wait forever
    usec = int(seconds % 1 * 1e6)
    return _TIMEVAL.pack(int(seconds), usec if seconds >= 1 else max(1, usec))


def kernel_timeout(sock: socket.socket, seconds: float | None, send: bool = True) -> None:
    """Bound sock's recv and send by `seconds` (None: no bound) in the kernel (SO_RCVTIMEO/SO_SNDTIMEO)
    and leave the socket blocking, so each recv or send is one system call. With Python's settimeout()
    each one is a poll() and then the call (and settimeout() itself an ioctl): three points per read
    where the thread gives up the GIL and must win it back, which is where a thread-per-connection
    server's tail comes from (bench/tail_bench.py). An expiry raises BlockingIOError (EAGAIN), which
    Reader.fill turns into socket.timeout. TLS sockets keep settimeout(): their reads are OpenSSL's.
    send=False leaves the send bound alone (a client connection's is send_timeout, set once)."""
    if type(sock) is not socket.socket:
        sock.settimeout(seconds)
        return
    if sock.gettimeout() is not None:
        sock.settimeout(None)  # blocking (one ioctl), e.g. after urllib3's connect timeout
    tv = _timeval(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    if send:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def send_timeout(sock: socket.socket, seconds: float) -> None:
    """A client connection's bound on each send of a response (nginx's send_timeout), set once: reads
    change only the receive bound (Reader.fill), so a send never inherits what the last read left.
    Over TLS the socket has one timeout for both: Reader(sock, send_bound) puts it back after each read."""
    if type(sock) is socket.socket:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))


class Reader:
    """A socket with a byte buffer. Each recv waits at most `timeout`, and never past `deadline`.

    The socket's timeout is set only when it changes (`applied`): on a kept-alive connection the same
    value holds request after request, and setting it is a system call. Whoever else sets the socket's
    timeout (a send with another bound) goes through apply() so the two agree."""

    __slots__ = ("sock", "buf", "timeout", "deadline", "applied", "send_bound", "got", "mark", "new_work", "memo")

    def __init__(self, sock: socket.socket, send_bound: float | None = None):
        self.sock = sock
        self.buf = bytearray()
        self.got = 0  # bytes received on the connection (the access log's bytes_received)
        self.mark = 0  # `got` less the buffer when the current request's head began
        self.timeout: float | None = None
        self.deadline: float | None = None
        self.applied: float | None = _UNSET  # the timeout last set on sock
        # A TLS client's send_timeout: its socket has one timeout for both directions, so after each
        # read fill() puts this back -- else a write inherits what the read left of a deadline (a head
        # completed near header_timeout: ~0 s to write the response). Plain sockets: send_timeout().
        self.send_bound = send_bound if type(sock) is not socket.socket else None
        # A client connection's reader, whose bytes may start a new request: its waits rejoin the gate
        # behind the requests under way (lb/http/gate.py); a backend's reader's go first.
        self.new_work = False
        # The last canonical head parsed from this connection and what its parse found (parse_response's
        # memo): a backend answering the same head again (a static page within one second) is not parsed again.
        self.memo: list = [None, None]

    def apply(self, t: float | None) -> None:
        if t != self.applied:
            kernel_timeout(self.sock, t)
            self.applied = t

    def fill(self) -> bool:
        """Read what is available into the buffer; False at EOF. Raises socket.timeout."""
        t = self.timeout
        if self.deadline is not None:
            left = self.deadline - monotonic()
            if left <= 0:
                raise socket.timeout("deadline")
            t = left if t is None or left < t else t
        if t != self.applied:
            kernel_timeout(self.sock, t, send=False)  # the send bound is apply()'s or send_timeout()'s
            self.applied = t
        g = gate.current
        gated = g is not None and g.leave()  # a connection thread gives its slot up while it waits
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            raise socket.timeout("timed out") from None  # SO_RCVTIMEO expired
        finally:
            if gated and g is not None:
                g.enter(not self.new_work or bool(self.buf))  # (more of a head already begun: under way)
            if self.send_bound is not None and self.applied != self.send_bound:
                self.sock.settimeout(self.send_bound)  # TLS: the next write's bound
                self.applied = self.send_bound
        if not data:
            return False
        self.buf += data
        self.got += len(data)
        return True

    def read_head(
        self, max_head: int = MAX_HEAD, max_first_line: int = MAX_REQUEST_LINE, what: str = "request"
    ) -> bytes | None:
        """Bytes up to the blank line (excluded), or None on EOF before any byte.

        A head (`what`: request or response) with a bare CR or LF is refused as soon as the byte
        arrives: parse_request/parse_response would refuse it anyway, and a head with LF line ends never
        shows the CRLFCRLF waited for here (it sat until header_timeout or read_timeout). Checked only
        while a head is incomplete, on the bytes not yet checked: a head that arrives whole costs
        nothing more (the parsers check those)."""
        buf = self.buf
        if not buf and not self.fill():  # (the usual start, a head not yet read: no pass over nothing)
            return None
        scan = 0
        checked = 0
        while True:
            i = buf.find(b"\r\n\r\n", scan)
            if i >= 0:
                # The limits hold however the bytes were split across reads (a head ending within the first
                # line's limit has its first CRLF there: no search).
                if i > max_first_line and buf.find(CRLF, 0, max_first_line + 2) < 0:
                    raise HttpError(414, "request line too long")
                if i > max_head:
                    raise HttpError(431, "request header block too large")
                head = bytes(buf[:i])
                del buf[: i + 4]
                return head
            if len(buf) > max_first_line and buf.find(CRLF, 0, max_first_line + 2) < 0:
                raise HttpError(414, "request line too long")
            if len(buf) > max_head:
                raise HttpError(431, "request header block too large")
            if buf:  # (an idle keep-alive connection's first pass has nothing to check)
                m = _BARE_EOL.search(buf, checked)
                if m is not None and (m.end() < len(buf) or buf[-1] == 10):  # a final CR awaits its LF
                    raise HttpError(400, f"bare CR or LF in the {what} head")
            n = len(buf)
            checked = n - 1 if n else 0
            scan = n - 3 if n > 3 else 0
            if not self.fill():
                if not buf:
                    return None
                raise HttpError(400, "connection closed inside the request head")

    def read_line(self, limit: int) -> bytes:
        """A CRLF-terminated line (chunk sizes, trailers) of at most `limit` bytes before its CRLF; a bare
        LF is refused, not read as a line end. The search stops at the limit, so a longer line is refused
        however the bytes were split across reads (a 5 kB extension in one read too)."""
        buf = self.buf
        while True:
            i = buf.find(b"\n", 0, limit + 2)
            if i >= 0:
                if i == 0 or buf[i - 1] != 13:
                    raise HttpError(400, "bare LF in a chunked body")
                line = bytes(buf[: i - 1])
                del buf[: i + 1]
                return line
            if len(buf) > limit + 1:
                raise HttpError(400, "chunk line too long")
            if not self.fill():
                raise EOFError("closed inside a line")

    def read_some(self, n: int) -> bytes:
        """Up to n bytes (at least one); EOFError at EOF."""
        buf = self.buf
        if not buf and not self.fill():
            raise EOFError("closed inside a body")
        if len(buf) <= n:
            data = bytes(buf)
            buf.clear()
        else:
            data = bytes(buf[:n])
            del buf[:n]
        return data

    def read_exact(self, n: int) -> bytes:
        buf = self.buf
        while len(buf) < n:
            if not self.fill():
                raise EOFError("closed inside a body")
        data = bytes(buf[:n])
        del buf[:n]
        return data


# ------------------------------------------------------------------------------------------ requests


class _Head:
    """What Request and ResponseHead share: `headers`, made from `raw` only when someone asks for it, and
    set, dropping `raw`, `spans` and the memo of what was written from them (`_memo` names that slot)."""

    __slots__ = ("_headers", "raw", "spans")
    _memo = ""
    _headers: list[tuple[bytes, bytes, bytes]] | None
    raw: bytes | None
    spans: list[tuple[int, int, bytes, bytes]] | None

    @property
    def headers(self) -> list[tuple[bytes, bytes, bytes]]:
        h = self._headers
        if h is None:
            assert self.raw is not None  # (set together: one or the other is there)
            h = self._headers = _split_headers(self.raw.split(CRLF), 1)
        return h

    @headers.setter
    def headers(self, value) -> None:
        self._headers = value
        self.raw = self.spans = None
        setattr(self, self._memo, None)


class Request(_Head):
    """A parsed request head. `raw`: the head as received, and `spans` its fast_fields() when it is
    canonical (None otherwise): upstream_head then writes the head from slices of it. `headers`, the
    [(name, lowercase name, value)] list, is made from `raw` only when someone asks for it; setting it
    (a request made from other fields, HTTP/2's) drops raw, so nothing relays bytes it does not match."""

    _memo = "sent"
    __slots__ = (
        "method",
        "target",
        "version",
        "content_length",
        "chunked",
        "keep_alive",
        "host",
        "expect_continue",
        "conn_tokens",
        "api_key",
        "xff",
        "proto",
        "fwd_host",
        "cookie",
        "request_id",
        "client_cert",
        "sent",
    )
    # (the types, for mypy: parse_request sets every one)
    method: bytes
    target: bytes
    version: bytes
    _headers: list[tuple[bytes, bytes, bytes]] | None
    raw: bytes | None
    spans: list[tuple[int, int, bytes, bytes]] | None
    content_length: int | None
    chunked: bool
    keep_alive: bool
    host: bytes | None
    expect_continue: bool
    conn_tokens: set[bytes]
    api_key: bytes | None
    xff: bytes | None
    proto: bytes | None
    fwd_host: bytes | None
    cookie: bytes | None
    request_id: bytes | None
    client_cert: ClientCert | None
    # [what the head sent upstream was written for, ..., that head's first part] (lb/proxy/tries.py's
    # upstream_head), shared by every parse of the same bytes through a connection's memo, as
    # ResponseHead.relayed; None when the head is not remembered
    sent: list | None

    def __repr__(self):
        return f"<Request {self.method!r} {self.target!r}>"


def _split_headers(lines: list[bytes], start: int) -> list[tuple[bytes, bytes, bytes]]:
    """[(name, lowercase name, value)] with the value's surrounding whitespace removed."""
    if len(lines) - start > MAX_HEADERS:
        raise HttpError(431, f"more than {MAX_HEADERS} header fields")
    out = []
    for line in lines[start:]:
        if len(line) > MAX_HEADER_LINE:
            raise HttpError(431, "header line too long")
        name, colon, value = line.partition(b":")
        if not colon or not name or name.translate(None, _TCHAR):
            if line[:1] in (b" ", b"\t"):
                raise HttpError(400, "obsolete header line folding")
            raise HttpError(400, "malformed header line")
        out.append((name, name.lower(), value.strip(b" \t")))
    return out


def _check_bytes(head: bytes) -> None:
    # A bare CR or LF anywhere (a line ending we and a backend might split differently) is refused.
    crlf = head.count(CRLF)
    if head.count(b"\r") != crlf or head.count(b"\n") != crlf:
        raise HttpError(400, "bare CR or LF in the request head")
    if _CTL.search(head):
        raise HttpError(400, "control character in the request head")


# The request fields parse_request looks at; every other one is only carried.
_REQUEST_FIELDS = frozenset(
    {
        b"host",
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"expect",
        b"x-api-key",
        b"x-request-id",
        b"x-forwarded-for",
        b"x-forwarded-proto",
        b"x-forwarded-host",
        b"cookie",
    }
)


def _request_line(head: bytes) -> tuple[bytes, bytes, bytes]:
    """The line-by-line path's checks of the whole head's bytes and of the request line."""
    _check_bytes(head)
    eol = head.find(CRLF)
    parts = (head if eol < 0 else head[:eol]).split(b" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if not method or method.translate(None, _TCHAR) or method != method.upper():
        raise HttpError(400, "invalid method")  # a token, and (as nginx requires) no lowercase
    if method == b"TRACE":
        raise HttpError(405, "TRACE is not allowed")  # it would echo credentials back (nginx: 405 too)
    m = _VERSION.match(version)
    if not m:
        raise HttpError(400, "invalid HTTP version")
    if m.group(1) != b"1":
        raise HttpError(505, "HTTP version not supported")
    if m.group(2) > b"1":
        version = b"HTTP/1.1"  # a later 1.x is served as the highest minor we speak (RFC 9110 2.5)
    if not target or _TARGET_BAD.search(target):
        raise HttpError(400, "invalid request target")
    return method, target, version


def _recall(memo: list | None, head: bytes) -> tuple[tuple | None, bool]:
    """(What a parse of these bytes found, or None; whether they are the connection's last head again.)
    What a parse found is kept only from a head's second time in a row: a connection whose heads differ
    each time (an API's bodies of varying length, ids in its headers) pays one compare and a store per head,
    not the building of what would never be used again."""
    if memo is None:
        return None, False
    if memo[0] == head:
        return memo[1], True
    memo[0] = head
    memo[1] = None
    return None, False


def parse_request(head: bytes, memo: list | None = None) -> Request:
    """Parse and check a request head. Raises HttpError for anything a backend could read differently.
    memo: the connection's [last head, what its parse found] (Reader.memo), as for parse_response: a
    client sending the same canonical head again gets a new Request with what the parse found."""
    found, again = _recall(memo, head)
    if found is not None:
        return _request_again(found)
    m = _FAST_REQUEST.fullmatch(head) if len(head) <= MAX_HEADER_LINE else None
    spans = None
    if m is not None:
        method, target, version = m.groups()
        if method != b"TRACE":
            spans = _spans(_REQUEST_SPECIAL, head, m.end(3))
    if spans is None:
        method, target, version = _request_line(head)
    r = Request()
    r.method, r.target, r.version = method, target, version
    r.sent = None
    if spans is None:
        r.headers = headers = _split_headers(head.split(CRLF), 1)
        fields = [(0, 0, lname, value) for _, lname, value in headers]
    else:
        r._headers = None
        r.raw, r.spans = head, spans
        fields = spans
    keep_alive = _read_fields(r, fields, version == b"HTTP/1.1")
    if r.chunked and r.content_length is not None:
        raise HttpError(400, "both Content-Length and Transfer-Encoding")
    if version == b"HTTP/1.0" and (r.chunked or r.expect_continue):
        raise HttpError(400, "chunked body or Expect on HTTP/1.0")
    if r.host is None:
        if version == b"HTTP/1.1":
            raise HttpError(400, "missing Host header")
        r.host = b""
    if spans is None and target[:1] != b"/":  # (the fast path's targets are origin-form)
        if target[:7].lower() == b"http://" or target[:8].lower() == b"https://":
            # absolute-form: served only for the Host it names; the edge is not an open forward proxy.
            rest = target.split(b"://", 1)[1]
            authority, slash, path = rest.partition(b"/")
            if authority.lower() != r.host.lower():
                raise HttpError(400, "absolute-form target for another host")
            r.target = b"/" + path
        else:
            # asterisk-form (OPTIONS *) too: it asks the edge itself, and nginx refuses it as well
            raise HttpError(400, "invalid request target")
    r.keep_alive = keep_alive
    if again and spans is not None:
        r.sent = sent = [None]
        memo[1] = (  # type: ignore[index]  # (again: memo is a list)
            method,
            target,
            version,
            r.content_length,
            r.chunked,
            keep_alive,
            r.host,
            r.expect_continue,
            r.conn_tokens,
            r.api_key,
            r.xff,
            r.proto,
            r.fwd_host,
            r.cookie,
            r.request_id,
            head,
            spans,
            sent,
        )
    return r


def _request_again(found: tuple) -> Request:
    """A new Request with what a parse of the same bytes found (parse_request's memo); client_cert is the
    caller's to set, as after a parse."""
    r = Request()
    (
        r.method,
        r.target,
        r.version,
        r.content_length,
        r.chunked,
        r.keep_alive,
        r.host,
        r.expect_continue,
        r.conn_tokens,
        r.api_key,
        r.xff,
        r.proto,
        r.fwd_host,
        r.cookie,
        r.request_id,
        r.raw,
        r.spans,
        r.sent,
    ) = found
    r._headers = r.client_cert = None
    return r


def _read_fields(r: Request, fields, keep_alive: bool) -> bool:
    """The fields the edge acts on, checked and kept on r (in one loop per request, not a call per field);
    returns keep_alive as the Connection header leaves it (given the version's default). fields: spans'
    shape, (start, end, lowercase name, value); only the last two are read."""
    r.content_length = None
    r.chunked = False
    r.host = r.api_key = r.xff = r.proto = r.fwd_host = r.cookie = r.request_id = r.client_cert = None
    r.expect_continue = False
    tokens: set[bytes] = set()
    te_seen = False
    for _, _, lname, value in fields:
        if lname not in _REQUEST_FIELDS:
            continue  # (most of a browser's headers: one set lookup, not eleven compares)
        if lname == b"host":
            if r.host is not None:
                raise HttpError(400, "duplicate Host header")
            if not value or _HOST_BAD.search(value):
                raise HttpError(400, "invalid Host header")
            r.host = value
        elif lname == b"content-length":
            if value.isdigit() and len(value) <= 15 and r.content_length is None:
                r.content_length = int(value)  # the usual one plain length: what the loop below finds
                continue
            # Several equal values (or "5, 5") are one length (RFC 9110 8.6); differing ones are smuggling.
            for v in value.split(b","):
                v = v.strip()
                if not v.isdigit() or len(v) > 15:
                    raise HttpError(400, "invalid Content-Length")
                if r.content_length is not None and int(v) != r.content_length:
                    raise HttpError(400, "conflicting Content-Length headers")
                r.content_length = int(v)
        elif lname == b"transfer-encoding":
            if te_seen:
                raise HttpError(400, "duplicate Transfer-Encoding header")
            te_seen = True
            if value.lower() != b"chunked":
                if b"," in value or value.lower() in (b"gzip", b"deflate", b"compress", b"identity"):
                    raise HttpError(501, "transfer coding not supported (only chunked)")
                raise HttpError(400, "invalid Transfer-Encoding")
            r.chunked = True
        elif lname == b"connection":
            for t in value.lower().split(b","):
                t = t.strip()
                if t == b"close":
                    keep_alive = False
                elif t == b"keep-alive":
                    keep_alive = True
                elif t and t not in NOT_NOMINABLE:
                    tokens.add(t)
        elif lname == b"expect":
            if value.lower() != b"100-continue":
                raise HttpError(417, "unsupported expectation")
            r.expect_continue = True
        elif lname == b"cookie":
            r.cookie = value if r.cookie is None else r.cookie + b"; " + value
        else:
            _identity_field(r, lname, value)
    r.conn_tokens = tokens
    return keep_alive


def _identity_field(r: Request, lname: bytes, value: bytes) -> None:
    """The fields HTTP/1.1 and HTTP/2 requests read alike: who asks, and what proxies before us said."""
    if lname == b"x-api-key":
        # One key per request: the limiter must count the key the backend will read (Go's Header.Get
        # and Python's email.message take the first of several, a last-wins limiter the last).
        if r.api_key is not None:
            raise HttpError(400, "more than one X-Api-Key header")
        r.api_key = value
    elif lname == b"x-request-id":
        r.request_id = value
    elif lname == b"x-forwarded-for":
        r.xff = value if r.xff is None else r.xff + b", " + value
    elif lname == b"x-forwarded-proto":
        r.proto = value
    elif lname == b"x-forwarded-host":
        r.fwd_host = value


# A field value relayed into an HTTP/1.1 head: any CR, LF, NUL or other control but HTAB would split or cut
# a line there (HTTP/2 carries values as length-prefixed strings, so nothing in its framing refuses them).
_VALUE_BAD = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_LOWER_TCHAR = bytes(c for c in _TCHAR if not 65 <= c <= 90)


def _check_pseudo_fields(method: bytes, target: bytes, n_headers: int) -> None:
    """A stream's :method and :path by _request_line's rules (CONNECT refused too), and its field count."""
    if not method or method.translate(None, _TCHAR) or method != method.upper():
        raise HttpError(400, "invalid method")
    if method == b"TRACE":
        raise HttpError(405, "TRACE is not allowed")
    if method == b"CONNECT":
        raise HttpError(405, "CONNECT is not allowed")  # the edge is no tunnel for HTTP/2 streams
    if not target or target[:1] != b"/" or _TARGET_BAD.search(target):
        raise HttpError(400, "invalid request target")  # asterisk-form too, as parse_request
    if n_headers > MAX_HEADERS:
        raise HttpError(431, f"more than {MAX_HEADERS} header fields")


def request_from_fields(
    method: bytes,
    target: bytes,
    authority: bytes | None,
    headers: list[tuple[bytes, bytes]],
    version: bytes = b"HTTP/2",
) -> Request:
    """A Request from an HTTP/2 (or 3) stream's fields, checked by parse_request's rules: the same
    Request, so every stage after it is the same. headers: the regular fields as (lowercase name,
    value), pseudo-fields taken out. The caller sets chunked when a body follows without a length
    (an HTTP/1.1 backend then gets it chunked). :authority is the Host (a Host field too must agree);
    split cookie fields are one again (RFC 9113 8.2.3). HttpError as parse_request raises it."""
    _check_pseudo_fields(method, target, len(headers))
    r = Request()
    r.method, r.target, r.version = method, target, version
    r.sent = None
    r.content_length = None
    r.chunked = False
    r.host = r.api_key = r.xff = r.proto = r.fwd_host = r.cookie = r.request_id = r.client_cert = None
    r.expect_continue = False
    r.conn_tokens = set()
    r.keep_alive = True
    out = []
    host_field = None
    for lname, value in headers:
        if not lname or lname.translate(None, _LOWER_TCHAR):
            raise HttpError(400, "malformed header name")
        if len(lname) + len(value) > MAX_HEADER_LINE:
            raise HttpError(431, "header line too long")
        if _VALUE_BAD.search(value):
            raise HttpError(400, "control character in a header value")
        value = value.strip(b" \t")
        if lname in _REQUEST_FIELDS:
            if lname == b"host":
                if host_field is not None:
                    raise HttpError(400, "duplicate Host header")
                host_field = value
                continue  # written once below, from :authority when there is one
            if lname == b"cookie":
                r.cookie = value if r.cookie is None else r.cookie + b"; " + value
                continue  # one Cookie line below: HTTP/1.1 wants one (RFC 6265 5.4)
            if lname == b"content-length":
                if not value.isdigit() or len(value) > 15:
                    raise HttpError(400, "invalid Content-Length")
                if r.content_length is not None and int(value) != r.content_length:
                    raise HttpError(400, "conflicting Content-Length headers")
                r.content_length = int(value)
            elif lname in (b"transfer-encoding", b"connection"):
                raise HttpError(400, "connection-specific header in an HTTP/2 request")
            elif lname == b"expect":
                continue  # 100-continue is implicit in HTTP/2's flow control
            else:
                _identity_field(r, lname, value)
        out.append((lname, lname, value))
    host = authority if authority else host_field
    if authority and host_field is not None and host_field.lower() != authority.lower():
        raise HttpError(400, "Host differs from :authority")
    if not host or _HOST_BAD.search(host):
        raise HttpError(400, "missing or invalid :authority")
    r.host = host
    out.insert(0, (b"Host", b"host", host))
    if r.cookie is not None:
        out.append((b"cookie", b"cookie", r.cookie))
    r.headers = out
    return r


def iter_chunked(reader: Reader, max_body: int, min_rate: float = 0.0, piece: int = 65536):
    """Decode a chunked request body (lb/http/chunked.py), yielding its data as it arrives: what one read
    brought is gathered (many small chunks are one piece of at most `piece` bytes) and yielded before the
    next read would wait, so a caller writes once per read, not once per chunk, and an interactive stream
    is not held back. Trailers are read and dropped: at most MAX_TRAILERS lines.

    The body is paced from its first byte: the deadline (body_deadline) counts every byte on the wire,
    size lines and trailers included, and so does max_body (framing is bytes a client made us read).
    Raises HttpError for bad framing (400) or too much (413); EOFError and socket errors pass through
    (the caller knows whether that is a client gone or a timeout).
    """
    buf = reader.buf
    dec = ChunkedDecoder(_bad_chunk, MAX_CHUNK_LINE, MAX_HEADER_LINE, MAX_TRAILERS)
    out = bytearray()  # data gathered, not yet yielded
    t0 = monotonic()
    if min_rate:
        body_deadline(reader, t0, 0, min_rate)
    while True:
        ev = dec.next(buf, piece - len(out))
        if type(ev) is bytes:
            out += ev
            if len(out) >= piece:
                yield bytes(out)
                out.clear()
        elif ev == NEED:  # the next read may wait: pass on what we have first
            if out:
                yield bytes(out)
                out.clear()
            if min_rate:
                body_deadline(reader, t0, dec.consumed, min_rate)
            if not reader.fill():
                raise EOFError("closed inside a body")
        elif ev == CHUNK:
            if dec.consumed + dec.size + 2 > max_body:
                raise HttpError(413, "request body too large")
        elif ev == TRAILER:
            # their bytes count too (400 like any other bad framing of a body past their number: the head
            # was fine, a 431 would tell the client to shorten its header fields)
            if dec.consumed > max_body:
                raise HttpError(413, "request body too large")
        elif ev == END:
            if out:
                yield bytes(out)
            return


def _bad_chunk(reason: str) -> HttpError:
    return HttpError(400, reason)


def iter_fixed(reader: Reader, n: int, min_rate: float = 0.0, piece: int = 65536):
    """A Content-Length body as it arrives."""
    t0 = monotonic()
    got = 0
    while got < n:
        data = reader.read_some(min(n - got, piece))
        got += len(data)
        yield data
        if min_rate:
            body_deadline(reader, t0, got, min_rate)


def body_deadline(reader: Reader, t0: float, received: int, min_rate: float) -> None:
    """A body must keep up a minimum average rate (Apache's mod_reqtimeout MinRate): the deadline is
    the silence allowance (reader.timeout) plus one second per min_rate bytes received so far."""
    reader.deadline = t0 + (reader.timeout or 0.0) + received / min_rate


# ----------------------------------------------------------------------------------------- responses


class ResponseHead(_Head):
    """A parsed response head; `raw`, `spans` and the lazy `headers` as for Request."""

    _memo = "relayed"
    __slots__ = (
        "status",
        "status_line",
        "content_length",
        "chunked",
        "codings",
        "close",
        "early",
        "conn_tokens",
        "relayed",
    )
    # (the types, for mypy: parse_response sets every one)
    status: int
    status_line: bytes
    _headers: list[tuple[bytes, bytes, bytes]] | None
    raw: bytes | None
    spans: list[tuple[int, int, bytes, bytes]] | None
    content_length: int | None
    chunked: bool
    codings: bytes
    close: bool
    early: bool
    conn_tokens: frozenset[bytes]
    # [skip, limiting, the head written] (lb/http/plan.py's last for this head's bytes), shared by every
    # parse of the same bytes through a connection's memo; None when the head is not remembered
    relayed: list | None


_NO_TOKENS: frozenset[bytes] = frozenset()
_KEEP_ALIVE = frozenset({b"keep-alive"})


def _status_line(head: bytes) -> tuple[bytes, bytes]:
    """The line-by-line path's checks of the whole head's bytes, and (status line, code)."""
    # A bare CR or LF: a client could split the lines where we did not (a header hidden inside a value
    # we relay, response splitting); nginx reads LF as a line end, we refuse, as for requests.
    crlf = head.count(CRLF)
    if head.count(b"\n") != crlf or head.count(b"\r") != crlf:
        raise UpstreamError("protocol", "bare CR or LF in the response head")
    # NUL and the other controls but HTAB (RFC 9110 5.5): relayed, a client may cut a field at a NUL or
    # read it otherwise than we did; nginx refuses a NUL in an upstream header too.
    if head.translate(None, _NOT_CTL):
        raise UpstreamError("protocol", "control character in the response head")
    eol = head.find(CRLF)
    status_line = head if eol < 0 else head[:eol]
    if status_line[:7] not in (b"HTTP/1.", b"http/1.") or len(status_line) < 12 or status_line[8:9] != b" ":
        raise UpstreamError("protocol", "not an HTTP/1.x status line")
    code = status_line[9:12]
    if not code.isdigit() or status_line[12:13] not in (b"", b" "):
        raise UpstreamError("protocol", "bad status code")
    return status_line, code


def parse_response(head: bytes, memo: list | None = None) -> ResponseHead:
    """A backend's response head. Raises UpstreamError('protocol') for anything not HTTP/1.x, and for
    framing a client could read differently from us: Content-Length with Transfer-Encoding (nginx's
    answer too), differing Content-Lengths, chunked applied twice or not last but present, and for
    control bytes (but HTAB) anywhere in the head.

    memo: the connection's [last head, what its parse found] (Reader.memo): a head byte for byte equal to
    the last canonical one is not parsed again (the parse is a function of the bytes alone); its
    ResponseHead is a new one all the same, so whatever a caller sets on it stays its own (_recall)."""
    r, again = _recalled(memo, head)
    if r is not None:
        return r
    r = ResponseHead()
    m = _FAST_RESPONSE.fullmatch(head) if len(head) <= MAX_HEADER_LINE else None
    if m is not None:
        eol = head.find(CRLF)
        if eol < 0:
            eol = len(head)
        status_line, code = head[:eol], m.group(1)
        r._headers = None
        r.raw = head
        r.spans = fields = _spans(_RESPONSE_SPECIAL, head, eol)
    else:
        status_line, code = _status_line(head)
        try:
            r.headers = headers = _split_headers(head.split(CRLF), 1)
        except HttpError as e:
            raise UpstreamError("protocol", e.reason) from None
        fields = [(0, 0, lname, value) for _, lname, value in headers]
    r.status = int(code)
    r.status_line = status_line
    r.content_length = None
    r.chunked = False
    r.codings = b""  # transfer codings other than a final chunked, relayed as they are
    r.early = False  # answered before the request was sent whole (set by the forwarder)
    close = status_line[5:8] == b"1.0"
    te = None
    tokens = _NO_TOKENS
    for _, _, lname, value in fields:
        if lname == b"content-length":
            if value.isdigit() and len(value) <= 18 and r.content_length is None:
                r.content_length = int(value)  # the usual one plain length: what the loop below finds
                continue
            for v in value.split(b","):
                v = v.strip()
                if not v.isdigit() or len(v) > 18:
                    raise UpstreamError("protocol", "invalid Content-Length")
                if r.content_length is not None and int(v) != r.content_length:
                    raise UpstreamError("protocol", "conflicting Content-Length headers")
                r.content_length = int(v)
        elif lname == b"transfer-encoding":
            te = value.lower() if te is None else te + b", " + value.lower()
        elif lname == b"connection":
            v = value.lower()
            if v.find(b"close") >= 0:  # (find, not `in`: not_relayed above says why)
                close = True
            elif v.find(b"keep-alive") >= 0:
                close = False
            # The fields it names are hop-by-hop: never relayed (relay() reads conn_tokens).
            named = _KEEP_ALIVE if v == b"keep-alive" else frozenset(t.strip() for t in v.split(b","))
            tokens = tokens | named if tokens else named
    if te is not None:
        if r.content_length is not None:
            raise UpstreamError("protocol", "both Content-Length and Transfer-Encoding")
        codings = [c.strip() for c in te.split(b",")]
        if codings[-1] == b"chunked":
            if b"chunked" in codings[:-1]:
                raise UpstreamError("protocol", "chunked applied twice")
            r.chunked = True
            codings.pop()
        else:
            close = True  # a coding other than chunked last: the body runs to the close (RFC 9112 6.3)
        r.codings = b", ".join(c for c in codings if c)
    r.close = close
    r.conn_tokens = tokens
    r.relayed = None
    if again and m is not None:  # (a canonical head: raw and spans are what it is relayed from)
        _remember(memo, head, r)  # type: ignore[arg-type]  # (again: memo is a list)
    return r


def _remember(memo: list, head: bytes, r: ResponseHead) -> None:
    r.relayed = relayed = [None, None, b""]
    memo[1] = (
        r.status,
        r.status_line,
        head,
        r.spans,
        r.content_length,
        r.chunked,
        r.codings,
        r.close,
        r.conn_tokens,
        relayed,
    )


def _recalled(memo: list | None, head: bytes) -> tuple[ResponseHead | None, bool]:
    """_recall() for a response, and on a hit the new ResponseHead with what a parse of the same bytes
    found (one call on the memo's common path, not two)."""
    if memo is None:
        return None, False
    if memo[0] != head:
        memo[0] = head
        memo[1] = None
        return None, False
    found = memo[1]
    if found is None:
        return None, True
    r = ResponseHead()
    (
        r.status,
        r.status_line,
        r.raw,
        r.spans,
        r.content_length,
        r.chunked,
        r.codings,
        r.close,
        r.conn_tokens,
        r.relayed,
    ) = found
    r._headers = None
    r.early = False
    return r, True


# ------------------------------------------------------------------------------ responses of our own

_date_cache: list = [0, b""]


def http_date() -> bytes:
    now = int(time())
    if _date_cache[0] != now:
        _date_cache[1] = formatdate(now, usegmt=True).encode()
        _date_cache[0] = now
    return _date_cache[1]


def own_response(status: int, reason: str, close: bool, extra: bytes = b"", head_only: bool = False) -> bytes:
    """A short text/plain answer from the edge itself (errors, 429, 503)."""
    body = reason.encode("utf-8", "replace") + b"\n"
    phrase = HTTPStatus(status).phrase.encode() if status in HTTPStatus._value2member_map_ else b"Error"
    head = (
        b"HTTP/1.1 %d %s\r\nDate: %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n%s%s\r\n"
        % (status, phrase, http_date(), len(body), extra, b"Connection: close\r\n" if close else b"")
    )
    return head if head_only else head + body


def send(sock: socket.socket, data) -> None:
    """sendall to the client; its failure is the client's (ClientGone), never a backend's."""
    try:
        sock.sendall(data)
    except OSError:
        raise ClientGone() from None


def linger(sock: socket.socket, seconds: float = 5.0, max_bytes: int = 16 << 20) -> None:
    """nginx's lingering close, after an answer sent while the request body may still be arriving:
    half-close, then read and discard (bounded in time and bytes) so that closing does not reset the
    connection before the client has read the answer."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_WR)  # an SSLSocket's own would drop its TLS state
        end = monotonic() + seconds
        n = 0
        while n < max_bytes:
            left = end - monotonic()
            if left <= 0:
                return
            sock.settimeout(min(left, 1.0))
            data = sock.recv(65536)
            if not data:
                return
            n += len(data)
    except OSError:
        pass
