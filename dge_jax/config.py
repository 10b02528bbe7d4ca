"""Model configuration: one frozen, hashable dataclass for every llama-like family.

Hugging Face `config.json` files are parsed strictly by `models/` (one parser per family);
what they produce is this dataclass, which `jax.jit` takes as a static argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class ConfigError(ValueError):
    """A checkpoint's configuration asks for something this library does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (split-halves layout, as in Hugging Face).

    kind: "default", "linear" (positions divided by `factor`), "llama3" (frequency-dependent
    scaling with `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`) or
    "longrope" (Phi-3 / Phi-3.5: each frequency divided by `short_factor[i]` while the
    sequence fits in `original_max_position_embeddings`, by `long_factor[i]` beyond it; cos
    and sin multiplied by `attention_factor`; see `dge_jax.runtime.rope`).
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and switches of a llama-like decoder; everything numerics depend on is here."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's `attention_bias` sets this and `o_bias`
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    # Local and global layers (Gemma 2/3, Mistral v0.1, Qwen2 with use_sliding_window, Phi-3):
    # layer i attends to keys with 0 <= query_pos - pos < layer_windows[i] (a sliding window),
    # or to every earlier key when layer_windows[i] == 0; () = every layer global.
    layer_windows: tuple[int, ...] = ()
    local_rope: RopeConfig | None = None  # the sliding layers' RoPE, where it differs (Gemma 3)
    attn_scale: float | None = None  # scores times this; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    # Gemma: embeddings times sqrt(hidden), RMSNorm weights as (1 + w), a norm after attention
    # and after the MLP as well as before each, and the MLP's activation.
    embed_scale: bool = False
    norm_offset: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # or "gelu_tanh" (GeGLU, Gemma)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ConfigError(
                f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers"
            )
        if any(w < 0 for w in self.layer_windows):
            raise ConfigError(f"a sliding window must be positive, got {self.layer_windows}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ConfigError(f"hidden_act={self.hidden_act!r}: supported are silu, gelu_tanh")

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens; 0 = global (every earlier key)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """The layers with a sliding window, in order."""
        return tuple(i for i, w in enumerate(self.layer_windows) if w)

    @property
    def rope_of_layers(self) -> tuple[RopeConfig, ...]:
        """Each layer's RoPE: `local_rope` on sliding layers where set, else `rope`."""
        local = self.local_rope or self.rope
        return tuple(local if self.window(i) else self.rope for i in range(self.num_layers))

    @property
    def group_size(self) -> int:
        """Query heads per kv head (GQA group)."""
        return self.num_heads // self.num_kv_heads


def with_fields(cls: type, base: Any, fields: dict[str, Any], what: str) -> Any:
    """`base` (an instance of the frozen dataclass `cls`, or None: cls's defaults) with
    `fields` by name replacing its own; a wrong `base` or an unknown name is a TypeError
    naming `what` and the known fields (how settings values take options by name)."""
    if base is not None and not isinstance(base, cls):
        raise TypeError(f"{what} must be a {cls.__name__}, got {type(base).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise TypeError(f"unknown {what} field(s) {unknown}; known: {', '.join(known)}")
    return cls(**fields) if base is None else dataclasses.replace(base, **fields)
