"""The arithmetic of lb/http2/guard.py's allowances, with time passed in."""

from lb.http2.guard import Allowance


def test_an_allowance_is_a_burst_then_a_rate():
    a = Allowance(3, 1.0, now=0.0)
    assert all(a.take(0.0) for _ in range(3))
    assert not a.take(0.0)
    assert not a.take(0.5)            # half a token back does not pay for one
    assert a.take(3.0)


def test_progress_earns_frames_back_but_never_past_the_burst():
    a = Allowance(10, 0.0, now=0.0)
    for _ in range(10):
        a.take(0.0)
    a.earn(4)
    assert sum(a.take(0.0) for _ in range(10)) == 4
    a.earn(1000)
    assert sum(a.take(0.0) for _ in range(20)) == 10
