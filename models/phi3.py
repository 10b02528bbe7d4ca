"""Phi-3 and Phi-3.5 (`model_type` "phi3", transformers' Phi3ForCausalLM) on the llama core.

Phi-3 is Llama with two fused projections: `self_attn.qkv_proj` ([q; k; v] rows, so q, k and v
are column blocks of its transpose) and `mlp.gate_up_proj` (gate then up, transformers'
`chunk(2)`). The key table splits each at load time into the llama fields (`layers.wq`,
`layers.wk`, `layers.wv`; `layers.w_gate`, `layers.w_up`), sizes from the config, so
`llama_like.forward` runs Phi-3 unchanged. Its RoPE is default or LongRoPE
(`dge_jax.runtime.rope` says how the short/long choice is made).
"""

from __future__ import annotations

import re
from typing import Any

from dge_jax.config import ModelConfig
from models import llama_like
from models.hf_config import parse_llama_like
from models.hf_values import read_int

_LAYER = llama_like._LAYER
# The llama rows a fused Phi-3 tensor replaces, and the fused rows: (pattern, fields, transform).
_FUSED: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (_LAYER + r"self_attn\.qkv_proj\.weight", ("layers.wq", "layers.wk", "layers.wv"), "transpose"),
    (_LAYER + r"mlp\.gate_up_proj\.weight", ("layers.w_gate", "layers.w_up"), "transpose"),
)
_REPLACED = frozenset(f for _, fields, _ in _FUSED for f in fields)


def key_table(cfg: ModelConfig) -> tuple[tuple[str, str | tuple[str, ...], str], ...]:
    """Llama's rows for `cfg` with the fused rows in place of the fields they fill."""
    rows = llama_like.hf_key_table(cfg)
    return tuple((p, f, t) for p, f, t in rows if f not in _REPLACED) + _FUSED

# Keys of Phi-3 configs beyond the llama-like ones: read (original_max_position_embeddings,
# by the longrope parser) or inert (`auto_map`: the remote-code classes transformers no longer
# needs; the dropouts are inert at inference).
PHI3_KEYS = frozenset({"original_max_position_embeddings", "auto_map"})


def parse_phi3(raw: dict[str, Any]) -> ModelConfig:
    """Phi-3 / Phi-3.5: Llama without biases (a true bias flag is refused), silu, RoPE default
    or longrope ("su" and "yarn", Phi-3's early names of longrope, are read as longrope as
    transformers' Phi3Config does; `original_max_position_embeddings` defaults to 4096 and
    `rms_norm_eps` to 1e-5, as there).

    `sliding_window`: transformers 5 applies it to every layer whenever it is set
    (Phi3Model picks `create_sliding_window_causal_mask` when `config.sliding_window` is not
    None; key visible iff query_pos - pos < window), so it is every layer's `layer_windows`
    entry here (Phi-3-mini-4k: 2047 of 4096 positions; the 128k models and Phi-3.5 set
    262144, longer than any sequence they take, which masks nothing). kvpress runs
    transformers' own Phi3ForCausalLM (its presses hook the attention modules), so it masks
    the same way.
    """
    raw = dict(raw)
    for key in ("rope_scaling", "rope_parameters"):
        params = raw.get(key)
        if isinstance(params, dict):
            params = dict(params)
            for name in ("rope_type", "type"):
                if params.get(name) in ("su", "yarn"):
                    params[name] = "longrope"
            raw[key] = params
    original = "original_max_position_embeddings"
    raw[original] = read_int(raw, original, 4096)  # Phi3Config's default; its type checked
    raw.setdefault("rms_norm_eps", 1e-5)  # Phi3Config's default (the shared parser's is 1e-6)
    return parse_llama_like(raw, "phi3", extra_inert=PHI3_KEYS)


def key_map(cfg: ModelConfig):
    """The `KeyMap` of a Phi-3 checkpoint: llama's table with the fused rows split."""
    from dge_jax.checkpoints.hf import KeyMap

    return KeyMap(
        rules=tuple((re.compile(p), f, t) for p, f, t in key_table(cfg)),
        shapes=llama_like.param_shapes(cfg),
        build=llama_like.params_from_flat,
    )
