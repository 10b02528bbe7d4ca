"""A folder named like the family package (`./models/` of checkpoints) must not hide the
built-in model families: `dge_jax.families` imports the installed package past it.

The shadow needs an editable install (its finder is asked after Python's path finder, which
takes a folder without `__init__.py` as a namespace package), so the in-process test installs
a finder of that kind for the repository's `models/` and puts the shadow first on the path.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from dge_jax import families
from dge_jax.config import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[1]


class _EditableFinder(importlib.abc.MetaPathFinder):
    """What setuptools' editable finder does: `models` -> the repository's package."""

    def find_spec(self, name, path=None, target=None):
        if name != "models":
            return None
        return importlib.util.spec_from_file_location(
            name, REPO / "models" / "__init__.py",
            submodule_search_locations=[str(REPO / "models")])


@pytest.fixture
def shadowed(tmp_path, monkeypatch):
    """The working directory holds `models/` (checkpoints, no __init__.py) and is first on
    the path; the repository reaches `models` only through an editable finder; the families
    are discovered anew. Yields a runner of `families._discover`."""
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    saved = {m: sys.modules.pop(m) for m in list(sys.modules)
             if m == "models" or m.startswith("models.")}
    repo = {str(REPO), ""}
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path if p not in repo])
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, _EditableFinder()])
    monkeypatch.setattr(families, "_DISCOVERED", False)
    monkeypatch.setattr(families, "_FAMILIES", {})
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for m in [m for m in sys.modules if m == "models" or m.startswith("models.")]:
        del sys.modules[m]
    sys.modules.update(saved)


def test_a_models_folder_in_the_working_directory_does_not_hide_the_families(shadowed):
    import importlib

    assert importlib.util.find_spec("models").origin is None  # the shadow: a namespace
    assert families.get_family("llama").model_type == "llama"
    assert pathlib.Path(sys.modules["models"].__file__) == REPO / "models" / "__init__.py"
    assert str(shadowed) in sys.path  # the path is as it was


def test_no_installed_package_behind_the_folder_is_one_clear_error(shadowed, monkeypatch):
    editable = (_EditableFinder, "__editable__")  # ours, and an editable install's
    monkeypatch.setattr(sys, "meta_path", [
        f for f in sys.meta_path if not isinstance(f, editable[0])
        and not getattr(f, "__module__", "").startswith(editable[1])])
    with pytest.raises(ConfigError, match=r"package 'models' .* is not installed; only the "
                                          r"folder\(s\) .* carry that name: install dge_jax"):
        families.get_family("llama")
    assert "models" not in sys.modules


def test_cli_generates_from_a_folder_that_holds_models(tmp_path):
    """`python -m dge_jax generate --model models/tiny` run where `./models/` holds the
    checkpoint, with dge_jax as installed (the README installs it editable)."""
    from tiny_model import build_tiny_llama

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = subprocess.run([sys.executable, "-c", "import dge_jax, models; print(models.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip("dge_jax is not installed (pip install -e .): the CLI cannot start here")
    build_tiny_llama(tmp_path / "models" / "tiny")
    out = subprocess.run(
        [sys.executable, "-m", "dge_jax", "generate", "--model", "models/tiny", "--prompt",
         "The pass key is", "--max_new_tokens", "2", "--json"],
        cwd=tmp_path, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"tokens"' in out.stdout or '"text"' in out.stdout, out.stdout
