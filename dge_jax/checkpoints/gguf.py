"""GGUF file -> Hugging Face checkpoint folder (config, safetensors, tokenizer).

llama.cpp ships models as one GGUF file: quantized tensors under its own names, some tensors
rewritten for its kernels (Llama's q/k rows permuted, Gemma's norms stored as 1 + w), and the
tokenizer as metadata. `convert_gguf_to_hf` undoes all of that with numpy and `gguf`'s own
dequantization kernels, so the rest of dge_jax reads one format: a Hugging Face folder.

What differs per architecture (`llama`, `gemma3`) is in `gguf_architectures`; the tokenizer
is rebuilt by `gguf_tokenizer`. Every tensor's shape is checked against the config, and a
name, metadata key or type this package does not know is an error, never a warning.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes  # numpy bfloat16; a jax dependency
import numpy as np
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import save_file

from dge_jax.checkpoints.gguf_architectures import (
    LLAMA,
    GGUFArchitecture,
    architecture,
    unpermute_qk,
)
from dge_jax.checkpoints.gguf_tokenizer import build_tokenizer, generation_config, tokenizer_config
from dge_jax.checkpoints.temp_folders import temp_name

__all__ = ["convert_gguf_to_hf", "dequantize", "hf_name", "unpermute_qk", "CONVERTER_VERSION"]

# Bump when the files convert_gguf_to_hf writes change, so cached conversions are redone.
# 2: tokenizer.json's BOS template also covers a pair of sequences, as transformers writes it.
CONVERTER_VERSION = 2

# Types whose gguf.quants numpy kernel is exercised by tests/test_gguf.py.
SUPPORTED_TYPES: frozenset[QType] = frozenset(
    {
        QType.F32,
        QType.F16,
        QType.BF16,
        QType.Q4_0,
        QType.Q4_1,
        QType.Q5_0,
        QType.Q5_1,
        QType.Q8_0,
        QType.Q4_K,
        QType.Q5_K,
        QType.Q6_K,
    }
)

OUTPUT_DTYPES = ("float32", "float16", "bfloat16")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor name; raises ValueError for unknown names."""
    return LLAMA.hf_name(gguf_name)


def dequantize(data: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """Float32 array of numpy `shape` from a GGUF tensor's raw data (as GGUFReader holds it).

    Uses gguf.quants' numpy kernels, limited to the types our tests check."""
    qtype = QType(qtype)
    if qtype not in SUPPORTED_TYPES:
        supported = sorted(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"GGUF tensor type {qtype.name} is not supported; supported: {supported}")
    values = np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)
    return values.reshape(shape)


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value metadata of an open GGUF file as Python values (str, int, float, lists).

    The GGUF.* header fields are left out; they describe the container, not the model."""
    return {
        key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")
    }


def _numpy_shape(tensor: Any) -> tuple[int, ...]:
    """GGUF stores dimensions fastest-first (ne0, ne1); numpy's order is the reverse."""
    return tuple(int(d) for d in reversed(tensor.shape))


def read_tensors(
    reader: gguf.GGUFReader,
    arch: GGUFArchitecture,
    config: Mapping[str, Any],
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, np.ndarray]:
    """All tensors of an open GGUF file as float32 arrays under HF names, each fixed as its
    architecture needs (`arch.fix_tensor`); `progress(done, total)` after each tensor.

    Shapes are checked against `config`; a missing or surplus tensor is an error."""
    expected = arch.expected_shapes(config)
    out: dict[str, np.ndarray] = {}
    for done, tensor in enumerate(reader.tensors, 1):
        name = arch.hf_name(tensor.name)
        shape = _numpy_shape(tensor)
        if expected.get(name) != shape:
            raise ValueError(
                f"GGUF tensor {tensor.name} has shape {shape}, expected "
                f"{expected.get(name, 'no such tensor in this config')}"
            )
        values = dequantize(tensor.data, tensor.tensor_type, shape)
        out[name] = arch.fix_tensor(name, values, config)
        if progress is not None:
            progress(done, len(reader.tensors))
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ValueError(f"GGUF file lacks tensors for: {missing[:5]} ({len(missing)} in all)")
    return out


def _cast(arrays: Mapping[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Arrays cast to the output dtype name (bfloat16 through ml_dtypes, which jax ships)."""
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {OUTPUT_DTYPES}")
    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    return {k: np.ascontiguousarray(v.astype(target, copy=False)) for k, v in arrays.items()}


def _write_json(path: Path, content: Mapping[str, Any]) -> None:
    """Pretty JSON with a trailing newline, UTF-8 (chat templates hold non-ASCII text)."""
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str = "float32",
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a Hugging Face folder for a llama or gemma3 GGUF file at `out_dir`; return its path.

    `progress(done, total)` is called after each tensor is dequantized. The folder is built in
    a sibling temp dir and renamed into place, so it is whole or absent."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty")
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {OUTPUT_DTYPES}")
    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    arch = architecture(meta)
    shapes = {arch.hf_name(t.name): _numpy_shape(t) for t in reader.tensors}
    config = arch.config(meta, shapes) | {"torch_dtype": dtype}
    tokenizer = build_tokenizer(meta, config["vocab_size"])
    tensors = _cast(read_tensors(reader, arch, config, progress), dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / temp_name(out)
    tmp.mkdir()  # a fresh name: exists only if the random tag collides, then this raises
    try:
        tmp.chmod(0o755)  # whatever the umask: the result is an ordinary folder
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "config.json", config)
        _write_json(
            tmp / "tokenizer_config.json",
            tokenizer_config(meta, config["max_position_embeddings"]),
        )
        _write_json(tmp / "generation_config.json", generation_config(meta))
        for file in tmp.iterdir():
            file.chmod(0o644)  # safetensors writes owner-only files
        try:
            tmp.rename(out)  # atomic; replaces an empty `out`, fails on a full one
        except OSError as err:
            raise FileExistsError(f"{out} appeared while converting {gguf_path}") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
