"""Shape rules of the library's code: short functions, one cache form."""

from __future__ import annotations

import ast
import pathlib

LIBRARY = pathlib.Path(__file__).resolve().parents[1] / "dge_jax"
MAX_LINES = 80


def _functions(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_function_in_the_library_is_longer_than_80_lines():
    long = [
        f"{path.name}:{line} {name} ({n} lines)"
        for path in sorted(LIBRARY.rglob("*.py"))
        for name, line, n in _functions(path)
        if n > MAX_LINES
    ]
    assert not long, "split these into stages a reader can find:\n  " + "\n  ".join(long)


def test_nothing_in_the_library_asks_which_form_a_cache_is_in():
    """The cache has one form (a tuple of layer groups): no code tests whether its arrays are
    tuples of per-layer arrays, as the per-layer form that it replaced made code do."""
    for path in sorted(LIBRARY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                target = ast.unparse(node.args[0])
                of_cache = "cache" in target and target.endswith((".k", ".v", ".pos", ".index"))
                assert not of_cache, (
                    f"{path.name}:{node.lineno}: isinstance({target}, ...)"
                )


MAX_MODULE_LINES = 500
MAX_TOP_LEVEL_MODULES = 8


def test_no_module_in_the_library_is_longer_than_500_lines():
    long = [
        f"{path.relative_to(LIBRARY.parent)} ({n} lines)"
        for path in sorted(LIBRARY.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "split these by what they hold:\n  " + "\n  ".join(long)


def test_the_library_shows_its_layers():
    """Few modules at the top (the public API, the CLI, configs, families, the stages); the
    rest live in folders named after their layer."""
    top = sorted(p.name for p in LIBRARY.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    layers = {p.name for p in LIBRARY.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders = {"checkpoints", "text", "distribution", "runtime", "kernels", "eviction", "rules"}
    assert folders <= layers, layers


MAX_FOLDER_SHARE = 0.30


def test_no_folder_holds_more_than_30_percent_of_the_library():
    """A folder that grows past 30 % of the library's lines is a room with too many things in
    it: cut it along its seams (runtime/ was 39 % before kernels/, distribution/ and text/)."""
    lines = {p: len(p.read_text().splitlines()) for p in LIBRARY.rglob("*.py")}
    total = sum(lines.values())
    for folder in (p for p in LIBRARY.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        share = sum(n for p, n in lines.items() if folder in p.parents) / total
        assert share <= MAX_FOLDER_SHARE, f"{folder.name}/ holds {share:.0%} of the library"
