"""Eviction: choose the slots each head keeps, then mask or compact the cache.

Eviction is masking first (DESIGN §3). ``select`` turns scores and per-head budgets into a keep
mask, ``apply_keep`` writes ``pos = -1`` into the evicted slots (same shapes, so the attention
code does not change), and ``compact`` gathers the kept slots into a smaller cache of static
capacity so memory and decode cost really fall. Budgets are traced arrays: a sweep over budgets
reuses one compiled ``select``.

Ranking rule, used everywhere a tie could matter: a head's slots are ordered by score, highest
first, and equal scores are ordered by slot, *later slot first*. Valid slots are sorted by
position within a head, so among equal scores the most recent entry wins (the one that matters
when a budget is smaller than the protected window, whose slots all score +inf).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.cache import KVCache

_INT32_MAX = np.iinfo(np.int32).max


def descending_rank(scores: jax.Array) -> jax.Array:
    """Each slot's rank along the last axis (0 = best), ties going to the later slot.

    scores: [..., S] f32 -> [..., S] int32. The shared tie rule of ``select`` and AdaKV budgets.
    """
    # Worked example: scores [1, 3, 3, 0]. Reversed: [0, 3, 3, 1]; a stable descending sort of
    # the reversed row gives order [1, 2, 3, 0] (reversed slots), i.e. original slots
    # [2, 1, 0, 3]: of the two 3s, slot 2 (the later one) comes first. Ranks [2, 1, 0, 3].
    reversed_scores = jnp.flip(scores, axis=-1)
    order = jnp.argsort(-reversed_scores, axis=-1, stable=True)
    rank_reversed = jnp.argsort(order, axis=-1, stable=True)  # inverse permutation
    return jnp.flip(rank_reversed, axis=-1).astype(jnp.int32)


def select(
    scores: jax.Array, budgets: jax.Array | int, valid: jax.Array | None = None
) -> jax.Array:
    """Keep mask [L, B, Hkv, S]: each head's top-``budget`` candidate slots.

    A slot is a candidate iff ``valid`` (default: score > -inf, which is how every policy marks
    an empty slot); a head with no more candidates than its budget keeps all of them.
    """
    # scores: [L, B, Hkv, S] f32; budgets: [] or [L, B, Hkv] int (traced is fine); valid: like
    # scores, bool. Other budget shapes go through budgets.expand_budgets first: a [L] budget
    # would broadcast against the Hkv axis here, silently wrong whenever L == Hkv.
    budgets = jnp.asarray(budgets)
    if budgets.ndim not in (0, 3):
        raise ValueError(
            f"budgets must be a scalar or [L, B, Hkv], got shape {budgets.shape}; "
            "use dge_jax.budgets.expand_budgets for per-layer or per-head specs"
        )
    if jnp.issubdtype(budgets.dtype, jnp.floating):
        raise TypeError(f"budgets must be integers, got {budgets.dtype}")
    budgets = jnp.broadcast_to(budgets.astype(jnp.int32), scores.shape[:-1])
    candidate = scores > -jnp.inf if valid is None else valid & ~jnp.isnan(scores)
    # Non-candidates rank after every candidate (NaN included), so `rank < budget` never
    # reaches one before all candidates of the head are kept.
    ranked = jnp.where(candidate, scores.astype(jnp.float32), -jnp.inf)
    rank = descending_rank(ranked)
    return (rank < budgets[..., None]) & candidate


def apply_keep(cache: KVCache, keep: jax.Array) -> KVCache:
    """The same cache with every slot outside ``keep`` emptied (pos = -1).

    keep: [L, B, Hkv, S] bool. Masking mode: shapes (and the compiled decode) do not change.
    """
    return KVCache(k=cache.k, v=cache.v, pos=jnp.where(keep, cache.pos, -1), index=cache.index)


def compact(cache: KVCache, capacity: int) -> KVCache:
    """A cache of ``capacity`` slots holding each head's valid slots first, in position order.

    k, v: [L, B, Hkv, S, D] -> [L, B, Hkv, capacity, D]; pos: [L, B, Hkv, S] -> [..., capacity]
    int32; index: max kept count (int32 scalar), where decoding appends next.

    Precondition (check on the host with ``check_capacity``): no head holds more than
    ``capacity`` entries; under jit the extra ones would be dropped silently (the newest first).
    """
    # k, v: [L, B, Hkv, S, D] -> [L, B, Hkv, capacity, D]; pos: [L, B, Hkv, S] -> [..., capacity]
    length = cache.capacity
    k, v, pos = cache.k, cache.v, cache.pos
    if capacity > length:  # growing: append empty slots so the gather below can fill them
        extra = capacity - length
        k = jnp.pad(k, ((0, 0),) * 3 + ((0, extra), (0, 0)))
        v = jnp.pad(v, ((0, 0),) * 3 + ((0, extra), (0, 0)))
        pos = jnp.pad(pos, ((0, 0),) * 3 + ((0, extra),), constant_values=-1)
    valid = pos >= 0
    # Sorting by position (empty slots last) keeps position order even for a cache whose valid
    # slots were not already sorted; for the usual sorted cache it equals a stable partition.
    order = jnp.argsort(jnp.where(valid, pos, _INT32_MAX), axis=-1, stable=True)[..., :capacity]
    new_pos = jnp.take_along_axis(pos, order, axis=-1)
    filled = (new_pos >= 0)[..., None]
    new_k = jnp.where(filled, jnp.take_along_axis(k, order[..., None], axis=-2), 0)
    new_v = jnp.where(filled, jnp.take_along_axis(v, order[..., None], axis=-2), 0)
    # Why one shared `index` = max kept count is right. cache.index is a single next-write slot
    # for every layer, row and head (decode writes token t of all heads into slot `index`).
    # After compaction head h holds n_h entries in slots [0, n_h). Writing the next token at
    # max(n_h) overwrites nobody's entry; a head with fewer entries keeps empty slots (pos -1)
    # in [n_h, max), which the mask `0 <= pos <= query_pos` ignores, and its entries stay sorted
    # by position because new tokens have larger positions than anything kept. Example, 2 heads
    # after compaction to capacity 6 (budgets 3 and 2), next token at position 9:
    #     slot:      0   1   2   3   4   5
    #     head 0:    0   4   8  -1  -1  -1     n_0 = 3
    #     head 1:    2   8  -1  -1  -1  -1     n_1 = 2     index = 3
    #     decode ->  head 0: 0 4 8 9 -1 -1     head 1: 2 8 -1 9 -1 -1
    # The gap (slot 2 of head 1) costs max(n) - n_h slots, the price of a per-cache index.
    index = jnp.minimum(jnp.max(jnp.sum(valid, axis=-1, dtype=jnp.int32)), capacity)
    return KVCache(k=new_k, v=new_v, pos=new_pos, index=index.astype(jnp.int32))


def check_capacity(
    kept: KVCache | jax.Array | np.ndarray, capacity: int, new_tokens: int = 0
) -> int:
    """The slots needed (max kept entries per head + ``new_tokens``); raises if over ``capacity``.

    Host-side check of ``compact``'s precondition. ``kept``: a cache, a keep mask
    [L, B, Hkv, S] bool or per-head counts [L, B, Hkv] int.
    """
    if isinstance(kept, KVCache):
        counts = np.asarray(kept.num_kept())
    else:
        arr = np.asarray(kept)
        counts = arr.sum(axis=-1) if arr.dtype == np.bool_ else arr
    needed = int(counts.max(initial=0)) + int(new_tokens)
    if needed > capacity:
        raise ValueError(
            f"compaction needs {needed} slots per head ({needed - new_tokens} kept + "
            f"{new_tokens} new tokens) but capacity is {capacity}"
        )
    return needed
