"""Quantized cache entries: what an int8 or int4 KV cache stores, and how attention reads it.

A layer group's keys or values ([Lg, B, Hkv, S, D]) are a plain array of the activation
dtype ("none"), an `Int8Entries` ("int8") or an `Int4Entries` ("int4"; `parse_kv_quant`
reads its options). Every form is read through `dequantize`, so attention and every rule
see the same numbers, and every form's leaves keep the leading [Lg, B, Hkv] axes, so what
moves whole layers, rows or heads (regroup, a layer scan, row stacking, mesh shardings) is
``jax.tree.map`` of the plain operation.

int8: symmetric, one scale per token per kv head, the scheme of MaxText's int8 KV cache,

    scale[..., s, 0] = max_d |x[..., s, d]| * (1 / 127)  (f32, then the activation dtype)
    q[..., s, d]     = round(x[..., s, d] / scale)        (int8 in [-127, 127])
    x'[..., s, d]    = q[..., s, d] * scale[..., s, 0]    (`dequantize`)

so |x - x'| <= scale / 2 per element, plus the activation dtype's rounding of the product.
Both leaves keep the slot axis second to last, so an operation that moves slots (a write, a
pad, a gather along the slots, slicing) is also ``jax.tree.map`` of the plain one: an int8
entry is quantized once, when it is written, and eviction never requantizes it.

int4: KIVI's scheme (Liu et al. 2024, arXiv 2402.02750; github.com/jy-yuan/KIVI), 4-bit
asymmetric with groups of G: keys per channel over G consecutive slots, values per token
over G consecutive channels,

    keys   [.., S, D]: scale, zero [.., S // G, D]   (group j: slots jG .. jG + G - 1)
    values [.., S, D]: scale, zero [.., S, D // G]   (group j: channels jG .. jG + G - 1)
    scale = (max - min) * (1 / 15), zero = min       (f32, then the activation dtype)
    q     = round((x - zero) / scale)                (in [0, 15])
    x'    = q * scale + zero                         (`dequantize`, the activation dtype)

so |x - x'| <= scale / 2 (plus the dtype's rounding), packed two a byte along D (channel 2j
in the low nibble of byte j, 2j + 1 in the high one), with a full-precision residual. The
slots form aligned blocks of R (a multiple of G): block b is slots [bR, (b + 1)R). The block
holding the layer's next write slot (index // R) is kept in `resid` [.., R, D] at full
precision; the write that completes a block quantizes it into the packed store, and a
trailing partial block (a capacity not a multiple of R) stays residual for good. Worked
example, G = 2, R = 4, S = 10, index 6 after a write of slots 4, 5:

    slot:    0 1 2 3 | 4 5 6 7 | 8 9
    block:      0    |    1    | (tail)
             packed  | resid (start 4: slots 4, 5 written, 6, 7 empty)

A write of 2 more tokens fills slots 6, 7: block 1 completes, is quantized (key groups
{4, 5} and {6, 7} per channel) and the residual moves to slots 8, 9 (start 8, the tail).
KIVI itself keeps a sliding residual of the last R values and quantizes keys from the
first token unaligned; aligned blocks make a write cost O(R * D) per layer whatever the
capacity (`write_int4`) and give every slot one fixed group.

A key group spans G slots, and eviction removes single slots: so whatever moves int4 entries
between slots (compaction's gather, the bounded sliding layers' moves, row stacking) runs
on the dequantized entries and requantizes the result (`map_slots`). dge_jax requantizes
int4 entries there, as kvpress requantizes its `QuantizedCache` after every compression;
int8 entries never are. Appending empty slots (`pad_slots`) moves nothing and stays exact.

Every attention path reads the dequantized entries, its own step's new entries as they are
stored after the step (int8: quantized; int4: full precision while their block is the
residual, quantized if the step completes it), so a decode step reads what a prefill step
of the same tokens would read after writing them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

# The cache's storage choices (`GenerationConfig.kv_quant`, the CLI's and runner's
# --kv_quant); "int4" also takes options, "int4-g64-r256" (`parse_kv_quant`).
KV_QUANTS = ("none", "int8", "int4")
INT8_MAX = 127
INT4_MAX = 15
INT4_GROUP, INT4_RESIDUAL = 32, 128  # KIVI's defaults
_INT4 = re.compile(r"int4(?:-g(\d+))?(?:-r(\d+))?")


class KVQuant(NamedTuple):
    """A parsed kv_quant: kind ("none", "int8", "int4") and int4's group G and residual R."""

    kind: str
    group: int = INT4_GROUP
    residual: int = INT4_RESIDUAL

    @property
    def name(self) -> str:
        """The canonical string: "int4" for KIVI's defaults, else "int4-g{G}-r{R}"."""
        if self.kind != "int4" or (self.group, self.residual) == (INT4_GROUP, INT4_RESIDUAL):
            return self.kind
        return f"int4-g{self.group}-r{self.residual}"


def parse_kv_quant(kv_quant: str) -> KVQuant:
    """"none" | "int8" | "int4[-g<G>][-r<R>]" -> `KVQuant`; a ValueError naming the grammar
    otherwise (G >= 1, R a multiple of G; int4 defaults G 32, R 128)."""
    grammar = ("kv_quant must be 'none', 'int8' or 'int4[-g<G>][-r<R>]' (int4: G tokens per "
               f"key group, G channels per value group, R a multiple of G; default G {INT4_GROUP},"
               f" R {INT4_RESIDUAL}), got {kv_quant!r}")  # fmt: skip
    if kv_quant in ("none", "int8"):
        return KVQuant(kv_quant)
    match = _INT4.fullmatch(kv_quant) if isinstance(kv_quant, str) else None
    if match is None:
        raise ValueError(grammar)
    group = int(match.group(1) or INT4_GROUP)
    residual = int(match.group(2) or INT4_RESIDUAL)
    if group < 1 or residual < group or residual % group:
        raise ValueError(grammar)
    return KVQuant("int4", group, residual)


def check_kv_quant(kv_quant: str) -> str:
    """`kv_quant` if `parse_kv_quant` reads it, else its ValueError."""
    parse_kv_quant(kv_quant)
    return kv_quant


class Int8Entries(NamedTuple):
    """Keys or values stored as int8 with one scale per token per kv head (module docstring):
    q [..., S, D] int8, scale [..., S, 1] in the activation dtype."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The entries' shape [..., S, D] (what a plain array of them would have)."""
        return self.q.shape

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype the entries are read in (the activation dtype)."""
        return self.scale.dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Entries:
    """Keys or values stored as KIVI's int4 (module docstring), for S slots of D channels:
    q [..., S, D // 2] uint8 (packed pairs; slots of the residual block and of the tail
    unused), scale and zero (keys [..., S // G, D], values [..., S, D // G]) in the
    activation dtype, resid [..., R, D] (the residual block, activation dtype) and start
    [...] int32 (its first slot, the same for every row and head of a layer; all leading
    axes kept so rows and heads split alike). keys, group (G), residual (R): static.
    q, scale and zero are stored with m rows merged into one of up to 128 lanes (`_merge`:
    [..., n / m, m * width], the same bytes); `logical` reads them one row a slot."""

    q: jax.Array
    scale: jax.Array
    zero: jax.Array
    resid: jax.Array
    start: jax.Array
    keys: bool = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(metadata=dict(static=True))
    residual: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The entries' shape [..., S, D] (what a plain array of them would have)."""
        d = self.resid.shape[-1]
        return (*self.q.shape[:-2], self.q.shape[-2] * (self.q.shape[-1] // (d // 2)), d)

    def logical(self, name: str) -> jax.Array:
        """Leaf `name` ("q", "scale", "zero") with one row per slot (per key group for keys'
        scales and zeros), as `quantize_int4` makes it, whatever rows storage merged."""
        d = self.resid.shape[-1]
        width = {"q": d // 2, "scale": d if self.keys else d // self.group}
        return _unmerge(getattr(self, name), width.get(name, width["scale"]))

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype the entries are read in (the activation dtype)."""
        return self.resid.dtype

    @property
    def kv_quant(self) -> str:
        """The kv_quant string these entries were made by."""
        return KVQuant("int4", self.group, self.residual).name


Entries = jax.Array | Int8Entries | Int4Entries


def quantize_int8(x: jax.Array, dtype: jnp.dtype | None = None) -> Int8Entries:
    """x [..., D] -> `Int8Entries` with scales [..., 1] of `dtype` (default x's).

    The scale is rounded to its dtype before dividing, so `dequantize` multiplies by the very
    scale the values were divided by; an all-zero row gets scale 0 and q 0."""
    dtype = jnp.dtype(dtype or x.dtype)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    # times the f32 reciprocal, as XLA computes a division by a constant anyway
    scale = (amax * jnp.float32(1 / INT8_MAX)).astype(dtype)
    safe = jnp.where(scale == 0, 1, scale).astype(jnp.float32)
    q = jnp.clip(jnp.round(x32 / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return Int8Entries(q=q, scale=scale)


def _grouped(x: jax.Array, keys: bool, group: int) -> jax.Array:
    """x [..., n, D] with its groups on their own axis: keys [..., n / G, G, D] (G slots per
    group), values [..., n, D / G, G] (G channels per group)."""
    *lead, n, d = x.shape
    if keys:
        return x.reshape(*lead, n // group, group, d)
    return x.reshape(*lead, n, d // group, group)


def _group_axis(keys: bool) -> int:
    return -2 if keys else -1


def quantize_int4(
    x: jax.Array, keys: bool, group: int, dtype: jnp.dtype | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., n, D] (n a multiple of G for keys) -> (q [..., n, D // 2] uint8 packed, scale,
    zero of `dtype`: keys [..., n / G, D], values [..., n, D / G]): KIVI's asymmetric 4 bits
    (module docstring). Scale and zero are rounded to their dtype before dividing, as
    `quantize_int8` does; a constant group gets scale 0 and q 0."""
    dtype = jnp.dtype(dtype or x.dtype)
    axis = _group_axis(keys)
    xg = _grouped(x.astype(jnp.float32), keys, group)
    lo, hi = jnp.min(xg, axis=axis, keepdims=True), jnp.max(xg, axis=axis, keepdims=True)
    scale = ((hi - lo) * jnp.float32(1 / INT4_MAX)).astype(dtype)
    zero = lo.astype(dtype)
    safe = jnp.where(scale == 0, 1, scale).astype(jnp.float32)
    q = jnp.clip(jnp.round((xg - zero.astype(jnp.float32)) / safe), 0, INT4_MAX)
    q = q.astype(jnp.uint8).reshape(x.shape)
    pairs = q.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed, jnp.squeeze(scale, axis), jnp.squeeze(zero, axis)


def dequantize_int4(
    q: jax.Array, scale: jax.Array, zero: jax.Array, keys: bool, group: int
) -> jax.Array:
    """`quantize_int4`'s packed q [..., n, D // 2] and its scale, zero -> x' [..., n, D] =
    q * scale + zero in the scale's dtype."""
    unpacked = jnp.stack([q & 0xF, q >> 4], axis=-1).reshape(*q.shape[:-1], 2 * q.shape[-1])
    axis = _group_axis(keys)
    s, z = jnp.expand_dims(scale, axis), jnp.expand_dims(zero, axis)
    x = _grouped(unpacked.astype(scale.dtype), keys, group) * s + z
    return x.reshape(unpacked.shape)


def dequantize(entries: Entries) -> jax.Array:
    """What attention reads: a plain array as it is, int8 entries as q * scale, int4 entries
    as q * scale + zero with the residual block in its place, all in the activation dtype
    (the one computation every path runs, so they agree to the bit)."""
    if isinstance(entries, Int8Entries):
        return entries.q.astype(entries.scale.dtype) * entries.scale
    if not isinstance(entries, Int4Entries):
        return entries
    e = entries
    r, slots = e.residual, e.shape[-2]
    n = slots // r * r  # slots in whole blocks; the rest is the tail, always residual
    lead = e.q.shape[:-2]
    base = dequantize_int4(e.logical("q")[..., :n, :], _region(e, n), _region(e, n, "zero"), e.keys,
                           e.group)  # fmt: skip
    # The residual replaces its block: block start // R of the [.., n / R, R, D] view, or
    # the tail when start // R is n / R (a start past the tail matches nothing).
    blocks = base.reshape(*lead, n // r, r, -1)
    here = jnp.arange(n // r) == (e.start // r)[..., None]  # [..., n / R]
    blocks = jnp.where(here[..., None, None], e.resid[..., None, :, :], blocks)
    tail = jnp.where((e.start == n)[..., None, None], e.resid[..., : slots - n, :], 0)
    return jnp.concatenate([blocks.reshape(*lead, n, -1), tail.astype(base.dtype)], axis=-2)


def _region(e: Int4Entries, n: int, name: str = "scale") -> jax.Array:
    """e's scale (or zero) of the first n slots (n a multiple of R, hence of G)."""
    x = e.logical(name)
    return x[..., : n // e.group, :] if e.keys else x[..., :n, :]


# TPU tiles an array's last dim in 128 lanes: int4's packed values (D / 2 bytes a slot) and
# values' scales (D / G a slot) would be padded there, and XLA lays a layer loop's carry out
# otherwise than the program's arguments, so the whole cache was copied padded (benchmarks/
# RESULTS.md, "An int4 cache (KIVI) compiled for TPU"). Stored leaves therefore merge m rows
# into one of m * width (a reshape of the same bytes, row-major): m the largest count of rows
# up to 128 lanes that divides the rows and the rows of a residual block (so a block's write
# covers whole stored rows). The stored last dim says m (`_unmerge`).
_LANES = 128


def _merge_factor(width: int, rows: int, unit: int) -> int:
    """Rows merged into one stored row: the largest m <= 128 // width dividing rows and unit."""
    return max(m for m in range(1, max(1, _LANES // width) + 1) if rows % m == 0 and unit % m == 0)


def _merge(x: jax.Array, unit: int) -> jax.Array:
    """x [..., n, W] (one row a slot, or a key group) stored as [..., n / m, m * W]."""
    *lead, n, w = x.shape
    m = _merge_factor(w, n, unit)
    return x.reshape(*lead, n // m, m * w)


def _unmerge(x: jax.Array, width: int) -> jax.Array:
    """A stored leaf [..., n / m, m * width] as [..., n, width] (`_merge` undone)."""
    *lead, rows, mw = x.shape
    return x.reshape(*lead, rows * (mw // width), width)


def _units(keys: bool, group: int, residual: int) -> tuple[int, int]:
    """Rows of a residual block in the packed values and in the scales and zeros."""
    return residual, (residual // group if keys else residual)


def quantize_int4_entries(
    x: jax.Array, index: jax.Array | int, like: KVQuant, keys: bool, dtype=None
) -> Int4Entries:
    """x [..., S, D] as `Int4Entries` whose layer has written slots [0, index): every whole
    block quantized, block index // R (or the tail) as the residual. index: an int or an
    array broadcasting to x's leading axes (one per layer: [Lg, 1, 1])."""
    dtype = jnp.dtype(dtype or x.dtype)
    g, r = like.group, like.residual
    *lead, slots, d = x.shape
    _check_int4(d, g)
    n = slots // r * r
    q, scale, zero = quantize_int4(x[..., :n, :], keys, g, dtype)
    # the store covers all S slots (the tail's and the residual's packed bytes unused)
    q = jnp.pad(q, ((0, 0),) * len(lead) + ((0, slots - n), (0, 0)))
    extra = (slots // g - n // g) if keys else slots - n
    scale, zero = (jnp.pad(a, ((0, 0),) * len(lead) + ((0, extra), (0, 0))) for a in (scale, zero))
    start = jnp.broadcast_to(jnp.asarray(index, jnp.int32) // r * r, lead)
    # The residual: block start // R of x padded to whole blocks (the tail, or empty slots)
    nb = n // r + 1
    padded = jnp.pad(x, ((0, 0),) * len(lead) + ((0, nb * r - slots), (0, 0))).astype(dtype)
    which = jnp.minimum(start // r, nb - 1)
    resid = jnp.take_along_axis(padded.reshape(*lead, nb, r, d),
                                which[..., None, None, None], axis=-3)[..., 0, :, :]  # fmt: skip
    uq, us = _units(keys, g, r)
    return Int4Entries(_merge(q, uq), _merge(scale, us), _merge(zero, us), resid, start,
                       keys=keys, group=g, residual=r)  # fmt: skip


def _check_int4(head_dim: int, group: int) -> None:
    """int4 packs channel pairs and groups values' channels by G: D even and a multiple of G."""
    if head_dim % 2 or head_dim % group:
        raise ValueError(
            f"kv_quant int4 with groups of {group} needs a head dim that is even and a multiple "
            f"of {group} (values are quantized per token in groups of {group} channels), got "
            f"{head_dim}: pick a group dividing it, e.g. 'int4-g{_divisor(head_dim, group)}'"
        )


def _divisor(d: int, below: int) -> int:
    """The largest even divisor of d not above `below` (2 if none), for the error above."""
    return max((g for g in range(2, below + 1, 2) if d % g == 0), default=2)


def write_int4(
    entries: Int4Entries, layer: jax.Array | int, slot: jax.Array | int, new: jax.Array
) -> tuple[Int4Entries, jax.Array]:
    """Layer `layer` of stacked entries [Lg, B, Hkv, S, D] with new [B, Hkv, T, D] written at
    slots [slot, slot + T); returns (the entries, new as read back once stored [B, Hkv, T,
    D] in new's dtype: full precision in the residual block, quantized in a block the write
    completes).

    The layer's next write slot is `slot` (its residual block starts at slot // R * R). The
    residual block and the T new entries form a window of 1 + ceil(T / R) whole blocks;
    each is quantized, and the complete ones (ending at or before slot + T and inside the
    store's whole blocks) are written into the packed store block by block; an incomplete
    block's slice (its start clamped into the store) writes back what the store holds, so
    a clamped start misplaces nothing. The new residual is the window's block of slot + T. Worked
    example, R = 4, slot 6, T = 3: the window is blocks 1, 2 (slots 4 .. 11, the residual's
    4, 5 then the new 6, 7, 8); block 1 ends at 8 <= 9: stored; block 2 holds slot 9, the
    next write: the new residual, start 8. Cost O((R + T) * D) per layer, whatever S."""
    e = entries
    g, r, keys = e.group, e.residual, e.keys
    slots, dtype = e.shape[-2], e.dtype
    b, h, t, d = new.shape
    nw = 1 + -(-t // r)  # blocks in the window
    start = slot // r * r
    window = jnp.concatenate([e.resid[layer], jnp.zeros((b, h, (nw - 1) * r, d), dtype)], axis=2)
    window = jax.lax.dynamic_update_slice_in_dim(window, new.astype(dtype), slot - start, axis=2)
    q, scale, zero = quantize_int4(window, keys, g, dtype)
    end = slot + t
    block = start // r + jnp.arange(nw)  # the window's block ids
    complete = ((block + 1) * r <= end) & (block < slots // r)

    def put(store, part, unit):
        # store [Lg, B, Hkv, X / m, m * Y] (rows merged, `_merge`); part [B, Hkv, nw * unit, Y]
        # (unit rows a block): each complete block written whole at layer by a
        # dynamic_update_slice, an incomplete one writes back what is there. Not a scatter:
        # its update window (rows, heads, lanes) made XLA lay a layer loop's carry out with
        # the rows second-minor, unlike the program's arguments, hence a copy of the store.
        m = store.shape[-1] // part.shape[-1]
        per = unit // m  # stored rows a block
        if slots // r == 0:  # no whole block: nothing is ever stored
            return store
        part = part.reshape(b, h, nw, per, store.shape[-1])
        for j in range(nw):
            at = jnp.minimum(block[j], slots // r - 1) * per  # in range; used if complete
            old = jax.lax.dynamic_slice(store, (layer, 0, 0, at, 0),
                                        (1, b, h, per, store.shape[-1]))  # fmt: skip
            new_rows = jnp.where(complete[j], part[None, :, :, j].astype(store.dtype), old)
            store = jax.lax.dynamic_update_slice(store, new_rows, (layer, 0, 0, at, 0))
        return store

    uq, us = _units(keys, g, r)
    new_start = end // r * r
    kept = jax.lax.dynamic_slice_in_dim(window, new_start - start, r, axis=2)
    stored = Int4Entries(
        q=put(e.q, q, uq), scale=put(e.scale, scale, us),
        zero=put(e.zero, zero, us), resid=e.resid.at[layer].set(kept),
        start=e.start.at[layer].set(new_start), keys=keys, group=g, residual=r,
    )  # fmt: skip
    # What the window reads back: complete blocks dequantized, the others as written
    read = dequantize_int4(q, scale, zero, keys, g).reshape(b, h, nw, r, d)
    read = jnp.where(complete[:, None, None], read, window.reshape(b, h, nw, r, d))
    read = jax.lax.dynamic_slice_in_dim(read.reshape(b, h, nw * r, d), slot - start, t, axis=2)
    return stored, read.astype(new.dtype)


def store_like(stored: Entries, new: jax.Array) -> Entries:
    """`new` [..., D] in the form of plain or int8 `stored` (cast to its dtype, or quantized
    like it): what a write puts into a cache holding `stored`. (int4: `write_int4`.)"""
    if isinstance(stored, Int8Entries):
        return quantize_int8(new, stored.dtype)
    return new.astype(stored.dtype)


def read_back(stored_new: Entries, new: jax.Array) -> jax.Array:
    """`new` as attention reads it once written as `stored_new` (`store_like`'s result): new
    itself for a plain cache, its dequantized int8 entries in new's dtype for an int8 one."""
    if isinstance(stored_new, Int8Entries):
        return dequantize(stored_new).astype(new.dtype)
    return new


def map_slots(f: Callable[[jax.Array], jax.Array], entries: Entries, index) -> Entries:
    """`f` (an operation on [..., S, D] arrays that moves slots: a gather, a shift) applied
    to stored entries whose layers will next write slot `index` (an int or an array
    broadcasting to their leading axes, [Lg, 1, 1] one per layer): to each leaf of plain and
    int8 entries (int8 scales move with their values), to int4 entries' dequantized values,
    requantized after (a key group is shared by G slots that `f` may part)."""
    return settle(jax.tree.map(f, movable(entries)), entries, index)


def movable(entries: Entries) -> Entries:
    """Entries whose every leaf keeps the slot axis second to last, for slot moves: int4
    dequantized, plain and int8 as they are (`map_slots`'s first half)."""
    return dequantize(entries) if isinstance(entries, Int4Entries) else entries


def settle(moved: Entries, like: Entries, index) -> Entries:
    """`movable` entries after a slot move, stored as `like` again (int4: requantized with
    next write slot `index`, `quantize_int4_entries`; `map_slots`'s second half)."""
    if not isinstance(like, Int4Entries):
        return moved
    quant = KVQuant("int4", like.group, like.residual)
    return quantize_int4_entries(moved, _per_layer(index, moved.ndim), quant, like.keys, like.dtype)


def _per_layer(index, ndim: int) -> jax.Array:
    """index [Lg] (one per layer) as [Lg, 1, 1, ...] against [Lg, B, Hkv, ...] entries of
    `ndim` dims (the leading axes less S, D); an int or a scalar as it is."""
    index = jnp.asarray(index, jnp.int32)
    return index.reshape(index.shape + (1,) * (ndim - 2 - index.ndim)) if index.ndim else index


def pad_slots(entries: Entries, extra: int) -> Entries:
    """Entries [..., S, D] with `extra` empty slots appended: zeros at the end of the slot
    axis of every leaf (int4: of the packed store, scale and zero; the residual block and
    its start unchanged, as the write slot is). Exact: no entry moves."""
    if not isinstance(entries, Int4Entries):
        return jax.tree.map(lambda x: _pad_axis(x, -2, extra), entries)
    e, slots = entries, entries.shape[-2]
    more = (slots + extra) // e.group - slots // e.group if e.keys else extra
    uq, us = _units(e.keys, e.group, e.residual)

    def pad(name, n, unit):  # rows merged again for the new count (`_merge`)
        return _merge(_pad_axis(e.logical(name), -2, n), unit)

    return dataclasses.replace(e, q=pad("q", extra, uq), scale=pad("scale", more, us),
                               zero=pad("zero", more, us))  # fmt: skip


def _pad_axis(x: jax.Array, axis: int, extra: int) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def read_slots(entries: Entries, slots: jax.Array) -> jax.Array:
    """The dequantized entries [..., W, D] at slots [..., W] of stored entries [..., S, D]:
    plain and int8 picked first (only the picked int8 slots dequantized), int4 dequantized
    first (its slots share groups)."""
    def pick(x):
        return jnp.take_along_axis(x, slots[..., None], axis=-2)
    if isinstance(entries, Int4Entries):
        return pick(dequantize(entries))
    return dequantize(jax.tree.map(pick, entries))


def empty_entries(
    shape: tuple[int, ...], dtype: jnp.dtype, kv_quant: str, keys: bool = True
) -> Entries:
    """Zeros of `shape` [..., S, D] stored as `kv_quant` asks, read in `dtype` (keys: int4's
    grouping, per channel for keys, per token for values)."""
    quant = parse_kv_quant(kv_quant)
    if quant.kind == "int8":
        return Int8Entries(q=jnp.zeros(shape, jnp.int8), scale=jnp.zeros((*shape[:-1], 1), dtype))
    if quant.kind == "int4":  # what `quantize_int4_entries` makes of zeros, built as zeros
        return _empty_int4(shape, dtype, quant, keys)
    return jnp.zeros(shape, dtype)



def _empty_int4(shape: tuple[int, ...], dtype, quant: KVQuant, keys: bool) -> Int4Entries:
    """Int4 zeros of `shape` [..., S, D] that wrote nothing: every leaf zeros, equal to
    `quantize_int4_entries` of zeros at index 0 (scale 0, zero 0, q 0, start 0) without its
    dense temporaries (a whole cache of them in prefill, which builds the cache under jit)."""
    *lead, slots, d = shape
    g, r = quant.group, quant.residual
    _check_int4(d, g)
    uq, us = _units(keys, g, r)
    n, w = (slots // g, d) if keys else (slots, d // g)  # scales' rows and width

    def zeros(rows, width, unit, dt):  # stored with rows merged (`_merge`)
        m = _merge_factor(width, rows, unit)
        return jnp.zeros((*lead, rows // m, m * width), dt)

    return Int4Entries(
        q=zeros(slots, d // 2, uq, jnp.uint8), scale=zeros(n, w, us, dtype),
        zero=zeros(n, w, us, dtype), resid=jnp.zeros((*lead, r, d), dtype),
        start=jnp.zeros(lead, jnp.int32), keys=keys, group=g, residual=r,
    )  # fmt: skip

def kv_quant_of(entries: Entries) -> str:
    """The kv_quant string `entries` are stored as (`parse_kv_quant` reads it back)."""
    if isinstance(entries, Int4Entries):
        return entries.kv_quant
    return "int8" if isinstance(entries, Int8Entries) else "none"


def entries_nbytes(entries: Entries) -> int:
    """Bytes the stored entries hold (values, scales, zeros, an int4 residual)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(entries))
