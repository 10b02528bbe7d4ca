"""TOVA (arXiv 2401.06104): attention of the last observed query only."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dge_jax.rules.base import Needs, ScoringRule, check_fields, finish, require_obs
from dge_jax.rules.ops import GQA, reduce, window_attention_sum
from dge_jax.rules.registry import register
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation


@register
@dataclasses.dataclass(frozen=True)
class TOVA(ScoringRule):
    """TOVA (arXiv 2401.06104): attention of the last observed query only.

    ``across_heads=True`` (default) aggregates over all query heads of the layer, as TOVA and
    kvpress's ``TOVAPress`` do (every kv head then scores alike); False uses the GQA group.
    """

    gqa: str = "mean"
    across_heads: bool = True

    name: ClassVar[str] = "tova"

    def __post_init__(self) -> None:
        check_fields(self, choices={"gqa": GQA}, bools=("across_heads",))

    @property
    def needs(self) -> Needs:
        """The last prompt query (and, under DGE, the drafts')."""
        return Needs(window=1)

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: the last query's attention (aggregated over heads); slots at or
        after its position (itself, and under DGE-W the drafts) are +inf."""
        require_obs(obs, "q", "q_pos")
        q_pos = obs.q_pos  # [B, W]
        last = jnp.argmax(jnp.where(q_pos >= 0, q_pos, -1), axis=-1)  # [B] index into W
        last_pos = jnp.take_along_axis(q_pos, last[:, None], axis=-1)  # [B, 1], -1 if none
        q_last = jnp.take_along_axis(obs.q, last[None, :, None, None, None], axis=3)
        # q_last: [L, B, Hq, 1, D]

        def layer(args: tuple[jax.Array, ...]) -> jax.Array:
            k, pos, q = args
            ones = jnp.ones(last_pos.shape, jnp.float32)
            attn = window_attention_sum(k, pos, q, last_pos, ones)  # [B, Hkv, G, S]
            if self.across_heads:
                flat = attn.reshape(attn.shape[0], -1, attn.shape[-1])  # [B, Hq, S]
                agg = reduce(flat, axis=1, how=self.gqa)[:, None]  # [B, 1, S]
                return jnp.broadcast_to(agg, pos.shape)
            return reduce(attn, axis=2, how=self.gqa)

        scores = jax.lax.map(layer, (cache.stored_k, cache.pos, q_last))
        protected = (last_pos[:, 0] >= 0)[None, :, None, None] & (
            cache.pos >= last_pos[None, :, :, None]
        )
        return finish(scores, cache.valid(), protected)
