"""Static-shape padded KV cache and the observations that scoring rules read.

One type, one form: a `KVCache` is a tuple of *layer groups*, runs of consecutive layers
stacked on a leading axis:

    group.k, group.v : [Lg, B, Hkv, S, D]   keys stored after RoPE, and values: plain
                                            arrays, int8 with per-token scales, or
                                            KIVI's int4 (`dge_jax.runtime.quantized`)
    group.pos        : [Lg, B, Hkv, S]      original token position of each slot, -1 = empty
    group.index      : [Lg]                 each layer's next slot to write

Every forward runs ``for group in cache.groups: lax.scan(layer, group)``, so the grouping is
a layout choice, never a different code path:

- a fresh cache is one group of all L layers (scanned: compile time flat in depth);
- `decoding.decode_loop` on CPU and GPU regroups it into groups of one layer (XLA:CPU copies
  the slice of a stacked array a layer reads, every step; a one-layer group is read in place);
- compaction to per-layer capacities (PyramidKV's budgets, AdaKV's) gives one group per run
  of layers with the same capacity, each holding only the slots its layers need;
- sliding-window layers in the bounded layout (`dge_jax.runtime.window_cache`) hold their
  window plus one prefill step from prefill on: again one group per run of one capacity,
  and what reads every layer at once pads the smaller ones (`padded_pos`).

A query at position p may attend to slot s of its head iff ``0 <= pos[s] <= p``. That one
rule covers left padding (padded slots hold -1), eviction (evicted slots get -1) and
causality, so a masked cache, a compacted cache and a full cache all run the same code.

Worked example, 2-row batch, prompts of 3 and 5 tokens left-padded to 5 slots, then one
decode step writes slot 5 (``index`` was 5):

    slot:        0   1   2   3   4   5
    row 0 pos:  -1  -1   0   1   2   3
    row 1 pos:   0   1   2   3   4   5
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.runtime.quantized import (
    Entries,
    dequantize,
    empty_entries,
    entries_nbytes,
    kv_quant_of,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Consecutive layers of one capacity, stacked on a leading [Lg] axis (module docstring)."""

    k: Entries  # [Lg, B, Hkv, S, D]: an array, `Int8Entries` or `Int4Entries`
    v: Entries  # [Lg, B, Hkv, S, D]
    pos: jax.Array  # [Lg, B, Hkv, S] int32, -1 = empty
    index: jax.Array  # [Lg] int32, next slot to write per layer

    @property
    def num_layers(self) -> int:
        """Lg, static."""
        return self.pos.shape[0]

    @property
    def capacity(self) -> int:
        """S, static."""
        return self.pos.shape[-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Padded per-head KV cache: a tuple of layer groups (module docstring).

    ``k``, ``v``, ``pos`` and ``index`` read every layer at once, stacked on a leading [L]
    axis (what scoring rules and selection read); they need one capacity for all layers.
    ``k`` and ``v`` are what attention reads (dequantized where the cache is quantized); the
    stored entries are each group's own.
    """

    groups: tuple[LayerGroup, ...]

    @classmethod
    def stacked(cls, k: jax.Array, v: jax.Array, pos: jax.Array, index: jax.Array | int) -> KVCache:
        """A one-group cache from all layers' arrays: k, v [L, B, Hkv, S, D], pos
        [L, B, Hkv, S]; index: one next slot for every layer ([] or int), or one per layer."""
        index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), pos.shape[:1])
        return cls((LayerGroup(k=k, v=v, pos=pos, index=index),))

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """Layers per group, static."""
        return tuple(g.num_layers for g in self.groups)

    @property
    def capacities(self) -> tuple[int, ...]:
        """Slots per head of each layer (S_i), static."""
        return tuple(c for g in self.groups for c in (g.capacity,) * g.num_layers)

    @property
    def capacity(self) -> int:
        """Slots per head (S), static; the largest layer's when capacities differ by layer."""
        return max(self.capacities)

    @property
    def dtype(self) -> jnp.dtype:
        """dtype the keys and values are read in (the stored one, or a quantized cache's
        activation dtype)."""
        return self.groups[0].k.dtype

    @property
    def kv_quant(self) -> str:
        """How the keys and values are stored (a `quantized.parse_kv_quant` string)."""
        return kv_quant_of(self.groups[0].k)

    @property
    def ragged(self) -> bool:
        """True when layers hold different numbers of slots."""
        return len(set(self.capacities)) > 1

    @property
    def num_layers(self) -> int:
        """L, static."""
        return sum(self.group_sizes)

    @property
    def batch_size(self) -> int:
        """B, static."""
        return self.groups[0].pos.shape[1]

    def _all_layers(self, name: str) -> jax.Array:
        if self.ragged:
            raise ValueError(
                f"cache.{name} stacks every layer and needs one capacity for all of them, got "
                f"{self.capacities}; read each group's arrays (cache.groups[i].{name}) of a "
                "cache compacted to per-layer capacities"
            )
        return jnp.concatenate([dequantize(getattr(g, name)) for g in self.groups])

    @property
    def k(self) -> jax.Array:
        """[L, B, Hkv, S, D] every layer's keys as attention reads them (one capacity for all
        layers)."""
        return self._all_layers("k")

    @property
    def v(self) -> jax.Array:
        """[L, B, Hkv, S, D] every layer's values as attention reads them (one capacity for all
        layers)."""
        return self._all_layers("v")

    @property
    def stored_k(self) -> Entries:
        """[L, B, Hkv, S, D] every layer's keys as stored (int8 or int4 entries in a quantized
        cache): what a scan over layers takes, to dequantize one layer at a time instead
        of the whole cache (a bf16 copy of every layer's keys is a bf16 cache's size)."""
        return self._stored("k")

    @property
    def stored_v(self) -> Entries:
        """[L, B, Hkv, S, D] every layer's values as stored (see `stored_k`)."""
        return self._stored("v")

    def _stored(self, name: str) -> Entries:
        if self.ragged:
            self._all_layers(name)  # raises its error: one capacity for all layers
        return jax.tree.map(concat, *(getattr(g, name) for g in self.groups))

    @property
    def pos(self) -> jax.Array:
        """[L, B, Hkv, S] int32 every layer's slot positions (one capacity for all layers)."""
        return self._all_layers("pos")

    @property
    def index(self) -> jax.Array:
        """[L] int32: each layer's next slot to write."""
        return jnp.concatenate([g.index for g in self.groups])

    def padded_pos(self) -> jax.Array:
        """[L, B, Hkv, S] int32: every layer's slot positions, a layer with fewer slots than
        the largest (`capacity`) padded with empty ones (-1). What selection reads of a cache
        whose layers differ in capacity (the bounded layout of sliding layers,
        `dge_jax.runtime.window_cache`): small beside k and v, which are never padded."""
        if not self.ragged:
            return self.pos
        s = self.capacity
        return jnp.concatenate([
            jnp.pad(g.pos, ((0, 0),) * 3 + ((0, s - g.capacity),), constant_values=-1)
            for g in self.groups
        ])  # fmt: skip

    def valid(self) -> jax.Array:
        """[L, B, Hkv, S] bool: slots holding a token (`padded_pos` where capacities differ)."""
        return self.padded_pos() >= 0

    def num_kept(self) -> jax.Array:
        """[L, B, Hkv] int32: occupied slots per head (per-layer capacities too)."""
        return jnp.concatenate([jnp.sum(g.pos >= 0, axis=-1, dtype=jnp.int32) for g in self.groups])

    def per_group(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """An array with a leading [L] layer axis (a keep mask, per-layer budgets) cut into
        one piece per group ([Lg, ...] each), in order."""
        bounds = group_bounds(self.group_sizes)
        return tuple(x[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True))

    def with_pos(self, pos: jax.Array) -> KVCache:
        """The same cache with slot positions ``pos`` [L, B, Hkv, S] (masking: shapes
        unchanged); where capacities differ, ``pos`` is padded as `padded_pos` is and each
        group takes its own slots."""
        groups = (
            dataclasses.replace(g, pos=p[..., : g.capacity])
            for g, p in zip(self.groups, self.per_group(pos), strict=True)
        )
        return KVCache(tuple(groups))

    def nbytes(self) -> int:
        """Bytes held by the cache arrays (k, v with their scales, and pos)."""
        return sum(entries_nbytes((g.k, g.v, g.pos)) for g in self.groups)


def group_bounds(sizes: Sequence[int]) -> list[int]:
    """[0, s0, s0 + s1, ...]: the first layer of each group, then L."""
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def group_layers(layers: Any, sizes: tuple[int, ...]) -> tuple[Any, ...]:
    """Layer weights stacked on a leading [L] axis (every family's `params.layers`) cut into
    groups of ``sizes`` consecutive layers, each stacked [Lg, ...]: the weights of a cache's
    layer groups (`KVCache.group_sizes`).

    Slicing a stacked array copies it on XLA:CPU, so a decode loop groups once, before the
    loop; one group of all layers is the stack itself, no copy. (Here, beside `group_bounds`,
    not in `dge_jax.families`, the layer below runtime/.)
    """
    bounds = group_bounds(sizes)
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    if bounds[-1] != num_layers:
        raise ValueError(f"group sizes {sizes} do not split the model's {num_layers} layers")
    return tuple(
        jax.tree.map(lambda w, a=a, b=b: w[a:b], layers)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    )


def init_cache(
    num_layers: int,
    batch_size: int,
    num_kv_heads: int,
    capacity: int | Sequence[int],
    head_dim: int,
    dtype: jnp.dtype = jnp.float32,
    kv_quant: str = "none",
) -> KVCache:
    """An empty cache of static ``capacity`` slots per head: one group of every layer, or,
    given one capacity per layer, one group per run of layers of one capacity.

    k, v: [Lg, B, Hkv, capacity, D] zeros of `dtype`, stored as `kv_quant` asks ("int8",
    "int4...": `quantized.Int8Entries`, `Int4Entries` read in `dtype`); pos: [Lg, B, Hkv,
    capacity] int32 all -1; index: [Lg] int32 zeros.
    """
    caps = (capacity,) * num_layers if isinstance(capacity, int | np.integer) else capacity
    caps = tuple(int(c) for c in caps)
    if len(caps) != num_layers:
        raise ValueError(f"{len(caps)} capacities for a cache of {num_layers} layers")
    groups = []
    for a, b in itertools.pairwise(group_bounds(runs_of_equal(caps))):
        shape = (b - a, batch_size, num_kv_heads, caps[a], head_dim)
        groups.append(LayerGroup(
            k=empty_entries(shape, dtype, kv_quant, keys=True),
            v=empty_entries(shape, dtype, kv_quant, keys=False),
            pos=jnp.full(shape[:-1], -1, jnp.int32),
            index=jnp.zeros((b - a,), jnp.int32),
        ))  # fmt: skip
    return KVCache(tuple(groups))


def runs_of_equal(values: Sequence[int]) -> tuple[int, ...]:
    """Lengths of the maximal runs of equal consecutive values: (8, 8, 4, 4, 4, 8) ->
    (2, 3, 1). The grouping of a cache whose layers have these capacities."""
    sizes: list[int] = []
    for i, value in enumerate(values):
        if i and value == values[i - 1]:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return tuple(sizes)


def regroup(cache: KVCache, sizes: Sequence[int]) -> KVCache:
    """The same layers in groups of the given sizes (summing to L); each new group must hold
    layers of one capacity. A copy, unless ``sizes`` is already the cache's grouping."""
    sizes = tuple(int(n) for n in sizes)
    if sum(sizes) != cache.num_layers or min(sizes, default=0) < 1:
        raise ValueError(f"group sizes {sizes} do not split the cache's {cache.num_layers} layers")
    if sizes == cache.group_sizes:
        return cache
    caps = cache.capacities
    bounds = group_bounds(sizes)
    # (group, layer within it) of every layer, to take each new group's layers from where
    # they are: a slice of one old group, or pieces of several concatenated.
    where = [(g, i) for g, n in enumerate(cache.group_sizes) for i in range(n)]
    groups = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if len(set(caps[a:b])) != 1:
            raise ValueError(
                f"layers {a}..{b - 1} hold different numbers of slots {caps[a:b]}: a group "
                "needs one capacity"
            )
        pieces = []  # (old group, first layer, last layer + 1)
        for g, i in where[a:b]:
            if pieces and pieces[-1][0] == g:
                pieces[-1][2] = i + 1
            else:
                pieces.append([g, i, i + 1])

        def take(name, pieces=pieces):
            parts = [jax.tree.map(lambda x, i=i, j=j: x[i:j], getattr(cache.groups[g], name))
                     for g, i, j in pieces]  # fmt: skip
            return parts[0] if len(parts) == 1 else jax.tree.map(concat, *parts)

        groups.append(LayerGroup(k=take("k"), v=take("v"), pos=take("pos"), index=take("index")))
    return KVCache(tuple(groups))

def concat(*parts: jax.Array) -> jax.Array:
    """The parts joined on their leading (layer) axis: `jax.tree.map`'s leaf function, so
    quantized entries join every leaf (values, scales, an int4 residual)."""
    return jnp.concatenate(parts)
