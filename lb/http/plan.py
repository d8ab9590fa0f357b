"""The head the edge writes from one it received, bytes in, bytes out: which of the backend's fields the
client gets, the body's framing and whether the connection stays open (the response plan), and the
request's fields as the backend gets them.

A head the parser found canonical (framing.Request/ResponseHead `spans` set: every line `Name: value`)
is written from slices of the received bytes: only the lines to drop or replace are touched, found by the
parser where they are. Any other head is rebuilt field by field from `headers`, as before; both give the
same bytes for a canonical head (tests/test_plan.py checks that on tables of heads). No sockets here.
"""

from __future__ import annotations

from lb.http.framing import REQUEST_NAMES, RESPONSE_NAMES, UNDERSCORE_NAME

CRLF = b"\r\n"
NO_BODY_STATUS = frozenset({204, 304})
# '_' as the byte value: `95 in raw` is one memchr, where `b"_" in raw` sets up a substring search (a tenth
# of the instructions, measured: 200 against 2,200 on the bench's request head).
_UNDERSCORE = ord("_")
# The client's head in one piece: the relayed head, the edge's lines, the framing (a bytearray: a small body
# is appended to it). The separator, empty, is never written to.
_JOIN = bytearray().join
_CLOSE = b"Connection: close\r\n\r\n"
_KEEP_ALIVE = b"Connection: keep-alive\r\n\r\n"


def _kept(raw: bytes, start: int, dropped: list, cl: int | None) -> bytearray:
    """raw[start:] (field lines, each after its CRLF) without the `dropped` spans, as lines each ending in
    CRLF; a dropped Content-Length is written in its place, once, as `cl` (when not None)."""
    out = bytearray()
    pos = start
    for s, e, lname in dropped:
        out += raw[pos:s]
        if cl is not None and lname == b"content-length":
            out += b"\r\nContent-Length: %d" % cl
            cl = None
        pos = e
    out += raw[pos:]
    if out:
        del out[:2]  # the first line's CRLF: the caller's first line ends with its own
        out += CRLF
    return out


def response_fields(rh, skip: frozenset, limiting: bool, slow: bool = False) -> bytearray:
    """The backend's field lines the client gets, each ending in CRLF: none that `skip` or the response's
    Connection names, no X-RateLimit-* when the edge writes its own (`limiting`), and Content-Length as
    the edge parsed it, in its place -- none for a 1xx or a 204 (RFC 9110 8.6). slow: `skip` names a field
    the parser does not locate (a route's `remove`), so the head is written line by line."""
    status = rh.status
    cl = rh.content_length if status >= 200 and status != 204 else None
    tokens = rh.conn_tokens
    if rh.spans is not None and not slow and (not tokens or tokens <= RESPONSE_NAMES):
        dropped = [
            (s, e, lname)
            for s, e, lname, _ in rh.spans
            if lname in skip or lname in tokens or (limiting and lname[:12] == b"x-ratelimit-")
        ]
        if not dropped:
            return (
                bytearray(rh.raw[len(rh.status_line) + 2 :] + b"\r\n")
                if len(rh.raw) > len(rh.status_line)
                else bytearray()
            )
        return _kept(rh.raw, len(rh.status_line), dropped, cl)
    out = bytearray()
    for name, lname, value in rh.headers:
        if lname in skip or (tokens and lname in tokens) or (limiting and lname[:12] == b"x-ratelimit-"):
            if lname == b"content-length" and cl is not None:
                out += b"Content-Length: %d\r\n" % cl  # in its place, once, as the edge parsed it
                cl = None
            continue
        out += name + b": " + value + b"\r\n"
    return out


def response_plan(
    rh,
    method: bytes,
    http10: bool,
    client_keep: bool,
    skip: frozenset,
    limiting: bool,
    extra: bytes,
    slow: bool = False,
) -> tuple[bytearray, str, bool]:
    """(the head for the client, the body's mode, whether the client connection stays open).

    mode: none (no body: HEAD, 1xx, 204, 304), length, chunked (decoded and re-chunked), eof (delimited by
    the backend's close, chunked to an HTTP/1.1 client) or raw (a transfer coding the edge does not decode:
    as it came, to the close). extra: the edge's own lines (X-Request-Id, rate-limit fields, Set-Cookie).
    A 101 outside a tunnel closes both sides: the caller also marks rh.close."""
    status = rh.status
    done = rh.relayed  # the head already written from these bytes (parse_response's memo), for this skip?
    if done is not None and done[0] is skip and done[1] == limiting and not slow:
        head: bytes | bytearray = done[2]  # (_relayed_head's, without the call)
    else:
        head = _relayed_head(rh, skip, limiting, slow)
    if method == b"HEAD" or status in NO_BODY_STATUS or status < 200:
        if status == 101:
            client_keep = False  # this connection speaks something else now
        mode = "none"
    elif rh.content_length is not None:
        mode = "length"
    elif rh.chunked:
        mode = "chunked"
    elif rh.codings:
        # a transfer coding the edge does not decode: as it came, to the close
        if http10:
            return _JOIN((head, extra, _CLOSE)), "raw", False
        return _JOIN((head, extra, b"Transfer-Encoding: ", rh.codings, CRLF, _CLOSE)), "raw", False
    else:
        mode = "eof"
    if mode == "none" or mode == "length":
        tail = (_KEEP_ALIVE if http10 else CRLF) if client_keep else _CLOSE
        return _JOIN((head, extra, tail)), mode, client_keep
    if http10:
        return _JOIN((head, extra, _CLOSE)), mode, False  # an HTTP/1.0 client reads to EOF
    te = b"Transfer-Encoding: " + rh.codings + b", chunked\r\n" if rh.codings else b"Transfer-Encoding: chunked\r\n"
    return _JOIN((head, extra, te, CRLF if client_keep else _CLOSE)), mode, client_keep


def _relayed_head(rh, skip: frozenset, limiting: bool, slow: bool) -> bytearray:
    """The status line (as HTTP/1.1) and response_fields(), each ending in CRLF. A canonical HTTP/1.1 head
    (the common one) is copied from its received bytes in one pass, the status line with it, without the
    lines response_fields() would drop; any other, line and fields apart."""
    tokens = rh.conn_tokens
    spans = rh.spans
    raw = rh.raw
    if spans is None or slow or (tokens and not tokens <= RESPONSE_NAMES) or raw[:8] != b"HTTP/1.1":
        head = bytearray(b"HTTP/1.1" + rh.status_line[8:] + CRLF)
        head += response_fields(rh, skip, limiting, slow)
        return head
    done = rh.relayed  # parse_response's memo: response_plan found nothing there for this skip; write it
    status = rh.status
    cl = rh.content_length if status >= 200 and status != 204 else None
    out: bytearray | None = None
    pos = 0
    for s, e, lname, _ in spans:  # (response_fields' choice of lines, written as it goes)
        if lname in skip or lname in tokens or (limiting and lname[:12] == b"x-ratelimit-"):
            if out is None:
                out = bytearray(raw[:s])
            else:
                out += raw[pos:s]
            if cl is not None and lname == b"content-length":
                out += b"\r\nContent-Length: %d" % cl  # in its place, once, as the edge parsed it
                cl = None
            pos = e
    if out is None:
        out = bytearray(raw)
    else:
        out += raw[pos:]
    out += CRLF
    if done is not None:
        done[:] = skip, limiting, bytes(out)
    return out


def request_head(
    req, replaced: frozenset, underscores: bool, length: int | None, slow: bool = False
) -> tuple[bytearray, int | None]:
    """The request line (as HTTP/1.1) and request_fields() after it. A canonical HTTP/1.1 head with no line
    to drop (the common one) is one copy of its received bytes: its first line is the request line the
    edge would write (parse_request's fast path reads method, target and version from it as they are)."""
    spans = getattr(req, "spans", None)
    if (
        spans is not None
        and not slow
        and req.version == b"HTTP/1.1"
        and not req.conn_tokens
        and (underscores or _UNDERSCORE not in req.raw or UNDERSCORE_NAME.search(req.raw) is None)
    ):
        for _, _, lname, _ in spans:
            if lname in replaced:
                break
        else:
            out = bytearray(req.raw)
            out += CRLF
            return out, length
    out = bytearray(req.method + b" " + req.target + b" HTTP/1.1\r\n")
    fields, length = request_fields(req, replaced, underscores, length, slow)
    out += fields
    return out, length


def request_fields(
    req, replaced: frozenset, underscores: bool, length: int | None, slow: bool = False
) -> tuple[bytearray, int | None]:
    """The client's field lines the backend gets, each ending in CRLF, and `length` if it is still to be
    written (None once a Content-Length took its place): none that `replaced` or the request's Connection
    names, none with '_' in its name unless `underscores`. slow: as for response_fields."""
    tokens = req.conn_tokens
    spans = getattr(req, "spans", None)
    if spans is not None and not slow and (not tokens or tokens <= REQUEST_NAMES):
        raw = req.raw
        if underscores or _UNDERSCORE not in raw or UNDERSCORE_NAME.search(raw) is None:
            dropped = [(s, e, lname) for s, e, lname, _ in spans if lname in replaced or lname in tokens]
            eol = raw.find(CRLF)
            if not dropped:
                return bytearray(raw[eol + 2 :] + b"\r\n") if eol >= 0 else bytearray(), length
            if length is not None and any(lname == b"content-length" for _, _, lname in dropped):
                return _kept(raw, eol, dropped, length), None
            return _kept(raw, eol, dropped, None), length
    out = bytearray()
    for name, lname, value in req.headers:
        if lname in replaced or (tokens and lname in tokens) or (not underscores and _UNDERSCORE in lname):
            if lname == b"content-length" and length is not None:
                out += b"Content-Length: %d\r\n" % length  # in its place, once, as the edge counted
                length = None
            continue
        out += name + b": " + value + b"\r\n"
    return out, length
