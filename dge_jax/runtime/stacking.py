"""Cells of one cache shape decoded as one batch: their states' rows interleaved, and split
back after; and the full caches the cells of a grid share, until the last one reads them.

Interleaved, not concatenated, so that on a device mesh (`dge_jax.distribution.sharding`) every row
stays on the device that holds it: a device's block of rows of each state becomes one block of
the stack, and neither stacking nor splitting moves a cache entry.

Sharing: every eviction point of a grid's draft shares the draft's keys and values
(`with_kv`; a rewind rewrites only positions), and masked caches share theirs, so a grid
holds one full cache where it held one per cell. `last_reads` names the step after which
nobody reads a cache's keys and values; that step takes them (`owns`) or deletes them after
(`release`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dge_jax.runtime.cache import KVCache, LayerGroup, regroup
from dge_jax.runtime.decoding import DecodeState
from dge_jax.runtime.quantized import (
    Int4Entries,
    KVQuant,
    dequantize,
    quantize_int4_entries,
    requantized_when_moved,
)


def with_kv(cache: KVCache, kv: KVCache) -> KVCache:
    """`cache` with the keys and values of `kv` (same layout), its own positions and index."""
    groups = zip(cache.groups, kv.groups, strict=True)
    return KVCache(tuple(dataclasses.replace(g, k=src.k, v=src.v) for g, src in groups))


def copy_but_kv(tree):
    """A copy of a cache or decode state whose keys and values stay the same arrays."""
    cache = tree if isinstance(tree, KVCache) else tree.cache
    kv = {id(x) for x in _kv(cache)}
    return jax.tree.map(lambda x: x if id(x) in kv else jnp.copy(x), tree)


def _kv(cache: KVCache) -> list[jax.Array]:
    return [x for g in cache.groups for x in jax.tree.leaves((g.k, g.v))]  # int8: and scales


def last_reads(steps: list[list[KVCache]]) -> dict[int, int]:
    """id of every key / value array -> the last of `steps` (the caches each step reads, in
    the order they run) that reads it."""
    return {id(x): n for n, caches in enumerate(steps) for c in caches for x in _kv(c)}


def owns(cache: KVCache, last: dict[int, int], step: int) -> bool:
    """Whether no step after `step` reads `cache`'s keys and values (`last_reads`)."""
    return all(last[id(x)] == step for x in _kv(cache))


def release(caches: list[KVCache], last: dict[int, int], step: int) -> None:
    """Deletes the keys and values of `caches` that no step after `step` reads: the grid's
    own buffers, freed now rather than when the last reference goes."""
    for x in {id(x): x for c in caches for x in _kv(c)}.values():
        if last[id(x)] == step and not x.is_deleted():
            x.delete()


def _interleave(xs: list[jax.Array], axis: int) -> jax.Array:
    """C arrays [.., B, ..] -> one [.., B·C, ..] whose row r·C + c is row r of array c."""
    x = jnp.stack(xs, axis=axis + 1)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2 :])


def split_rows(x, parts: int) -> list:
    """The `parts` member arrays [B, ...] of rows interleaved by `stack_states` along the
    first axis of x [B·C, ...]: member c holds rows c, c + C, c + 2C, ... (numpy or JAX)."""
    return [x[c::parts] for c in range(parts)]



def _interleave_int4(parts: list[Int4Entries], index: jax.Array) -> Int4Entries:
    """int4 entries [Lg, B, ...] of each state, their rows interleaved (`_interleave`), with
    next write slots index [Lg] (the largest of the states'), one layer at a time
    (`jax.lax.map`, so a dense temporary is one layer's, not the group's). An int4 layer's
    residual block is the one holding its next write slot: where every state's residual
    already starts there, the stored leaves are interleaved as they are (exact: the stack
    reads what each state read); where one starts earlier, its entries are dequantized,
    interleaved and requantized around the new residual block."""
    first = parts[0]
    quant = KVQuant("int4", first.group, first.residual)

    def one(args):
        *layer, i = args  # each state's layer [B, ...], its next write slot a scalar
        start = i // quant.residual * quant.residual  # the stack's residual block

        def as_stored():
            return jax.tree.map(lambda *xs: _interleave(list(xs), axis=0), *layer)

        def requantized():
            rows = _interleave([dequantize(e) for e in layer], axis=0)
            return quantize_int4_entries(rows, i, quant, first.keys, first.dtype)

        same = jnp.all(jnp.stack([jnp.all(e.start == start) for e in layer]))
        return jax.lax.cond(same, as_stored, requantized)

    return jax.lax.map(one, (*parts, jnp.asarray(index, jnp.int32)))

@functools.partial(jax.jit, static_argnames=("group_sizes",))
def stack_states(
    states: list[DecodeState], group_sizes: tuple[int, ...] | None = None
) -> DecodeState:
    """One state holding the given states' rows, interleaved: row r of state c becomes row
    r·C + c of C states (a copy of all of them; `split_rows` undoes it per array).

    Every cache must have the same capacities and layer groups; each layer's next write slot
    becomes the largest `index` among them: a cache whose entries end earlier just has empty
    slots before it (pos -1, ignored by the mask), as after compaction. limit and key come
    from the first. group_sizes (static): the stack's layer groups (default: the caches'), so
    that the one copy stacking makes is already in the grouping `decode_loop` runs.
    """
    first = states[0]
    caches = [s.cache for s in states]
    if group_sizes is not None:  # slices inside this jit: fused into the interleaving copy
        caches = [regroup(c, group_sizes) for c in caches]
    if len({(c.capacities, c.group_sizes) for c in caches}) != 1:
        raise ValueError(
            "stack_states: caches differ in capacities or layer groups: "
            f"{sorted({(c.capacities, c.group_sizes) for c in caches})}"
        )

    def interleaved(groups: tuple[LayerGroup, ...]) -> LayerGroup:
        index = jnp.max(jnp.stack([g.index for g in groups]), axis=0)

        def rows_of(name):  # rows are axis 1 of [Lg, B, ...] (an int8 cache's scales too)
            parts = [getattr(g, name) for g in groups]
            if name == "pos":
                return _interleave(parts, axis=1)
            if requantized_when_moved(parts[0]):
                return _interleave_int4(parts, index)
            return jax.tree.map(lambda *xs: _interleave(list(xs), axis=1), *parts)

        return LayerGroup(k=rows_of("k"), v=rows_of("v"), pos=rows_of("pos"), index=index)

    cache = KVCache(tuple(interleaved(gs) for gs in zip(*(c.groups for c in caches), strict=True)))

    def rows(name):
        return _interleave([getattr(s, name) for s in states], axis=0)

    return DecodeState(
        cache=cache,
        tokens=rows("tokens"),
        step=rows("step"),
        limit=first.limit,
        last=rows("last"),
        pos=rows("pos"),
        done=rows("done"),
        key=first.key,
    )
