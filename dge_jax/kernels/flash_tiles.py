"""The flash kernels' tiling (`flash.py`): tile sizes, the scalar-prefetched skip tables and
the small helpers the kernels and their index maps share (masks, row / column turns, block
index clamps). `flash_decode.py` takes its tile size and constants from here too."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dge_jax.kernels.attention import ScoreSpec

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
