"""Eviction: choose the slots each head keeps, then mask or compact the cache.

Eviction is masking first (DESIGN §3). ``select`` turns scores and per-head budgets into a keep
mask, ``apply_keep`` writes ``pos = -1`` into the evicted slots (same shapes, so the attention
code does not change), and ``compact`` gathers the kept slots into a smaller cache of static
capacity so memory and decode cost really fall. Budgets are traced arrays: a sweep over budgets
reuses one compiled ``select``.

Ranking rule, used everywhere a tie could matter: a head's slots are ordered by score, highest
first, and equal scores by the tie rule ``ties`` (``Eviction.ties``):

- ``"later"`` (the default, and the only rule before the option existed): equal scores go to the
  *later slot* (higher slot index). In every cache decoding builds a head's valid slots are in
  position order (left-padded prompt, then drafts and decode tokens appended; `compact` keeps
  that order), so this is also the later position, the more recent entry; on a hand-made cache
  whose slots are out of position order it is still the slot index that decides.
- ``"earlier"``: equal scores go to the earlier original position (``cache.pos``), whatever the
  slot order (``select`` given ``positions``; `top_mask` alone knows only slots: earlier slot).

Ties are common: max-pooling copies one value over up to ``kernel`` neighbours, so SnapKV's
scores come in plateaus of exactly equal values. Worked example, one head, scores by slot
(positions 0..4) ``[.2, .5, .5, .5, .1]``, budget 2: "later" keeps slots 2 and 3, "earlier"
keeps slots 1 and 2. (It also decides which window entries survive when a budget is smaller
than the protected window, whose slots all score +inf: "later" keeps the most recent.)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.cache import KVCache, stack_layers

_INT32_MAX = np.iinfo(np.int32).max
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
        order = jnp.argsort(jnp.where(candidate, positions, _INT32_MAX), axis=-1, stable=True)
        keep = top_mask(
            jnp.take_along_axis(scores, order, axis=-1), budgets,
            jnp.take_along_axis(candidate, order, axis=-1), "earlier",
        )  # fmt: skip
        return jnp.take_along_axis(keep, jnp.argsort(order, axis=-1), axis=-1)

    return jax.lax.cond(_in_position_order(positions, candidate), by_slot, by_sorted_position)


def select(
    scores: jax.Array,
    budgets: jax.Array | int,
    valid: jax.Array | None = None,
    *,
    ties: str = "later",
    positions: jax.Array | None = None,
) -> jax.Array:
    """Keep mask [L, B, Hkv, S]: each head's top-``budget`` candidate slots.

    A slot is a candidate iff ``valid`` (default: score > -inf, which is how every policy marks
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
            "use dge_jax.budgets.expand_budgets for per-layer or per-head specs"
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

    keep: [L, B, Hkv, S] bool. Masking mode: shapes (and the compiled decode) do not change.
    """
    return KVCache(k=cache.k, v=cache.v, pos=jnp.where(keep, cache.pos, -1), index=cache.index)


def _first_reaching(running: jax.Array, targets: jax.Array) -> jax.Array:
    """[..., T] int32: for each target, the first index whose non-decreasing `running` [..., S]
    value reaches it (S if none): a binary search along the last axis that keeps every
    leading axis in place, so a cache sharded over rows and heads stays so."""
    slots = running.shape[-1]
    shape = running.shape[:-1] + targets.shape
    lo = jnp.zeros(shape, jnp.int32)  # the answer lies in [lo, hi]
    hi = jnp.full(shape, slots, jnp.int32)
    for _ in range(max(slots, 1).bit_length()):
        mid = (lo + hi) // 2
        short = jnp.take_along_axis(running, jnp.minimum(mid, slots - 1), axis=-1) < targets
        short &= lo < hi  # settled searches stay put
        lo, hi = jnp.where(short, mid + 1, lo), jnp.where(short, hi, mid)
    return lo


def compact(cache: KVCache, capacity: int | Sequence[int]) -> KVCache:
    """A cache of ``capacity`` slots holding each head's valid slots first, in position order.

    k, v: [L, B, Hkv, S, D] -> [L, B, Hkv, capacity, D]; pos: [L, B, Hkv, S] -> [..., capacity]
    int32; index: max kept count (int32 scalar), where decoding appends next.

    ``capacity`` may instead give each layer its own (a sequence of L ints: budgets that differ
    by layer, as PyramidKV's, then cost only what each layer keeps). The result is then in
    per-layer form (`dge_jax.cache.split_layers`) with layer i of capacity[i] slots and
    ``index`` [L], each layer's max kept count.

    Precondition (check on the host with ``check_capacity``): no head holds more than its
    layer's capacity entries; under jit the extra ones would be dropped silently (the newest
    first).
    """
    if isinstance(cache.k, tuple):
        cache = stack_layers(cache)
    if isinstance(capacity, int | np.integer):
        k, v, pos, count = _compact_heads(cache.k, cache.v, cache.pos, int(capacity))
        return KVCache(k=k, v=v, pos=pos, index=jnp.max(count).astype(jnp.int32))
    capacities = tuple(int(c) for c in capacity)
    if len(capacities) != cache.num_layers:
        raise ValueError(
            f"compact: {len(capacities)} capacities for a cache of {cache.num_layers} layers; "
            "give one int, or one per layer"
        )
    # All layers are compacted at the largest capacity in one batched op, then each is cut
    # to its own: slots past a layer's capacity hold nothing it kept (the precondition), and
    # one op compiles in a fraction of the time of L ops of different shapes.
    k, v, pos, count = _compact_heads(cache.k, cache.v, cache.pos, max(capacities))
    index = jnp.minimum(jnp.max(count, axis=(1, 2)), jnp.asarray(capacities))  # [L]
    return KVCache(
        k=tuple(k[i, ..., :c, :] for i, c in enumerate(capacities)),
        v=tuple(v[i, ..., :c, :] for i, c in enumerate(capacities)),
        pos=tuple(pos[i, ..., :c] for i, c in enumerate(capacities)),
        index=index.astype(jnp.int32),
    )


def _compact_heads(
    k: jax.Array, v: jax.Array, pos: jax.Array, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`compact` of arrays with any leading axes: k, v [..., S, D], pos [..., S] ->
    [..., capacity(, D)], and count [...] int32, the entries each head now holds."""
    length = pos.shape[-1]
    if capacity > length:  # growing: append empty slots so the gather below can fill them
        extra = capacity - length
        lead = ((0, 0),) * (pos.ndim - 1)
        k = jnp.pad(k, lead + ((0, extra), (0, 0)))
        v = jnp.pad(v, lead + ((0, extra), (0, 0)))
        pos = jnp.pad(pos, lead + ((0, extra),), constant_values=-1)
    valid = pos >= 0
    count = jnp.sum(valid, axis=-1, keepdims=True, dtype=jnp.int32)
    # Target slot j takes the head's (j+1)-th valid slot: the first slot s whose running
    # count of valid slots reaches j + 1. Example, valid [0, 1, 1, 0, 1] -> running count
    # [0, 1, 2, 2, 3] -> targets 0, 1, 2 take slots 1, 2, 4; targets from `count` on are
    # empty. This stable partition keeps slot order, which is position order in every cache
    # decoding builds (prompt left to right, then each new token); a cache whose valid slots
    # are out of position order is sorted by position instead (an argsort: ~5x slower,
    # `python -m benchmarks.selection`).
    running = jnp.cumsum(valid, axis=-1, dtype=jnp.int32)
    order = _first_reaching(running, jnp.arange(1, capacity + 1, dtype=jnp.int32))
    order = jnp.minimum(order, pos.shape[-1] - 1)
    taken = jnp.take_along_axis(pos, order, axis=-1)
    empty = jnp.arange(capacity) >= count  # [..., capacity]
    taken = jnp.where(empty, -1, taken)
    in_order = jnp.all((taken[..., 1:] > taken[..., :-1]) | (taken[..., 1:] < 0))
    order = jax.lax.cond(
        in_order,
        lambda: order,
        lambda: jnp.argsort(jnp.where(valid, pos, _INT32_MAX), axis=-1, stable=True)[
            ..., :capacity
        ],
    )
    new_pos = jnp.where(empty, -1, jnp.take_along_axis(pos, order, axis=-1))
    filled = (new_pos >= 0)[..., None]
    new_k = jnp.where(filled, jnp.take_along_axis(k, order[..., None], axis=-2), 0)
    new_v = jnp.where(filled, jnp.take_along_axis(v, order[..., None], axis=-2), 0)
    # Why one shared next-write slot = max kept count is right. cache.index is a single
    # next-write slot for every row and head of a layer (every layer, unless capacities are
    # per layer): decode writes token t of all heads into slot `index`. After compaction head
    # h holds n_h entries in slots [0, n_h). Writing the next token at max(n_h) overwrites
    # nobody's entry; a head with fewer entries keeps empty slots (pos -1) in [n_h, max),
    # which the mask `0 <= pos <= query_pos` ignores, and its entries stay sorted by position
    # because new tokens have larger positions than anything kept. Example, 2 heads after
    # compaction to capacity 6 (budgets 3 and 2), next token at position 9:
    #     slot:      0   1   2   3   4   5
    #     head 0:    0   4   8  -1  -1  -1     n_0 = 3
    #     head 1:    2   8  -1  -1  -1  -1     n_1 = 2     index = 3
    #     decode ->  head 0: 0 4 8 9 -1 -1     head 1: 2 8 -1 9 -1 -1
    # The gap (slot 2 of head 1) costs max(n) - n_h slots, the price of a shared index.
    return new_k, new_v, new_pos, jnp.minimum(count[..., 0], capacity)


def check_capacity(
    kept: KVCache | jax.Array | np.ndarray,
    capacity: int | Sequence[int],
    new_tokens: int = 0,
) -> int:
    """The slots needed (max kept entries per head + ``new_tokens``); raises if over ``capacity``.

    Host-side check of ``compact``'s precondition. ``kept``: a cache, a keep mask
    [L, B, Hkv, S] bool or per-head counts [L, B, Hkv] int; ``capacity``: one for every layer
    or one per layer (then each layer is checked against its own).
    """
    if isinstance(kept, KVCache):
        counts = np.asarray(kept.num_kept())
    else:
        arr = np.asarray(kept)
        counts = arr.sum(axis=-1) if arr.dtype == np.bool_ else arr
    per_layer = counts.reshape(counts.shape[0], -1).max(axis=1, initial=0) + int(new_tokens)
    if np.ndim(capacity) and len(capacity) != len(per_layer):
        raise ValueError(
            f"{len(capacity)} capacities for {len(per_layer)} layers; give one, or one per layer"
        )
    limits = np.broadcast_to(np.asarray(capacity), per_layer.shape)
    for layer, (needed, limit) in enumerate(zip(per_layer, limits, strict=True)):
        if needed > limit:
            where = "" if np.ndim(capacity) == 0 else f" in layer {layer}"
            raise ValueError(
                f"compaction needs {needed} slots per head{where} ({needed - new_tokens} kept "
                f"+ {new_tokens} new tokens) but capacity is {int(limit)}"
            )
    return int(per_layer.max(initial=int(new_tokens)))
