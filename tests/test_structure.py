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
