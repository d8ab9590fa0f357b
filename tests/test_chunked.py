"""The chunked decoder (lb/http/chunked.py) on its own: byte tables in, events out, no sockets."""

from __future__ import annotations

import pytest

from lb.http.chunked import CHUNK, CHUNK_END, END, NEED, TRAILER, ChunkedDecoder, chunk_size


class Bad(Exception):
    pass


def decode(wire: bytes, split: int | None = None, most: int = 65536, **kw):
    """Every event for `wire` fed `split` bytes at a time (None: all at once): data joined per chunk."""
    dec = ChunkedDecoder(Bad, **kw)
    buf = bytearray()
    events, fed = [], 0
    while True:
        ev = dec.next(buf, most)
        if not isinstance(ev, bytes) and ev == NEED:
            if fed >= len(wire):
                events.append("EOF")
                return events, dec
            step = len(wire) if split is None else split
            buf += wire[fed:fed + step]
            fed += step
            continue
        if isinstance(ev, bytes) and events and isinstance(events[-1], bytes):
            events[-1] += ev
        else:
            events.append(ev)
        if not isinstance(ev, bytes) and ev == END:
            assert fed >= len(wire) or buf == bytearray(wire[fed - len(buf):fed])
            return events, dec


@pytest.mark.parametrize("split", [None, 1, 2, 3, 7])
def test_chunks_decode_to_their_data_however_the_bytes_are_split(split):
    wire = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    events, dec = decode(wire, split)
    assert events == [CHUNK, b"hello", CHUNK_END, CHUNK, b" world", CHUNK_END, TRAILER, END]
    assert dec.consumed == len(wire)


def test_data_comes_in_pieces_of_at_most_most():
    events, _ = decode(b"a\r\n0123456789\r\n0\r\n\r\n", most=4)
    assert events[:2] == [CHUNK, b"0123456789"]     # joined by the helper; each piece was <= 4
    dec = ChunkedDecoder(Bad)
    buf = bytearray(b"a\r\n0123456789\r\n0\r\n\r\n")
    assert dec.next(buf, 4) == CHUNK and dec.size == 10
    assert [dec.next(buf, 4) for _ in range(3)] == [b"0123", b"4567", b"89"]


def test_what_follows_the_message_is_left_in_the_buffer():
    dec = ChunkedDecoder(Bad)
    buf = bytearray(b"0\r\n\r\nGET / HTTP/1.1\r\n")
    assert dec.next(buf) == END
    assert buf == b"GET / HTTP/1.1\r\n"


@pytest.mark.parametrize("wire, why", [
    (b"0x5\r\nhello\r\n0\r\n\r\n", "invalid chunk size"),
    (b"+5\r\nhello\r\n0\r\n\r\n", "invalid chunk size"),
    (b" 5\r\nhello\r\n0\r\n\r\n", "invalid chunk size"),
    (b"5_0\r\n", "invalid chunk size"),
    (b"\r\n", "invalid chunk size"),
    (b"1000000000000000\r\n", "invalid chunk size"),
    (b"5\nhello\r\n0\r\n\r\n", "bare LF in a chunked body"),
    (b"5\r\nhello!\r\n0\r\n\r\n", "chunk longer than its declared size"),
    (b"5;" + b"e" * 2000 + b"\r\n", "chunk line too long"),
    (b"0\r\n" + b"X: y\r\n" * 3 + b"\r\n", "more than 2 trailer fields"),
    (b"0\r\nX: " + b"y" * 100 + b"\r\n\r\n", "chunk line too long"),
])
@pytest.mark.parametrize("split", [None, 1])
def test_bad_framing_raises_the_callers_error_with_its_reason(wire, why, split):
    with pytest.raises(Bad, match=why):
        decode(wire, split, max_trailers=2, max_trailer_line=64)


def test_a_body_cut_short_needs_more():
    events, _ = decode(b"5\r\nhel")
    assert events == [CHUNK, b"hel", "EOF"]


def test_chunk_sizes_are_strict_hex():
    assert chunk_size(b"1aF") == 0x1AF
    assert chunk_size(b"10;name=value") == 16
    assert [chunk_size(x) for x in (b"", b"-1", b"0x1", b"1 ", b"g")] == [-1] * 5
