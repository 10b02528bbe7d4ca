"""FullKV: no eviction, the generator skips selection for it (`is_full`)."""

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
class FullKV(ScoringRule):
    """No eviction: the generator skips selection for it (`is_full`); ``score`` keeps every
    slot."""

    name: ClassVar[str] = "full"

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: +inf for every valid slot, -inf for empty ones."""
        valid = cache.valid()
        return finish(jnp.zeros(valid.shape, jnp.float32), valid, protected=valid)


def is_full(rule: object) -> bool:
    """Whether ``rule`` is the no-eviction sentinel (the generator then selects nothing)."""
    return isinstance(rule, FullKV)
