import dis
import functools
import sys
import types
from pathlib import Path

import pytest

# Tests import the project's packages (lb, limiter, wrk) from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# A real redis-server per session (and per test, for fault tests): fixtures visible to every test module.
from tests.redis_server import own_redis, redis_server  # noqa: E402,F401


@pytest.fixture(scope="module")
def backend():
    """One identity backend, shared by the tests of one module (a module whose backend is of another kind,
    scripted or recording, defines its own)."""
    from tests.support import Backend
    b = Backend("one")
    yield b
    b.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throwaway CA and two server certificates for 127.0.0.1, ::1 and localhost, as PEM files:
    {"ca", "cert1", "key1", "cert2", "key2"} -> path."""
    trustme = pytest.importorskip("trustme", reason="trustme (requirements-dev.txt) makes the test certificates")
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    files = {"ca": d / "ca.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    for n in ("1", "2"):
        leaf = ca.issue_cert("127.0.0.1", "::1", "localhost")
        files["cert" + n], files["key" + n] = d / f"cert{n}.pem", d / f"key{n}.pem"
        leaf.cert_chain_pems[0].write_to_path(str(files["cert" + n]))
        leaf.private_key_pem.write_to_path(str(files["key" + n]))
    return {k: str(v) for k, v in files.items()}


@pytest.fixture(scope="module")
def backends():
    """Three identity backends named a, b, c, shared by the tests of one module."""
    from tests.support import Backend
    bs = [Backend(n) for n in ("a", "b", "c")]
    yield bs
    for b in bs:
        b.stop()


# -- the two tiers: `pytest -m "not integration"` is the fast loop (README "The two commands") ------------
#
# A test is `integration` when it starts a process or a server socket: it (or a fixture it uses, or a
# helper of the test files it calls, followed through) names one of these. Read from the compiled code,
# not from a list of files, so a new test lands in the right tier by itself; a module the reading cannot
# see through says `pytestmark = pytest.mark.integration` itself.
STARTS = frozenset({
    "Edge", "Backend", "Proc", "RawServer", "RecordingBackend", "RedisServer", "Cluster", "SentinelSet",
    "Browser", "subprocess", "Popen", "start_in_thread", "take_over", "run_nginx", "App", "serve",
    "make_server", "create_server", "create_connection", "listen", "fork", "spawn", "ws_backend",
})
OURS = ("tests", "bench", "wrk")      # helpers followed into; the product's own code is not


@functools.cache
def _names(code: types.CodeType) -> tuple[set[str], set[str]]:
    """Every name the code uses (attributes too), and those it takes from its module or an import."""
    every, loaded = set(code.co_names), set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "IMPORT_FROM"):
            loaded.add(ins.argval)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):     # lambdas, nested functions, comprehensions
            e, g = _names(c)
            every |= e
            loaded |= g
    return every, loaded


def _starts(obj, seen: set[int]) -> str:
    """What this function (or class) starts a process or a server with, itself or through our helpers
    ("" for nothing): the chain of names, e.g. "run_case > Edge"."""
    if id(obj) in seen:
        return ""
    seen.add(id(obj))
    if isinstance(obj, type):
        for v in vars(obj).values():
            if isinstance(v, types.FunctionType) and (why := _starts(v, seen)):
                return why
        return ""
    func = getattr(obj, "__wrapped__", obj)
    code = getattr(func, "__code__", None)
    if code is None:
        return ""
    every, names = _names(code)
    if every & STARTS:
        return min(every & STARTS)
    scope = getattr(func, "__globals__", {})
    for name in names:
        # a name this module does not hold at the top was imported in the function: any helper of ours by it
        for used in [scope[name]] if name in scope else _helpers().get(name, ()):
            if isinstance(used, (types.FunctionType, type)) and _ours(used) and (why := _starts(used, seen)):
                return f"{name} > {why}"
    # module.helper(): the attributes it reads of a module of ours (`protocol.detect_wrk2()`)
    modules = [scope[n] for n in names if isinstance(scope.get(n), types.ModuleType) and _ours_module(scope[n])]
    for mod in modules:
        for name in every:
            used = getattr(mod, name, None)
            if isinstance(used, (types.FunctionType, type)) and _ours(used) and (why := _starts(used, seen)):
                return f"{mod.__name__.rsplit('.', 1)[-1]}.{name} > {why}"
    return ""


def _ours_module(mod) -> bool:
    return (getattr(mod, "__name__", "") or "").split(".")[0] in OURS


def _ours(obj) -> bool:
    return (getattr(obj, "__module__", "") or "").split(".")[0] in OURS


_by_name: dict[str, list] = {}


def _helpers() -> dict[str, list]:
    """Every function and class of our loaded test and bench modules, by name (read once, after collection)."""
    if not _by_name:
        for mod in list(sys.modules.values()):
            if (getattr(mod, "__name__", "") or "").split(".")[0] in OURS:
                for name, obj in vars(mod).items():
                    if isinstance(obj, (types.FunctionType, type)) and _ours(obj):
                        _by_name.setdefault(name, []).append(obj)
    return _by_name


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("integration") or item.get_closest_marker("unit"):
            continue
        seen: set[int] = set()
        fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        for f in [getattr(item, "function", None), *fixtures]:
            if f is not None and (why := _starts(f, seen)):
                item.add_marker(pytest.mark.integration)
                item.user_properties.append(("integration", why))    # why, for a surprised reader
                break
