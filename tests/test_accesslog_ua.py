"""The access log's User-Agent: read from a canonical head where it is (no split of the head), it must be what
the head's fields say -- the first User-Agent line, whatever the name's case -- and None when there is none."""

import pytest

from lb.http.framing import parse_request
from lb.ops.accesslog import _user_agent

HEADS = [
    b"GET / HTTP/1.1\r\nHost: a\r\nUser-Agent: curl/8.0\r\nAccept: */*",
    b"GET / HTTP/1.1\r\nHost: a\r\nuser-AGENT: x y\tz\r\nUser-Agent: second",
    b"GET / HTTP/1.1\r\nUser-Agent: first\r\nHost: a",
    b"GET / HTTP/1.1\r\nHost: a\r\nUser-Agent-X: no\r\nX-UA: User-Agent: no",
    b"GET / HTTP/1.1\r\nHost: a\r\nUser-Agent: \xff\xfe",
    b"GET / HTTP/1.1\r\nHost: a",
    b"GET / HTTP/1.1\r\nHost: a\r\nUser-Agent:  blanks around \r\nUser-Agent: second",  # not canonical
]


@pytest.mark.unit
@pytest.mark.parametrize("head", HEADS)
def test_the_user_agent_is_the_first_user_agent_field(head):
    fields = parse_request(head).headers
    want = next((v for _, lname, v in fields if lname == b"user-agent"), None)
    assert _user_agent(parse_request(head)) == want
