"""Scoring rules: which cache entries matter, as one f32 score per slot (higher = keep).

Every policy is a frozen, hashable dataclass (a static argument of ``jax.jit``) with one method,
``score(cache, obs) -> [L, B, Hkv, S] f32``: empty slots score -inf (never kept), protected
slots +inf (kept before anything else), the rest a finite importance. Policies know nothing of
timing (DESIGN §1): prefill eviction and DGE call the same ``score``, only ``obs`` differs.

What the generator reads besides ``score``:

- ``obs_window``: how many trailing prompt queries the forward must record (0 = none);
- ``needs_attn_sum``: whether ``obs.attn_sum`` (H2O's accumulated attention) is needed;
- ``needs_out_proj``: whether ``obs.out_proj`` (the layers' output projections) is needed;
- ``is_full``: True only for ``FullKV``, the no-eviction sentinel;
- ``scorer`` and ``layer_schedule`` (`ScoringRule`'s defaults: itself, and one budget for
  every layer; PyramidKV selects from SnapKV's scores with `budgets.PyramidSchedule`);
- ``refine(scores, budgets, cache, obs)``: the scores selection ranks once each head's
  budget is known (the scores themselves, except for two-stage rules such as CriticalKV).

This module holds the attention rules and controls and the registry of every rule; the
shared pieces are in `dge_jax.rules.scoring`, the query-free rules in
`dge_jax.rules.key_statistics`, the rules built on another rule's scores in
`dge_jax.rules.rule_wrappers`.

Shapes: cache ``k: [L, B, Hkv, S, D]``, ``pos: [L, B, Hkv, S]``; ``obs.q: [L, B, Hq, W, D]``,
``obs.q_pos: [B, W]``. GQA: query head h belongs to kv head ``h // (Hq // Hkv)``; a kv head's
score aggregates its group's scores (``gqa="mean"`` or ``"max"``). SnapKV and PyramidKV pool
each query head's attention and then aggregate the group (kvpress's order), or, with
``gqa_before_pool=True``, aggregate the group's attention and then pool (KVCache-Factory's
"kv_head" order): see `SnapKV`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from dge_jax.eviction.budgets import PyramidSchedule
from dge_jax.eviction.observation import Observation
from dge_jax.rules.scoring import (
    GQA,
    POOLING,
    ScoringRule,
    check_fields,
    finish,
    first_query_pos,
    gqa_aggregate,
    pool1d,
    reduce,
    require_obs,
    window_attention_sum,
)
from dge_jax.runtime.cache import KVCache


@dataclasses.dataclass(frozen=True)
class FullKV(ScoringRule):
    """No eviction: the generator skips selection when ``is_full``; ``score`` keeps every slot."""

    name: ClassVar[str] = "full"
    is_full: ClassVar[bool] = True

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: +inf for every valid slot, -inf for empty ones."""
        valid = cache.valid()
        return finish(jnp.zeros(valid.shape, jnp.float32), valid, protected=valid)


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
    def obs_window(self) -> int:
        """Trailing prompt queries per layer this rule reads (0 = none)."""
        return self.window

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
        scores = jax.lax.map(layer, (cache.k, cache.pos, obs.q, unprotected))
        return finish(scores, cache.valid(), protected)


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV (arXiv 2406.02069): SnapKV's scores with budgets falling from bottom to top.

    Its ``layer_schedule`` is KVCache-Factory's ``PyramidKVCluster`` schedule (beta 20,
    `budgets.PyramidSchedule`); its ``scorer`` is SnapKV with the same settings.
    """

    beta: int = 20

    name: ClassVar[str] = "pyramidkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, ints={"beta": 1})

    @property
    def scorer(self) -> SnapKV:
        """The policy whose scores this one selects from: SnapKV with the same settings (a
        grid scores SnapKV and PyramidKV cells of one timing once)."""
        return SnapKV(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SnapKV)})

    @property
    def layer_schedule(self) -> PyramidSchedule:
        """KVCache-Factory's linear pyramid over this policy's window (`PyramidSchedule`)."""
        return PyramidSchedule(window=self.window, beta=self.beta)


@dataclasses.dataclass(frozen=True)
class H2O(ScoringRule):
    """H2O (arXiv 2306.14048): accumulated attention over every observed query, recent kept.

    One-shot: scores are ``obs.attn_sum`` (whole prompt, plus drafts under DGE).
    """

    window: int = 32
    gqa: str = "mean"

    name: ClassVar[str] = "h2o"
    needs_attn_sum: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_fields(self, ints={"window": 0}, choices={"gqa": GQA})

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: GQA-aggregated attention sums; the last ``window`` prompt
        positions (pos > prompt_end - window, so drafts too) are +inf."""
        require_obs(obs, "attn_sum", "prompt_end")
        scores = gqa_aggregate(obs.attn_sum.astype(jnp.float32), cache.k.shape[2], self.gqa)
        # Row with prompt_end = 9 and window 4: positions 6, 7, 8, 9 (and any draft at 10+).
        protected = cache.pos > (obs.prompt_end - self.window)[None, :, None, None]
        return finish(scores, cache.valid(), protected)


@dataclasses.dataclass(frozen=True)
class StreamingLLM(ScoringRule):
    """StreamingLLM (arXiv 2309.17453): attention sinks plus the most recent entries.

    Original positions are kept (no re-rotation), like kvpress's ``StreamingLLMPress``.
    """

    sinks: int = 4

    name: ClassVar[str] = "streamingllm"

    def __post_init__(self) -> None:
        check_fields(self, ints={"sinks": 0})

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: position (recency), with positions < ``sinks`` at +inf.

        A budget B then keeps the sinks and the B - sinks most recent entries.
        """
        # Positions are exact in f32 up to 2**24 tokens.
        return finish(cache.pos.astype(jnp.float32), cache.valid(), cache.pos < self.sinks)


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


@dataclasses.dataclass(frozen=True)
class KeyNorm(ScoringRule):
    """Control: keep low-norm keys (arXiv 2406.11430; kvpress ``KnormPress``)."""

    name: ClassVar[str] = "knorm"

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: -‖k‖₂ of each (post-RoPE) key, as kvpress scores it."""
        return finish(-jnp.linalg.norm(cache.k.astype(jnp.float32), axis=-1), cache.valid())


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
    def obs_window(self) -> int:
        """Trailing prompt queries per layer this rule reads (0 = none)."""
        return 1

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

        scores = jax.lax.map(layer, (cache.k, cache.pos, q_last))
        protected = (last_pos[:, 0] >= 0)[None, :, None, None] & (
            cache.pos >= last_pos[None, :, :, None]
        )
        return finish(scores, cache.valid(), protected)
