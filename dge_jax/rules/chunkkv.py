"""ChunkKV (arXiv 2502.00299): whole chunks of consecutive positions, ranked by the mean of
the inner rule's scores over each chunk."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dge_jax.rules.base import Needs, Rule, finish, require_obs
from dge_jax.rules.registry import register
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.wrapper import Wrapper, check_inner
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation


@register
@dataclasses.dataclass(frozen=True)
class ChunkKV(Wrapper):
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

    inner: Rule = SnapKV()
    chunk_length: int = 20

    name: ClassVar[str] = "chunkkv"

    def __post_init__(self) -> None:
        check_inner(self, self.inner)
        if isinstance(self.chunk_length, bool) or not isinstance(self.chunk_length, int):
            raise TypeError(
                f"ChunkKV.chunk_length must be an integer >= 1, got {self.chunk_length!r}"
            )
        if self.chunk_length < 1:
            raise ValueError(
                f"ChunkKV.chunk_length must be an integer >= 1, got {self.chunk_length}"
            )

    @property
    def needs(self) -> Needs:
        """What the inner rule reads; nothing protected (its window is scored, not kept)."""
        return dataclasses.replace(self.inner.needs, protected=0)

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
