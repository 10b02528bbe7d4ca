"""The project's own import graph, read statically (ast, nothing is imported).

Every .py under dge_jax/, models/, experiments/ and benchmarks/ is a module (a package's
`__init__.py` is the module named by the package). Its imports are every `import x` and
`from x import y` at any depth (function bodies included: a lazy import is still an edge), plus
`importlib.import_module("literal")` / `__import__("literal")` calls; imports under
`if TYPE_CHECKING:` are left out (never executed). `from pkg import name` imports `pkg.name`
when that is a project module, else `pkg`; `import a.b.c` imports the longest project module
prefix of `a.b.c`. Parent packages are not added as implicit edges.

Asserted:

- no import cycle among the project's modules (the failure names, for every import that is
  on a cycle, a shortest such cycle as a path a -> b -> ... -> a, with each edge's file:line
  and, for a lazy import, its function);
- no module in dge_jax/ imports anything from models/ (families are entry points: models/
  imports dge_jax, never the reverse);
- every module of dge_jax/ is in one of the package's layers (`LAYERS`, lowest first), and
  the layers import only downwards: for every pair of layers, no module of the lower one
  imports a module of the higher one (the failure names each such import's file:line). A name
  imported under `if TYPE_CHECKING:` for an annotation is no import (families.py names
  runtime's KVCache so).
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from collections import deque

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOTS = ("dge_jax", "models", "experiments", "benchmarks")


@dataclasses.dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported project module
    where: str  # "path:line"
    code: str  # the import's first line as written, and its function if lazy (for messages)


def project_modules(repo: pathlib.Path, roots=ROOTS) -> dict[str, pathlib.Path]:
    """Module name -> file for every .py under the given top-level packages."""
    modules = {}
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            if any(p.startswith(".") for p in parts):  # benchmarks/.peers/venv: not ours
                continue
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules) -> str | None:
    """The longest prefix of dotted `name` that is a project module, or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in modules:
            return prefix
    return None


def _relative_base(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module a `from .{level} name import ...` in `module` refers to."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, name] if name else base)


def _literal_import_call(node: ast.Call) -> str | None:
    """The literal x of importlib.import_module("x"), import_module("x") or __import__("x")."""
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__")
    )
    if not (named and node.args):
        return None
    arg = node.args[0]
    if (
        isinstance(arg, ast.Constant)
        and isinstance(arg.value, str)
        and not arg.value.startswith(".")
    ):
        return arg.value
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """(node, enclosing function name or None) for every node of `tree` except the bodies of
    `if TYPE_CHECKING:` (never executed)."""
    todo: list[tuple[ast.AST, str | None]] = [(tree, None)]
    while todo:
        node, scope = todo.pop()
        yield node, scope
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            scope = node.name
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = [node.test, *node.orelse]
        else:
            children = list(ast.iter_child_nodes(node))
        todo.extend((child, scope) for child in children)


def import_edges(modules: dict[str, pathlib.Path], repo: pathlib.Path = REPO) -> list[Edge]:
    """Every import of a project module by a project module (self-imports left out)."""
    edges = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        source = path.read_text(encoding="utf-8")
        where_file = path.relative_to(repo).as_posix()
        for node, scope in _runtime_nodes(ast.parse(source, filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [t for a in node.names if (t := _resolve(a.name, modules))]
            elif isinstance(node, ast.ImportFrom):
                base = (
                    _relative_base(module, is_package, node.level, node.module)
                    if node.level
                    else node.module
                )
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in modules else _resolve(base, modules)
                    if target:
                        targets.append(target)
            elif isinstance(node, ast.Call) and (name := _literal_import_call(node)):
                if target := _resolve(name, modules):
                    targets = [target]
            if not targets:
                continue
            code = (ast.get_source_segment(source, node) or "").splitlines()[0].strip()
            if scope:
                code += f"  [inside {scope}()]"
            for target in dict.fromkeys(targets):
                if target != module:
                    edges.append(Edge(module, target, f"{where_file}:{node.lineno}", code))
    return sorted(edges, key=lambda e: (e.src, e.dst, int(e.where.rsplit(":", 1)[1])))


def graph_of(edges: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return sorted(components)


def _shortest_path(graph, start: str, goal: str, within: set[str]) -> list[str]:
    """start -> ... -> goal, shortest (BFS, ties broken by name), through `within` only."""
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        cur = queue.popleft()
        if cur == goal:
            path = [cur]
            while (prev := parent[path[-1]]) is not None:
                path.append(prev)
            return path[::-1]
        for nxt in sorted(graph.get(cur, ())):
            if nxt in within and nxt not in parent:
                parent[nxt] = cur
                queue.append(nxt)
    raise AssertionError(f"no path {start} -> {goal} within {sorted(within)}")


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles as closed paths [a, b, ..., a], empty iff the graph is acyclic.

    For every edge u -> v inside a strongly connected component, the shortest cycle through
    that edge (u -> v, then v back to u), rotations removed: every import that takes part in
    a cycle appears in at least one reported path, so breaking them all leaves none.
    """
    cycles = []
    seen = set()
    for component in strongly_connected(graph):
        members = set(component)
        for u in component:
            for v in sorted(graph.get(u, ())):
                if v not in members:
                    continue
                ring = [u] if v == u else [u, *_shortest_path(graph, v, u, members)[:-1]]
                key = min(tuple(ring[i:] + ring[:i]) for i in range(len(ring)))
                if key not in seen:
                    seen.add(key)
                    cycles.append([*key, key[0]])
    return cycles


def describe_cycle(cycle: list[str], edges: list[Edge]) -> str:
    lines = ["  " + " -> ".join(cycle)]
    for src, dst in zip(cycle, cycle[1:], strict=False):
        e = next(e for e in edges if e.src == src and e.dst == dst)
        lines.append(f"      {src} -> {dst}: {e.where}  {e.code}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    modules = project_modules(REPO)
    assert {"dge_jax", "dge_jax.families", "models", "models.llama_like"} <= set(modules)
    return import_edges(modules)


def test_no_import_cycles(edges):
    cycles = find_cycles(graph_of(edges))
    if cycles:
        pytest.fail(
            "import cycle(s) among the project's modules:\n"
            + "\n".join(describe_cycle(c, edges) for c in cycles),
            pytrace=False,
        )


def test_dge_jax_never_imports_models(edges):
    bad = [e for e in edges if e.src.split(".")[0] == "dge_jax" and e.dst.split(".")[0] == "models"]
    if bad:
        pytest.fail(
            "dge_jax/ imports models/ (models/ imports dge_jax, never the reverse):\n"
            + "\n".join(f"  {e.where}: {e.src} -> {e.dst}  {e.code}" for e in bad),
            pytrace=False,
        )


# The layers of dge_jax/, lowest first: a module imports only modules of its own layer or of
# the layers below it. An entry is a module, or a package with every module under it; the
# entry "dge_jax" is the package's __init__.py alone (the public API, above what it exports).
LAYERS = (
    "dge_jax.config",  # ModelConfig / RopeConfig: static values
    "dge_jax.families",  # the protocol a model family implements, and the registry
    "dge_jax.text",  # prompts in (given a tokenizer and a config), samplers: host side
    "dge_jax.distribution",  # meshes, axis rules, constraints in jit, several processes
    "dge_jax.runtime",  # the cache (and its mesh layout) and the loops that run a forward
    "dge_jax.kernels",  # the attention kernels: platform's choice, constraints' shard_map specs
    "dge_jax.checkpoints",  # files in: laid out with distribution.sharding, families' key tables
    "dge_jax.rules",  # what entries are ranked by (KVzip's repeat prompt: the tokenizer)
    "dge_jax.eviction",  # when and how a cache is evicted: rules, budgets, timings
    "dge_jax.model",  # a loaded Model: the checkpoints' output
    "dge_jax.stages",  # the stages a cell goes through
    "dge_jax.generation",  # generate / generate_grid: the stages in order
    "dge_jax",  # __init__.py: load, generate, ...
    "dge_jax.cli",  # python -m dge_jax generate | convert
    "dge_jax.__main__",
)


def layer_of(module: str, layers: tuple[str, ...] = LAYERS) -> int | None:
    """The index in `layers` of the layer holding `module`, None if none holds it. An entry
    without a dot (the package itself) holds its __init__.py alone."""
    for i, entry in enumerate(layers):
        if module == entry or ("." in entry and module.startswith(entry + ".")):
            return i
    return None


def upward_imports(edges: list[Edge], layers: tuple[str, ...] = LAYERS) -> list[Edge]:
    """The imports from a module of one layer to a module of a higher layer."""
    bad = []
    for e in edges:
        src, dst = layer_of(e.src, layers), layer_of(e.dst, layers)
        if src is not None and dst is not None and dst > src:
            bad.append(e)
    return bad


def test_every_module_of_dge_jax_is_in_one_layer():
    modules = [m for m in project_modules(REPO) if m.split(".")[0] == "dge_jax"]
    missing = [entry for entry in LAYERS if entry not in modules]
    assert not missing, f"LAYERS names no module of dge_jax/: {missing}"
    unplaced = [m for m in modules if layer_of(m) is None]
    assert not unplaced, f"put these modules in a layer of LAYERS (test_imports.py): {unplaced}"


def test_layers_import_only_downwards(edges):
    bad = upward_imports(edges)
    if bad:
        pytest.fail(
            "a module of dge_jax/ imports one of a higher layer (LAYERS, lowest first: "
            + " < ".join(name.rpartition(".")[2] for name in LAYERS)
            + "); move what it needs down:\n"
            + "\n".join(
                f"  {e.where}: {e.src} [{LAYERS[layer_of(e.src)]}] -> {e.dst} "
                f"[{LAYERS[layer_of(e.dst)]}]  {e.code}"
                for e in bad
            ),
            pytrace=False,
        )


# ------------------------------------------------------------- the checker itself


def test_find_cycles_on_hand_made_graphs():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]
    # One SCC {a, b, c, d} holding two cycles, plus an acyclic tail e -> a and a 2-cycle x<->y.
    graph = {
        "a": {"b"},
        "b": {"c", "d"},
        "c": {"a"},
        "d": {"b"},
        "e": {"a"},
        "x": {"y"},
        "y": {"x"},
    }
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["b", "d", "b"], ["x", "y", "x"]]
    assert strongly_connected(graph) == [["a", "b", "c", "d"], ["e"], ["x", "y"]]
    # Every edge on a cycle is reported, not only each node's shortest cycle: a -> c -> d -> a
    # is no node's shortest cycle (a, c and d each have a 2-cycle) but d -> a is only on it.
    graph = {"a": {"b", "c"}, "b": {"a"}, "c": {"d"}, "d": {"a", "c"}}
    assert find_cycles(graph) == [["a", "b", "a"], ["a", "c", "d", "a"], ["c", "d", "c"]]


def test_upward_imports_on_hand_made_edges():
    layers = ("pkg.low", "pkg.mid", "pkg", "pkg.top")
    assert [layer_of(m, layers) for m in ("pkg.low", "pkg.low.x", "pkg", "pkg.topx", "x")] == [
        0, 0, 2, None, None]  # fmt: skip
    edges = [
        Edge("pkg.mid.a", "pkg.low", "a.py:1", ""),  # down
        Edge("pkg.low.x", "pkg.low.y", "x.py:2", ""),  # within a layer
        Edge("pkg", "pkg.mid", "__init__.py:3", ""),  # down
        Edge("pkg.top", "pkg", "top.py:4", ""),  # down
        Edge("other", "pkg.top", "other.py:5", ""),  # from outside the layers
        Edge("pkg.low.x", "pkg.top.b", "x.py:6", ""),  # up, over two layers
        Edge("pkg.mid", "pkg", "mid.py:7", ""),  # up, to the package's __init__
    ]
    assert [e.where for e in upward_imports(edges, layers)] == ["x.py:6", "mid.py:7"]


def test_import_edges_on_a_hand_made_tree(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg.core import thing\n",
        "pkg/core.py": "import os\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        "    import pkg.rel\nelse:\n    import pkg.sub\nthing = 1\n",
        "pkg/lazy.py": "def f():\n    from pkg import core, thing\n    import other.deep\n",
        "pkg/rel.py": "from . import core\nfrom .sub import leaf\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/leaf.py": "import importlib\n\nimportlib.import_module('other')\n",
        "other/__init__.py": "from other import deep\n",
        "other/deep.py": "import pkg.sub.leaf.missing_attr\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = project_modules(tmp_path, roots=("pkg", "other"))
    assert set(modules) == {"pkg", "pkg.core", "pkg.lazy", "pkg.rel", "pkg.sub", "pkg.sub.leaf",
                            "other", "other.deep"}  # fmt: skip
    found = {(e.src, e.dst) for e in import_edges(modules, tmp_path)}
    assert found == {
        ("pkg", "pkg.core"),
        ("pkg.core", "pkg.sub"),  # the else branch of `if TYPE_CHECKING` runs; its body does not
        ("pkg.lazy", "pkg.core"),  # from pkg import core: a module
        ("pkg.lazy", "pkg"),  # from pkg import thing: an attribute of the package
        ("pkg.lazy", "other.deep"),
        ("pkg.rel", "pkg.core"),
        ("pkg.rel", "pkg.sub.leaf"),
        ("pkg.sub.leaf", "other"),
        ("other.deep", "pkg.sub.leaf"),
        ("other", "other.deep"),
    }
    cycles = find_cycles(graph_of(import_edges(modules, tmp_path)))
    assert cycles == [["other", "other.deep", "pkg.sub.leaf", "other"]]
