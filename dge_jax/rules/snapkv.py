"""SnapKV (arXiv 2404.14469): attention of the observation window, pooled along the sequence.

A kv head's score aggregates its query group's (``gqa="mean"`` or ``"max"``). SnapKV pools each
query head's attention and then aggregates the group (kvpress's order), or, with
``gqa_before_pool=True``, aggregates the group's attention and then pools (KVCache-Factory's
"kv_head" order): see `SnapKV`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from dge_jax.rules.base import Needs, ScoringRule, check_fields, finish, require_obs
from dge_jax.rules.ops import (
    GQA,
    POOLING,
    first_query_pos,
    pool1d,
    reduce,
    window_attention_sum,
)
from dge_jax.rules.registry import register
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation


@register
@dataclasses.dataclass(frozen=True)
class SnapKV(ScoringRule):
    """SnapKV (arXiv 2404.14469): attention of the observation window, pooled along the sequence.

    Defaults are the paper's (window 32, kernel 7, max-pool); ``SnapKV.kvpress()`` is kvpress's.

    gqa_before_pool: the order of the two reductions of a kv group's per-query-head window
    attention. False (default, kvpress's order): pool each query head's attention along the
    keys, then aggregate the group (``gqa``: mean or max). True (KVCache-Factory's "kv_head"
    path): aggregate the group's attention with ``gqa`` first, then pool. Avg-pool commutes
    with the mean (up to rounding); max-pool does not. Worked example, 2 query heads of one
    group, 5 unprotected keys, max-pool, kernel 3 (the borders add nothing), gqa mean:

        head a attention:  0   .6   0    0   .4       pooled:  .6  .6  .6  .4  .4
        head b attention:  0    0  .6    0   .4       pooled:  0   .6  .6  .6  .4
        pool, then mean (False):                               .3  .6  .6  .5  .4
        group mean:        0   .3  .3    0   .4
        mean, then pool (True):                                .3  .3  .3  .4  .4

    Budget 2 keeps keys {1, 2} under False and {3, 4} under True. With budget 1 each order
    has a two-way plateau, and `Eviction.ties` picks within it: key 2 ("later") or key 1
    ("earlier") under False, key 4 or key 3 under True.
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    gqa: str = "mean"
    gqa_before_pool: bool = False

    name: ClassVar[str] = "snapkv"

    def __post_init__(self) -> None:
        check_fields(
            self,
            ints={"window": 1, "kernel": 1},
            choices={"pooling": POOLING, "gqa": GQA},
            bools=("gqa_before_pool",),
        )
        if self.kernel % 2 != 1:
            raise ValueError(
                f"{type(self).__name__}.kernel must be a positive odd number, got {self.kernel}"
            )

    @classmethod
    def kvpress(cls, **overrides: Any) -> SnapKV:
        """kvpress ``SnapKVPress`` defaults: window 64, kernel 5, avg-pool, means over window and
        group; with the same queries its scores select exactly kvpress's entries."""
        return cls(**{"window": 64, "kernel": 5, "pooling": "avg", "gqa": "mean", **overrides})

    @property
    def needs(self) -> Needs:
        """The last ``window`` prompt queries; their entries are always kept."""
        return Needs(window=self.window, protected=self.window)

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: pooled mean window attention; window (and draft) entries +inf.

        Every observed query counts (the last ``window`` prompt queries, plus drafts under DGE).
        """
        # Formula, per layer / row / kv head, with Q the observed queries (q_pos >= 0):
        #   a[g, s] = mean_{w in Q} softmax_s(q[g, w] . k[s] / sqrt(D))   (causal, valid keys)
        #   p[g, s] = pool_s(a[g, s] over unprotected valid slots)        (odd kernel, see pool1d)
        #   score[s] = mean_g p[g, s] (or max)    with    protected = pos >= min_{w in Q} q_pos[w]
        # (gqa_before_pool: score[s] = pool_s(mean_g a[g, s]) (or max), the same masks.)
        # kvpress (snapkv_press.py) does the same in this order: softmax over all keys with the
        # causal window mask, drop the window's own keys, mean over the window's queries,
        # avg_pool1d(padding = kernel // 2), mean over the group, window entries score max + 1.
        # (KVCache-Factory's GQA "kv_head" path reduces the group *before* pooling; for avg-pool
        # the order is irrelevant, for max-pool with gqa="mean" it is not: we pool first unless
        # gqa_before_pool. A static branch: the default traces exactly the code it always did.)
        # Pool neighbours are slots: empty and protected slots are padding (see pool1d), which
        # on a left-padded prefill cache is exactly the zero padding kvpress puts at the ends.
        require_obs(obs, "q", "q_pos")
        first = first_query_pos(obs.q_pos)  # [B]
        protected = (cache.pos >= 0) & (cache.pos >= first[None, :, None, None])
        unprotected = (cache.pos >= 0) & ~protected
        # Weighted mean over observed queries (weights all 1 unless DGE re-weighs drafts).
        weight = (obs.q_pos >= 0).astype(jnp.float32)  # [B, W]
        if obs.q_weight is not None:
            weight = weight * obs.q_weight
        total = jnp.maximum(jnp.sum(weight, axis=-1), 1e-30)  # [B]

        def layer(args: tuple[jax.Array, ...]) -> jax.Array:
            k, pos, q, include = args  # [B, Hkv, S, D], [B, Hkv, S], [B, Hq, W, D], [B, Hkv, S]
            weighted = window_attention_sum(k, pos, q, obs.q_pos, weight)  # [B, Hkv, G, S]
            mean = weighted / total[:, None, None, None]
            if self.gqa_before_pool:
                grouped = reduce(mean, axis=2, how=self.gqa)  # [B, Hkv, S]
                return pool1d(grouped, include, self.kernel, self.pooling)
            pooled = pool1d(mean, include[:, :, None, :], self.kernel, self.pooling)
            return reduce(pooled, axis=2, how=self.gqa)  # [B, Hkv, S]

        # lax.map over layers: peak memory is one layer's [B, Hq, W, S] attention, not L of them.
        scores = jax.lax.map(layer, (cache.stored_k, cache.pos, obs.q, unprotected))
        return finish(scores, cache.valid(), protected)
