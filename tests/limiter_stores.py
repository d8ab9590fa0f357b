"""The store-parametrised fixture for the limiter's shared behavioural suite.

`make(algorithm, limit, window, **kw)` builds a limiter on the store under test; every test in the
suite runs once per entry of STORES:

    memory   the in-process store
    redis    a real redis-server (one per session, tests/redis_server.py); every limiter gets a fresh
             key prefix, so tests never see each other's state, and runs strict (a Lua/Python
             verdict mismatch raises instead of being counted); denials answered from its local
             denial cache where it can (the default)
    redis-nocache  the same with the denial cache off: every decision is a script call
"""

import itertools

import pytest

from limiter import build


def _memory(algorithm, limit, window, **kw):
    return build(algorithm, limit, window, store="memory", **kw)


_prefixes = itertools.count()


def _redis(url, **defaults):
    def make(algorithm, limit, window, **kw):
        kw = {**defaults, **kw}
        kw.setdefault("prefix", f"test:{next(_prefixes)}:")
        kw.setdefault("timeout", 2.0)  # a loaded CI machine must not turn into fail-open decisions
        lim = build(algorithm, limit, window, store=url, **kw)
        lim.strict = True
        return lim

    return make


STORES = {"memory": lambda request: _memory,
          "redis": lambda request: _redis(request.getfixturevalue("redis_server").url),
          "redis-nocache": lambda request: _redis(request.getfixturevalue("redis_server").url, deny_cache=0)}


# a real redis-server: the integration tier (tests/conftest.py cannot see through getfixturevalue)
@pytest.fixture(params=[pytest.param(s, marks=[pytest.mark.integration] if s != "memory" else []) for s in sorted(STORES)])
def make(request):
    return STORES[request.param](request)
