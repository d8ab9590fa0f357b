"""Backend names to addresses, for DNS-named backends ([upstream] resolver): each A/AAAA record is a
backend of its own (Envoy's STRICT_DNS cluster, nginx's `server ... resolve`).

`resolver = "HOST:PORT"` asks that server directly (nginx's `resolver`): one A and one AAAA query over
UDP with a timeout, and the records' smallest TTL, so re-resolution can follow it. `resolver =
"system"` asks the machine's resolver (getaddrinfo: /etc/hosts, nsswitch), which gives no TTL.
A small client of our own rather than a library: the project takes no DNS dependency for two queries.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from time import monotonic

from lb.errors import ResolveError

A, AAAA = 1, 28


def is_address(host: str) -> bool:
    """An IP literal is one backend, exactly as before: never resolved."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def lookup(name: str, resolver: str, timeout: float = 2.0) -> tuple[list[str], float | None]:
    """(every address of `name`, sorted, and the smallest TTL or None). Raises ResolveError when there is
    no answer: the caller keeps what it had."""
    if resolver == "system":
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise ResolveError(str(e)) from None
        return sorted({str(i[4][0]) for i in infos}), None
    host, _, port = resolver.rpartition(":")
    server = (host.strip("[]"), int(port))
    addrs, ttls, errors = set(), [], []
    for qtype in (A, AAAA):
        try:
            for addr, ttl in query(server, name, qtype, timeout):
                addrs.add(addr)
                ttls.append(ttl)
        except (OSError, ResolveError) as e:
            errors.append(f"{'A' if qtype == A else 'AAAA'}: {e}")
    if not addrs:
        raise ResolveError("; ".join(errors) or "no A or AAAA records")
    return sorted(addrs), (min(ttls) if ttls else None)


def query(server: tuple[str, int], name: str, qtype: int, timeout: float) -> list[tuple[str, int]]:
    """One question over UDP, answered within `timeout` in all: [(address, ttl)] of the answer's records of
    that type (CNAMEs followed by the server: only the records of qtype are read)."""
    qid = int.from_bytes(os.urandom(2), "big")
    question = encode_name(name) + struct.pack("!HH", qtype, 1)
    packet = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + question
    fam = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    deadline = monotonic() + timeout
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        s.connect(server)  # a connected UDP socket takes answers from that server only
        s.send(packet)
        while True:
            # One deadline for the whole question: answers that are not ours (a late one to an earlier
            # query, a spoof) are skipped, and a stream of them cannot hold the resolving thread past it.
            left = deadline - monotonic()
            if left <= 0:
                raise ResolveError("timed out")
            s.settimeout(left)
            data = s.recv(4096)
            if answers(data, qid, question):
                return parse_answer(data, qtype)


def answers(data: bytes, qid: int, question: bytes) -> bool:
    """Whether `data` is the answer to our query: a response with its id and its question (RFC 5452,
    section 9.1; the name compared without case, as servers may echo it in another)."""
    if len(data) < 12 + len(question):
        return False
    rid, flags, qd = struct.unpack("!HHH", data[:6])
    echoed = data[12 : 12 + len(question)]
    return (
        rid == qid
        and flags & 0x8000 != 0
        and qd == 1
        and echoed[:-4].lower() == question[:-4].lower()
        and echoed[-4:] == question[-4:]
    )


def encode_name(name: str) -> bytes:
    out = b""
    for label in name.rstrip(".").split("."):
        try:
            raw = label.encode("idna")
        except UnicodeError:  # e.g. a label over 63 characters: no question can carry it
            raise ResolveError(f"bad name {name!r}") from None
        if not 0 < len(raw) < 64:
            raise ResolveError(f"bad name {name!r}")
        out += bytes([len(raw)]) + raw
    return out + b"\0"


def _skip_name(data: bytes, i: int) -> int:
    while True:
        if i >= len(data):
            raise ResolveError("truncated answer")
        n = data[i]
        if n & 0xC0 == 0xC0:  # a compression pointer ends the name
            return i + 2
        if n == 0:
            return i + 1
        i += 1 + n


def parse_answer(data: bytes, qtype: int) -> list[tuple[str, int]]:
    try:
        _, flags, qd, an, _, _ = struct.unpack("!HHHHHH", data[:12])
        rcode = flags & 0xF
        if rcode == 3:
            raise ResolveError("no such name (NXDOMAIN)")
        if rcode:
            raise ResolveError(f"server answered rcode {rcode}")
        i = 12
        for _ in range(qd):
            i = _skip_name(data, i) + 4
        out = []
        for _ in range(an):
            i = _skip_name(data, i)
            rtype, _, ttl, rdlen = struct.unpack("!HHIH", data[i : i + 10])
            i += 10
            rdata = data[i : i + rdlen]
            if len(rdata) != rdlen:  # a record cut short: no address to read from it
                raise ResolveError("malformed answer")
            i += rdlen
            if rtype == qtype == A and rdlen == 4:
                out.append((socket.inet_ntop(socket.AF_INET, rdata), ttl))
            elif rtype == qtype == AAAA and rdlen == 16:
                out.append((socket.inet_ntop(socket.AF_INET6, rdata), ttl))
        return out
    except struct.error:
        raise ResolveError("malformed answer") from None
