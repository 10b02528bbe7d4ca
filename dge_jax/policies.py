"""Scoring rules: which cache entries matter, as one f32 score per slot (higher = keep).

Every policy is a frozen, hashable dataclass (a static argument of ``jax.jit``) with one method,
``score(cache, obs) -> [L, B, Hkv, S] f32``: empty slots score -inf (never kept), protected
slots +inf (kept before anything else), the rest a finite importance. Policies know nothing of
timing (DESIGN §1): prefill eviction and DGE call the same ``score``, only ``obs`` differs.

What the generator reads besides ``score``:

- ``obs_window``: how many trailing prompt queries the forward must record (0 = none);
- ``needs_attn_sum``: whether ``obs.attn_sum`` (H2O's accumulated attention) is needed;
- ``is_full``: True only for ``FullKV``, the no-eviction sentinel;
- ``scorer`` and ``layer_schedule`` (`ScoringRule`'s defaults: itself, and one budget for
  every layer; PyramidKV selects from SnapKV's scores with `budgets.PyramidSchedule`).

Shapes: cache ``k: [L, B, Hkv, S, D]``, ``pos: [L, B, Hkv, S]``; ``obs.q: [L, B, Hq, W, D]``,
``obs.q_pos: [B, W]``. GQA: query head h belongs to kv head ``h // (Hq // Hkv)``; a kv head's
score aggregates its group's scores (``gqa="mean"`` or ``"max"``). SnapKV and PyramidKV pool
each query head's attention and then aggregate the group (kvpress's order), or, with
``gqa_before_pool=True``, aggregate the group's attention and then pool (KVCache-Factory's
"kv_head" order): see `SnapKV`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.budgets import PyramidSchedule
from dge_jax.cache import KVCache
from dge_jax.observation import Observation

_INT32_MAX = np.iinfo(np.int32).max
_GQA = ("mean", "max")
_POOLING = ("max", "avg")


class Policy(Protocol):
    """What every scoring rule offers the generator (see the module docstring)."""

    is_full: ClassVar[bool]
    needs_attn_sum: ClassVar[bool]

    @property
    def scorer(self) -> Policy:
        """The policy whose `score` this one selects from (itself, or PyramidKV's SnapKV)."""
        ...

    @property
    def layer_schedule(self) -> PyramidSchedule | None:
        """Per-layer budgets from the nominal one (PyramidKV's), or None: every layer alike."""
        ...

    @property
    def obs_window(self) -> int:
        """Trailing prompt queries per layer the forward must record (0 = none)."""
        ...

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: higher = keep; empty slots -inf, always-kept slots +inf."""
        ...


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_fields(
    obj: Any,
    ints: dict[str, int | tuple[int, int]] | None = None,
    choices: dict[str, tuple[str, ...]] | None = None,
    bools: tuple[str, ...] = (),
) -> None:
    """Checks a frozen dataclass's fields in its ``__post_init__``: one line naming the field,
    the bad value and what is allowed (TypeError for a wrong type, ValueError for a range).

    ints: field -> minimum, or (minimum, maximum) inclusive; Python and numpy integers pass
    (stored back as ``int``), bools and floats do not. choices: field -> allowed strings.
    bools: fields that must be True or False.
    """
    owner = type(obj).__name__
    for name, bounds in (ints or {}).items():
        value = getattr(obj, name)
        low, high = bounds if isinstance(bounds, tuple) else (bounds, None)
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
            raise TypeError(
                f"{owner}.{name} must be {allowed}, got {value!r} ({type(value).__name__})"
            )
        if value < low or (high is not None and value > high):
            raise ValueError(f"{owner}.{name} must be {allowed}, got {value}")
        object.__setattr__(obj, name, int(value))
    for name, allowed in (choices or {}).items():
        _check_choice(f"{owner}.{name}", getattr(obj, name), allowed)
    for name in bools:
        value = getattr(obj, name)
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"{owner}.{name} must be True or False, got {value!r}")
        object.__setattr__(obj, name, bool(value))


def _finish(scores: jax.Array, valid: jax.Array, protected: jax.Array | None = None) -> jax.Array:
    """Scores [L, B, Hkv, S] f32 with protected slots at +inf and empty slots at -inf.

    The one place that writes the sentinels, so every rule agrees on them (empty wins).
    """
    scores = scores.astype(jnp.float32)
    if protected is not None:
        scores = jnp.where(protected, jnp.inf, scores)
    return jnp.where(valid, scores, -jnp.inf)


def _group(x: jax.Array, num_kv_heads: int, axis: int) -> jax.Array:
    """Split query-head axis ``axis`` (size Hq) into [Hkv, G]: head h -> (h // G, h % G)."""
    hq = x.shape[axis]
    if hq % num_kv_heads:
        raise ValueError(f"{hq} query heads do not split into {num_kv_heads} kv heads")
    return x.reshape(x.shape[:axis] + (num_kv_heads, hq // num_kv_heads) + x.shape[axis + 1 :])


def _reduce(x: jax.Array, axis: int, how: str) -> jax.Array:
    return jnp.mean(x, axis=axis) if how == "mean" else jnp.max(x, axis=axis)


def gqa_aggregate(x: jax.Array, num_kv_heads: int, how: str = "mean") -> jax.Array:
    """Per-kv-head scores [L, B, Hkv, S] from per-query-head ones [L, B, Hq, S].

    A kv head's entries serve its whole query group, so its score is the group's mean or max.
    """
    _check_choice("gqa", how, _GQA)
    return _reduce(_group(x, num_kv_heads, axis=2), axis=3, how=how)


def _first_query_pos(q_pos: jax.Array) -> jax.Array:
    """[B] int32: each row's earliest observed query position (int32 max if none)."""
    return jnp.min(jnp.where(q_pos >= 0, q_pos, _INT32_MAX), axis=-1)


def _window_attention_sum(
    k: jax.Array, pos: jax.Array, q: jax.Array, q_pos: jax.Array, weight: jax.Array
) -> jax.Array:
    """Weighted sum over observed queries of their softmax attention to one layer's cache.

    k: [B, Hkv, S, D], pos: [B, Hkv, S], q: [B, Hq, W, D], q_pos: [B, W], weight: [B, W] f32
    -> [B, Hkv, G, S] f32, sum_w weight[w] * softmax_s(q[w] . k[s] / sqrt(D)). Causal per
    query (``0 <= pos <= q_pos``); a query slot with q_pos = -1 adds nothing.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[-1]
    qg = _group(q.astype(jnp.float32), num_kv_heads, axis=1)  # [B, Hkv, G, W, D]
    logits = jnp.einsum("bhgwd,bhsd->bhgws", qg, k.astype(jnp.float32)) / math.sqrt(head_dim)
    # mask [B, Hkv, 1, W, S]: the slot holds a token no later than the (existing) query.
    key_pos = pos[:, :, None, None, :]
    query_pos = q_pos[:, None, None, :, None]
    mask = (key_pos >= 0) & (key_pos <= query_pos) & (query_pos >= 0)
    logits = jnp.where(mask, logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)  # fully masked rows: avoid inf - inf
    unnormalised = jnp.exp(logits - peak)  # masked slots: exp(-inf) = 0
    total = jnp.sum(unnormalised, axis=-1)  # [B, Hkv, G, W]
    # Each query's 1 / total folds into its weight, so the [.., W, S] probabilities are never
    # written out: one pass fewer over the largest array of a scoring (faster on CPU:
    # benchmarks/RESULTS.md, "Measured design choices").
    coef = jnp.where(total > 0, weight[:, None, None, :] / jnp.where(total > 0, total, 1.0), 0.0)
    return jnp.einsum("bhgws,bhgw->bhgs", unnormalised, coef)


def pool1d(x: jax.Array, include: jax.Array, kernel: int, how: str) -> jax.Array:
    """Same-length 1-D pooling along the last axis where only ``include``d slots carry values.

    x: [..., S] f32, include: [..., S] bool -> [..., S] f32.

    Excluded slots (empty, protected) and the borders act as padding: zeros counted in the
    divisor for ``avg`` (torch ``avg_pool1d`` with count_include_pad), absent for ``max``.
    """
    # x: [..., S] f32, include: [..., S] bool -> [..., S]. kernel odd, half = kernel // 2.
    # Worked example, avg, kernel 3, slots [pad, 0, 1, 2, win] with attention [-, .2, .4, .6, -]
    # (slot 0 left padding, slot 4 the protected window): slot 1 -> (0 + .2 + .4) / 3,
    # slot 3 -> (.4 + .6 + 0) / 3. The window's own (large) attention never leaks into slot 3,
    # matching kvpress/KVCache-Factory, which cut the window off before pooling.
    _check_choice("pooling", how, _POOLING)
    if kernel % 2 != 1:
        raise ValueError(f"pooling kernel must be odd, got {kernel}")
    if kernel == 1:
        return jnp.where(include, x, 0.0 if how == "avg" else -jnp.inf)
    half = kernel // 2
    fill = 0.0 if how == "avg" else -jnp.inf
    padded = jnp.pad(
        jnp.where(include, x, fill), [(0, 0)] * (x.ndim - 1) + [(half, half)], constant_values=fill
    )
    length = x.shape[-1]
    windows = [padded[..., o : o + length] for o in range(kernel)]
    if how == "avg":
        return sum(windows[1:], windows[0]) / kernel
    return jnp.max(jnp.stack(windows), axis=0)


def _check_obs(obs: Observation, *fields: str) -> None:
    for field in fields:
        if getattr(obs, field) is None:
            raise ValueError(f"this policy needs obs.{field}, which the forward did not record")


# ---------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------


class ScoringRule:
    """The defaults every policy shares: it scores with its own `score`, and its budget is
    the same for every layer. Derive a policy from it (see WORKSPACE.md)."""

    @property
    def scorer(self) -> Policy:
        """The policy whose `score` this one selects from: itself."""
        return self

    @property
    def layer_schedule(self) -> PyramidSchedule | None:
        """None: every layer keeps the nominal budget."""
        return None


@dataclasses.dataclass(frozen=True)
class FullKV(ScoringRule):
    """No eviction: the generator skips selection when ``is_full``; ``score`` keeps every slot."""

    name: ClassVar[str] = "full"
    is_full: ClassVar[bool] = True
    needs_attn_sum: ClassVar[bool] = False

    @property
    def obs_window(self) -> int:
        """Trailing prompt queries per layer this rule reads (0 = none)."""
        return 0

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: +inf for every valid slot, -inf for empty ones."""
        valid = cache.valid()
        return _finish(jnp.zeros(valid.shape, jnp.float32), valid, protected=valid)


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
    is_full: ClassVar[bool] = False
    needs_attn_sum: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_fields(
            self,
            ints={"window": 1, "kernel": 1},
            choices={"pooling": _POOLING, "gqa": _GQA},
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
        _check_obs(obs, "q", "q_pos")
        first = _first_query_pos(obs.q_pos)  # [B]
        protected = (cache.pos >= 0) & (cache.pos >= first[None, :, None, None])
        unprotected = (cache.pos >= 0) & ~protected
        # Weighted mean over observed queries (weights all 1 unless DGE re-weighs drafts).
        weight = (obs.q_pos >= 0).astype(jnp.float32)  # [B, W]
        if obs.q_weight is not None:
            weight = weight * obs.q_weight
        total = jnp.maximum(jnp.sum(weight, axis=-1), 1e-30)  # [B]

        def layer(args: tuple[jax.Array, ...]) -> jax.Array:
            k, pos, q, include = args  # [B, Hkv, S, D], [B, Hkv, S], [B, Hq, W, D], [B, Hkv, S]
            weighted = _window_attention_sum(k, pos, q, obs.q_pos, weight)  # [B, Hkv, G, S]
            mean = weighted / total[:, None, None, None]
            if self.gqa_before_pool:
                grouped = _reduce(mean, axis=2, how=self.gqa)  # [B, Hkv, S]
                return pool1d(grouped, include, self.kernel, self.pooling)
            pooled = pool1d(mean, include[:, :, None, :], self.kernel, self.pooling)
            return _reduce(pooled, axis=2, how=self.gqa)  # [B, Hkv, S]

        # lax.map over layers: peak memory is one layer's [B, Hq, W, S] attention, not L of them.
        scores = jax.lax.map(layer, (cache.k, cache.pos, obs.q, unprotected))
        return _finish(scores, cache.valid(), protected)


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
    is_full: ClassVar[bool] = False
    needs_attn_sum: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_fields(self, ints={"window": 0}, choices={"gqa": _GQA})

    @property
    def obs_window(self) -> int:
        """Trailing prompt queries per layer this rule reads (0 = none)."""
        return 0

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: GQA-aggregated attention sums; the last ``window`` prompt
        positions (pos > prompt_end - window, so drafts too) are +inf."""
        _check_obs(obs, "attn_sum", "prompt_end")
        scores = gqa_aggregate(obs.attn_sum.astype(jnp.float32), cache.k.shape[2], self.gqa)
        # Row with prompt_end = 9 and window 4: positions 6, 7, 8, 9 (and any draft at 10+).
        protected = cache.pos > (obs.prompt_end - self.window)[None, :, None, None]
        return _finish(scores, cache.valid(), protected)


@dataclasses.dataclass(frozen=True)
class StreamingLLM(ScoringRule):
    """StreamingLLM (arXiv 2309.17453): attention sinks plus the most recent entries.

    Original positions are kept (no re-rotation), like kvpress's ``StreamingLLMPress``.
    """

    sinks: int = 4

    name: ClassVar[str] = "streamingllm"
    is_full: ClassVar[bool] = False
    needs_attn_sum: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_fields(self, ints={"sinks": 0})

    @property
    def obs_window(self) -> int:
        """Trailing prompt queries per layer this rule reads (0 = none)."""
        return 0

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: position (recency), with positions < ``sinks`` at +inf.

        A budget B then keeps the sinks and the B - sinks most recent entries.
        """
        # Positions are exact in f32 up to 2**24 tokens.
        return _finish(cache.pos.astype(jnp.float32), cache.valid(), cache.pos < self.sinks)


@dataclasses.dataclass(frozen=True)
class RandomScores(ScoringRule):
    """Control: uniform random scores from a key folded from ``seed`` (kvpress RandomPress)."""

    seed: int = 0

    name: ClassVar[str] = "random"
    is_full: ClassVar[bool] = False
    needs_attn_sum: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_fields(self, ints={"seed": (0, 2**32 - 1)})  # jax.random.fold_in takes a uint32

    @property
    def obs_window(self) -> int:
        """Trailing prompt queries per layer this rule reads (0 = none)."""
        return 0

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32 in [0, 1): the same for the same seed and cache shape."""
        key = jax.random.fold_in(jax.random.key(0), self.seed)
        return _finish(jax.random.uniform(key, cache.pos.shape, jnp.float32), cache.valid())


@dataclasses.dataclass(frozen=True)
class KeyNorm(ScoringRule):
    """Control: keep low-norm keys (arXiv 2406.11430; kvpress ``KnormPress``)."""

    name: ClassVar[str] = "knorm"
    is_full: ClassVar[bool] = False
    needs_attn_sum: ClassVar[bool] = False

    @property
    def obs_window(self) -> int:
        """Trailing prompt queries per layer this rule reads (0 = none)."""
        return 0

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: -‖k‖₂ of each (post-RoPE) key, as kvpress scores it."""
        return _finish(-jnp.linalg.norm(cache.k.astype(jnp.float32), axis=-1), cache.valid())


@dataclasses.dataclass(frozen=True)
class TOVA(ScoringRule):
    """TOVA (arXiv 2401.06104): attention of the last observed query only.

    ``across_heads=True`` (default) aggregates over all query heads of the layer, as TOVA and
    kvpress's ``TOVAPress`` do (every kv head then scores alike); False uses the GQA group.
    """

    gqa: str = "mean"
    across_heads: bool = True

    name: ClassVar[str] = "tova"
    is_full: ClassVar[bool] = False
    needs_attn_sum: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_fields(self, choices={"gqa": _GQA}, bools=("across_heads",))

    @property
    def obs_window(self) -> int:
        """Trailing prompt queries per layer this rule reads (0 = none)."""
        return 1

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: the last query's attention (aggregated over heads); slots at or
        after its position (itself, and under DGE-W the drafts) are +inf."""
        _check_obs(obs, "q", "q_pos")
        q_pos = obs.q_pos  # [B, W]
        last = jnp.argmax(jnp.where(q_pos >= 0, q_pos, -1), axis=-1)  # [B] index into W
        last_pos = jnp.take_along_axis(q_pos, last[:, None], axis=-1)  # [B, 1], -1 if none
        q_last = jnp.take_along_axis(obs.q, last[None, :, None, None, None], axis=3)
        # q_last: [L, B, Hq, 1, D]

        def layer(args: tuple[jax.Array, ...]) -> jax.Array:
            k, pos, q = args
            ones = jnp.ones(last_pos.shape, jnp.float32)
            attn = _window_attention_sum(k, pos, q, last_pos, ones)  # [B, Hkv, G, S]
            if self.across_heads:
                flat = attn.reshape(attn.shape[0], -1, attn.shape[-1])  # [B, Hq, S]
                agg = _reduce(flat, axis=1, how=self.gqa)[:, None]  # [B, 1, S]
                return jnp.broadcast_to(agg, pos.shape)
            return _reduce(attn, axis=2, how=self.gqa)

        scores = jax.lax.map(layer, (cache.k, cache.pos, q_last))
        protected = (last_pos[:, 0] >= 0)[None, :, None, None] & (
            cache.pos >= last_pos[None, :, :, None]
        )
        return _finish(scores, cache.valid(), protected)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

POLICIES: dict[str, type] = {
    cls.name: cls
    for cls in (FullKV, SnapKV, PyramidKV, H2O, StreamingLLM, RandomScores, KeyNorm, TOVA)
}


def make_policy(name: str, **options: Any) -> Policy:
    """The policy registered as ``name`` built with ``options``; unknown names or options raise.

    For command lines and sweeps: ``make_policy("snapkv", window=8)``.
    """
    key = name.lower()
    if key not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[key]
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for policy {key!r}; known: {known or 'none'}"
        )
    return cls(**options)
