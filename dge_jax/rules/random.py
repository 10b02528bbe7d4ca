"""Control `random`: uniform random scores (kvpress ``RandomPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dge_jax.rules.base import ScoringRule, check_fields, finish
from dge_jax.rules.registry import register
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation


@register
@dataclasses.dataclass(frozen=True)
class RandomScores(ScoringRule):
    """Control: uniform random scores from a key folded from ``seed`` (kvpress RandomPress)."""

    seed: int = 0

    name: ClassVar[str] = "random"

    def __post_init__(self) -> None:
        check_fields(self, ints={"seed": (0, 2**32 - 1)})  # jax.random.fold_in takes a uint32

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32 in [0, 1): the same for the same seed and cache shape."""
        key = jax.random.fold_in(jax.random.key(0), self.seed)
        return finish(jax.random.uniform(key, cache.pos.shape, jnp.float32), cache.valid())
