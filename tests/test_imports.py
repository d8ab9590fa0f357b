"""The house's dependencies point one way: no import cycles, and no room imports a room above it.

Read from the source with ast (module-level imports and the lazy ones inside functions alike: a lazy
import is still a dependency, it only hides a cycle until run time). The layering, bottom -> top; a
module may import its own room and the rooms below it, never one above:

    limiter            the rate-limiting library: knows nothing of lb
    lb.logs, lb.netaddr, lb.errors    leaves: every room may use them, they use no room
                       (and lb itself, the package: __version__)
    demo               the demo backends: --demo starts them beside the edge; they use only the leaves
    lb.http            framing, the socket reader, TLS
    lb.upstream        backends, balancer, health, outlier, breaker, retries, DNS
    lb.limiting        the limit stage, rules, key hashing, identity, the store's start-up checks
    lb.config          flags and TOML into one Config: above the rooms whose grammar it uses (a rule, a
                       key file, a retry condition, a certificate pair is parsed and checked by its
                       own room), below everything that reads the Config
    lb.ops             admin, metrics, access log, dashboard, fanout
    lb.http2           HTTP/2: the client connection driver, its streams' Downstream, the h2c:// calls
    lb.proxy           listener, pipeline, forward, tunnel, spool
    lb.process         app, serve, supervisor, signals, sdnotify
    edge               the entry point, on top

Inside a room, modules may import one another as long as no cycle forms.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lb", "limiter", "demo")

# Each room's height; a module may import a room whose height is <= its own (equal only for its own room).
LAYERS = [
    ["limiter"],
    ["lb.logs", "lb.netaddr", "lb.errors", "lb"],
    ["demo"],
    ["lb.http"],
    ["lb.upstream"],
    ["lb.limiting"],
    ["lb.config"],
    ["lb.ops"],
    ["lb.http2"],
    ["lb.proxy"],
    ["lb.process"],
    ["edge"],
]
HEIGHT = {room: h for h, rooms in enumerate(LAYERS) for room in rooms}


def module_files() -> dict[str, Path]:
    files = {"edge": ROOT / "edge.py"}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def resolve(name: str, modules: set[str]) -> str | None:
    """The project module an imported name lands in (`lb.ops.metrics.Metrics` -> `lb.ops.metrics`)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: set[str]) -> set[str]:
    """Every project module `module` imports, anywhere in its file (functions included)."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one.
            names = [f"{base}.{alias.name}" for alias in node.names] if base else []
        for name in names:
            target = resolve(name, modules)
            if target and target != module:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    files = module_files()
    modules = set(files)
    return {m: imports_of(m, p, modules) for m, p in files.items()}


def room_of(module: str) -> str:
    """The most specific room in LAYERS that holds `module`."""
    best = ""
    for room in HEIGHT:
        inside = module == room or (room != "lb" and module.startswith(room + "."))
        if inside and len(room) > len(best):
            best = room
    assert best, f"{module} is in no room of the layering: add it to LAYERS"
    return best


def cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each a cycle to break."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(deps[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_lazy_and_relative_imports(tmp_path):
    # The check is only as good as its reader: an import inside a function counts, and so does a relative one.
    pkg = tmp_path / "lb" / "ops"
    pkg.mkdir(parents=True)
    src = pkg / "m.py"
    src.write_text("import os\nfrom . import metrics\ndef f():\n    from lb.http.framing import Reader\n"
                   "    import limiter.shm\n")
    modules = {"lb.ops.m", "lb.ops.metrics", "lb.http.framing", "limiter.shm", "limiter"}
    assert imports_of("lb.ops.m", src, modules) == {"lb.ops.metrics", "lb.http.framing", "limiter.shm"}


def test_every_module_is_in_a_room():
    for module in graph():
        room_of(module)


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles (break each one):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_point_down_the_layering():
    wrong = []
    for module, targets in sorted(graph().items()):
        mine = room_of(module)
        for target in sorted(targets):
            theirs = room_of(target)
            if theirs == mine:
                continue
            if HEIGHT[theirs] >= HEIGHT[mine]:
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)
