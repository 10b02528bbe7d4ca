"""What differs between the GGUF architectures the converter reads: `llama` and `gemma3`.

Each architecture is a `GGUFArchitecture`: its metadata keys -> a transformers config dict, its
tensor-name table, the HF tensor shapes a config needs, and the per-tensor fix llama.cpp's
writer applied (q/k rows permuted for Llama's interleaved RoPE; Gemma's norms stored as 1 + w).
Everything is strict: an unknown key, tensor name or setting is an error naming it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

Meta = Mapping[str, Any]
Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class GGUFArchitecture:
    """One `general.architecture`: how its file maps onto a Hugging Face checkpoint."""

    name: str
    tensor_table: tuple[tuple[re.Pattern[str], str], ...]
    config: Callable[[Meta, Shapes], dict[str, Any]]
    expected_shapes: Callable[[Mapping[str, Any]], dict[str, tuple[int, ...]]]
    fix_tensor: Callable[[str, np.ndarray, Mapping[str, Any]], np.ndarray]

    def hf_name(self, gguf_name: str) -> str:
        """The HF name of a GGUF tensor name; ValueError for a name the table lacks.

        Strict on purpose: a tensor we do not map would silently change the model."""
        if gguf_name == "rope_freqs.weight":
            raise ValueError(
                "GGUF tensor 'rope_freqs.weight' (Llama-3.1-style RoPE frequency factors) is not "
                "supported: its scaling parameters cannot be recovered for a Hugging Face config"
            )
        for pattern, target in self.tensor_table:
            if pattern.fullmatch(gguf_name):
                return pattern.sub(target, gguf_name)
        raise ValueError(f"unknown GGUF tensor name {gguf_name!r} for a {self.name} model")


def scalar(meta: Meta, key: str, kind: type) -> Any:
    """meta[key] checked to be a scalar of `kind`; a missing or per-layer value is an error."""
    if key not in meta:
        raise ValueError(f"GGUF metadata lacks required key {key!r}")
    value = meta[key]
    if isinstance(value, list | bool) or not isinstance(value, int | float):
        raise ValueError(f"GGUF metadata {key!r} = {value!r} is not a scalar number")
    return kind(value)


def _table(pairs: tuple[tuple[str, str], ...]) -> tuple[tuple[re.Pattern[str], str], ...]:
    """(GGUF name pattern, HF name template) pairs compiled; patterns are matched in full."""
    return tuple((re.compile(pattern), target) for pattern, target in pairs)


def _check_keys(meta: Meta, arch: str, known: frozenset[str]) -> None:
    """ValueError naming every `<arch>.*` metadata key the converter does not understand."""
    unknown = sorted(
        k for k in meta if k.startswith(f"{arch}.") and k.removeprefix(f"{arch}.") not in known
    )
    if unknown:
        raise ValueError(f"GGUF {arch} metadata keys not understood by the converter: {unknown}")


def _attention(meta: Meta, arch: str, shapes: Shapes) -> dict[str, Any]:
    """The config fields every architecture reads alike: sizes, heads, head_dim, vocabulary."""
    hidden = scalar(meta, f"{arch}.embedding_length", int)
    n_heads = scalar(meta, f"{arch}.attention.head_count", int)
    n_kv = n_heads
    if f"{arch}.attention.head_count_kv" in meta:
        n_kv = scalar(meta, f"{arch}.attention.head_count_kv", int)
    head_dim = (
        scalar(meta, f"{arch}.attention.key_length", int)
        if f"{arch}.attention.key_length" in meta
        else hidden // n_heads
    )
    if meta.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ValueError("GGUF attention.value_length differs from key_length; not supported")
    if meta.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("GGUF rope.dimension_count != head_dim (partial rotary) is not supported")
    if "model.embed_tokens.weight" not in shapes:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    vocab = shapes["model.embed_tokens.weight"][0]
    if meta.get(f"{arch}.vocab_size", vocab) != vocab:
        raise ValueError(f"GGUF {arch}.vocab_size {meta[f'{arch}.vocab_size']} != embedding rows")
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": scalar(meta, f"{arch}.feed_forward_length", int),
        "num_hidden_layers": scalar(meta, f"{arch}.block_count", int),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": scalar(meta, f"{arch}.context_length", int),
        "rms_norm_eps": scalar(meta, f"{arch}.attention.layer_norm_rms_epsilon", float),
    }


def _special_ids(meta: Meta) -> dict[str, Any]:
    """bos/eos/pad ids as the tokenizer metadata gives them (None when absent)."""
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def _layer_shapes(config: Mapping[str, Any], norms: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor a decoder-only config needs, numpy `[out, in]`, with the given per-layer
    norms of width hidden_size (and q/k norms of width head_dim when named)."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        for norm in norms:
            width = d if norm.startswith("self_attn.") else h
            shapes[p + norm + ".weight"] = (width,)
    return shapes


# ---------------------------------------------------------------------------------------------
# llama

# Names both architectures share: embeddings, final norm, attention and MLP projections.
_SHARED_NAMES = (
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"blk\.(\d+)\.attn_k\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"blk\.(\d+)\.attn_v\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
)

_LLAMA_TABLE = _table((
    *_SHARED_NAMES,
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
))  # fmt: skip

# `<arch>.*` metadata keys both architectures read (`_attention`, the RoPE base).
_SHARED_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
    "rope.dimension_count",
})  # fmt: skip

_LLAMA_KEYS = _SHARED_KEYS | frozenset({
    "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "expert_count",
    "expert_used_count",
})  # fmt: skip


def _rope_scaling(meta: Meta) -> dict[str, Any] | None:
    """The HF `rope_scaling` dict for llama.rope.scaling.* metadata (None when absent)."""
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": scalar(meta, "llama.rope.scaling.factor", float)}
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (only 'linear')")


def llama_config(meta: Meta, shapes: Shapes) -> dict[str, Any]:
    """A transformers LlamaForCausalLM config dict from GGUF metadata and HF-named tensor shapes.

    vocab_size is the embedding's row count; weights are tied when there is no `output` tensor."""
    _check_keys(meta, "llama", _LLAMA_KEYS)
    if meta.get("llama.expert_count", 0):
        raise ValueError("mixture-of-experts llama GGUF files are not supported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_attention(meta, "llama", shapes),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta),
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        **_special_ids(meta),
        "use_cache": True,
    }


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: `w: [n_heads * head_dim, in]` back to HF order.

    llama.cpp interleaves each head's two rotary halves (rows 0, d/2, 1, d/2+1, ...)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"q/k projection with {rows} rows does not split into {n_heads} heads")
    half = rows // n_heads // 2
    # GGUF row order within a head is (pair index i, half h); HF's is (h, i).
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_fix(name: str, w: np.ndarray, config: Mapping[str, Any]) -> np.ndarray:
    """q and k rows back from llama.cpp's interleaved-RoPE order."""
    if name.endswith("q_proj.weight"):
        return unpermute_qk(w, config["num_attention_heads"])
    if name.endswith("k_proj.weight"):
        return unpermute_qk(w, config["num_key_value_heads"])
    return w


LLAMA = GGUFArchitecture(
    name="llama",
    tensor_table=_LLAMA_TABLE,
    config=llama_config,
    expected_shapes=lambda c: _layer_shapes(c, ("input_layernorm", "post_attention_layernorm")),
    fix_tensor=_llama_fix,
)

# ---------------------------------------------------------------------------------------------
# gemma3 (the text model; llama.cpp writes Gemma 3's vision tower to a separate mmproj file)

_GEMMA3_TABLE = _table((
    *_SHARED_NAMES,
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight",
     r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.pre_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
))  # fmt: skip

_GEMMA3_KEYS = _SHARED_KEYS | {"attention.sliding_window"}

_GEMMA3_NORMS = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm",
)  # fmt: skip

# What the file does not say, as both readers of it fix it (transformers' Gemma3TextConfig
# defaults; llama.cpp's llama-model.cpp hard-codes the same for gemma3): every sixth layer
# global, local RoPE base 1e4, attention scaled by 256 ** -0.5 (head_dim 256 on the sizes
# whose query_pre_attn_scalar is 256; 27B's is not, see gemma3_config), no soft caps.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0


def gemma3_config(meta: Meta, shapes: Shapes) -> dict[str, Any]:
    """A transformers Gemma3ForCausalLM (`gemma3_text`) config dict, as transformers' GGUF
    loader maps this file's metadata onto Gemma3TextConfig's defaults.

    `rope.scaling.*` (the 4B-27B files) is refused: transformers' GGUF mapping drops it, which
    would run those models with the wrong global RoPE."""
    _check_keys(meta, "gemma3", _GEMMA3_KEYS)
    if "lm_head.weight" in shapes:
        raise ValueError("GGUF gemma3 file has an output.weight; Gemma 3 ties its head")
    fields = _attention(meta, "gemma3", shapes)
    if fields["head_dim"] != 256:
        # query_pre_attn_scalar defaults to 256 (= head_dim) in transformers; only the 27B
        # model differs (hidden / heads), and its file cannot say so.
        raise ValueError(
            f"GGUF gemma3 head_dim {fields['head_dim']} != 256: query_pre_attn_scalar cannot be "
            "recovered from the file; convert this size from its Hugging Face checkpoint"
        )
    layers = fields["num_hidden_layers"]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **fields,
        "sliding_window": scalar(meta, "gemma3.attention.sliding_window", int),
        "layer_types": [
            "full_attention" if (n + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
            for n in range(layers)
        ],
        "rope_parameters": {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": float(meta.get("gemma3.rope.freq_base", 1_000_000.0)),
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA},
        },
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_bidirectional_attention": False,
        **_special_ids(meta),
        "use_cache": True,
    }


def _gemma3_fix(name: str, w: np.ndarray, config: Mapping[str, Any]) -> np.ndarray:
    """llama.cpp stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the weight);
    the HF convention, which the model code follows, stores w. q/k rows are in HF order already
    (llama.cpp runs Gemma's RoPE in NeoX order, so its writer does not permute them)."""
    return w - np.float32(1.0) if name.endswith("norm.weight") else w


GEMMA3 = GGUFArchitecture(
    name="gemma3",
    tensor_table=_GEMMA3_TABLE,
    config=gemma3_config,
    expected_shapes=lambda c: _layer_shapes(c, _GEMMA3_NORMS),
    fix_tensor=_gemma3_fix,
)

ARCHITECTURES: dict[str, GGUFArchitecture] = {a.name: a for a in (LLAMA, GEMMA3)}


def architecture(meta: Meta) -> GGUFArchitecture:
    """The architecture of a file's `general.architecture`; ValueError naming it otherwise.

    Checked before anything else, so an unsupported file fails with the reason, not a symptom."""
    name = meta.get("general.architecture")
    if name not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]
