"""GGUF file -> Hugging Face Llama checkpoint folder (config, safetensors, tokenizer).

llama.cpp ships models as one GGUF file: quantized tensors under its own names, q/k rows permuted
for its interleaved RoPE, and the tokenizer as metadata. `convert_gguf_to_hf` undoes all of that
with numpy only, so the rest of dge_jax reads one format: a Hugging Face folder.

Conversion is a table (GGUF name pattern -> HF name); every tensor's shape is checked against the
config, and a name, metadata key or type this module does not know is an error, never a warning.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes  # numpy bfloat16; a jax dependency
import numpy as np
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from dge_jax.checkpoints.temp_folders import temp_name

# Bump when the files convert_gguf_to_hf writes change, so cached conversions are redone.
CONVERTER_VERSION = 1

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

# GGUF tensor name -> Hugging Face Llama name. Patterns are matched in full.
TENSOR_TABLE: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), target)
    for pattern, target in (
        (r"token_embd\.weight", "model.embed_tokens.weight"),
        (r"output_norm\.weight", "model.norm.weight"),
        (r"output\.weight", "lm_head.weight"),
        (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
        (r"blk\.(\d+)\.attn_q\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
        (r"blk\.(\d+)\.attn_k\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
        (r"blk\.(\d+)\.attn_v\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
        (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
        (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
        (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
        (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
        (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    )
)

# llama.* metadata keys understood by llama_config; any other llama.* key is an error.
_LLAMA_KEYS = frozenset(
    {
        "context_length",
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "vocab_size",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "attention.value_length",
        "attention.layer_norm_rms_epsilon",
        "rope.freq_base",
        "rope.dimension_count",
        "rope.scaling.type",
        "rope.scaling.factor",
        "rope.scaling.original_context_length",
        "rope.scaling.finetuned",
        "expert_count",
        "expert_used_count",
    }
)

# tokenizer.ggml.pre values whose pre-tokenizer we rebuild: every number code point split off
# alone (llama.cpp's `\p{N}` pass), then GPT-2's byte-level regex. "gpt-2" has no digit pass.
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_PLAIN_PRE = frozenset({"gpt-2", "gpt2"})

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp token types


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor name; raises ValueError for unknown names.

    Strict on purpose: a tensor we do not map would silently change the model."""
    if gguf_name == "rope_freqs.weight":
        raise ValueError(
            "GGUF tensor 'rope_freqs.weight' (Llama-3.1-style RoPE frequency factors) is not "
            "supported: its scaling parameters cannot be recovered for a Hugging Face config"
        )
    for pattern, target in TENSOR_TABLE:
        if pattern.fullmatch(gguf_name):
            return pattern.sub(target, gguf_name)
    raise ValueError(f"unknown GGUF tensor name {gguf_name!r} for a llama model")


def dequantize(data: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """Float32 array of numpy `shape` from a GGUF tensor's raw data (as GGUFReader holds it).

    Uses gguf.quants' numpy kernels, limited to the types our tests check."""
    qtype = QType(qtype)
    if qtype not in SUPPORTED_TYPES:
        supported = sorted(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"GGUF tensor type {qtype.name} is not supported; supported: {supported}")
    values = np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)
    return values.reshape(shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: `w: [n_heads * head_dim, in]` back to HF order.

    llama.cpp interleaves each head's two rotary halves (rows 0, d/2, 1, d/2+1, ...)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"q/k projection with {rows} rows does not split into {n_heads} heads")
    half = rows // n_heads // 2
    # GGUF row order within a head is (pair index i, half h); HF's is (h, i).
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value metadata of an open GGUF file as Python values (str, int, float, lists).

    The GGUF.* header fields are left out; they describe the container, not the model."""
    return {
        key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")
    }


def check_architecture(meta: Mapping[str, Any]) -> None:
    """Raise ValueError naming the architecture unless general.architecture is 'llama'.

    Checked before anything else, so a Qwen or Gemma file fails with the reason, not a symptom."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; only 'llama' is")


def _scalar(meta: Mapping[str, Any], key: str, kind: type) -> Any:
    """meta[key] checked to be a scalar of `kind`; a missing or per-layer value is an error."""
    if key not in meta:
        raise ValueError(f"GGUF metadata lacks required key {key!r}")
    value = meta[key]
    if isinstance(value, list | bool) or not isinstance(value, int | float):
        raise ValueError(f"GGUF metadata {key!r} = {value!r} is not a scalar number")
    return kind(value)


def _rope_scaling(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The HF `rope_scaling` dict for llama.rope.scaling.* metadata (None when absent)."""
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _scalar(meta, "llama.rope.scaling.factor", float)}
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (only 'linear')")


def llama_config(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """A transformers LlamaForCausalLM config dict from GGUF metadata and HF-named tensor shapes.

    vocab_size is the embedding's row count; weights are tied when there is no `output` tensor."""
    check_architecture(meta)
    unknown = sorted(
        k for k in meta if k.startswith("llama.") and k.removeprefix("llama.") not in _LLAMA_KEYS
    )
    if unknown:
        raise ValueError(f"GGUF llama metadata keys not understood by the converter: {unknown}")
    if meta.get("llama.expert_count", 0):
        raise ValueError("mixture-of-experts llama GGUF files are not supported")

    hidden = _scalar(meta, "llama.embedding_length", int)
    n_heads = _scalar(meta, "llama.attention.head_count", int)
    n_kv = n_heads
    if "llama.attention.head_count_kv" in meta:
        n_kv = _scalar(meta, "llama.attention.head_count_kv", int)
    head_dim = (
        _scalar(meta, "llama.attention.key_length", int)
        if "llama.attention.key_length" in meta
        else hidden // n_heads
    )
    if meta.get("llama.attention.value_length", head_dim) != head_dim:
        raise ValueError("GGUF attention.value_length differs from key_length; not supported")
    if meta.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("GGUF rope.dimension_count != head_dim (partial rotary) is not supported")
    if "model.embed_tokens.weight" not in shapes:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    vocab = shapes["model.embed_tokens.weight"][0]
    if meta.get("llama.vocab_size", vocab) != vocab:
        raise ValueError(f"GGUF llama.vocab_size {meta['llama.vocab_size']} != embedding rows")

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _scalar(meta, "llama.feed_forward_length", int),
        "num_hidden_layers": _scalar(meta, "llama.block_count", int),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": _scalar(meta, "llama.context_length", int),
        "rms_norm_eps": _scalar(meta, "llama.attention.layer_norm_rms_epsilon", float),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta),
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "use_cache": True,
    }


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a Llama `config` needs, with its numpy shape `[out, in]`.

    The converter asserts the GGUF file gives exactly these: none missing, none extra."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


def _numpy_shape(tensor: Any) -> tuple[int, ...]:
    """GGUF stores dimensions fastest-first (ne0, ne1); numpy's order is the reverse."""
    return tuple(int(d) for d in reversed(tensor.shape))


def read_tensors(reader: gguf.GGUFReader, config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """All tensors of an open llama GGUF file as float32 arrays under HF names, q/k un-permuted.

    Shapes are checked against `config`; a missing or surplus tensor is an error."""
    expected = expected_shapes(config)
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        shape = _numpy_shape(tensor)
        if expected.get(name) != shape:
            raise ValueError(
                f"GGUF tensor {tensor.name} has shape {shape}, expected "
                f"{expected.get(name, 'no such tensor in this config')}"
            )
        w = dequantize(tensor.data, tensor.tensor_type, shape)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[name] = w
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ValueError(f"GGUF file lacks tensors for: {missing[:5]} ({len(missing)} in all)")
    return out


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer matching llama.cpp's `tokenizer.ggml.pre` value."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        # Digits splits every Unicode number (Rust char::is_numeric == \p{N}) into its own piece.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _PLAIN_PRE:
        return byte_level
    supported = sorted(_DIGIT_SPLIT_PRE | _PLAIN_PRE)
    raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported; supported: {supported}")


def _post_processor(tokens: list[str], meta: Mapping[str, Any]) -> processors.PostProcessor:
    """Byte-level post-processing, plus BOS/EOS only where the file's add_*_token flags ask."""
    ends = {}
    for which in ("bos", "eos"):
        if meta.get(f"tokenizer.ggml.add_{which}_token", False):
            index = meta[f"tokenizer.ggml.{which}_token_id"]
            ends[which] = (tokens[index], index)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if not ends:
        return byte_level
    single = [ends[w][0] for w in ("bos",) if w in ends] + ["$A"]
    single += [ends[w][0] for w in ("eos",) if w in ends]
    template = processors.TemplateProcessing(single=single, special_tokens=list(ends.values()))
    return processors.Sequence([byte_level, template])


def build_tokenizer(meta: Mapping[str, Any], vocab_size: int) -> Tokenizer:
    """A `tokenizers.Tokenizer` (byte-level BPE) rebuilt from `tokenizer.ggml.*` metadata.

    Control tokens become special added tokens and user-defined ones plain added tokens, so
    `<|im_start|>` in text is one token, as in the original tokenizer.json."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"GGUF tokenizer.ggml.model {meta.get('tokenizer.ggml.model')!r} is not supported; "
            "only 'gpt2' (byte-level BPE) is"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if len(tokens) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokens)} tokens, more than {vocab_size} embeddings")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF tokenizer.ggml.tokens holds duplicate tokens")
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise ValueError("GGUF tokenizer.ggml.merges entry is not two space-separated tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(tokens, meta)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    kinds = list(zip(tokens, types, strict=True))
    # Both are already in the BPE vocabulary, so adding them keeps their ids.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _TOKEN_CONTROL]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in kinds
            if k == _TOKEN_USER_DEFINED
        ]
    )
    return tok


def _token(meta: Mapping[str, Any], key: str) -> str | None:
    """The token text for the id stored under tokenizer.ggml.<key>, or None when absent."""
    index = meta.get(f"tokenizer.ggml.{key}")
    return None if index is None else meta["tokenizer.ggml.tokens"][index]


def tokenizer_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    """transformers `tokenizer_config.json` content: special tokens and the chat template.

    The tokenizer class is the generic fast one, so tokenizer.json is used exactly as written."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": _token(meta, "bos_token_id"),
        "eos_token": _token(meta, "eos_token_id"),
        "unk_token": _token(meta, "unknown_token_id"),
        "pad_token": _token(meta, "padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def generation_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    """transformers `generation_config.json` content: the special token ids, nothing sampled."""
    ids = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return {k: v for k, v in ids.items() if v is not None}


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
    gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "float32"
) -> Path:
    """Write a Hugging Face Llama folder for a llama GGUF file at `out_dir` and return its path.

    The folder is built in a sibling temp dir and renamed into place, so it is whole or absent."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty")
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {OUTPUT_DTYPES}")
    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    check_architecture(meta)
    shapes = {hf_name(t.name): _numpy_shape(t) for t in reader.tensors}
    config = llama_config(meta, shapes) | {"torch_dtype": dtype}
    tokenizer = build_tokenizer(meta, config["vocab_size"])
    tensors = _cast(read_tensors(reader, config), dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / temp_name(out)
    tmp.mkdir()  # a fresh name: exists only if the random tag collides, then this raises
    try:
        tmp.chmod(0o755)  # whatever the umask: the result is an ordinary folder
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta))
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
