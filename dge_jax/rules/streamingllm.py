"""StreamingLLM (arXiv 2309.17453): attention sinks plus the most recent entries."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dge_jax.rules.base import Needs, ScoringRule, check_fields, finish
from dge_jax.rules.registry import register
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation


@register
@dataclasses.dataclass(frozen=True)
class StreamingLLM(ScoringRule):
    """StreamingLLM (arXiv 2309.17453): attention sinks plus the most recent entries.

    Original positions are kept (no re-rotation), like kvpress's ``StreamingLLMPress``.
    """

    sinks: int = 4

    name: ClassVar[str] = "streamingllm"

    def __post_init__(self) -> None:
        check_fields(self, ints={"sinks": 0})

    @property
    def needs(self) -> Needs:
        """Nothing recorded; the sinks are always kept."""
        return Needs(protected=self.sinks)

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: position (recency), with positions < ``sinks`` at +inf.

        A budget B then keeps the sinks and the B - sinks most recent entries.
        """
        # Positions are exact in f32 up to 2**24 tokens.
        return finish(cache.pos.astype(jnp.float32), cache.valid(), cache.pos < self.sinks)
