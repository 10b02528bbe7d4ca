"""Selection: choose the slots each head keeps, then mask the rest out.

Eviction is masking first, so budgets stay traced and a sweep compiles once. ``select_slots`` turns
scores and per-head budgets into a keep mask, ``apply_keep`` writes ``pos = -1`` into the
evicted slots (same shapes, so the attention code does not change);
`dge_jax.runtime.compaction.compact` then gathers the kept slots into a smaller cache of static
capacity so memory and decode cost really fall. Both live in runtime/, below the rules:
CriticalKV's first stage selects too.

Ranking rule, used everywhere a tie could matter: a head's slots are ordered by score, highest
first, and equal scores by the tie rule ``ties`` (``Eviction.ties``):

- ``"later"`` (the default, and the only rule before the option existed): equal scores go to the
  *later slot* (higher slot index). In every cache decoding builds a head's valid slots are in
  position order (left-padded prompt, then drafts and decode tokens appended; `compact` keeps
  that order), so this is also the later position, the more recent entry; on a hand-made cache
  whose slots are out of position order it is still the slot index that decides.
- ``"earlier"``: equal scores go to the earlier original position (``cache.pos``), whatever the
  slot order (``select_slots`` given ``positions``; `top_mask` alone knows only slots: earlier
  slot).

Ties are common: max-pooling copies one value over up to ``kernel`` neighbours, so SnapKV's
scores come in plateaus of exactly equal values. Worked example, one head, scores by slot
(positions 0..4) ``[.2, .5, .5, .5, .1]``, budget 2: "later" keeps slots 2 and 3, "earlier"
keeps slots 1 and 2. (It also decides which window entries survive when a budget is smaller
than the protected window, whose slots all score +inf: "later" keeps the most recent.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dge_jax.distribution.multihost import fetch
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.compaction import INT32_MAX

TIES = ("later", "earlier")


def _check_ties(ties: str) -> None:
    if not isinstance(ties, str) or ties not in TIES:
        raise ValueError(f"ties must be one of {TIES}, got {ties!r}")


def _order_key(scores: jax.Array) -> jax.Array:
    """uint32 keys that order like the f32 scores (-inf lowest, +inf highest; -0.0 == 0.0)."""
    # IEEE floats of one sign order like their bit patterns, negative ones in reverse. Setting
    # the sign bit of non-negatives and flipping every bit of negatives maps the whole line
    # onto increasing unsigned integers: -inf -> 0x007FFFFF, -1.0 -> 0x407FFFFF,
    # 0.0 -> 0x80000000, 1.0 -> 0xBF800000, +inf -> 0xFF800000. -0.0 is made 0.0 first, so
    # the two zeros tie, as they do under a float comparison.
    x = jnp.where(scores == 0, jnp.float32(0), scores.astype(jnp.float32))
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >= jnp.uint32(0x80000000), ~bits, bits | jnp.uint32(0x80000000))


def top_mask(
    scores: jax.Array, budgets: jax.Array, candidate: jax.Array, ties: str = "later"
) -> jax.Array:
    """[..., S] bool: the top-``budgets`` candidates of each row by score, ties by slot.

    scores: [..., S] float; budgets: [...] int (traced is fine); candidate: [..., S] bool, whose
    scores must not be NaN; ties (static): "later" = equal scores go to the later slot,
    "earlier" = to the earlier slot. A row with no more candidates than its budget keeps all
    of them. Equals ranking the candidates (highest score first, equal scores later (earlier)
    slot first) and keeping ranks below the budget, without sorting: a 32-step bisection finds
    each row's threshold score, the budget-th highest, and only the ties at that score are
    counted. The tie rule only changes that last count (from the right or from the left).
    """
    _check_ties(ties)
    key = jnp.where(candidate, _order_key(scores), jnp.uint32(0))
    budgets = budgets.astype(jnp.int32)

    def count_at_least(threshold: jax.Array) -> jax.Array:
        return jnp.sum(candidate & (key >= threshold[..., None]), axis=-1, dtype=jnp.int32)

    def bisect(_, bounds):
        # Invariant: the threshold (the largest key with >= budget candidates at or above
        # it) lies in [lo, hi]; mid rounds up, so 32 halvings of the 2^32 keys leave
        # lo == hi. A budget above the row's candidate count never finds enough and ends at
        # lo == 0: every candidate is above it and kept.
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + (hi > lo).astype(jnp.uint32)
        enough = count_at_least(mid) >= budgets
        return jnp.where(enough, mid, lo), jnp.where(enough | (mid == lo), hi, mid - 1)

    lo = jnp.zeros(budgets.shape, jnp.uint32)
    hi = jnp.full(budgets.shape, 0xFFFFFFFF, jnp.uint32)
    threshold, _ = jax.lax.fori_loop(0, 32, bisect, (lo, hi))
    threshold = threshold[..., None]
    above = candidate & (key > threshold)
    tied = candidate & (key == threshold)
    # Worked example: scores [1, 3, 3, 0], budget 2 -> threshold 3, nothing above it, two tied
    # slots for two places; budget 1 -> one place, and counting ties from the right
    # ([2, 2, 1, 0] at the tied slots 1, 2) gives it to slot 2, the later one; counting them
    # from the left ("earlier": [0, 1, 2, 2]) gives it to slot 1.
    room = budgets[..., None] - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    if ties == "later":
        rank = jnp.flip(jnp.cumsum(jnp.flip(tied, -1), axis=-1, dtype=jnp.int32), -1)
    else:
        rank = jnp.cumsum(tied, axis=-1, dtype=jnp.int32)
    return (above | (tied & (rank <= room))) & (budgets[..., None] > 0)


def _in_position_order(positions: jax.Array, candidate: jax.Array) -> jax.Array:
    """[] bool: in every row, the candidates' positions increase with the slot index."""
    marked = jnp.where(candidate, positions, -1)
    before = jax.lax.cummax(marked, axis=marked.ndim - 1)  # [..., S]: max up to each slot
    before = jnp.concatenate([jnp.full_like(before[..., :1], -1), before[..., :-1]], axis=-1)
    return jnp.all(~candidate | (positions > before))


def _top_mask_earlier_position(
    scores: jax.Array, budgets: jax.Array, candidate: jax.Array, positions: jax.Array
) -> jax.Array:
    """`top_mask` with equal scores going to the earlier ``positions`` (distinct per row among
    candidates). When the candidates are in position order, as in every cache decoding builds,
    that is the earlier slot and nothing more is done; otherwise (a hand-made cache) the rows
    are put into position order (an argsort), selected, and put back."""

    def by_slot() -> jax.Array:
        return top_mask(scores, budgets, candidate, "earlier")

    def by_sorted_position() -> jax.Array:
        order = jnp.argsort(jnp.where(candidate, positions, INT32_MAX), axis=-1, stable=True)
        keep = top_mask(
            jnp.take_along_axis(scores, order, axis=-1), budgets,
            jnp.take_along_axis(candidate, order, axis=-1), "earlier",
        )  # fmt: skip
        return jnp.take_along_axis(keep, jnp.argsort(order, axis=-1), axis=-1)

    return jax.lax.cond(_in_position_order(positions, candidate), by_slot, by_sorted_position)


def select_slots(
    scores: jax.Array,
    budgets: jax.Array | int,
    valid: jax.Array | None = None,
    *,
    ties: str = "later",
    positions: jax.Array | None = None,
) -> jax.Array:
    """Keep mask [L, B, Hkv, S]: each head's top-``budget`` candidate slots.

    A slot is a candidate iff ``valid`` (default: score > -inf, which is how every rule marks
    an empty slot); a head with no more candidates than its budget keeps all of them.
    ties (static, see the module docstring): "later" gives equal scores to the later slot
    (today's rule; ``positions`` is not read); "earlier" to the earlier position in
    ``positions`` ([L, B, Hkv, S] int, e.g. ``cache.pos``), or to the earlier slot without it.
    """
    # scores: [L, B, Hkv, S] f32; budgets: [] or [L, B, Hkv] int (traced is fine); valid: like
    # scores, bool. Other budget shapes go through budgets.expand_budgets first: a [L] budget
    # would broadcast against the Hkv axis here, silently wrong whenever L == Hkv.
    budgets = jnp.asarray(budgets)
    if budgets.ndim not in (0, 3):
        raise ValueError(
            f"budgets must be a scalar or [L, B, Hkv], got shape {budgets.shape}; "
            "use dge_jax.eviction.budgets.expand_budgets for per-layer or per-head specs"
        )
    if jnp.issubdtype(budgets.dtype, jnp.floating):
        raise TypeError(f"budgets must be integers, got {budgets.dtype}")
    budgets = jnp.broadcast_to(budgets.astype(jnp.int32), scores.shape[:-1])
    candidate = scores > -jnp.inf if valid is None else valid & ~jnp.isnan(scores)
    _check_ties(ties)
    if ties == "earlier" and positions is not None:
        positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), scores.shape)
        return _top_mask_earlier_position(scores, budgets, candidate, positions)
    return top_mask(scores, budgets, candidate, ties)


def apply_keep(cache: KVCache, keep: jax.Array) -> KVCache:
    """The same cache with every slot outside ``keep`` emptied (pos = -1).

    keep: [L, B, Hkv, S] bool (S: the largest layer's slots, `KVCache.padded_pos`). Masking
    mode: shapes (and the compiled decode) do not change.
    """
    return cache.with_pos(jnp.where(keep, cache.padded_pos(), -1))


def kept_positions(cache: KVCache | jax.Array, keep: jax.Array) -> list[list[list[list[int]]]]:
    """Per row, layer and kv head: the sorted original positions kept (for analysis/plots).

    cache.pos (or `cache` itself, the positions): [L, B, Hkv, S] int32 and keep: [L, B, Hkv,
    S] bool -> nested lists [B][L][Hkv].
    """
    pos = fetch(cache.pos if isinstance(cache, KVCache) else cache)
    mask = fetch(keep)
    nl, b, h, _ = pos.shape
    return [
        [
            [sorted(pos[layer, r, i][mask[layer, r, i]].tolist()) for i in range(h)]
            for layer in range(nl)
        ]
        for r in range(b)
    ]
