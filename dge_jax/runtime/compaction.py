"""Compaction: the kept slots gathered into a smaller cache of a static capacity, so memory
and decode cost really fall (masking keeps the shape; this changes it).

`compact` gathers each head's valid slots first, in position order, per layer group;
`compact_heads` is the same gather on arrays with any leading axes (what decode-time
compression calls inside its loop); `check_capacity` is the host-side check of compact's
precondition. Stored entries move whole: an int8 cache's scales travel with their values;
an int4 cache's are gathered dequantized and requantized after, as KIVI's key groups span
several slots (`dge_jax.runtime.quantized`, `map_slots`), one layer at a time
(`compaction_plan` first, from the positions alone, then `compact_int4_layers`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.distribution.multihost import fetch
from dge_jax.runtime import platform
from dge_jax.runtime.cache import (
    KVCache,
    LayerGroup,
    concat,
    group_bounds,
    runs_of_equal,
)
from dge_jax.runtime.quantized import (
    Entries,
    Int4Entries,
    KVQuant,
    quantize_int4_entries,
    read_slots,
    requantized_when_moved,
)

INT32_MAX = np.iinfo(np.int32).max

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
    by layer, as PyramidKV's, then cost only what each layer keeps). Each run of layers of
    one capacity is then one layer group (`dge_jax.runtime.cache`), and each layer's
    ``index`` is its own max kept count.

    Precondition (check on the host with ``check_capacity``): no head holds more than its
    layer's capacity entries; under jit the extra ones would be dropped silently (the newest
    first).
    """
    if isinstance(capacity, int | np.integer):
        capacities, shared = (int(capacity),) * cache.num_layers, True
    else:
        capacities, shared = tuple(int(c) for c in capacity), False
    if len(capacities) != cache.num_layers:
        raise ValueError(
            f"compact: {len(capacities)} capacities for a cache of {cache.num_layers} layers; "
            "give one int, or one per layer"
        )
    if requantized_when_moved(cache.groups[0].k):  # every group is stored alike
        return _compact_int4(cache, capacities, shared)
    # Each input group is compacted at its layers' largest capacity in one batched op, then
    # cut into the output groups: slots past a layer's capacity hold nothing it kept (the
    # precondition), and one op compiles in a fraction of the time of one op per layer.
    parts = []  # per input group: (first layer, k, v, pos, count [Lg])
    for first, group in zip(group_bounds(cache.group_sizes)[:-1], cache.groups, strict=True):
        room = max(capacities[first : first + group.num_layers])
        k, v, pos, count = compact_heads(group.k, group.v, group.pos, room)
        parts.append((first, k, v, pos, jnp.max(count, axis=(1, 2))))
    counts = jnp.concatenate([p[4] for p in parts])  # [L] each layer's max kept count
    # One shared capacity: every layer's next slot is the max kept count of the whole cache
    # (as before per-layer capacities existed); per-layer capacities: each layer's own.
    index = jnp.broadcast_to(jnp.max(counts), counts.shape) if shared else counts
    index = jnp.minimum(index, jnp.asarray(capacities)).astype(jnp.int32)
    sizes = runs_of_equal(capacities)
    bounds = group_bounds(sizes)
    groups = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        cap = capacities[a]

        def take(j, a=a, b=b, cap=cap):
            """Layers [a, b) of field j (1 k, 2 v, 3 pos) cut to `cap` slots."""
            pieces = []
            for first, *arrays in parts:
                n = arrays[0].shape[0]
                lo, hi = max(a, first), min(b, first + n)
                if lo < hi:
                    part = slice(lo - first, hi - first)
                    x = jax.tree.map(lambda a, part=part: a[part], arrays[j - 1])
                    pieces.append(jax.tree.map(lambda a: a[..., :cap, :], x) if j < 3
                                  else x[..., :cap])  # fmt: skip
            return pieces[0] if len(pieces) == 1 else jax.tree.map(concat, *pieces)

        groups.append(LayerGroup(k=take(1), v=take(2), pos=take(3), index=index[a:b]))
    return KVCache(tuple(groups))


def _compact_int4(cache: KVCache, capacities: tuple[int, ...], shared: bool) -> KVCache:
    """`compact` of an int4 cache, one layer at a time: each input group's plan
    (`compaction_plan`, from pos alone) gives every layer's kept count, hence its next write
    slot, before any entry moves; then each run of layers of one output capacity is
    dequantized, gathered and requantized layer by layer (`compact_int4_layers`), so the
    dense temporary is one layer's (a whole group's, 32 layers of Llama-3.1-8B, would be a
    bf16 copy of the cache at the eviction's peak). Same result as the plain path's
    batched gather followed by `settle`."""
    plans = []  # per input group: (first layer, group, order, new pos)
    counts = []
    for first, group in zip(group_bounds(cache.group_sizes)[:-1], cache.groups, strict=True):
        room = max(capacities[first : first + group.num_layers])
        order, new_pos, count = compaction_plan(group.pos, room)
        plans.append((first, group, order, new_pos))
        counts.append(jnp.max(count, axis=(1, 2)))
    counts = jnp.concatenate(counts)
    index = jnp.broadcast_to(jnp.max(counts), counts.shape) if shared else counts
    index = jnp.minimum(index, jnp.asarray(capacities)).astype(jnp.int32)
    bounds = group_bounds(runs_of_equal(capacities))
    groups = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        cap = capacities[a]
        ks, vs, ps = [], [], []
        for first, group, order, new_pos in plans:
            lo, hi = max(a, first), min(b, first + group.num_layers)
            if lo >= hi:
                continue
            part = slice(lo - first, hi - first)
            o, p = order[part][..., :cap], new_pos[part][..., :cap]
            for out, x in ((ks, group.k), (vs, group.v)):
                layers = jax.tree.map(lambda y, part=part: y[part], x)
                out.append(compact_int4_layers(layers, o, p, index[lo:hi]))
            ps.append(p)
        k, v, pos = (xs[0] if len(xs) == 1 else jax.tree.map(concat, *xs) for xs in (ks, vs, ps))
        groups.append(LayerGroup(k=k, v=v, pos=pos, index=index[a:b]))
    return KVCache(tuple(groups))




def compact_heads(
    k: Entries, v: Entries, pos: jax.Array, capacity: int
) -> tuple[Entries, Entries, jax.Array, jax.Array]:
    """`compact` of arrays with any leading axes: k, v [..., S, D], pos [..., S] ->
    [..., capacity(, D)], and count [...] int32, the entries each head now holds. The order
    depends on ``pos`` alone, so other per-slot arrays ([..., S, X]) passed as k or v with the
    same ``pos`` land in the same slots (decode-time H2O carries its attention sums so, and
    int8 entries their scales [..., S, 1]; int4 entries come `quantized.movable`)."""
    length = pos.shape[-1]
    if capacity > length:  # growing: append empty slots so the gather below can fill them
        extra = capacity - length
        lead = ((0, 0),) * (pos.ndim - 1)
        k, v = jax.tree.map(lambda x: jnp.pad(x, lead + ((0, extra), (0, 0))), (k, v))
        pos = jnp.pad(pos, lead + ((0, extra),), constant_values=-1)
    order, new_pos, count = compaction_plan(pos, capacity)
    filled = (new_pos >= 0)[..., None]

    def gather(x):
        return jnp.where(filled, jnp.take_along_axis(x, order[..., None], axis=-2), 0)

    new_k, new_v = jax.tree.map(gather, (k, v))
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
    return new_k, new_v, new_pos, count


def compaction_plan(pos: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where `compact_heads` takes each slot from, from the positions alone: pos [..., S'] (S'
    >= capacity: padded with -1 when growing) -> order [..., capacity] int32 (the source slot
    of each target slot; any slot where the target is empty), the new pos [..., capacity]
    and count [...] int32, the entries each head holds after (at most capacity)."""
    if capacity > pos.shape[-1]:  # growing: empty slots to fill (`compact_heads` pads first)
        extra = capacity - pos.shape[-1]
        pos = jnp.pad(pos, ((0, 0),) * (pos.ndim - 1) + ((0, extra),), constant_values=-1)
    valid = pos >= 0
    count = jnp.sum(valid, axis=-1, keepdims=True, dtype=jnp.int32)
    # Target slot j takes the head's (j+1)-th valid slot: the first slot s whose running
    # count of valid slots reaches j + 1. Example, valid [0, 1, 1, 0, 1] -> running count
    # [0, 1, 2, 2, 3] -> targets 0, 1, 2 take slots 1, 2, 4; targets from `count` on are
    # empty. This stable partition keeps slot order, which is position order in every cache
    # decoding builds (prompt left to right, then each new token); a cache whose valid slots
    # are out of position order is sorted by position instead (an argsort, several times
    # slower: benchmarks/RESULTS.md, "Eviction step"; `python -m benchmarks.selection`).
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
        lambda: jnp.argsort(jnp.where(valid, pos, INT32_MAX), axis=-1, stable=True)[
            ..., :capacity
        ],
    )
    new_pos = jnp.where(empty, -1, jnp.take_along_axis(pos, order, axis=-1))
    return order, new_pos, jnp.minimum(count[..., 0], capacity)


def compact_int4_layers(
    entries: Int4Entries, order: jax.Array, new_pos: jax.Array, index: jax.Array
) -> Int4Entries:
    """int4 entries [Lg, B, Hkv, S, D] compacted by `compaction_plan`'s order and new pos
    [Lg, B, Hkv, C] and requantized with next write slots index [Lg]: one layer at a time
    (`jax.lax.map`: gather the kept slots, dequantized in the platform's int4 pieces by
    `read_slots`, requantize), so the dense temporary is a layer's at most, not the
    group's. Equal, to the bit, to `settle` of `compact_heads` of the `movable` entries (the
    same per-layer arithmetic; tests/test_int4_cache.py)."""
    slots = entries.shape[-2]
    quant = KVQuant("int4", entries.group, entries.residual)
    pieces = platform.current().int4_pieces

    def one(args):
        e, o, p, i = args  # one layer: [B, Hkv, ...], index a scalar
        at = jnp.minimum(o, slots - 1)[..., None]  # an empty target's source: any slot
        x = jnp.where((p >= 0)[..., None], read_slots(e, at[..., 0], pieces), 0)
        return quantize_int4_entries(x, i, quant, e.keys, e.dtype)

    return jax.lax.map(one, (entries, order, new_pos, jnp.asarray(index, jnp.int32)))


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
        counts = fetch(kept.num_kept())
    else:
        arr = fetch(kept)
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
