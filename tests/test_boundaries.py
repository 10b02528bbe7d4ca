"""Narrow boundaries (issue #46): every function of dge_jax/ that is jitted or that a model
family calls takes at most `MAX_PARAMS` parameters, read statically (ast, nothing imported).

Jitted: decorated with ``jax.jit`` / ``jit`` / ``functools.partial(jax.jit, ...)``, or
wrapped by ``jax.jit(f, ...)`` in its module. Family-facing: a function of dge_jax/ that a
module of models/ imports by name. Parameters: positional, keyword-only and ``*args`` /
``**kwargs`` alike (a static setting is still a parameter: settings fixed at trace time
travel as one frozen spec, tensors of one layer or step as one pytree, as
`kernels.attention.AttentionSpec` / `LayerCache`, `eviction.evict.SelectionSpec` /
`SelectionInputs` and `runtime.decoding.PrefillSpec` / `StepSpec` do).

The test names every function over the bound; a hand-made module shows the scan can fail.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
MAX_PARAMS = 6


def _is_jit(node: ast.AST) -> bool:
    """jax.jit, jit, or functools.partial / partial of either (with its options)."""
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "partial":
            return bool(node.args) and _is_jit(node.args[0])
        return _is_jit(func)
    if isinstance(node, ast.Attribute):
        return node.attr == "jit"
    return isinstance(node, ast.Name) and node.id == "jit"


def count_params(fn: ast.FunctionDef) -> int:
    a = fn.args
    return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)


def jitted(source: str) -> dict[str, int]:
    """Name -> parameters of each module-level function of `source` that is jitted."""
    tree = ast.parse(source)
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    names = {name for name, fn in defs.items() if any(map(_is_jit, fn.decorator_list))}
    for node in ast.walk(tree):  # jax.jit(f, ...) anywhere in the module
        if isinstance(node, ast.Call) and _is_jit(node.func) and node.args:
            if isinstance(node.args[0], ast.Name) and node.args[0].id in defs:
                names.add(node.args[0].id)
    return {name: count_params(defs[name]) for name in names}


def _module_file(module: str) -> pathlib.Path | None:
    path = REPO / module.replace(".", "/")
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def boundary() -> dict[str, int]:
    """Every jitted or family-facing function of dge_jax/ -> its parameter count."""
    found = {}
    for path in sorted((REPO / "dge_jax").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for name, n in jitted(path.read_text()).items():
            found[f"{module}.{name}"] = n
    for path in sorted((REPO / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dge_jax")):
                continue
            src = _module_file(node.module)
            if src is None:
                continue
            defs = {n.name: n for n in ast.parse(src.read_text()).body
                    if isinstance(n, ast.FunctionDef)}  # fmt: skip
            for alias in node.names:
                if alias.name in defs:
                    found[f"{node.module}.{alias.name}"] = count_params(defs[alias.name])
    return found


def offenders(found: dict[str, int]) -> dict[str, int]:
    return {name: n for name, n in found.items() if n > MAX_PARAMS}


def test_the_scan_finds_the_boundary():
    """The scan sees the entry points it is about (a scan that finds nothing passes anything)."""
    found = boundary()
    for name in ("dge_jax.kernels.layer_attention.cache_layer_attention",
                 "dge_jax.runtime.decoding.prefill_prompt",
                 "dge_jax.eviction.evict.select_for_budgets",
                 "dge_jax.rules.kvzip.chunk_scores"):  # fmt: skip
        assert name in found, name


def test_every_jitted_or_family_facing_function_takes_at_most_six_parameters():
    over = offenders(boundary())
    assert not over, (
        f"over {MAX_PARAMS} parameters (pass static settings as one frozen spec and a layer's "
        f"or step's tensors as one pytree): {over}"
    )


def test_the_scan_can_fail():
    """A hand-made module: decorated, partial-decorated and wrapped jitted functions over the
    bound are named; narrow ones and plain helpers are not."""
    source = '''
import functools
import jax
from jax import jit

@jax.jit
def wide(a, b, c, d, e, f, g):
    pass

@functools.partial(jax.jit, static_argnames=("s",))
def wide_kw(a, b, *, c, d, e, f, s):
    pass

@jit
def narrow(a, b, c, d, e, f):
    pass

def wrapped(a, b, c, d, e, f, *rest, **more):
    pass

def helper(a, b, c, d, e, f, g, h):
    pass

fast = jax.jit(wrapped, static_argnames=("f",))
'''
    found = jitted(source)
    assert found == {"wide": 7, "wide_kw": 7, "narrow": 6, "wrapped": 8}
    assert offenders(found) == {"wide": 7, "wide_kw": 7, "wrapped": 8}
