"""LagKV (arXiv 2504.04704): lag-relative spread of keys and values.

Query-free (from the keys and values alone, over each row's prompt entries): DGE and DGE-W
select exactly what prefill eviction selects, the draft entries kept on top.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dge_jax.rules.base import Needs, ScoringRule, check_fields, finish
from dge_jax.rules.ops import prompt_entries
from dge_jax.rules.registry import register
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.quantized import dequantize
from dge_jax.runtime.records import Observation


@register
@dataclasses.dataclass(frozen=True)
class LagKV(ScoringRule):
    """LagKV (arXiv 2504.04704; kvpress ``LagKVPress``): lag-relative spread of keys and values.

    Prompt positions after the ``sinks`` are cut into partitions of ``lag_size``; each entry
    of partition j is scored by how widely its key (and value) varies across channels once
    scaled by the min-max range of partition j + 1, softmaxed within the partition, keys and
    values averaged; without ``cross_scoring`` the score is the entry's rank within its
    partition / lag_size, so every partition keeps its share. Sinks and the tail (the last
    full partition, which has no reference, plus the remainder) score 1, above every rank.
    A prompt shorter than sinks + 2·lag_size is not partitioned: sinks score 1, the rest by
    recency ((pos - sinks) / (n - sinks)), as kvpress does.

    A reference channel whose range is zero scales to 0 here (kvpress divides by zero and
    its scores turn NaN); with real or random weights that does not occur.
    """

    sinks: int = 4
    lag_size: int = 128
    cross_scoring: bool = False

    name: ClassVar[str] = "lagkv"

    def __post_init__(self) -> None:
        check_fields(self, ints={"sinks": 0, "lag_size": 2}, bools=("cross_scoring",))

    @property
    def needs(self) -> Needs:
        """Nothing recorded; the sinks count as always kept (they score 1, the top)."""
        return Needs(protected=self.sinks)

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32 in [0, 1]: partition ranks (or softmaxed spreads), sinks and
        tail 1; short prompts by recency."""
        prompt = prompt_entries(cache, obs)
        n = (obs.prompt_end + 1)[None, :, None, None]  # prompt tokens per row
        rel = cache.pos - self.sinks  # position after the sinks
        full = (n - self.sinks) // self.lag_size  # complete partitions per row
        part = jnp.where(rel >= 0, rel // self.lag_size, -1)
        # Scored: partitions 0 .. full - 2 (each has a complete reference partition after it).
        scored = prompt & (rel >= 0) & (part <= full - 2)
        ranks = jax.lax.map(self._layer, (cache.stored_k, cache.stored_v, cache.pos, scored))
        # Worked example, sinks 4, lag 128, a 600-token prompt: full = 4 partitions (positions
        # 4..515), the remainder 516..599; partitions 0..2 (4..387) are scored, partition 3 and
        # the remainder (388..599, 212 entries) are the tail and score 1 like the 4 sinks.
        partitioned = jnp.where(scored, ranks, 1.0)
        recency = jnp.where(rel >= 0, rel / jnp.maximum(n - self.sinks, 1), 1.0)
        short = n < self.sinks + 2 * self.lag_size
        return finish(jnp.where(short, recency, partitioned), prompt)

    def _layer(self, args: tuple[jax.Array, ...]) -> jax.Array:
        """One layer's partition scores [B, Hkv, S] (meaningful where `scored`)."""
        k, v, pos, scored = args  # [B, Hkv, S, D] x2, [B, Hkv, S], [B, Hkv, S]
        k, v = dequantize(k), dequantize(v)  # one layer at a time
        s = pos.shape[-1]
        lag = self.lag_size
        parts = s // lag + 1  # enough partitions for any position a slot can hold
        # Position-major view: slot -> dense index (partition, offset) = pos - sinks. The
        # members of partitions 0 .. full - 1 land at their index; every other slot at the
        # dump index parts * lag, which is dropped. `inverse` maps each dense index back to
        # its slot (s = none), so gathering with it lays the keys out as [parts, lag].
        rel = pos - self.sinks
        member = (rel >= 0) & (rel < parts * lag) & (pos >= 0)
        dense = jnp.where(member, rel, parts * lag)

        def inverse(idx: jax.Array) -> jax.Array:  # [S] -> [parts * lag + 1]
            slots = jnp.arange(s, dtype=jnp.int32)
            return jnp.full((parts * lag + 1,), s, jnp.int32).at[idx].set(slots, mode="drop")

        inv = jax.vmap(jax.vmap(inverse))(dense)[..., : parts * lag]  # [B, Hkv, parts * lag]

        def laid_out(x: jax.Array) -> jax.Array:  # [B, Hkv, S, D] -> [B, Hkv, parts, lag, D]
            padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 0), (0, 1), (0, 0)))
            picked = jnp.take_along_axis(padded, inv[..., None], axis=2)
            return picked.reshape(x.shape[:2] + (parts, lag, x.shape[-1]))

        score = (self._spread(laid_out(k)) + self._spread(laid_out(v))) / 2  # [B, Hkv, P-1, lag]
        if not self.cross_scoring:
            # Rank within the partition (0 = lowest), as kvpress's argsort().argsort() / lag.
            score = jnp.argsort(jnp.argsort(score, axis=-1), axis=-1) / lag
        flat = jnp.pad(score.reshape(score.shape[:2] + (-1,)), ((0, 0), (0, 0), (0, lag + 1)))
        # Back to slots: a scored slot's dense index is below (full - 1) * lag <= (P - 1) * lag.
        return jnp.take_along_axis(flat, jnp.where(scored, dense, flat.shape[-1] - 1), axis=-1)

    @staticmethod
    def _spread(x: jax.Array) -> jax.Array:
        """[B, Hkv, P, lag, D] -> [B, Hkv, P - 1, lag]: softmax over each partition of the
        channel std (unbiased, as torch's) of its entries min-max scaled by the next one."""
        ref, target = x[:, :, 1:], x[:, :, :-1]
        low = jnp.min(ref, axis=-2, keepdims=True)
        span = jnp.max(ref, axis=-2, keepdims=True) - low
        scaled = jnp.where(span > 0, (target - low) / jnp.where(span > 0, span, 1.0), 0.0)
        return jax.nn.softmax(jnp.std(scaled, axis=-1, ddof=1), axis=-1)
