"""The store-parametrised fixture for the limiter's shared behavioural suite.

`make(algorithm, limit, window, **kw)` builds a limiter on the store under test.  Today only the
in-memory store exists; the Redis store (a later issue) adds an entry to STORES (e.g. a factory that
starts/flushes a redis-server and passes store="redis://...") and every test in the suite runs on it.
"""

import pytest

from limiter import build


def _memory(algorithm, limit, window, **kw):
    return build(algorithm, limit, window, store="memory", **kw)


STORES = {"memory": _memory}


@pytest.fixture(params=sorted(STORES))
def make(request):
    return STORES[request.param]
