"""Shape rules of the library's code: short functions, one cache form, no tracker numbers."""

from __future__ import annotations

import ast
import pathlib
import re

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


# "issue 44", "issues #3", "#45" (not "&#1;", a URL's "/#2" or a hex colour's "#1f77b4")
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w&/#])#\d+(?![\w-])")
CODE_FOLDERS = ("dge_jax", "models", "experiments", "benchmarks")


def test_no_code_cites_an_issue_number():
    """Comments and docstrings say what they mean: an issue number says nothing to a reader
    without the tracker (RESULTS.md and the docs may cite issues; code may not)."""
    repo = LIBRARY.parent
    found = [
        f"{path.relative_to(repo)}:{n}: {line.strip()[:80]}"
        for folder in CODE_FOLDERS
        for path in sorted((repo / folder).rglob("*"))
        if path.suffix in (".py", ".sh") and not any(p.startswith(".") for p in path.parts)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if ISSUE_NUMBER.search(line)
    ]
    assert not found, "say what the issue meant instead:\n  " + "\n  ".join(found)


def test_the_issue_number_pattern():
    hits = ("(issue #45)", "issue 44's changes", "issues 3 and 9", "#30's changes", "see #7.")
    misses = ("color='#1f77b4'", "&#10;", "https://x.org/a/#2", "top-k #k", "# 3 rows")
    assert all(ISSUE_NUMBER.search(s) for s in hits)
    assert not any(ISSUE_NUMBER.search(s) for s in misses)
