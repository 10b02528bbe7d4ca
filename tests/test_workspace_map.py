"""The contributors' map cannot go stale.

- docs/modules.md, the list of every module with the first sentence of its docstring, is what
  `docs/make_module_map.py` generates from the tree as it is (so a new, moved or re-described
  module shows there, or this fails), and every module has a docstring to describe it.
- Every path WORKSPACE.md names exists, and WORKSPACE.md stays a map (at most 350 lines).
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w./<-])((?:[\w-]+/)*[\w-]+\.(?:py|md|ipynb))\b")
MAX_WORKSPACE_LINES = 350


def module_map():
    spec = importlib.util.spec_from_file_location("make_module_map",
                                                  ROOT / "docs" / "make_module_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_module_map_is_generated_from_the_tree():
    mm = module_map()
    assert (ROOT / "docs" / "modules.md").read_text(encoding="utf-8") == mm.render(), (
        "docs/modules.md is stale: run python docs/make_module_map.py")


def test_every_module_has_a_docstring_the_map_shows():
    mm = module_map()
    bare = [str(p) for p in mm.modules() if not mm.summary(ROOT / p)]
    assert not bare, "modules without a docstring:\n  " + "\n  ".join(bare)


def test_the_map_follows_a_new_module(tmp_path):
    """The check can fail: a module added to a package shows in the rendered map (and one
    without a docstring is named as such)."""
    mm = module_map()
    (tmp_path / "dge_jax" / "new").mkdir(parents=True)
    (tmp_path / "dge_jax" / "new" / "thing.py").write_text('"""Does a thing. More."""\n')
    (tmp_path / "dge_jax" / "bare.py").write_text("x = 1\n")
    text = mm.render(tmp_path)
    assert "## dge_jax/new/\n\n- `thing.py`: Does a thing." in text
    assert "- `bare.py`: (no docstring)" in text


def _resolve(name: str) -> bool:
    """A path WORKSPACE names: from the repository root, or inside one of its packages."""
    roots = [ROOT, *(ROOT / p for p in ("dge_jax", "experiments", "benchmarks", "models"))]
    if any((r / name).exists() for r in roots):
        return True
    return any(p.as_posix().endswith("/" + name) for p in ROOT.rglob(pathlib.Path(name).name))


def test_every_path_workspace_names_exists():
    """Every path exists, but the files a recipe block creates (its first line names them)."""
    text = (ROOT / "WORKSPACE.md").read_text(encoding="utf-8")
    firsts = re.findall(r"^```python\n(#[^\n]*)", text, re.M)
    recipes = {name for line in firsts for name in PATH.findall(line)}
    missing = sorted({name for name in PATH.findall(text)
                      if name not in recipes and not _resolve(name)})
    assert not missing, "WORKSPACE.md names paths that do not exist:\n  " + "\n  ".join(missing)


def test_workspace_stays_a_map():
    lines = len((ROOT / "WORKSPACE.md").read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_WORKSPACE_LINES, f"WORKSPACE.md has {lines} lines"
