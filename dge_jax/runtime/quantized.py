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
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dge_jax.runtime.int4_entries import (
    Int4Entries as Int4Entries,
)
from dge_jax.runtime.int4_entries import (
    _empty_int4,
    _merge,
    _per_layer,
    _units,
    _unmerge,
)
from dge_jax.runtime.int4_entries import (
    dequantize_int4 as dequantize_int4,
)
from dge_jax.runtime.int4_entries import (
    quantize_int4 as quantize_int4,
)
from dge_jax.runtime.int4_entries import (
    quantize_int4_entries as quantize_int4_entries,
)
from dge_jax.runtime.int4_entries import (
    write_int4 as write_int4,
)
from dge_jax.runtime.kv_quant import (
    INT4_GROUP as INT4_GROUP,
)
from dge_jax.runtime.kv_quant import (
    INT4_RESIDUAL as INT4_RESIDUAL,
)
from dge_jax.runtime.kv_quant import (
    KV_QUANTS as KV_QUANTS,
)
from dge_jax.runtime.kv_quant import (
    KVQuant as KVQuant,
)
from dge_jax.runtime.kv_quant import (
    check_kv_quant as check_kv_quant,
)
from dge_jax.runtime.kv_quant import (
    parse_kv_quant as parse_kv_quant,
)

INT8_MAX = 127

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


def dequantize(entries: Entries) -> jax.Array:
    """What attention reads: a plain array as it is, int8 entries as q * scale, int4 entries
    as q * scale + zero with the residual block in its place, all in the activation dtype
    (the one computation every path runs, so they agree to the bit)."""
    if isinstance(entries, Int8Entries):
        return entries.q.astype(entries.scale.dtype) * entries.scale
    if not isinstance(entries, Int4Entries):
        return entries
    e = entries
    n = e.shape[-2] // e.residual * e.residual  # slots in whole blocks; the rest is the tail
    return jnp.concatenate([dequantize_slots(e, 0, n), int4_tail(e)], axis=-2)


PIECES = 8  # pieces the kernels and the rules read an int4 layer's whole blocks in


def piece_plan(slots: int, residual: int, pieces: int = PIECES) -> tuple[int, int, int]:
    """(slots per piece, pieces, whole-block slots n) for a capacity of `slots`: `pieces`
    pieces of whole blocks of `residual` slots (fewer when there are fewer blocks; the last
    one may end where the one before it did not, so pieces cover [0, n) with some slots
    twice)."""
    n = slots // residual * residual
    size = residual * max(1, -(-(n // residual) // pieces))
    return size, -(-n // size), n


def over_pieces(slots: int, residual: int, pieces: int, piece: Callable, tail: Callable, carry):
    """`carry` folded over an int4 layer of `slots` slots read in pieces (`piece_plan`):
    piece(start, size, seen, carry) for each piece of whole blocks under a `fori_loop`, then
    tail(n, carry) when S % R slots follow them. The last piece moves back to end at n, so
    its first slots may be ones the piece before it read: `seen` [size] marks them (slot
    start + i < p * size), for a reader that must not count a slot twice."""
    size, count, n = piece_plan(slots, residual, pieces)

    def step(p, c):
        covered = p * size  # slots [0, covered) were read by the pieces before
        start = jnp.minimum(covered, n - size)
        return piece(start, size, start + jnp.arange(size) < covered, c)

    if count:
        carry = jax.lax.fori_loop(0, count, step, carry)
    return tail(n, carry) if slots > n else carry


def dequantize_slots(entries: Entries, start: jax.Array | int, size: int) -> jax.Array:
    """Slots [start, start + size) of stored entries [..., S, D] as `dequantize` reads them
    (the same numbers as its [..., start:start + size, :]), the other slots left alone: what
    reads an int4 layer a piece at a time never holds all of it dequantized. start: an int
    or a traced scalar. int4: start and size multiples of R inside the whole blocks (the
    tail: `int4_tail`), so every key group and residual block is all in or all out."""
    if not isinstance(entries, Int4Entries):
        return dequantize(jax.tree.map(
            lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=a.ndim - 2), entries))
    e, r = entries, entries.residual
    if size % r:
        raise ValueError(f"int4 entries are read in whole blocks of {r} slots, not {size}")
    d = e.resid.shape[-1]
    per_block_q, per_block_scale = _units(e.keys, e.group, r)  # rows of a block in each leaf

    def rows(name: str, width: int, per_block: int) -> jax.Array:
        """The piece's rows of stored leaf `name` (merged m to a row: sliced merged, then
        unmerged, so only the piece is ever laid out one row a slot)."""
        x = getattr(e, name)
        m = x.shape[-1] // width
        first = start // r * (per_block // m)
        return _unmerge(jax.lax.dynamic_slice_in_dim(x, first, size // r * per_block // m,
                                                     axis=x.ndim - 2), width)  # fmt: skip

    width = d if e.keys else d // e.group
    base = dequantize_int4(rows("q", d // 2, per_block_q), rows("scale", width, per_block_scale),
                           rows("zero", width, per_block_scale), e.keys, e.group)  # fmt: skip
    # The residual replaces its block: the piece's block i is block start // R + i.
    lead = base.shape[:-2]
    blocks = base.reshape(*lead, size // r, r, d)
    here = start // r + jnp.arange(size // r) == (e.start // r)[..., None]  # [..., size / R]
    blocks = jnp.where(here[..., None, None], e.resid[..., None, :, :], blocks)
    return blocks.reshape(*lead, size, d)


def int4_tail(entries: Int4Entries) -> jax.Array:
    """The tail of int4 entries (the S % R slots past the whole blocks, always residual) as
    `dequantize` reads them: the residual's first slots when the residual block is the tail
    (start = the whole blocks' end), else zeros (empty slots)."""
    e = entries
    slots = e.shape[-2]
    n = slots // e.residual * e.residual
    return jnp.where((e.start == n)[..., None, None], e.resid[..., : slots - n, :], 0).astype(
        e.dtype)


def requantized_when_moved(entries: Entries) -> bool:
    """Whether moving `entries` between slots dequantizes and requantizes them (int4: a key
    group is shared by G slots that a move parts), so compaction, decode-time compression and
    row stacking move them one layer at a time (`map_slots`)."""
    return isinstance(entries, Int4Entries)


def written_first(entries: Entries) -> bool:
    """Whether a step writes its entries before attention reads them (int4: a step that
    completes a residual block quantizes entries already in the cache, and reading the
    written buffers keeps the update in place); plain and int8 entries are read beside the
    cache, then written. Also: whether kernels get the layer dequantized first (int4)."""
    return isinstance(entries, Int4Entries)


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


def read_slots(entries: Entries, slots: jax.Array, pieces: int = 1) -> jax.Array:
    """The dequantized entries [..., W, D] at slots [..., W] of stored entries [..., S, D]:
    plain and int8 picked first (only the picked int8 slots dequantized); int4 dequantized
    whole and picked (pieces <= 1), or read in `pieces` pieces of whole blocks (its slots
    share groups; `over_pieces`), each piece dequantized and the slots inside it picked, so
    the layer is never dequantized whole."""
    def pick(x, at):
        return jnp.take_along_axis(x, at[..., None], axis=-2)

    if not isinstance(entries, Int4Entries):
        return dequantize(jax.tree.map(lambda x: pick(x, slots), entries))
    e = entries
    if pieces <= 1:
        return pick(dequantize(e), slots)

    def from_part(part: jax.Array, start, out: jax.Array) -> jax.Array:
        local = slots - start
        inside = (local >= 0) & (local < part.shape[-2])
        return jnp.where(inside[..., None], pick(part, jnp.clip(local, 0, part.shape[-2] - 1)),
                         out)  # fmt: skip

    out = jnp.zeros((*slots.shape, e.resid.shape[-1]), e.dtype)
    # A slot read twice (the last piece's `seen` ones) reads alike both times.
    return over_pieces(
        e.shape[-2], e.residual, pieces,
        lambda start, size, seen, acc: from_part(dequantize_slots(e, start, size), start, acc),
        lambda n, acc: from_part(int4_tail(e), n, acc), out)  # fmt: skip


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



def kv_quant_of(entries: Entries) -> str:
    """The kv_quant string `entries` are stored as (`parse_kv_quant` reads it back)."""
    if isinstance(entries, Int4Entries):
        return entries.kv_quant
    return "int8" if isinstance(entries, Int8Entries) else "none"


def entries_nbytes(entries: Entries) -> int:
    """Bytes the stored entries hold (values, scales, zeros, an int4 residual)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(entries))
