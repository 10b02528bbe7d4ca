"""The flash kernels' tiling (`flash.py`): tile sizes, the scalar-prefetched skip tables and
the small helpers the kernels and their index maps share (masks, row / column turns, block
index clamps), and how keys and values travel into a kernel, plain or int8 (operands, their
BlockSpecs, the block read back). `flash_decode.py` takes these from here too."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dge_jax.kernels.attention import _MASKED, ScoreSpec
from dge_jax.runtime.quantized import Entries, Int8Entries

_LANES = 128  # TPU vector lane count: tile sizes are multiples of it
_NEVER = jnp.iinfo(jnp.int32).max  # a key tile's smallest visible position when it has none
_NT = (((1,), (1,)), ((), ()))  # dot_general numbers of A @ B^T (contract both last dims)


class _Tables(NamedTuple):
    """The scalar-prefetched tables (jax arrays in the wrapper, SMEM refs in kernels).

    layer [1] (the stacked cache's layer the k / v index maps read); window [1] (0: global);
    num_slots [1]; per batch row b: kmin / kmax [B * nk] (key tile j's smallest / largest
    visible position), qmin / qmax [B * nq] (query tile i's smallest real / largest
    position), kfirst / klast [B * nq] (query tile i's first / last needed key tile), qfirst /
    qlast [B * nk] (key tile j's first / last needed query tile), kend [B] (the last key tile
    any query tile needs). Key tile j is needed by query tile i iff kmin[j] <= qmax[i] and,
    with a window, qmin[i] - kmax[j] < window (`_needed`).
    """

    layer: jax.Array
    window: jax.Array
    num_slots: jax.Array
    kmin: jax.Array
    kmax: jax.Array
    qmin: jax.Array
    qmax: jax.Array
    kfirst: jax.Array
    klast: jax.Array
    qfirst: jax.Array
    qlast: jax.Array
    kend: jax.Array


_NUM_TABLES = len(_Tables._fields)


def _tile(n: int, block: int, name: str) -> tuple[int, int]:
    """(tile, padded length): `block` shrunk to n rounded up to 128 when n is smaller."""
    if block <= 0 or block % _LANES:
        raise ValueError(f"{name} must be a positive multiple of {_LANES}, got {block}")
    tile = min(block, -(-n // _LANES) * _LANES)
    return tile, -(-n // tile) * tile


class _Dims(NamedTuple):
    """Static sizes: G query heads per kv head, nq / nk query / key tiles of bq / bk, S; and
    the logits' soft cap (None: none)."""

    g: int
    nq: int
    nk: int
    bq: int
    bk: int
    s_len: int
    softcap: float | None = None
    kv_refs: int = 1  # refs per k or v block: 1 plain, 2 int8 (values, scales)

    def cap(self, scores: jax.Array) -> jax.Array:
        return ScoreSpec(softcap=self.softcap).cap(scores)


def _skip_tables(
    spos: jax.Array, qpos: jax.Array, num_slots: jax.Array, bq: int, bk: int,
    layer: jax.Array | int = 0, window: jax.Array | int = 0,
) -> _Tables:
    """The tables (see `_Tables`) from padded slot [B, Hkv, S'] and query [B, T'] positions
    (the layer's), the stacked cache's layer index and the layer's window (0: global).

    A tile pair nothing in common is skipped; a query tile needing no key tile (all padding)
    gets kfirst = nk - 1, klast = 0, so its clamped index min(max(j, kfirst), klast) is 0 for
    every j: one DMA, no compute (and likewise for key tiles no query tile needs).
    """
    b, _, s_pad = spos.shape
    nk, nq = s_pad // bk, qpos.shape[1] // bq
    readable = (spos >= 0) & (jnp.arange(s_pad) < num_slots)
    kmin = jnp.where(readable, spos, _NEVER).reshape(b, -1, nk, bk).min(axis=(1, 3))  # [B, nk]
    kmax = jnp.where(readable, spos, -1).reshape(b, -1, nk, bk).max(axis=(1, 3))
    qtiles = qpos.reshape(b, nq, bq)
    qmax = qtiles.max(axis=2)  # [B, nq]
    # The smallest real position (qmax, -1 or not, for an all-padding tile: no overflow below)
    qmin = jnp.minimum(jnp.where(qtiles >= 0, qtiles, _NEVER).min(axis=2), qmax)
    window = jnp.asarray(window, jnp.int32)
    needed = _needed(kmin[:, None, :], kmax[:, None, :], qmin[:, :, None], qmax[:, :, None],
                     window)  # [B, nq, nk]  # fmt: skip
    kj, qi = jnp.arange(nk), jnp.arange(nq)[:, None]
    kfirst = jnp.min(jnp.where(needed, kj, nk - 1), axis=2)
    klast = jnp.max(jnp.where(needed, kj, 0), axis=2)
    qfirst = jnp.min(jnp.where(needed, qi, nq - 1), axis=1)
    qlast = jnp.max(jnp.where(needed, qi, 0), axis=1)
    kend = klast.max(axis=1)  # every key tile past it is unwritten or seen by no query
    tables = (kmin, kmax, qmin, qmax, kfirst, klast, qfirst, qlast, kend)
    flat = [x.reshape(-1).astype(jnp.int32) for x in tables]
    one = [jnp.reshape(jnp.asarray(x, jnp.int32), (1,)) for x in (layer, window, num_slots)]
    return _Tables(*one, *flat)


def _needed(kmin, kmax, qmin, qmax, window):
    """Whether a key tile (smallest / largest visible position kmin / kmax) may hold a slot
    visible to a query tile (smallest real / largest position qmin / qmax): some slot is not
    after the latest query and, on a sliding layer, some slot is inside the earliest query's
    window. Both hold for any visible (slot, query) pair, so skipping the rest is exact."""
    return (kmin <= qmax) & ((window <= 0) | (qmin - kmax < window))


def _tile_needed(tab: _Tables, b, qi, j, dims: _Dims) -> jax.Array:
    """`_needed` of query tile qi and key tile j of batch row b, read from the SMEM tables."""
    kt, qt = b * dims.nk + j, b * dims.nq + qi
    return _needed(tab.kmin[kt], tab.kmax[kt], tab.qmin[qt], tab.qmax[qt], tab.window[0])


def _visible(slot_pos: jax.Array, query_pos: jax.Array, window: jax.Array) -> jax.Array:
    """`attention.visible` with a window that is always an int32 (0: global)."""
    ok = (slot_pos >= 0) & (slot_pos <= query_pos)
    return ok & ((window <= 0) | (query_pos - slot_pos < window))


def _start_softmax(m_ref, l_ref, *acc_refs) -> None:
    """An online softmax's scratch at its first key block: running max -1e30 (`_MASKED`),
    normaliser and unnormalised outputs 0 (f32)."""
    m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    for acc_ref in acc_refs:
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _column(row: jax.Array) -> jax.Array:
    """[1, n] -> [n, 1] (through a lane-wide transpose, the form Mosaic lowers)."""
    return jnp.broadcast_to(row, (_LANES, row.shape[1])).T[:, :1]


def _row(col: jax.Array) -> jax.Array:
    """[n, 1] -> [1, n] (the inverse of `_column`)."""
    return jnp.broadcast_to(col, (col.shape[0], _LANES)).T[:1, :]


def _head_and_tile(i: jax.Array, nq: int) -> tuple[jax.Array, jax.Array]:
    """Row tile i -> (query head i // nq, query tile i % nq) of its kv head's group.

    Truncating lax.div / lax.rem (grid indices are >= 0): jnp's floor division lowers
    through `sign`, whose Mosaic rule asks the local device for its TPU generation and so
    fails when compiling for a TPU from a machine without one.
    """
    return jax.lax.div(i, nq), jax.lax.rem(i, nq)


def _clamp(i: jax.Array, first: jax.Array, last: jax.Array) -> jax.Array:
    """Block index i moved into [first, last]: a skipped tile reuses a needed one's DMA."""
    return jnp.minimum(jnp.maximum(i, first), last)


# ---------------------------------------------------------------------------------------------
# Keys and values into a kernel: plain, or int8 values with their scales (`runtime.quantized`)


def _kv_operands(entries: Entries, layer: jax.Array, s_pad: int,
                 slots_minor: bool = False) -> tuple[jax.Array, ...]:  # fmt: skip
    """The stacked k or v [Lg, B, Hkv, S, D] as a kernel's operands: (values,) for a plain
    cache; (int8 values, layer `layer`'s scales [B, Hkv, 1, s_pad]) for an int8 one, the
    scales padded with zeros past S. slots_minor: the values through their [.., D, S] view
    (`flash_decode`).

    The values stay stacked (the kernel's index maps pick the layer: no copy of them), while
    the layer's scales are sliced out and turned so that a key block's scales are a [1, bk]
    block along the lanes, as the slot positions' are (a [bk, 1] block would take bk
    sublanes of one lane each). That is one pass over one layer's scales per call (read
    [B, Hkv, S, 1], write [B, Hkv, 1, S']), 2 bytes a slot per kv head in bf16 against D for
    the int8 values. Reshaping the whole stack instead depends on how XLA lays out a
    [.., S, 1] array: compiled for v5e, a decode loop with one kv head per device copied
    every layer's scales per call that way (tests/test_flash_decode.py now bounds the
    loop's copies by one layer's scales).
    """
    if not isinstance(entries, Int8Entries):
        return (jnp.swapaxes(entries, -1, -2) if slots_minor else entries,)
    values = jnp.swapaxes(entries.q, -1, -2) if slots_minor else entries.q
    scale = jax.lax.dynamic_index_in_dim(entries.scale, layer, keepdims=False)[..., 0]
    scale = jnp.pad(scale, ((0, 0), (0, 0), (0, s_pad - scale.shape[-1])))
    return values, scale[:, :, None, :]


def _kv_specs(operands: tuple[jax.Array, ...], block: tuple, index_map,
              slots_minor: bool = False) -> list:  # fmt: skip
    """The BlockSpecs of `_kv_operands`: the values' `block` ([bk, D], or slots-minor
    [D, bk], after three squeezed axes) at index_map's (layer, b, h, row, col), and an int8
    cache's scales over the same slots, a [1, bk] block at (b, h, 0, key block)."""
    specs = [pl.BlockSpec(block, index_map)]
    if len(operands) == 1:
        return specs
    bk = block[-1] if slots_minor else block[-2]

    def scale_map(*idx):
        _, b, h, row, col = index_map(*idx)
        return b, h, 0, col if slots_minor else row

    return [*specs, pl.BlockSpec((None, None, 1, bk), scale_map)]


def _read_entries(refs, slots_minor: bool = False) -> jax.Array:
    """A key or value block as attention reads it, from its refs (`_kv_operands`' order):
    the values as loaded, or int8 values q and scales [1, bk] as q.astype(dtype) * scale in
    the scales' (activation) dtype: `quantized.dequantize`'s product, so a kernel reads the
    numbers the XLA path reads. A [bk, D] block takes the scales as a column [bk, 1] (a
    lane-wide transpose, in f32: exact for 16-bit scales too), a slots-minor [D, bk] block
    as the row they are."""
    if len(refs) == 1:
        return refs[0][...]
    values, scale = refs[0][...], refs[1][...]
    if not slots_minor:
        scale = _column(scale.astype(jnp.float32)).astype(scale.dtype)
    return values.astype(scale.dtype) * scale


def _layer_bytes(operands: tuple[jax.Array, ...]) -> int:
    """Bytes a kernel reads to read one layer of `_kv_operands`' operands once: the stacked
    values' one layer, and an int8 cache's scales (already the layer's)."""
    values, *scales = operands
    per_layer = values.size * values.dtype.itemsize // values.shape[0]
    return per_layer + sum(x.size * x.dtype.itemsize for x in scales)
