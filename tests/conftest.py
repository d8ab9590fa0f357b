import sys
from pathlib import Path

import pytest

# Tests import the project's packages (lb, limiter, wrk) from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# A real redis-server per session (and per test, for fault tests): fixtures visible to every test module.
from tests.redis_server import own_redis, redis_server  # noqa: E402,F401


@pytest.fixture(scope="module")
def backends():
    """Three identity backends named a, b, c, shared by the tests of one module."""
    from tests.support import Backend
    bs = [Backend(n) for n in ("a", "b", "c")]
    yield bs
    for b in bs:
        b.stop()
