"""H2O's per-slot prob sums over an int4 layer's packed bytes, as a Pallas TPU kernel.

`bytes_probs_sums` is `flash._sums_kernel`'s keys-major pass over the slots `flash_int4`'s
forward kernel reads (the whole residual blocks' packed bytes, `int4_tiles`): each row's
softmax normalised by a log-sum-exp it is given (the forward kernel's joined with the
residual block's and the tail's, so that these sums and the residual's add up to one per
row), its grid (batch, kv head, key tile, row tile) and its skip tables. A key tile is
unpacked once, at its first row tile (`int4_tiles.key_halves`, into two [bk / m, 128]
scratch halves of the activation dtype). The queries come as `flash._rows_in`'s rows, their
channels reordered to the even ones then the odd ones ([bq, D] a row tile: the bytes flash's
sums kernel reads); each row tile places its even (odd) channels at part t's lanes by an
exact 0/1 product ([bq, 128]: one term a lane), then scores the tile against them ([bk / m,
bq]: the slots m r + t). Read already placed (`int4_tiles.query_parts`, as the forward
kernel reads them), every key tile would read 2 m times those bytes, zeros included: at m =
2, 4x the queries' bytes, which this pass reads once a key tile. The sums come out in the
parts' order, [m, bk / m] a key tile, and are put back in slot order outside the kernel.
The numbers are `written_slot_attention`'s sums over the dequantized layer up to float
summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dge_jax.kernels.flash_tiles import (
    _LANES,
    _NT,
    _NUM_TABLES,
    _clamp,
    _column,
    _Dims,
    _head_and_tile,
    _row,
    _Tables,
    _tile_needed,
    _visible,
)
from dge_jax.kernels.int4_tiles import key_halves

_HIGHEST = jax.lax.Precision.HIGHEST


def bytes_probs_sums(tables: _Tables, operands: tuple[jax.Array, ...], lse: jax.Array,
                     dims: _Dims, group: int, interpret: bool) -> jax.Array:  # fmt: skip
    """The packed slots' prob sums [B, Hkv, G, S'] f32 (query head h G + g's in row g, slot
    order). tables: the forward kernel's skip tables; operands: (query positions [B, 1,
    T'], query rows [B, Hkv, G T', D] (`flash._rows_in`'s, scaled), key bytes (stacked, the
    layer at tables.layer), key scales, zeros [B, Hkv, S / G, D], the two key lane matrices
    [D, 128], slot positions by part [B, Hkv, m, S' / m]); lse: each row's log-sum-exp [B,
    Hkv, 1, G T'] (the same rows)."""
    qpos, rows, kq, ks, kz, even, odd, spos = operands
    b, hkv, m = kq.shape[1], kq.shape[2], spos.shape[2]
    nq, nk, bq, bk, g = dims.nq, dims.nk, dims.bq, dims.bk, dims.g
    d = ks.shape[-1]
    # channels 0, 2, .., then 1, 3, ..: each half a contiguous run for `_placements`
    rows = rows.reshape(*rows.shape[:-1], d // 2, 2).swapaxes(-1, -2).reshape(rows.shape)
    place = jnp.asarray(_placements(d, m), rows.dtype)
    grid_spec = _grid_spec(dims, (b, hkv, m, d), group, ks.dtype)
    s_len = kq.shape[3] * m
    flops = 2 * 2 * b * hkv * g * nq * bq * (s_len + nk * m * d) * _LANES  # with placing
    layer_bytes = kq.size * kq.dtype.itemsize // kq.shape[0] + sum(
        x.size * x.dtype.itemsize for x in (ks, kz, spos))
    sums = pl.pallas_call(
        functools.partial(_kernel, dims=dims, m=m, group=group),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, hkv, g, m, nk * bk // m), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=flops, transcendentals=b * hkv * g * nq * bq * s_len,
            bytes_accessed=rows.size * rows.dtype.itemsize * nk + layer_bytes
            + 4 * b * hkv * g * s_len),
        interpret=interpret,
    )(*tables, qpos, rows, place, lse, kq, ks, kz, even, odd, spos)
    # part t's lane r is slot m r + t
    return sums.swapaxes(-1, -2).reshape(b, hkv, g, nk * bk)


def _grid_spec(dims: _Dims, sizes: tuple[int, int, int, int], group: int, dtype):
    """The grid (batch, kv head, key tile, row tile) and blocks of `bytes_probs_sums`' call;
    sizes: (B, Hkv, m, D); dtype: the key tiles' unpacked halves'. Row tiles are flash's
    sums kernel's: clamped into the key tile's needed ones, key tiles past kend to kend."""
    b, hkv, m, d = sizes
    nq, nk, bq, bk, g = dims.nq, dims.nk, dims.bq, dims.bk, dims.g

    def query_tile(bi, j, i, refs):  # row tile i's (head, query tile), clamped as flash's
        tab = _Tables(*refs)
        head, qi = _head_and_tile(i, nq)
        return head, _clamp(qi, tab.qfirst[bi * nk + j], tab.qlast[bi * nk + j])

    def key_tile(bi, j, refs):
        return jnp.minimum(j, _Tables(*refs).kend[bi])

    def rows_map(bi, h, j, i, *refs):
        head, qi = query_tile(bi, j, i, refs)
        return bi, h, head * nq + qi, 0

    def lse_map(bi, h, j, i, *refs):
        head, qi = query_tile(bi, j, i, refs)
        return bi, h, 0, head * nq + qi

    def packed_map(bi, h, j, i, *refs):
        return _Tables(*refs).layer[0], bi, h, key_tile(bi, j, refs), 0

    def groups_map(bi, h, j, i, *refs):
        return bi, h, key_tile(bi, j, refs), 0

    def by_slot(bi, h, j, i, *refs):
        return bi, h, 0, key_tile(bi, j, refs)

    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=_NUM_TABLES,
        grid=(b, hkv, nk, g * nq),
        in_specs=[
            pl.BlockSpec((None, 1, bq), lambda bi, h, j, i, *refs: (
                bi, 0, query_tile(bi, j, i, refs)[1])),  # fmt: skip
            pl.BlockSpec((None, None, bq, d), rows_map),
            pl.BlockSpec((2 * m, d, _LANES), lambda *_: (0, 0, 0)),
            pl.BlockSpec((None, None, 1, bq), lse_map),
            pl.BlockSpec((None, None, None, bk // m, _LANES), packed_map),
            pl.BlockSpec((None, None, bk // group, d), groups_map),
            pl.BlockSpec((None, None, bk // group, d), groups_map),
            pl.BlockSpec((d, _LANES), lambda *_: (0, 0)),
            pl.BlockSpec((d, _LANES), lambda *_: (0, 0)),
            pl.BlockSpec((None, None, m, bk // m), by_slot),
        ],
        out_specs=pl.BlockSpec((None, None, g, m, bk // m),
                               lambda bi, h, j, i, *_: (bi, h, 0, 0, j)),  # fmt: skip
        scratch_shapes=[
            pltpu.VMEM((bk // m, _LANES), dtype),
            pltpu.VMEM((bk // m, _LANES), dtype),
            pltpu.VMEM((m, bk // m, 1), jnp.int32),
            pltpu.VMEM((g, m, bk // m, 1), jnp.float32),
        ],
    )


def _kernel(*refs, dims: _Dims, m: int, group: int) -> None:
    """One (batch, kv head, key tile, row tile) step: the key tile unpacked at row tile 0
    (scratch: its even- and odd-channel halves [bk / m, 128], its parts' slot positions as
    columns [m, bk / m, 1]), then each row tile's probabilities exp(s - lse) summed over its
    rows into its head's columns [G, m, bk / m, 1], written as rows at the last row tile."""
    tab = _Tables(*refs[:_NUM_TABLES])
    (qpos_ref, q_ref, place_ref, lse_ref, kq_ref, ks_ref, kz_ref, even_ref, odd_ref, spos_ref,
     out_ref, lo_ref, hi_ref, colpos_ref, acc_ref) = refs[_NUM_TABLES:]  # fmt: skip
    b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    head, qi = _head_and_tile(i, dims.nq)

    @pl.when(i == 0)
    def _start():
        halves = key_halves(kq_ref[...], ks_ref[...], kz_ref[...], (even_ref, odd_ref), m, group)
        lo_ref[...], hi_ref[...] = halves
        for t in range(m):
            colpos_ref[t] = _column(spos_ref[t : t + 1, :])
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(_tile_needed(tab, b, qi, j, dims))
    def _step():
        q = q_ref[...]  # [bq, D]: even channels, then odd ones
        # exact either way (one term a lane); f32 needs HIGHEST not to round through bf16
        precision = _HIGHEST if q.dtype == jnp.float32 else None
        for t in range(m):  # [bk / m, bq]: part t's slots against the tile's rows
            st = None
            for half, k_ref in enumerate((lo_ref, hi_ref)):
                placed = jnp.dot(q, place_ref[2 * t + half], precision=precision,
                                 preferred_element_type=jnp.float32).astype(q.dtype)  # fmt: skip
                part = jax.lax.dot_general(k_ref[...].astype(q.dtype), placed, _NT,
                                           preferred_element_type=jnp.float32)  # fmt: skip
                st = part if st is None else st + part
            visible = _visible(colpos_ref[t], qpos_ref[...], tab.window[0])
            # A row that sees nothing (padding) has no visible entry: the where keeps it 0.
            p = jnp.where(visible, jnp.exp(dims.cap(st) - lse_ref[...]), 0.0)
            acc_ref[head, t] += p.sum(axis=1, keepdims=True)

    @pl.when(i == dims.g * dims.nq - 1)
    def _finish():
        for g in range(dims.g):
            for t in range(m):
                out_ref[g, t : t + 1, :] = _row(acc_ref[g, t])


def _placements(d: int, m: int) -> np.ndarray:
    """0/1 matrices [2 m, D, 128]: 2 t + h moves a query row's half h (even channels at
    [0, D / 2), odd ones at [D / 2, D)) to part t's lanes [t D / 2, (t + 1) D / 2), where
    `int4_tiles.key_halves` holds part t's channels."""
    half = d // 2
    out = np.zeros((2 * m, d, _LANES), np.float32)
    c = np.arange(half)
    for t in range(m):
        for h in range(2):
            out[2 * t + h, h * half + c, t * half + c] = 1
    return out
