"""Ported model families. Importing this package registers them with `dge_jax.families`.

Each family is a config parser with its fixed switches; they all share the llama-like core
(Phi-3 with its own key table, `models/phi3.py`, splitting its fused tensors).
To add a family, write its parser here and register it (see WORKSPACE.md).
"""

from __future__ import annotations

from typing import Any

from dge_jax.config import ModelConfig
from dge_jax.families import ModelFamily, register_family
from models import llama_like, phi3
from models.gemma import parse_gemma2, parse_gemma3, parse_gemma3_text
from models.hf_config import BIAS_KEYS, parse_llama_like


def parse_llama(raw: dict[str, Any]) -> ModelConfig:
    """Llama 1/2/3: `attention_bias` adds q/k/v/o biases, `mlp_bias` MLP biases; rope default,
    linear or llama3."""
    bias = bool(raw.get("attention_bias", False))
    return parse_llama_like(
        raw, "llama", qkv_bias=bias, o_bias=bias, bias_keys=frozenset(BIAS_KEYS)
    )


def parse_mistral(raw: dict[str, Any]) -> ModelConfig:
    """Mistral: Llama without biases (a true bias flag is refused); `sliding_window`, when
    set, is every layer's window (`layer_windows`), as transformers' Mistral masks it."""
    return parse_llama_like(raw, "mistral")


def parse_qwen2(raw: dict[str, Any]) -> ModelConfig:
    """Qwen2: q/k/v biases always on, o_proj and MLP without (a true bias flag is refused)."""
    return parse_llama_like(raw, "qwen2", qkv_bias=True)


def parse_qwen3(raw: dict[str, Any]) -> ModelConfig:
    """Qwen3: RMSNorm on q and k over head_dim; `attention_bias` on q/k/v/o."""
    bias = bool(raw.get("attention_bias", False))
    keys = frozenset({"attention_bias"})
    return parse_llama_like(raw, "qwen3", qkv_bias=bias, o_bias=bias, qk_norm=True, bias_keys=keys)


for _name, _parse, _key_map in [
    ("llama", parse_llama, llama_like.key_map),
    ("mistral", parse_mistral, llama_like.key_map),
    ("qwen2", parse_qwen2, llama_like.key_map),
    ("qwen3", parse_qwen3, llama_like.key_map),
    ("gemma2", parse_gemma2, llama_like.key_map),
    ("gemma3_text", parse_gemma3_text, llama_like.key_map),
    ("gemma3", parse_gemma3, llama_like.multimodal_key_map),
    ("phi3", phi3.parse_phi3, phi3.key_map),
]:
    register_family(
        ModelFamily(
            model_type=_name,
            parse_config=_parse,
            key_map=_key_map,
            forward=llama_like.forward,
            init_params=llama_like.init_params,
            param_axes=llama_like.PARAM_AXES,
            out_projection=llama_like.out_projection,
        )
    )
