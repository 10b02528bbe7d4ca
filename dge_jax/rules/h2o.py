"""H2O (arXiv 2306.14048): accumulated attention of every observed query, recent entries kept."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dge_jax.rules.base import Needs, ScoringRule, check_fields, finish, require_obs
from dge_jax.rules.ops import GQA, gqa_aggregate
from dge_jax.rules.registry import register
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation


@register
@dataclasses.dataclass(frozen=True)
class H2O(ScoringRule):
    """H2O (arXiv 2306.14048): accumulated attention over every observed query, recent kept.

    One-shot: scores are ``obs.attn_sum`` (whole prompt, plus drafts under DGE).
    """

    window: int = 32
    gqa: str = "mean"

    name: ClassVar[str] = "h2o"

    def __post_init__(self) -> None:
        check_fields(self, ints={"window": 0}, choices={"gqa": GQA})

    @property
    def needs(self) -> Needs:
        """Attention sums; the last ``window`` prompt entries are always kept."""
        return Needs(attn_sum=True, protected=self.window)

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: GQA-aggregated attention sums; the last ``window`` prompt
        positions (pos > prompt_end - window, so drafts too) are +inf."""
        require_obs(obs, "attn_sum", "prompt_end")
        scores = gqa_aggregate(obs.attn_sum.astype(jnp.float32), cache.k.shape[2], self.gqa)
        # Row with prompt_end = 9 and window 4: positions 6, 7, 8, 9 (and any draft at 10+).
        protected = cache.pos > (obs.prompt_end - self.window)[None, :, None, None]
        return finish(scores, cache.valid(), protected)
