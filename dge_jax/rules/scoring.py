"""What every scoring rule shares: the `Policy` protocol, the `ScoringRule` defaults, field
checks, the score sentinels, GQA aggregation, window attention and pooling.

The rules themselves live in `dge_jax.rules.policies` (attention rules and controls, and the
registry), `dge_jax.rules.key_statistics` (query-free rules) and
`dge_jax.rules.rule_wrappers` (rules built on another rule's scores). Shapes: cache
``k: [L, B, Hkv, S, D]``, ``pos: [L, B, Hkv, S]``; ``obs.q: [L, B, Hq, W, D]``,
``obs.q_pos: [B, W]``. GQA: query head h belongs to kv head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.eviction.budgets import PyramidSchedule
from dge_jax.eviction.observation import Observation
from dge_jax.runtime.cache import INT32_MAX, KVCache

GQA = ("mean", "max")
POOLING = ("max", "avg")


class Policy(Protocol):
    """What every scoring rule offers the generator (see `dge_jax.rules.policies`)."""

    is_full: ClassVar[bool]
    needs_attn_sum: ClassVar[bool]
    needs_out_proj: ClassVar[bool]

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

    @property
    def query_stats_from(self) -> int | None:
        """None, or the first position whose pre-RoPE query enters `obs.q_stats`."""
        ...

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: higher = keep; empty slots -inf, always-kept slots +inf."""
        ...

    @property
    def reconstruction(self):
        """None, or the reconstruct stage whose scores (`obs.recon`) the rule reads."""
        ...

    def refine(
        self,
        scores: jax.Array,
        budgets: jax.Array,
        cache: KVCache,
        obs: Observation,
        ties: str = "later",
    ) -> jax.Array:
        """The scores selection ranks, once each head's budget [L, B, Hkv] is known."""
        ...


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
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
        check_choice(f"{owner}.{name}", getattr(obj, name), allowed)
    for name in bools:
        value = getattr(obj, name)
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"{owner}.{name} must be True or False, got {value!r}")
        object.__setattr__(obj, name, bool(value))


def finish(scores: jax.Array, valid: jax.Array, protected: jax.Array | None = None) -> jax.Array:
    """Scores [L, B, Hkv, S] f32 with protected slots at +inf and empty slots at -inf.

    The one place that writes the sentinels, so every rule agrees on them (empty wins).
    """
    scores = scores.astype(jnp.float32)
    if protected is not None:
        scores = jnp.where(protected, jnp.inf, scores)
    return jnp.where(valid, scores, -jnp.inf)


def group_heads(x: jax.Array, num_kv_heads: int, axis: int) -> jax.Array:
    """Split query-head axis ``axis`` (size Hq) into [Hkv, G]: head h -> (h // G, h % G)."""
    hq = x.shape[axis]
    if hq % num_kv_heads:
        raise ValueError(f"{hq} query heads do not split into {num_kv_heads} kv heads")
    return x.reshape(x.shape[:axis] + (num_kv_heads, hq // num_kv_heads) + x.shape[axis + 1 :])


def reduce(x: jax.Array, axis: int, how: str) -> jax.Array:
    return jnp.mean(x, axis=axis) if how == "mean" else jnp.max(x, axis=axis)


def gqa_aggregate(x: jax.Array, num_kv_heads: int, how: str = "mean") -> jax.Array:
    """Per-kv-head scores [L, B, Hkv, S] from per-query-head ones [L, B, Hq, S].

    A kv head's entries serve its whole query group, so its score is the group's mean or max.
    """
    check_choice("gqa", how, GQA)
    return reduce(group_heads(x, num_kv_heads, axis=2), axis=3, how=how)


def first_query_pos(q_pos: jax.Array) -> jax.Array:
    """[B] int32: each row's earliest observed query position (int32 max if none)."""
    return jnp.min(jnp.where(q_pos >= 0, q_pos, INT32_MAX), axis=-1)


def window_attention_sum(
    k: jax.Array, pos: jax.Array, q: jax.Array, q_pos: jax.Array, weight: jax.Array
) -> jax.Array:
    """Weighted sum over observed queries of their softmax attention to one layer's cache.

    k: [B, Hkv, S, D], pos: [B, Hkv, S], q: [B, Hq, W, D], q_pos: [B, W], weight: [B, W] f32
    -> [B, Hkv, G, S] f32, sum_w weight[w] * softmax_s(q[w] . k[s] / sqrt(D)). Causal per
    query (``0 <= pos <= q_pos``); a query slot with q_pos = -1 adds nothing.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[-1]
    qg = group_heads(q.astype(jnp.float32), num_kv_heads, axis=1)  # [B, Hkv, G, W, D]
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
    check_choice("pooling", how, POOLING)
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


def require_obs(obs: Observation, *fields: str) -> None:
    for field in fields:
        if getattr(obs, field) is None:
            raise ValueError(f"this policy needs obs.{field}, which the forward did not record")


class ScoringRule:
    """The defaults every policy shares: it scores with its own `score`, reads no queries,
    attention sums or output projection, keeps the same budget in every layer, and ranks its
    scores as they are. Derive a policy from it and override what differs (WORKSPACE.md)."""

    is_full: ClassVar[bool] = False
    needs_attn_sum: ClassVar[bool] = False
    # True: `obs.out_proj` (each layer's output projection, [L, Hq, D, E]) must be filled in.
    needs_out_proj: ClassVar[bool] = False

    @property
    def scorer(self) -> Policy:
        """The policy whose `score` this one selects from: itself."""
        return self

    @property
    def layer_schedule(self) -> PyramidSchedule | None:
        """None: every layer keeps the nominal budget."""
        return None

    @property
    def obs_window(self) -> int:
        """Trailing prompt queries per layer this rule reads (0 = none)."""
        return 0

    @property
    def query_stats_from(self) -> int | None:
        """None, or the first prompt position whose pre-RoPE query enters `obs.q_stats`
        (ExpectedAttention's: after its sinks)."""
        return None

    @property
    def reconstruction(self):
        """None, or the reconstruct stage this rule reads (`kvzip.Reconstruction`: the
        prompt repeated over the cache, its attention in `obs.recon`)."""
        return None

    def refine(
        self,
        scores: jax.Array,
        budgets: jax.Array,
        cache: KVCache,
        obs: Observation,
        ties: str = "later",
    ) -> jax.Array:
        """The scores selection ranks, given each head's budget [L, B, Hkv] int32 and the tie
        rule: the `scorer`'s scores as they are. A two-stage rule (CriticalKV) re-ranks here."""
        return scores
