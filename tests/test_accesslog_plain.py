"""The text line's fields, escaped per field (escape(), _text()) or, when nothing in any of them needs it, taken
as they are (accesslog._escaped's one check): the two must give the same line for any field values."""

import itertools

import pytest

from lb.ops.accesslog import _escaped, _text, escape

IPS = ["127.0.0.1", None, "::1", "10.0.0.5 x"]
STRS = [None, "http://127.0.0.1:9001", "a\"b", "rule:dry_run,other", "x" * 2049, "é", "\udcff", 7]
METHODS = [b"GET", b"M" * 33, b"GE T"]
TARGETS = [b"/api?x=1", b"/" + b"a" * 2048, b"/\xff", b"/a\\b", b'/"q"']
HOSTS = [None, b"api.example.com", b"h" * 257, b"h\x00", "str-host"]
UAS = [None, b"curl/8.0", b"Mozilla/5.0 (X11)", b"u" * 513, b"\x7f"]


def _per_field(ip, upstream, rid, key, limited_by, method, target, host, ua):
    """The line's fields as line() wrote them before _escaped (one escape or _text each)."""
    return (
        _text(ip),
        _text(upstream),
        _text(rid),
        _text(key),
        _text(limited_by),
        escape(method, 32),
        escape(target),
        "-" if host is None else escape(host, 256),
        "-" if ua is None else '"' + escape(ua, 512) + '"',
    )


CASES = [
    (ip, s, s2, "k-3a9c01d2", s, m, t, h, u)
    for ip, s, s2 in itertools.product(IPS, STRS, STRS[:3])
    for m, t, h, u in [(METHODS[0], TARGETS[0], HOSTS[1], UAS[1])]
] + [
    ("127.0.0.1", None, "6f1c", None, None, m, t, h, u)
    for m, t, h, u in itertools.product(METHODS, TARGETS, HOSTS, UAS)
]


@pytest.mark.unit
@pytest.mark.parametrize("fields", CASES)
def test_the_one_check_gives_the_per_field_escapes(fields):
    assert _escaped(*fields) == _per_field(*fields)
