"""The import graph of the repository's rooms, read from the source (AST), not from a running process.

Every import counts: module level, inside functions, and ``importlib.import_module("...")`` /
``__import__("...")`` with a literal name. Both ``strata.<room>.x`` and a bare ``<room>.x`` map to
the room, so the same reader measures the tree before and after the namespace change.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

# Lowest first: a room may import only rooms at or below its own rank.
ROOMS = ("kernels", "kvstore", "pipeline", "stages", "deployments", "strata")
RANK = {room: i for i, room in enumerate(ROOMS)}
HTTP_ONLY = "loadtest"  # talks to the server over HTTP only: imports nothing of ours
FOLDERS = (*ROOMS, HTTP_ONLY)
# The rooms inside pipeline/, lowest first: core -> frontend -> models -> parallel -> contract.
PIPELINE_ROOMS = ("contract", "parallel", "models", "frontend", "core")
PIPELINE_RANK = {room: i for i, room in enumerate(PIPELINE_ROOMS)}
# The rooms inside deployments/, lowest first: the Ray-free OpenAI surface, then Ray Serve's plumbing.
DEPLOYMENT_ROOMS = ("openai", "ray_serve")


@dataclass
class Import:
    source: str  # module that imports, e.g. "strata.pipeline.core.engine"
    target: str  # module imported, e.g. "strata.kvstore.block_pool"
    line: int
    how: str  # "import", "from", "importlib"


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)
    lines: dict[str, int] = field(default_factory=dict)  # lines of code per room folder


def module_name(repo: Path, path: Path) -> str:
    """``pipeline/models/mlp.py`` -> ``strata.pipeline.models.mlp``; ``strata/cli.py`` -> ``strata.cli``."""
    parts = list(path.relative_to(repo).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts if parts[0] == "strata" else ["strata", *parts])


def canonical(name: str) -> str | None:
    """Map an imported name onto our modules (``kernels.x`` or ``strata.kernels.x``); None if foreign."""
    head = name.split(".")[0]
    if head == "strata":
        return name
    if head in FOLDERS and head != "strata":
        return "strata." + name
    return None


def _resolve(name: str | None, how: str, modules: dict[str, Path]) -> str | None:
    """The module an import of ours lands in. ``from pkg import attr`` adds an edge to ``pkg.attr``
    only when that is a module; any other name of ours is kept even if no file has it, so an
    upward import of a moved or misspelled module is still seen."""
    if name is None or (how == "submodule" and name not in modules):
        return None
    return name


def room_of(module: str) -> str:
    """The room a canonical module name lives in (the entry room for ``strata`` and ``strata.cli``...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS and parts[1] != "strata" else "strata"


def _literal_import_call(node: ast.Call) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
        value = node.args[0].value
        return value if isinstance(value, str) else None
    return None


def read_graph(repo: Path) -> Graph:
    graph = Graph()
    for folder in FOLDERS:
        root = repo / folder
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.py")):
            graph.modules[module_name(repo, path)] = path
            text = path.read_text()
            graph.lines[folder] = graph.lines.get(folder, 0) + len(text.splitlines())
    for module, path in graph.modules.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[tuple[str, str]] = []
            if isinstance(node, ast.Import):
                targets = [(alias.name, "import") for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import name`: the package, and the submodule when `name` is one
                targets = [(base, "from")] + [(f"{base}.{alias.name}", "submodule") for alias in node.names]
            elif isinstance(node, ast.Call):
                name = _literal_import_call(node)
                targets = [(name, "importlib")] if name else []
            for name, how in targets:
                target = _resolve(canonical(name), how, graph.modules)
                if target is not None:
                    graph.imports.append(Import(module, target, getattr(node, "lineno", 0), how))
    return graph


def upward_imports(graph: Graph) -> list[Import]:
    """Imports from a room into a room above it, and any import of ours from the HTTP-only room."""
    bad = []
    for imp in graph.imports:
        src, dst = room_of(imp.source), room_of(imp.target)
        if src == HTTP_ONLY:
            bad.append(imp)
        elif dst == HTTP_ONLY:
            if src != "strata":  # only the entry room wires the load generator into the CLI
                bad.append(imp)
        elif RANK[dst] > RANK[src]:
            bad.append(imp)
    return bad


def inner_room_of(module: str, room: str) -> str | None:
    """``strata.pipeline.core.engine`` -> ``core`` for room ``pipeline``; None outside the room (or for
    the room's package itself)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == room else None


def inner_upward_imports(graph: Graph, room: str, inner_rooms: tuple[str, ...]) -> list[Import]:
    """Imports inside ``room`` from one of its ``inner_rooms`` (lowest first) into one above it, or into
    a module outside them."""
    rank = {r: i for i, r in enumerate(inner_rooms)}
    bad = []
    for imp in graph.imports:
        src, dst = inner_room_of(imp.source, room), inner_room_of(imp.target, room)
        if src is None or room_of(imp.target) != room:
            continue
        if dst not in rank or src not in rank or rank[dst] > rank[src]:
            bad.append(imp)
    return bad


def pipeline_upward_imports(graph: Graph) -> list[Import]:
    """Imports inside pipeline/ from a room into a room above it, or into a module outside the rooms."""
    return inner_upward_imports(graph, "pipeline", PIPELINE_ROOMS)


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan). A package ``__init__`` that
    re-exports its own submodules is not a cycle unless a submodule imports the package back."""
    edges: dict[str, set[str]] = {m: set() for m in graph.modules}
    for imp in graph.imports:
        if imp.target in edges and imp.target != imp.source:
            edges[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


if __name__ == "__main__":  # a report for humans: `python tests/import_graph.py [REPO]`
    import sys

    repo = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    g = read_graph(repo)
    up = upward_imports(g) + pipeline_upward_imports(g) + inner_upward_imports(g, "deployments", DEPLOYMENT_ROOMS)
    cyc = cycles(g)
    print(f"modules: {len(g.modules)}  imports of ours: {len(g.imports)}")
    print("lines per room: " + ", ".join(f"{k} {v}" for k, v in sorted(g.lines.items())))
    print(f"upward imports: {len(up)}")
    for imp in up:
        print(f"  {imp.source}:{imp.line} -> {imp.target} ({imp.how})")
    print(f"cycles: {len(cyc)}")
    for c in cyc:
        print("  " + " <-> ".join(c))
