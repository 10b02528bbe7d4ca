"""Rules built on another rule's scores: CriticalKV re-ranks them with the output projection
of the values, ChunkKV keeps whole chunks of consecutive positions by their summed score.

Each wraps an inner policy and reads what it reads (its query window, attention sums), so
it works under every timing the inner rule does: under DGE the drafted queries inform the
inner scores, and the wrapper's stage follows them.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dge_jax.eviction import selection
from dge_jax.eviction.budgets import PyramidSchedule
from dge_jax.eviction.observation import Observation
from dge_jax.rules.policies import SnapKV
from dge_jax.rules.scoring import Policy, ScoringRule, finish, group_heads, require_obs
from dge_jax.runtime.cache import KVCache


def _check_inner(owner: object, inner: object) -> None:
    if not isinstance(inner, ScoringRule) or getattr(inner, "is_full", False):
        raise TypeError(
            f"{type(owner).__name__}.inner must be an evicting scoring rule (e.g. SnapKV()), "
            f"got {inner!r}"
        )


class _Wrapper(ScoringRule):
    """What a wrapper reads is what its inner rule reads."""

    inner: Policy

    @property
    def obs_window(self) -> int:
        """Trailing prompt queries per layer the inner rule reads."""
        return self.inner.obs_window

    @property
    def needs_attn_sum(self) -> bool:  # type: ignore[override]
        return self.inner.needs_attn_sum

    @property
    def query_stats_from(self) -> int | None:
        return self.inner.query_stats_from

    @property
    def reconstruction(self):
        return self.inner.reconstruction

    @property
    def layer_schedule(self) -> PyramidSchedule | None:
        """The inner rule's per-layer budgets (PyramidKV's), if any."""
        return self.inner.layer_schedule


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


@dataclasses.dataclass(frozen=True)
class CriticalKV(_Wrapper):
    """CriticalKV (arXiv 2502.03805; kvpress ``CriticalKVPress`` / ``CriticalAdaKVPress``).

    Two stages per head with budget B: the ⌊first_stage_ratio·B⌋ entries the inner rule
    ranks highest are kept; the rest of the budget goes to the highest (score + epsilon) ·
    ‖v W_o‖₁ (`projected_value_norms`). With ``head_budget="adakv"`` the head budgets come
    from the inner scores first, as in ``CriticalAdaKVPress``. The inner scores are shared
    with the inner rule's own cells (``scorer``), so a grid scores once for both.
    """

    inner: Policy = SnapKV()
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    name: ClassVar[str] = "criticalkv"
    needs_out_proj: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_inner(self, self.inner)
        for field in ("epsilon", "first_stage_ratio"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"CriticalKV.{field} must be a number >= 0, got {value!r}")
        if self.first_stage_ratio > 1:
            raise ValueError(
                f"CriticalKV.first_stage_ratio must be in [0, 1], got {self.first_stage_ratio}"
            )

    @property
    def scorer(self) -> Policy:
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
        stage1 = selection.select(scores, first, ties=ties, positions=cache.pos)
        norms = projected_value_norms(cache.v, obs.out_proj)
        # +inf (protected, drafts) and -inf (empty) stay as they are: inf * 0 would be NaN.
        rescored = jnp.where(jnp.isfinite(scores), (scores + self.epsilon) * norms, scores)
        return jnp.where(stage1, jnp.inf, rescored)


@dataclasses.dataclass(frozen=True)
class ChunkKV(_Wrapper):
    """ChunkKV (arXiv 2502.00299; kvpress ``ChunkKVPress``): whole chunks of positions.

    Prompt positions are cut into chunks of ``chunk_length`` from position 0 (the last one
    may be shorter); a chunk's score is the mean of the inner scores of its entries over
    every kv head of the layer, so all heads of a layer rank chunks alike, and every entry
    scores its chunk's score. The inner rule's always-kept entries (its window, scored +inf)
    count with the largest finite score of the layer plus 1, as kvpress's SnapKV and
    ExpectedAttention score them (max + 1); ChunkKV itself protects nothing, like kvpress.

    Budget B per head keeps the ⌊B / chunk_length⌋ best chunks and, of the next, its first
    (ties "earlier") or last ("later") B mod chunk_length entries; kvpress keeps whole chunks
    only, int(n_chunks · (1 - ratio)) of them: the same set when B is a multiple of
    chunk_length, except that where the short last chunk is among the best, the budget's rest
    comes here from the next best chunk (kvpress keeps fewer than B).
    """

    inner: Policy = SnapKV()
    chunk_length: int = 20

    name: ClassVar[str] = "chunkkv"

    def __post_init__(self) -> None:
        _check_inner(self, self.inner)
        if isinstance(self.chunk_length, bool) or not isinstance(self.chunk_length, int):
            raise TypeError(
                f"ChunkKV.chunk_length must be an integer >= 1, got {self.chunk_length!r}"
            )
        if self.chunk_length < 1:
            raise ValueError(
                f"ChunkKV.chunk_length must be an integer >= 1, got {self.chunk_length}"
            )

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: each prompt entry's chunk score; drafts as the inner rule."""
        require_obs(obs, "prompt_end")
        inner = self.inner.scorer.score(cache, obs)
        pos = cache.pos
        prompt = (pos >= 0) & (pos <= obs.prompt_end[None, :, None, None])
        finite = prompt & jnp.isfinite(inner)
        top = jnp.max(jnp.where(finite, inner, -jnp.inf), axis=(2, 3), keepdims=True)  # [L, B]
        # kvpress's inner rules score their window / sinks at max + 1 (SnapKV, ExpectedAttention):
        # with attention-sized scores (< 1) that +1 is what keeps a window chunk on top.
        value = jnp.where(finite, inner, jnp.where(prompt & (inner > 0), top + 1.0, 0.0))
        value = jnp.where(jnp.isfinite(value), value, 0.0)  # a layer with no finite score
        nl, b, h, s = pos.shape
        chunks = s // self.chunk_length + 1  # enough for any position a slot can hold
        # Chunk sums and member counts over the layer's heads: scatter-add by chunk id.
        ids = jnp.where(prompt, pos // self.chunk_length, chunks)  # non-prompt -> dump chunk
        flat_ids = ids.reshape(nl, b, h * s)

        def chunk_sums(x: jax.Array) -> jax.Array:  # [L, B, H*S] -> [L, B, chunks + 1]
            add = lambda i, v: jnp.zeros((chunks + 1,), jnp.float32).at[i].add(v)  # noqa: E731
            return jax.vmap(jax.vmap(add))(flat_ids, x.reshape(nl, b, h * s))

        total = chunk_sums(value)
        count = chunk_sums(prompt.astype(jnp.float32))
        mean = total / jnp.maximum(count, 1.0)
        per_slot = jnp.take_along_axis(mean, flat_ids, axis=-1).reshape(nl, b, h, s)
        return finish(jnp.where(prompt, per_slot, inner), cache.valid())
