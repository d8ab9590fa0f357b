"""lb/memtrim.py: after a burst of large responses the RSS comes back (the measurement is in
docs/performance.md; here, the decision and the one thread per process)."""

import threading

from lb import memtrim


def test_a_trim_is_due_only_past_the_growth_over_the_floor():
    assert not memtrim.due(1000, 1000)
    assert not memtrim.due(1100, 1000)
    assert memtrim.due(1101, 1000)


def test_one_thread_per_process_however_many_listeners_start_it():
    first = memtrim.start()
    assert memtrim.start() == first
    assert sum(1 for t in threading.enumerate() if t.name == "malloc-trim") == (1 if first else 0)
