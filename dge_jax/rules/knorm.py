"""Control `knorm`: keep low-norm keys (kvpress ``KnormPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dge_jax.rules.base import ScoringRule, finish
from dge_jax.rules.registry import register
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation


@register
@dataclasses.dataclass(frozen=True)
class KeyNorm(ScoringRule):
    """Control: keep low-norm keys (arXiv 2406.11430; kvpress ``KnormPress``)."""

    name: ClassVar[str] = "knorm"

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: -‖k‖₂ of each (post-RoPE) key, as kvpress scores it."""
        return finish(-jnp.linalg.norm(cache.k.astype(jnp.float32), axis=-1), cache.valid())
