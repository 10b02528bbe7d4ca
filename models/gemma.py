"""Gemma 2 and Gemma 3 (text): the llama-like core with Gemma's switches.

What differs from Llama, all as transformers 5 runs it (`modeling_gemma2.py`,
`modeling_gemma3.py`): embeddings times sqrt(hidden); RMSNorm as (1 + w) in f32; a norm on
attention's and the MLP's outputs as well as before each (`sandwich_norms`); GeGLU (GELU's
tanh approximation); logits scaled by `query_pre_attn_scalar` ** -0.5; a tied head; sliding-
window layers (`layer_types`; Gemma 2 alternates, Gemma 3 makes every sixth layer global).
Gemma 2 soft-caps attention logits (50) and final logits (30). Gemma 3 has q/k norms and two
RoPEs: global layers `rope_theta` (1e6, linear scaling on the larger models), sliding
layers `rope_local_base_freq` (1e4); transformers 5 spells them `rope_parameters`
{"full_attention": ..., "sliding_attention": ...}.

A `gemma3` (multimodal) config holds the text model in `text_config`, which lists only what
differs from `Gemma3TextConfig`'s defaults; they are filled in here (`GEMMA3_TEXT_DEFAULTS`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dge_jax.config import ConfigError, ModelConfig, RopeConfig
from models.hf_config import parse_llama_like
from models.hf_rope import parse_rope, rope_ignored
from models.hf_values import read_bool, read_float, read_int, read_object

# Keys Gemma configs carry besides the llama-like ones: read below, or bookkeeping.
GEMMA_KEYS = frozenset({
    "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
    "rope_local_base_freq", "sliding_window_pattern", "hidden_activation",
    "cache_implementation", "use_bidirectional_attention", "final_attn_implementation",
    "_sliding_window_pattern",  # transformers writes it beside the layer_types it made
})  # fmt: skip
ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq")

# transformers 5.24's Gemma3TextConfig defaults, for a multimodal config's sparse text_config.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}  # fmt: skip


def _gemma(raw: dict[str, Any], family: str, rope: RopeConfig, local: RopeConfig | None,
           **switches: Any) -> ModelConfig:  # fmt: skip
    """The llama-like parse of a Gemma config, then Gemma's switches."""
    if read_bool(raw, "use_bidirectional_attention", False, null_default=True):
        raise ConfigError("use_bidirectional_attention=true (an encoder use of Gemma) is not "
                          "supported: this library decodes causally")  # fmt: skip
    bias = read_bool(raw, "attention_bias", False)
    read_int(raw, "head_dim", None)  # null too is refused: Gemma's is not hidden / heads
    plain = {k: v for k, v in raw.items() if k not in ROPE_KEYS}
    # transformers' Gemma reads `hidden_activation` (default GELU-tanh) and ignores
    # `hidden_act`, which Gemma 2 configs carry beside it
    plain.pop("hidden_act", None)
    plain.setdefault("hidden_activation", "gelu_pytorch_tanh")
    cfg = parse_llama_like(
        plain, family, qkv_bias=bias, o_bias=bias, bias_keys=frozenset({"attention_bias"}),
        extra_inert=GEMMA_KEYS, activations=frozenset({"gelu_pytorch_tanh"}), **switches,
    )  # fmt: skip
    scalar = read_float(raw, "query_pre_attn_scalar", 256.0)
    return dataclasses.replace(
        cfg, rope=rope, local_rope=local if local != rope else None,
        attn_scale=scalar ** -0.5, attn_softcap=_cap(raw, "attn_logit_softcapping"),
        final_softcap=_cap(raw, "final_logit_softcapping"), embed_scale=True, norm_offset=True,
        sandwich_norms=True, tie_word_embeddings=read_bool(raw, "tie_word_embeddings", True),
    )  # fmt: skip


def _cap(raw: dict[str, Any], key: str) -> float | None:
    """A soft cap (> 0), or None (null or absent: no cap, as transformers reads it)."""
    return read_float(raw, key, None, null_default=True)


def parse_gemma2(raw: dict[str, Any]) -> ModelConfig:
    """Gemma 2: one RoPE (`rope_theta`), soft caps, alternating sliding and global layers.

    gemma-2-9b-it's config.json also carries `sliding_window_size`, an early name that
    transformers never reads; it is accepted when it says what `sliding_window` says."""
    raw = dict(raw)
    legacy = raw.pop("sliding_window_size", None)
    if legacy is not None and legacy != raw.get("sliding_window"):
        raise ConfigError(
            f"sliding_window_size={legacy} differs from sliding_window="
            f"{raw.get('sliding_window')}: transformers reads only sliding_window; make them "
            "equal or drop sliding_window_size")
    return _gemma(raw, "gemma2", parse_rope(raw), None)


def parse_gemma3_text(raw: dict[str, Any]) -> ModelConfig:
    """Gemma 3's text model: q/k norms, a global and a local RoPE."""
    params = read_object(raw, "rope_parameters")
    ignored = rope_ignored(raw)  # transformers checks each layer kind's rope against it
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5
        unknown = set(params) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ConfigError(f"unknown rope_parameters layer kind(s) {sorted(unknown)}")
        rope, local = (
            parse_rope({"rope_parameters": read_object(params, kind, "rope_parameters.")}
                       | _theta(raw, key, default), where=f"rope_parameters.{kind}",
                       ignored=ignored)
            for kind, key, default in (("full_attention", "rope_theta", 1_000_000.0),
                                       ("sliding_attention", "rope_local_base_freq", 10_000.0))
        )  # fmt: skip
    else:  # rope_theta (+ rope_scaling) global, rope_local_base_freq local, unscaled
        rope = parse_rope({k: raw[k] for k in ("rope_scaling",) if k in raw}
                          | _theta(raw, "rope_theta", 1_000_000.0), ignored=ignored)  # fmt: skip
        local = RopeConfig(theta=read_float(raw, "rope_local_base_freq", 10_000.0))
    return _gemma(raw, "gemma3_text", rope, local, qk_norm=True)


def _theta(raw: dict[str, Any], key: str, default: float) -> dict[str, float]:
    """{"rope_theta": raw[key] or the default}: a theta when rope_parameters has none."""
    return {"rope_theta": read_float(raw, key, default)}


def parse_gemma3(raw: dict[str, Any]) -> ModelConfig:
    """A multimodal `gemma3` config: its text model (`text_config` over the text defaults).
    Only the text model runs here; the vision tower's weights are skipped at load."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("gemma3 config.json has no text_config")
    return parse_gemma3_text(GEMMA3_TEXT_DEFAULTS | {k: v for k, v in text.items()
                                                     if k != "model_type"})  # fmt: skip
