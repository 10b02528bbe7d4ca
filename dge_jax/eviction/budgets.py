"""Budgets: how many entries each kv head keeps right after eviction.

A budget counts every entry a head keeps, the protected window and draft entries included.
Whatever the spec, ``select`` reads a traced int32 ``[L, B, Hkv]`` array, so a sweep over budgets,
or a switch from uniform to per-layer or head-adaptive budgets, compiles once.

- ``expand_budgets``: scalar, per-layer ``[L]``, per-head ``[L, Hkv]`` or ``[L, B, Hkv]`` specs.
- ``adakv_budgets``: AdaKV's head-adaptive split of each layer's pool (any scoring rule).
- ``global_budgets``: the same split of one pool across all layers and heads (KVzip's).

PyramidKV's per-layer budgets are a rule's ``layer_schedule``
(`dge_jax.rules.base.PyramidSchedule`).
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp

from dge_jax.eviction.sliding import global_pool
from dge_jax.runtime.selection import top_mask


def _floor_times(n: jax.Array, alpha: float) -> jax.Array:
    """⌊n·alpha⌋ for int32 ``n`` and a static ``alpha``, exact for decimal alphas such as 0.2.

    kvpress writes ``int(n_kept * alpha)`` in float64; without x64 we use alpha's small
    fraction (0.2 = 1/5) in integer arithmetic, which agrees with it for every n < 10**5 at
    alpha 0.1, 0.2, 0.25, 0.3, 0.5 (float64 rounding makes it differ, e.g. 90 · 0.7 = 62.99…).
    """
    frac = Fraction(alpha).limit_denominator(1 << 12)
    if abs(float(frac) - alpha) > 1e-12:  # not a short fraction: best effort in f32
        return jnp.floor(n.astype(jnp.float32) * jnp.float32(alpha)).astype(jnp.int32)
    return (n * frac.numerator) // frac.denominator


def expand_budgets(
    spec: jax.Array | int, num_layers: int, batch_size: int, num_kv_heads: int
) -> jax.Array:
    """Per-head budgets [L, B, Hkv] int32 from a scalar, [L], [L, Hkv] or [L, B, Hkv] spec.

    The spec's rank says what it means, so traced specs work and nothing is guessed from sizes.
    """
    spec = jnp.asarray(spec)
    if jnp.issubdtype(spec.dtype, jnp.floating):
        raise TypeError(f"budgets must be integers, got {spec.dtype}")
    spec = spec.astype(jnp.int32)
    L, B, H = num_layers, batch_size, num_kv_heads
    expected = {0: (), 1: (L,), 2: (L, H), 3: (L, B, H)}
    if spec.ndim not in expected or spec.shape != expected[spec.ndim]:
        raise ValueError(
            f"budget spec of shape {spec.shape} is none of scalar, [L]={(L,)}, "
            f"[L, Hkv]={(L, H)} or [L, B, Hkv]={(L, B, H)}"
        )
    if spec.ndim == 1:
        spec = spec[:, None, None]
    elif spec.ndim == 2:
        spec = spec[:, None, :]
    return jnp.broadcast_to(spec, (L, B, H))


def _floors_raised(
    scores: jax.Array, layer_budgets: jax.Array | int, alpha: float, ties: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What both allocators start from: budgets [L, 1, 1] int32, valid slots, and scores
    [L, B, Hkv, S] f32 with each head's top ⌊alpha·B_l⌋ raised to +inf (its floor)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    L, B, H, _ = scores.shape
    layer_budgets = jnp.asarray(layer_budgets)
    if layer_budgets.shape not in ((), (L,)):
        raise ValueError(f"layer_budgets must be a scalar or [L]={(L,)}, got {layer_budgets.shape}")
    budget = jnp.broadcast_to(layer_budgets.astype(jnp.int32), (L,))[:, None, None]  # [L, 1, 1]
    valid = scores > -jnp.inf
    scores = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
    floor = top_mask(scores, jnp.broadcast_to(_floor_times(budget, alpha), (L, B, H)), valid, ties)
    return budget, valid, jnp.where(floor, jnp.inf, scores)


def adakv_budgets(
    scores: jax.Array, layer_budgets: jax.Array | int, alpha: float = 0.2, ties: str = "later"
) -> jax.Array:
    """Head-adaptive budgets [L, B, Hkv]: AdaKV's split of each layer's pool Hkv·B_l per row.

    Follows kvpress ``AdaKVPress``: a floor of ⌊α·B_l⌋ entries per head, the rest to the top
    scores across the layer's heads jointly; the counts sum to Hkv·B_l (fewer if slots run out).
    ties (static, `dge_jax.evict`): which head an equal score at the joint threshold counts
    for: "later" the later head, "earlier" the earlier one.
    """
    # scores: [L, B, Hkv, S] f32, -inf = empty; layer_budgets: [] or [L] int (traced is fine).
    #
    # kvpress's rule, per layer and row (n_kept = B_l, n_safe = int(n_kept * alpha)):
    #   1. each head's top n_safe scores are raised to the dtype's max (the safeguard);
    #   2. the Hkv * n_kept highest of the raised scores, over all heads jointly, are kept.
    # A head's kept set is then its own top-c_h entries, so returning the counts c_h and letting
    # `select` take each head's top c_h gives the same entries. Note that protected slots (+inf)
    # sit in a head's top n_safe, so they use up its floor first, exactly as kvpress's window
    # entries (scored max + 1) do. Worked example, Hkv = 2, B_l = 3, alpha = 0.5 (floor 1):
    #     head 0 scores: .9 .8 .7 .6 .5 .4       head 1 scores: .3 .2 .1 .0 .0 .0
    #     without the floor the joint top 6 are all head 0's -> counts (6, 0);
    #     with it .9 and .3 are raised first, then the joint top 4 of the rest are head 0's
    #     .8 .7 .6 .5 -> counts (5, 1), sum 6 = Hkv * B_l.
    L, B, H, S = scores.shape
    budget, valid, raised = _floors_raised(scores, layer_budgets, alpha, ties)
    # Joint ranking over the layer's heads: flatten [H, S] per (layer, row). Ties follow the
    # same rule as select by flat index: "later" = later head, then later slot; "earlier" =
    # earlier head, then earlier slot. Only the counts come out, and they depend only on each
    # head's multiset of (raised) scores and on which *head* wins a tie (the flat order is
    # head-major), never on which slot within a head does: `select` then picks each head's
    # own top-c_h by its tie rule (by position, for "earlier"), so the kept entries are
    # exactly those of ranking all heads jointly with that rule.
    chosen = top_mask(
        raised.reshape(L, B, H * S), jnp.broadcast_to(H * budget[..., 0], (L, B)),
        valid.reshape(L, B, H * S), ties,
    ).reshape(L, B, H, S)  # fmt: skip
    return jnp.sum(chosen, axis=-1, dtype=jnp.int32)


def global_budgets(
    scores: jax.Array, layer_budgets: jax.Array | int, alpha: float = 0.0, ties: str = "later"
) -> jax.Array:
    """Per-head budgets [L, B, Hkv] from one pool per row across every layer and head.

    kvpress ``KVzipPress`` (``layerwise=False``, its default): the pool is Σ_l Hkv·B_l
    entries; a floor of ⌊α·B_l⌋ per head (KVzip's α is 0), the rest to the highest scores
    of the whole cache jointly. Like `adakv_budgets` with the layer axis in the pool; ties
    across heads go by flat index (layer, head, slot): "later" to the later layer and head.
    Scores must be comparable across layers (KVzip's attention probabilities are).
    """
    L, B, H, S = scores.shape
    budget, valid, raised = _floors_raised(scores, layer_budgets, alpha, ties)
    # One ranking per row over [L, H, S]: rows to the front, then flatten (layer-major).
    flat = lambda x: x.transpose(1, 0, 2, 3).reshape(B, L * H * S)  # noqa: E731
    pool = jnp.broadcast_to(H * jnp.sum(budget[:, 0, 0]), (B,))
    chosen = top_mask(flat(raised), pool, flat(valid), ties)
    return jnp.sum(chosen.reshape(B, L, H, S), axis=-1, dtype=jnp.int32).transpose(1, 0, 2)


def head_budgets(
    mode: str,
    scores: jax.Array,
    budget: jax.Array | int,
    alpha: float,
    ties: str,
    head_cap: int | None = None,
    sliding: jax.Array | None = None,
) -> jax.Array:
    """Per-head budgets [L, B, Hkv] of `budget` under head-budget `mode` ("uniform",
    "adakv", "global"), capped at head_cap. sliding [L, 1, 1, 1] (None: no layer slides):
    the sliding layers, left out of the global pool (`dge_jax.eviction.sliding`)."""
    nl, b, hkv, _ = scores.shape
    if mode == "adakv":
        per_head = adakv_budgets(scores, budget, alpha, ties)
    elif mode == "global":
        if sliding is not None:
            budget = global_pool(budget, sliding, nl)
        per_head = global_budgets(scores, budget, alpha, ties)
    else:
        per_head = expand_budgets(budget, nl, b, hkv)
    return per_head if head_cap is None else jnp.minimum(per_head, head_cap)
