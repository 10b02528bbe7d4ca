"""CriticalKV (arXiv 2502.03805): two stages per head, the inner rule's best entries, then
the rest of the budget by (score + epsilon) times the projected value norm ‖v W_o‖₁."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dge_jax.rules.base import Needs, Rule, require_obs
from dge_jax.rules.ops import group_heads
from dge_jax.rules.registry import register
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.wrapper import Wrapper, check_inner
from dge_jax.runtime import selection
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation


def projected_value_norms(v: jax.Array, out_proj: jax.Array) -> jax.Array:
    """‖v_s W_o^h‖₁ averaged over each kv head's query group: [L, B, Hkv, S] f32.

    v: [L, B, Hkv, S, D]; out_proj: [L, Hq, D, E] (query head h's rows of W_o). What the
    entry would add to the layer's output if attended with weight 1, by head (kvpress's
    ``CriticalKVPress.vwl1norm``).
    """
    num_kv_heads = v.shape[2]

    def layer(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        v_l, wo = args  # [B, Hkv, S, D], [Hq, D, E]
        wo = group_heads(wo.astype(jnp.float32), num_kv_heads, axis=0)  # [Hkv, G, D, E]
        # One query head at a time: [B, Hkv, S, E] is the largest array, not [.., G, S, E].
        def head(g: jax.Array) -> jax.Array:
            proj = jnp.einsum("bhsd,hde->bhse", v_l.astype(jnp.float32), wo[:, g])
            return jnp.sum(jnp.abs(proj), axis=-1)

        return jnp.mean(jax.lax.map(head, jnp.arange(wo.shape[1])), axis=0)

    return jax.lax.map(layer, (v, out_proj))


@register
@dataclasses.dataclass(frozen=True)
class CriticalKV(Wrapper):
    """CriticalKV (arXiv 2502.03805; kvpress ``CriticalKVPress`` / ``CriticalAdaKVPress``).

    Two stages per head with budget B: the ⌊first_stage_ratio·B⌋ entries the inner rule
    ranks highest are kept; the rest of the budget goes to the highest (score + epsilon) ·
    ‖v W_o‖₁ (`projected_value_norms`). With ``head_budget="adakv"`` the head budgets come
    from the inner scores first, as in ``CriticalAdaKVPress``. The inner scores are shared
    with the inner rule's own cells (``scorer``), so a grid scores once for both.
    """

    inner: Rule = SnapKV()
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    name: ClassVar[str] = "criticalkv"

    def __post_init__(self) -> None:
        check_inner(self, self.inner)
        for field in ("epsilon", "first_stage_ratio"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"CriticalKV.{field} must be a number >= 0, got {value!r}")
        if self.first_stage_ratio > 1:
            raise ValueError(
                f"CriticalKV.first_stage_ratio must be in [0, 1], got {self.first_stage_ratio}"
            )

    @property
    def needs(self) -> Needs:
        """The inner rule's needs and the output projection (stage 2's ‖v W_o‖₁)."""
        return self.inner.needs | Needs(out_proj=True)

    @property
    def scorer(self) -> Rule:
        """The inner rule's scorer: stage 1 ranks its scores."""
        return self.inner.scorer

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """The inner rule's scores (stage 2 needs the budget: `refine`)."""
        return self.scorer.score(cache, obs)

    def refine(
        self,
        scores: jax.Array,
        budgets: jax.Array,
        cache: KVCache,
        obs: Observation,
        ties: str = "later",
    ) -> jax.Array:
        """Stage 1's entries at +inf, the rest at (score + epsilon) · ‖v W_o‖₁."""
        require_obs(obs, "out_proj")
        scores = self.inner.refine(scores, budgets, cache, obs, ties)
        # kvpress: int(n_kept * first_stage_ratio) by the inner score, topk then scatter max.
        first = jnp.floor(budgets * jnp.float32(self.first_stage_ratio)).astype(jnp.int32)
        stage1 = selection.select_slots(scores, first, ties=ties, positions=cache.pos)
        norms = projected_value_norms(cache.v, obs.out_proj)
        # +inf (protected, drafts) and -inf (empty) stay as they are: inf * 0 would be NaN.
        rescored = jnp.where(jnp.isfinite(scores), (scores + self.epsilon) * norms, scores)
        return jnp.where(stage1, jnp.inf, rescored)
