"""The pure parts of failover, with the clock passed in: the balancer's strategies and slow start, the
ejection state machine, the retry budget. The same code runs in the edge (tests/test_failover.py)."""

import random
from collections import Counter

import pytest

from lb.upstream.backends import Backend, make_backend
from lb.upstream.balancer import SLOW_START_MIN, Balancer
from lb.config.load import Config, parse_backend_url
from lb.upstream.health import record
from lb.upstream.outlier import MAX_EJECTION_TIME, Ejector
from lb.upstream.retrybudget import RetryBudget


def pool(*weights, **kw):
    cfg = Config()
    return [make_backend(parse_backend_url(f"http://10.0.0.{i + 1}:80", w, "t"), cfg, **kw)
            for i, w in enumerate(weights)]


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


# ------------------------------------------------------------------------------------ strategies

def test_smooth_weighted_interleaves_and_skips_what_is_out_of_rotation():
    a, b, c = pool(3, 1, 1)
    bal = Balancer([a, b, c], "weighted")
    assert [bal.pick() for _ in range(5)] == [a, b, a, c, a]
    b.drained = True
    b.refresh()
    assert Counter(bal.pick() for _ in range(40)) == {a: 30, c: 10}
    assert bal.pick(exclude=(a,)) is c and bal.pick(exclude=(a, c)) is None


@pytest.mark.parametrize("strategy", ["round-robin", "weighted", "least-request"])
def test_every_strategy_honours_exclude_and_rotation(strategy):
    a, b, c = pool(1, 1, 1)
    bal = Balancer([a, b, c], strategy, rng=random.Random(1))
    a.ejected = True
    a.refresh()
    picks = Counter(bal.pick(exclude=(b,)) for _ in range(30))
    assert picks == {c: 30}
    c.up = False
    c.refresh()
    assert bal.pick(exclude=(b,)) is None and bal.pick() is b


def test_a_pick_without_a_turn_leaves_round_robin_where_it_was():
    """turn=False (a hedge beside the request's own try) skips the excluded one without moving the
    cursor: the backend after it keeps its turn."""
    a, b, c = pool(1, 1, 1)
    bal = Balancer([a, b, c], "round-robin")
    assert bal.pick() is a
    assert bal.pick(exclude=(a,), turn=False) is b
    assert [bal.pick() for _ in range(3)] == [b, c, a]
    assert bal.pick(exclude=(b,)) is c                 # a retry still takes c's turn, as it always did
    assert bal.pick() is a


def test_least_request_prefers_fewer_in_flight():
    a, b, c = pool(1, 1, 1)
    bal = Balancer([a, b, c], "least-request", rng=random.Random(7))
    c.inflight = 10                       # the slow one piles up requests
    picks = Counter(bal.pick() for _ in range(3000))
    assert picks[c] == 0                  # in any pair, the other has fewer in flight
    assert 1300 < picks[a] < 1700 and 1300 < picks[b] < 1700
    c.inflight = 0                        # idle: a uniform spread (each in 2 of the 3 pairs)
    picks = Counter(bal.pick() for _ in range(3000))
    assert all(850 < picks[x] < 1150 for x in (a, b, c)), picks


def test_least_request_weighted_follows_weights_idle_and_shifts_under_load():
    a, b = pool(3, 1)
    bal = Balancer([a, b], "least-request")
    assert Counter(bal.pick() for _ in range(400)) == {a: 300, b: 100}   # idle: the weights
    a.inflight = 5                        # 3/6 = 0.5 against 1/1: b gets two picks in three
    assert Counter(bal.pick() for _ in range(300)) == {a: 100, b: 200}


# ------------------------------------------------------------------------------------ slow start

def shares_over_windows(bal, target, clock, seconds, window, picks_per_second=200):
    """target's share of the picks in each window, the clock advanced per pick."""
    out = []
    step = 1.0 / picks_per_second
    for _ in range(int(seconds / window)):
        got = Counter()
        for _ in range(int(window * picks_per_second)):
            clock.t += step
            got[bal.pick()] += 1
        out.append(got[target] / sum(got.values()))
    return out


@pytest.mark.parametrize("strategy", ["weighted", "least-request", "round-robin"])
def test_slow_start_ramps_a_rejoining_backend_to_its_weight_share(strategy):
    clock = Clock()
    a, b, c = pool(1, 1, 1)
    bal = Balancer([a, b, c], strategy, slow_start=10, clock=clock, rng=random.Random(5))
    assert a.joined_at is None            # the pool at start does not ramp
    c.up = False
    c.refresh(clock.t)
    clock.t += 30
    c.up = True
    assert c.refresh(clock.t) and c.joined_at == clock.t
    shares = shares_over_windows(bal, c, clock, seconds=14, window=2)
    # the ramp: weight max(10%, t/10) -> share w/(2+w); windows of 2 s (means 0.1, 0.3, 0.5, 0.7, 0.9)
    expected = [w / (2 + w) for w in (0.11, 0.3, 0.5, 0.7, 0.9, 1, 1)]
    for got, want in zip(shares, expected):
        assert abs(got - want) < 0.05, (shares, expected)
    assert shares[0] < 1 / 3 * 0.4 and abs(shares[-1] - 1 / 3) < 0.05   # least-request: seeded draws
    assert bal.effective_weight(c, clock.t) == 1


def test_a_backend_back_up_from_its_health_checks_starts_its_ramp():
    a, b = pool(1, 1)
    assert record(a, False, "refused", rise=2, fall=1) == "DOWN" and not a.in_rotation
    assert record(a, True, "HTTP 200", rise=2, fall=1) is None and not a.in_rotation
    assert record(a, True, "HTTP 200", rise=2, fall=1) == "UP" and a.in_rotation
    assert a.joined_at is not None and b.joined_at is None
    a.drained = True                      # drained: health passes, still out
    a.refresh()
    assert record(a, True, "HTTP 200", rise=2, fall=1) is None and not a.in_rotation


def test_slow_start_weight_is_linear_from_the_minimum():
    clock = Clock()
    (a,) = pool(4, joined_at=clock.t)
    bal = Balancer([a], slow_start=8, clock=clock)
    assert bal.effective_weight(a, clock.t) == 4 * SLOW_START_MIN
    assert bal.effective_weight(a, clock.t + 2) == 1.0
    assert bal.effective_weight(a, clock.t + 6) == 3.0
    assert bal.effective_weight(a, clock.t + 8) == 4
    bal.set_backends([a], slow_start=0)
    assert bal.effective_weight(a, clock.t) == 4      # off: full weight at once


# ------------------------------------------------------------------------------------ ejection

def fail(ej, b, bs, now, n):
    return [ej.observe(b, False, now, bs) for _ in range(n)]


def test_consecutive_failures_eject_for_a_growing_time_then_return():
    a, b, c = pool(1, 1, 1)
    bs = [a, b, c]
    ej = Ejector(eject_after=5, eject_for=30, max_percent=50)
    t = 100.0
    assert fail(ej, a, bs, t, 4) == [None] * 4
    ej.observe(a, True, t, bs)            # a success breaks the run
    assert fail(ej, a, bs, t, 4) == [None] * 4 and a.in_rotation
    assert ej.observe(a, False, t, bs) == 30
    assert a.ejected and not a.in_rotation and a.state == "EJECTED" and ej.ejected == 1
    assert ej.sweep(bs, t + 29.9) == [] and a.ejected
    assert ej.sweep(bs, t + 30) == [a] and a.in_rotation and a.fail_run == 0 and ej.ejected == 0
    assert a.joined_at == t + 30          # slow start begins at the return
    # ejected again soon after: twice as long
    assert fail(ej, a, bs, t + 31, 5)[-1] == 60
    assert ej.sweep(bs, t + 91) == [a]
    # behaving for two more eject_for periods takes two off the multiplier: 2 -> 0, then +1
    assert fail(ej, a, bs, t + 91 + 60, 5)[-1] == 30


def test_ejection_time_is_capped():
    (a, b) = pool(1, 1)
    ej = Ejector(eject_after=1, eject_for=100, max_percent=50)
    t = 0.0
    for n in range(1, 6):
        d = ej.observe(a, False, t, [a, b])
        assert d == min(100 * n, MAX_EJECTION_TIME)
        t += d
        assert ej.sweep([a, b], t) == [a]


def test_never_more_than_max_percent_ejected_and_a_lone_backend_never():
    bs = pool(1, 1, 1, 1)
    ej = Ejector(eject_after=2, eject_for=10, max_percent=50)
    for b in bs:
        fail(ej, b, bs, 0.0, 2)
    assert [b.ejected for b in bs] == [True, True, False, False]    # 2 of 4 = 50%
    (only,) = pool(1)
    assert fail(Ejector(1, 10, 50), only, [only], 0.0, 3) == [None] * 3 and not only.ejected
    assert fail(Ejector(1, 10, 100), only, [only], 0.0, 1) == [10] and only.ejected   # the operator's call
    off = Ejector(0, 10, 50)
    (x, y) = pool(1, 1)
    assert fail(off, x, [x, y], 0.0, 50) == [None] * 50 and not x.ejected


def test_an_ejection_that_ends_while_down_leaves_it_out():
    a, b, c = pool(1, 1, 1)
    bs = [a, b, c]
    ej = Ejector(eject_after=1, eject_for=5, max_percent=50)
    ej.observe(a, False, 0.0, bs)
    a.up = False                           # the active checks take it DOWN meanwhile
    a.refresh()
    assert ej.sweep(bs, 5.0) == [a] and not a.in_rotation and a.state == "DOWN"
    a.up = True
    assert a.refresh(7.0) and a.in_rotation and a.joined_at == 7.0


def probe(ej, b, ok, now, rise=2, fall=2):
    """What HealthChecker._loop does with one probe's result: (transition, returned from ejection)."""
    change = record(b, ok, "HTTP 200" if ok else "refused", rise=rise, fall=fall)
    return change, ok and ej.probe_passed(b, rise, now)


def test_rise_passed_probes_since_an_ejection_end_it_early():
    """Envoy's successful_active_health_check_uneject_host, counted as HAProxy's rise: the passes a DOWN
    backend needs to come back end an ejection too (passes from before the ejection do not count)."""
    a, b, c = pool(1, 1, 1)
    bs = [a, b, c]
    ej = Ejector(eject_after=5, eject_for=30, max_percent=50)
    for t in range(10):
        probe(ej, a, True, float(t))       # healthy all along: a long streak
    assert fail(ej, a, bs, 10.0, 5)[-1] == 30 and a.ejected and a.pass_streak == 0
    assert probe(ej, a, True, 11.0) == (None, False) and a.ejected and not a.in_rotation
    assert probe(ej, a, True, 12.0) == (None, True)
    assert not a.ejected and a.in_rotation and ej.ejected == 0 and a.fail_run == 0
    assert a.returned_at == 12.0 and a.joined_at == 12.0 and a.times_ejected == 1
    assert ej.sweep(bs, 40.0) == []        # returned once: the sweep has nothing left to return
    assert probe(ej, a, True, 13.0) == (None, False)       # a pass while not ejected does nothing
    # its multiplier is kept: ejected again soon after, for twice as long, and the same probes end it
    assert fail(ej, a, bs, 14.0, 5)[-1] == 60
    assert probe(ej, a, False, 15.0) == (None, False)      # a failed probe breaks the run
    assert probe(ej, a, True, 16.0) == (None, False) and a.ejected
    assert probe(ej, a, True, 17.0) == (None, True) and a.in_rotation


def test_a_down_backend_is_not_ejected_and_a_restarted_one_rejoins_at_its_up():
    """A backend killed under traffic: the retries eject it, the probes take it DOWN; restarted, its
    `rise` passes bring it UP and end the ejection at the same probe, not 30 s later (milestone 3)."""
    a, b, c = pool(1, 1, 1)
    bs = [a, b, c]
    ej = Ejector(eject_after=5, eject_for=30, max_percent=50)
    assert fail(ej, a, bs, 0.0, 5)[-1] == 30                # killed: five failed requests eject it
    assert probe(ej, a, False, 0.5) == (None, False)
    assert probe(ej, a, False, 1.0) == ("DOWN", False) and a.state == "DOWN" and a.ejected
    assert probe(ej, a, True, 2.0) == (None, False)          # restarted
    assert probe(ej, a, True, 2.5) == ("UP", True)
    assert a.in_rotation and not a.ejected and a.joined_at == 2.5 and ej.ejected == 0
    # DOWN, its failures neither eject it nor count: UP again, it takes eject_after new ones
    (x, y) = pool(1, 1)
    probe(ej, x, False, 0.0)
    assert probe(ej, x, False, 0.5)[0] == "DOWN"
    assert fail(ej, x, [x, y], 1.0, 20) == [None] * 20 and not x.ejected and x.fail_run == 0
    probe(ej, x, True, 1.5)
    assert probe(ej, x, True, 2.0) == ("UP", False) and x.in_rotation
    assert fail(ej, x, [x, y], 2.5, 4) == [None] * 4 and fail(ej, x, [x, y], 2.5, 1) == [30]


# ------------------------------------------------------------------------------------ retry budget

def test_retry_budget_is_a_fraction_of_active_requests_with_a_floor():
    rb = RetryBudget(percent=20, minimum=3)    # Envoy's floor; ours defaults to 10
    for _ in range(10):
        rb.start()
    assert rb.allowed() == 3                             # 20% of 10 = 2 < the floor
    assert [rb.try_retry(False) for _ in range(4)] == [True, True, True, False]
    assert rb.try_retry(True)                           # a request holding a slot keeps it
    for _ in range(20):
        rb.start()
    assert rb.allowed() == 6                            # 20% of 30
    assert [rb.try_retry(False) for _ in range(4)] == [True, True, True, False]
    assert rb.retrying == 6 and rb.peak == 6 and rb.refused == 2
    rb.end(held=True)
    assert rb.retrying == 5 and rb.active == 29
