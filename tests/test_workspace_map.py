"""WORKSPACE.md's map matches the tree: every path it names exists, and every module of the
library, the families, the runner and the benchmarks is named in it.

The map is the ```text block under "## Layout". A line indented less than the description
column is an entry (a folder `name/` or a file), nested by indentation; everything after the
name, continuation lines included, is its description. A `*.py` name in a description refers
to a file inside the entry's folder (a file entry: its parent folder) at any depth, or else in
the nearest folder above it that has one.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESCRIPTION_COLUMN = 20
NAMED = ("dge_jax", "models", "experiments", "benchmarks")  # every module must be in the map
PY_NAME = re.compile(r"(?<![\w./<])([\w/]+\.py)\b")


def layout() -> str:
    text = (ROOT / "WORKSPACE.md").read_text()
    section = text.split("## Layout", 1)[1]
    return section.split("```text\n", 1)[1].split("```", 1)[0]


def entries() -> list[tuple[pathlib.Path, str]]:
    """(path relative to the repository, its description) for every entry of the map."""
    out: list[tuple[pathlib.Path, str]] = []
    stack: list[tuple[int, pathlib.Path]] = []
    for line in layout().splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent >= DESCRIPTION_COLUMN:  # continuation of the last entry's description
            path, text = out[-1]
            out[-1] = (path, text + " " + line.strip())
            continue
        name, _, text = line.strip().partition(" ")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else pathlib.Path()
        path = parent / name.rstrip("/")
        if name.endswith("/"):
            stack.append((indent, path))
        out.append((path, text.strip()))
    return out


def mentioned(path: pathlib.Path, text: str) -> list[pathlib.Path]:
    """The files a description names, each resolved inside the entry's folder, else in the
    nearest folder above it that has one (a suite's description may name `rows.py` beside
    the suites' folder)."""
    folder = path if (ROOT / path).is_dir() else path.parent
    found = []
    for name in PY_NAME.findall(text):
        place = folder / name
        for above in [folder, *folder.parents][:-1]:  # never the repository root itself
            hits = sorted((ROOT / above).rglob(name)) if "/" not in name else [ROOT / above / name]
            hits = [h for h in hits if h.exists()]
            if hits:
                place = hits[0].relative_to(ROOT)
                break
        found.append(place)
    return found


def test_every_path_the_map_names_exists():
    missing = [str(p) for p, _ in entries() if not (ROOT / p).exists()]
    missing += [
        f"{m} (named in {p}'s description)"
        for p, text in entries()
        for m in mentioned(p, text)
        if not (ROOT / m).exists()
    ]
    assert not missing, "WORKSPACE.md names paths that do not exist:\n  " + "\n  ".join(missing)


def test_every_module_is_named():
    named = {p for p, _ in entries()}
    named |= {m for p, text in entries() for m in mentioned(p, text)}
    unnamed = [
        str(path.relative_to(ROOT))
        for top in NAMED
        for path in sorted((ROOT / top).rglob("*.py"))
        if path.name != "__init__.py"
        and not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
        and path.relative_to(ROOT) not in named
    ]
    assert not unnamed, "modules WORKSPACE.md's map does not name:\n  " + "\n  ".join(unnamed)
