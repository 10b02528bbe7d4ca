"""The stored layout of an int4 layer as the Pallas kernels read it in place
(`flash_decode_int4`, decode; `flash_int4`, prefill): which layouts they take, the queries,
scales and positions laid out for it outside the kernels, and the blocks unpacked in VMEM.

Slot s's D channels are D / 2 bytes (`runtime.int4_entries`), byte i holding channel 2i (low
nibble) and 2i + 1 (high); m = 128 / (D / 2) slots share a stored row of 128 lanes (slot m r +
t at lanes [t D / 2, (t + 1) D / 2) of row r, "part t"). A block of bk slots is then [bk / m,
128] bytes, unpacked into its low and high nibbles, two [bk / m, 128] arrays whose lane l
holds channel 2 (l mod D / 2) (low) or that plus 1 (high) of slot m r + l // (D / 2). No
relayout of the bytes is needed:

- Keys. A group's scales and zeros are one stored row of D channels ([bk / G, D] a block of
  the layer's, sliced out of the stack first: passed stacked, XLA relaid the whole stack
  around the layer loop, whose layout of it puts the batch second-minor, as the int8 scales'
  note in `flash_tiles._kv_operands` found for those); a 0/1 matrix product moves channel 2
  (l mod D / 2) to lane l (and + 1 for the high nibbles: exact, one term a lane), and each
  row is repeated over its G / m stored rows (`key_halves`). The queries are split outside
  the kernels into their even and odd channels, placed at part t's lanes for each t
  (`query_parts`: [m R, 128] for R rows, zeros elsewhere): two products against the two
  halves give [m R, bk / m] scores, rows t R .. (t + 1) R those of slots m r + t. Softmax
  does not care about slot order, so the positions come in the same order (`by_part`).
- Values. Their scales and zeros are per slot and group of G channels; outside the kernels
  the layer's are laid out as rows (group g, part t) over slots (`value_scales`: [2 D / G m,
  S / m], 16 bytes a slot for D = 128 against the 128 bytes of k and v).
- The residual block and the tail (slots past the whole blocks) are not in the bytes: the
  kernels mask them, and they are joined after them by log-sum-exp (`residual_and_tail`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.kernels.attention import LayerCache
from dge_jax.kernels.flash_tiles import _LANES
from dge_jax.runtime.quantized import Int4Entries, int4_tail

_HIGHEST = jax.lax.Precision.HIGHEST
# A stack of packed bytes under this many bytes (per device) is passed one layer at a time:
# given a small stack, XLA:TPU streamed 8-layer slices of it into VMEM for every layer's call
# (a compacted DGE cell's decode, Llama-8B at batch 24 on a v5e: 53 MB a leaf, 5.1 GB a step
# of such copies; benchmarks/RESULTS.md, "An int4 cache"). Slicing costs at most twice the
# stack's bytes a step; a larger stack (a 32k FullKV cache) is read in place.
SLICED_BELOW = 64 * 2**20


def layer_of(entries, layer: jax.Array, fields: tuple[str, ...] | None = None):
    """Layer `layer` of stacked entries: every leaf sliced, or of int4 entries only `fields`
    (the others stay stacked: a reader of the scales needs no slice of the bytes)."""
    def index(x):
        return jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)

    if fields is None:
        return jax.tree.map(index, entries)
    return dataclasses.replace(entries, **{f: index(getattr(entries, f)) for f in fields})


def packed_bytes(k: Int4Entries, v: Int4Entries, layer: jax.Array):
    """(k's, v's stacked packed bytes, the layer the kernels' index maps read in them): the
    stacks in place at `layer`, or under `SLICED_BELOW` bytes the layer sliced out as a stack
    of one, read at 0."""
    if k.q.size * k.q.dtype.itemsize < SLICED_BELOW:
        return (*(jax.lax.dynamic_slice_in_dim(x, layer, 1) for x in (k.q, v.q)), jnp.int32(0))
    return k.q, v.q, layer


def supports(entries) -> bool:
    """Whether the kernels read these stacked int4 entries: packed rows of 128 lanes (m slots
    each) and, for keys, one group per stored scale row (module docstring; head dims 64 and
    under merge key groups into a row, and keep `int4_pieces`)."""
    if not isinstance(entries, Int4Entries):
        return False
    d = entries.resid.shape[-1]
    rows_ok = entries.q.shape[-1] == _LANES and _LANES % (d // 2) == 0
    return rows_ok and (not entries.keys or entries.scale.shape[-1] == d)


def query_parts(qg: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Query rows [..., R, D] as the kernel's two [..., m R, 128] operands: their even (then
    odd) channels at part t's lanes in rows t R .. (t + 1) R, zeros elsewhere."""
    half = qg.shape[-1] // 2
    lead = ((0, 0),) * (qg.ndim - 1)

    def parts(x):
        return jnp.concatenate([jnp.pad(x, (*lead, (p * half, _LANES - (p + 1) * half)))
                                for p in range(m)], axis=-2)  # fmt: skip

    return parts(qg[..., 0::2]), parts(qg[..., 1::2])


def key_lanes(d: int) -> tuple[jax.Array, jax.Array]:
    """0/1 matrices [D, 128] moving a key scale row's channel 2 (l mod D / 2) (even), or
    that plus 1 (odd), to lane l: the channel the low (high) nibble at lane l holds."""
    lane = np.arange(_LANES) % (d // 2)
    even = (np.arange(d)[:, None] == 2 * lane[None, :]).astype(np.float32)
    return jnp.asarray(even), jnp.asarray(np.roll(even, 1, axis=0))


def value_scales(v: Int4Entries, layer: jax.Array, m: int, s_pad: int) -> jax.Array:
    """Layer `layer`'s value scales then zeros [B, Hkv, S, D / G] as rows (group g, part t)
    over slots: [B, Hkv, 2 D / G m, s_pad / m], row g m + t (zeros: + D / G m) slot r holding
    slot m r + t's; zero past S."""
    v = layer_of(v, layer, ("scale", "zero"))

    def rows(name):  # the layer sliced first: the stacked leaves are never relaid
        x = v.logical(name)
        b, h, s, ng = x.shape
        x = x.reshape(b, h, s // m, m, ng).transpose(0, 1, 4, 3, 2).reshape(b, h, ng * m, s // m)
        return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, (s_pad - s) // m)))

    return jnp.concatenate([rows("scale"), rows("zero")], axis=2)


def by_part(spos: jax.Array, m: int) -> jax.Array:
    """Slot positions [B, Hkv, S'] as [B, Hkv, m, S' / m]: row t slot r is slot m r + t."""
    b, h, s = spos.shape
    return spos.reshape(b, h, s // m, m).swapaxes(-1, -2)


def residual_and_tail(cache: LayerCache, layer, pos, start, n: int):
    """The entries the kernels do not read, as (k, v, pos) [B, Hkv, R + S - n, D] (what
    `flash_decode._fold_new` and `int4_pieces.join` take): the residual block at `start`
    (positions past S: -1), then the tail (`int4_tail`: zeros unless it is the residual
    block, whose slots it then hides)."""
    k, v = (layer_of(x, layer, ("resid", "start")) for x in (cache.k, cache.v))
    r, s_len = k.residual, pos.shape[-1]
    first = start[0, 0]  # one residual start a layer
    padded = jnp.pad(pos, ((0, 0), (0, 0), (0, r)), constant_values=-1)
    parts_k, parts_v = [k.resid], [v.resid]
    parts_pos = [jax.lax.dynamic_slice_in_dim(padded, first, r, axis=2)]
    if s_len > n:
        parts_k.append(int4_tail(k))
        parts_v.append(int4_tail(v))
        parts_pos.append(jnp.where(first == n, -1, pos[..., n:]))
    return tuple(jnp.concatenate(x, axis=2) for x in (parts_k, parts_v, parts_pos))


def key_halves(kq: jax.Array, ks: jax.Array, kz: jax.Array, lane_refs, m: int,
               group: int) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """A key block's packed bytes [bk / m, 128] dequantized as (low, high) nibbles [bk / m,
    128] in the scales' dtype: q * scale + zero, the group rows' scales and zeros [bk / G, D]
    moved to their lanes by the 0/1 matrices `lane_refs` (`key_lanes`: even, odd) and each
    repeated over its G / m stored rows (module docstring)."""
    dtype = ks.dtype
    halves = []
    for nib, lanes_ref in zip(nibbles(kq, dtype), lane_refs, strict=True):
        def lanes(x, lanes_ref=lanes_ref):  # a group row [bk / G, D] -> [bk / m, 128]
            moved = jnp.dot(x.astype(jnp.float32), lanes_ref[...], precision=_HIGHEST,
                            preferred_element_type=jnp.float32)  # fmt: skip
            per = group // m  # stored rows a group
            wide = jnp.broadcast_to(moved[:, None, :], (moved.shape[0], per, _LANES))
            return wide.reshape(moved.shape[0] * per, _LANES).astype(dtype)

        halves.append(nib * lanes(ks) + lanes(kz))
    return halves[0], halves[1]


def nibbles(packed: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Packed bytes [n, 128] -> (low, high) nibbles [n, 128] in `dtype`."""
    x = packed.astype(jnp.int32)
    return (x & 0xF).astype(dtype), ((x >> 4) & 0xF).astype(dtype)


