"""The layers point one way: the import graph of ``hetroute/``, ``predictors/`` and ``profiling/``.

The graph is read from the source with :mod:`ast`, nothing is imported. A node is a module (a package
is its ``__init__.py``); there is an arrow A -> B for every ``import B`` or ``from B import x`` in A that
names a module of the three packages (``from P import m`` names the submodule ``P.m`` when there is
one), wherever the statement stands: at the top, inside a function (a deferred import still ties A to
B) and under ``if TYPE_CHECKING:``. Type-only imports count: a type-only cycle still ties the two
modules together (each must be read to understand the other), and it becomes a real one the day a name
is needed at run time. Imports made by ``importlib`` (the CLI finds ``hetroute.commands.<name>`` so) are
not seen.

The rules:

1. No cycle between modules.
2. No cycle between layers. A layer is a subpackage of ``hetroute`` (``hetroute.sim``), a top-level
   module of it (``hetroute.config``), ``predictors`` or ``profiling``.
3. The simulated world (``hetroute.sim``, ``hetroute.tuner``) and the router (``hetroute.policies``,
   ``hetroute.routing``, ``hetroute.proxy``) do not import each other, in either direction. What both
   need to know about GPUs and models is the catalog (``hetroute.catalog``), which imports neither.
   ``hetroute.simulation``, the layer above both, is where the simulator drives the real router.
4. Stronger, one way: ``hetroute.sim`` and ``hetroute.tuner`` do not even load the router through
   other modules (what importing a module loads: its imports, each one's packages, and so on). The
   other way this does not hold, on purpose: the policies' default latency model is the roofline
   prior (``hetroute.prior``), fitted to the engine model (``hetroute.sim.engine_model``), so the
   router stands above the engine model; rule 2 keeps that arrow from ever turning back.
5. The catalog loads nothing of ``hetroute`` but ``hetroute.errors`` and the validation layer
   ``hetroute.fields``.
6. ``hetroute.config`` loads no policy: it validates ``policy.type`` against ``hetroute.policy_names``.
7. The validation layer ``hetroute.fields`` loads nothing of ``hetroute`` but ``hetroute.errors``, so
   every layer, the catalog included, may read its input through it.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hetroute", "predictors", "profiling")
SIMULATED = ("hetroute.sim", "hetroute.tuner")
ROUTER = ("hetroute.policies", "hetroute.routing", "hetroute.proxy")
CATALOG = "hetroute.catalog"
FIELDS = "hetroute.fields"

Graph = Mapping[str, frozenset[str]]


def _module_files() -> dict[str, Path]:
    files: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _known(name: str, modules: Iterable[str]) -> str | None:
    """The longest module of the graph that ``name`` is or lies in (``a.b.c`` -> ``a.b``), if any."""
    known = set(modules)
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _imports_of(module: str, path: Path, modules: Iterable[str]) -> frozenset[str]:
    """Every module of the graph that ``module`` imports, in any statement of the file."""
    names = set(modules)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            hit = _known(target, names)
            if hit is not None and hit != module:
                found.add(hit)
    return frozenset(found)


@functools.cache
def import_graph() -> Graph:
    files = _module_files()
    return {module: _imports_of(module, path, files) for module, path in files.items()}


def _within(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _layer(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "hetroute" and len(parts) > 1 else parts[0]


def _cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(graph: Graph, members: list[str]) -> str:
    inside = set(members)
    arrows = [f"{a} -> {b}" for a in members for b in sorted(graph.get(a, ())) if b in inside]
    return "; ".join(arrows)


def _ancestors(module: str, graph: Graph) -> list[str]:
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in graph]


def loads(graph: Graph, start: str) -> dict[str, str]:
    """What importing ``start`` loads: each module, with the module whose import brought it in.

    Importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` too, so packages count."""
    came_from: dict[str, str] = {}
    todo = [start]
    for package in _ancestors(start, graph):
        came_from[package] = start
        todo.append(package)
    while todo:
        module = todo.pop()
        for target in sorted(graph.get(module, ())):
            for hit in (*_ancestors(target, graph), target):
                if hit != start and hit not in came_from:
                    came_from[hit] = module
                    todo.append(hit)
    return came_from


def _chain(came_from: Mapping[str, str], start: str, end: str) -> str:
    path = [end]
    while path[-1] != start:
        path.append(came_from[path[-1]])
    return " -> ".join(reversed(path))


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "hetroute.config" in graph["hetroute.app"]  # top of the file
    assert "hetroute.prior" in graph["hetroute.policies.backend_model"]  # inside a function
    assert "hetroute.policies.backend_model" in graph["hetroute.policies.base"]  # under TYPE_CHECKING
    assert "hetroute.policies.balanced_minmax" in graph["hetroute.policies"]  # from a package import a module
    assert "predictors" in graph["hetroute.simulation.simulator"]  # a plain ``import predictors``
    assert {"profiling.discover", "predictors.online"} <= set(graph)


def test_no_module_imports_itself_back() -> None:
    graph = import_graph()
    cycles = [_describe(graph, members) for members in _cycles(graph)]
    assert not cycles, "import cycles: " + " | ".join(cycles)


def test_layers_point_one_way() -> None:
    graph = import_graph()
    layers: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = layers.setdefault(_layer(module), set())
        mine.update(_layer(t) for t in targets if _layer(t) != _layer(module))
    layer_graph = {layer: frozenset(targets) for layer, targets in layers.items()}
    cycles = []
    for members in _cycles(layer_graph):
        arrows = [
            f"{a} -> {b}"
            for a, targets in sorted(graph.items())
            for b in sorted(targets)
            if _layer(a) in members and _layer(b) in members and _layer(a) != _layer(b)
        ]
        cycles.append(f"{members}: " + "; ".join(arrows))
    assert not cycles, "layer cycles: " + " | ".join(cycles)


def test_the_simulated_world_and_the_router_do_not_import_each_other() -> None:
    graph = import_graph()
    crossing = [
        f"{a} -> {b}"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if (_within(a, SIMULATED) and _within(b, ROUTER)) or (_within(a, ROUTER) and _within(b, SIMULATED))
    ]
    assert not crossing, "imports across sim/tuner and policies/routing/proxy: " + "; ".join(crossing)


def test_sim_and_tuner_do_not_load_the_router_at_all() -> None:
    graph = import_graph()
    chains = []
    for module in sorted(m for m in graph if _within(m, SIMULATED)):
        came_from = loads(graph, module)
        chains += [_chain(came_from, module, hit) for hit in sorted(came_from) if _within(hit, ROUTER)]
    assert not chains, "sim/tuner load the router: " + " | ".join(chains)


def test_the_catalog_imports_neither_side() -> None:
    graph = import_graph()
    catalog = sorted(m for m in graph if _within(m, (CATALOG,)))
    assert {"hetroute.catalog.specs", "hetroute.catalog.roofline"} <= set(catalog)
    allowed = ("hetroute", "hetroute.errors", FIELDS, CATALOG)
    chains = []
    for module in catalog:
        came_from = loads(graph, module)
        chains += [
            _chain(came_from, module, hit)
            for hit in sorted(came_from)
            if not (hit in allowed or _within(hit, (CATALOG,)))
        ]
    assert not chains, "the catalog loads: " + " | ".join(chains)


def test_the_config_loads_no_policy() -> None:
    graph = import_graph()
    came_from = loads(graph, "hetroute.config")
    chains = [
        _chain(came_from, "hetroute.config", hit) for hit in sorted(came_from) if _within(hit, ROUTER[:1])
    ]
    assert not chains, "hetroute.config loads policies: " + " | ".join(chains)


def test_the_validation_layer_sits_at_the_bottom() -> None:
    graph = import_graph()
    came_from = loads(graph, FIELDS)
    chains = [
        _chain(came_from, FIELDS, hit)
        for hit in sorted(came_from)
        if hit not in ("hetroute", "hetroute.errors")
    ]
    assert not chains, "hetroute.fields loads: " + " | ".join(chains)
