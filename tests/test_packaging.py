"""setup.cfg declares what the code imports: the library's install pulls only what dge_jax/
and models/ import, the `eval` extra what experiments/ adds, and benchmarks/ is not installed.
Read statically (ast over the sources, configparser over setup.cfg)."""

from __future__ import annotations

import ast
import configparser
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
# import name -> distribution name, where they differ
DISTRIBUTION = {"orbax": "orbax-checkpoint", "absl": "absl-py", "yaml": "pyyaml"}


def _setup() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def _requirements(text: str) -> set[str]:
    names = set()
    for line in text.strip().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[<>=!\[ ;@]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def _third_party(*folders: str) -> set[str]:
    """Distribution names of every top-level import in the folders that is neither the
    standard library nor one of the project's own packages."""
    own = {"dge_jax", "models", "experiments", "benchmarks"}
    found = set()
    for folder in folders:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    tops = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    if top not in own and top not in sys.stdlib_module_names:
                        found.add(DISTRIBUTION.get(top, top).lower().replace("_", "-"))
    return found


def test_install_requires_is_what_the_library_imports():
    declared = _requirements(_setup()["options"]["install_requires"])
    assert declared == _third_party("dge_jax", "models")


def test_the_eval_extra_is_what_experiments_adds():
    cfg = _setup()
    library = _requirements(cfg["options"]["install_requires"])
    extra = _requirements(cfg["options.extras_require"]["eval"])
    # wonderwords is read as files (RULER's word lists, located without importing it)
    assert extra == (_third_party("experiments") - library) | {"wonderwords"}
    assert "dge-jax" in _requirements(cfg["options.extras_require"]["test"])  # test has eval


def test_benchmarks_is_not_installed():
    include = _setup()["options.packages.find"]["include"].split()
    assert include == ["dge_jax*", "models*", "experiments*"]
