import sys
from pathlib import Path

# Tests import the project's packages (lb, limiter, wrk) from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# A real redis-server per session (and per test, for fault tests): fixtures visible to every test module.
from tests.redis_server import own_redis, redis_server  # noqa: E402,F401
