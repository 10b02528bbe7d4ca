"""The small protocol between `dge_jax` and the model families that live in `models/`.

A family says how to read a Hugging Face config (`parse_config`), how checkpoint tensor names
map onto its parameters (`key_map`), and how to run a forward pass over the padded cache
(`forward`). `dge_jax` never imports a family directly: `models/` registers its families here
when it is imported, and `get_family` imports it on first use, the way plugins are discovered.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from dge_jax.cache import KVCache
from dge_jax.config import ConfigError, ModelConfig


class ForwardOutput(NamedTuple):
    """What a forward pass returns.

    logits: [B, V] f32 (last position) or [B, T, V] f32 (every position), or None.
    cache: the cache with the T new entries written at slots [index, index + T).
    q_window: [L, B, Hq, W, D] the last W queries per layer (post-RoPE), when asked.
    probs_sum: [L, B, Hq, S] f32 attention each slot received from these T queries, when asked.
    """

    logits: jax.Array | None
    cache: KVCache
    q_window: jax.Array | None
    probs_sum: jax.Array | None


# forward(config, params, tokens [B, T], positions [B, T], cache, *, obs_window, record_attn,
#         logits, key_block) -> ForwardOutput. `cache` is a stacked KVCache, or one in
# per-layer form (`dge_jax.cache.split_layers`) with `split_layer_params(params)`, for which
# the layers run as an unrolled loop and the output cache keeps that form.
ForwardFn = Callable[..., ForwardOutput]


def split_layer_params(params: Any) -> Any:
    """`params` with its per-layer weights as a tuple of one tree per layer.

    Every family keeps its layer weights in a pytree field `layers` stacked on a leading [L]
    axis (what `lax.scan` over layers reads). An unrolled layer loop wants separate buffers
    instead: split once, outside any decode loop, since slicing the stack inside the loop
    copies every layer's weights every step. Idempotent.
    """
    if isinstance(params.layers, tuple):
        return params
    num_layers = jax.tree.leaves(params.layers)[0].shape[0]
    layers = tuple(jax.tree.map(lambda a, i=i: a[i], params.layers) for i in range(num_layers))
    return dataclasses.replace(params, layers=layers)


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One ported architecture: config parser, checkpoint key map, forward pass."""

    model_type: str
    parse_config: Callable[[dict[str, Any]], ModelConfig]
    key_map: Callable[[ModelConfig], Any]
    forward: ForwardFn
    init_params: Callable[..., Any]


_FAMILIES: dict[str, ModelFamily] = {}
_BUILTINS_IMPORTED = False


def register_family(family: ModelFamily) -> None:
    """Makes `family` loadable by its Hugging Face `model_type`."""
    _FAMILIES[family.model_type] = family


def get_family(model_type: str) -> ModelFamily:
    """The family registered for `model_type`; a clear error for an unknown one."""
    global _BUILTINS_IMPORTED
    if not _BUILTINS_IMPORTED:  # the built-in families, even if a user registered one first
        importlib.import_module("models")
        _BUILTINS_IMPORTED = True
    if model_type not in _FAMILIES:
        raise ConfigError(
            f"unknown model_type {model_type!r} in config.json; supported: "
            f"{', '.join(sorted(_FAMILIES))}"
        )
    return _FAMILIES[model_type]
