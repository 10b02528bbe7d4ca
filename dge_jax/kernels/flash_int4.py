"""Prefill attention over an int4 cache as a Pallas TPU flash kernel unpacking int4 in VMEM.

`int4_flash_attention` gives `flash.flash_attention`'s output (`written_slot_attention`'s
contract, without prob sums) over one layer of an int4 cache (`runtime.int4_entries`, KIVI)
whose stored layout the kernels read (`int4_tiles.supports`: head dims 128 and 256), the
chunk's entries already written (int4 writes first). It reads the packed bytes where they are
stored, the layer's key scales and zeros and its value scales laid out by (group, part)
(`int4_tiles`), and unpacks each key and value block in VMEM. The Pallas path before it
dequantized the layer a piece at a time in XLA (`int4_pieces`), writing and reading an
activation-dtype copy of every piece for every chunk.

The grid, the skip tables and the query rows are `flash.flash_attention`'s: (batch, kv head,
query tile, key tile), the G query heads of a kv head in one block. A key block of bk slots
(a multiple of 16 G: whole tiles of its bk / G key scale rows, and of 128 lanes of bk / m
slots) is unpacked into two halves (`int4_tiles.key_halves`: even and odd channels of the m
slots of a stored row, at their lanes) and scored against each query row's even and odd
channels at part t's lanes ([m bq, 128] a head: `int4_tiles.query_parts`), giving [m bq,
bk / m] scores whose rows t bq .. (t + 1) bq are the slots m r + t, with the slot positions in
that order (`int4_tiles.by_part`). The value block is dequantized as `dequantize` does, q *
scale + zero, in its two halves: its scales and zeros ([2 D / G m, bk / m], rows (group,
part)) are turned to lanes (a transpose, then a 0/1 product moving row (g, t) to the lanes of
part t and group g: exact), once per step for the G heads. Each part's probabilities [bq,
bk / m] times the halves keep the lanes of their part; at the last key tile the parts are
folded onto lanes [0, D / 2) by lane rolls, and the output comes out as even channels then
odd ones, reordered outside the kernel.

Products: m = 2 at head dim 128, where half of each query part's lanes are zeros and each
part's value product fills only its part's lanes, so the kernel does twice the MXU work of
the bf16 kernel's over the same slots (m = 1 at head dim 256: the same work). What it saves
is the dequantized copies: the bytes it reads are the packed ones, a quarter of bf16's.

The residual block and the tail (slots past the whole blocks, full precision) are masked in
the kernel and read after it by `flash.flash_attention` as a layer of their own (R + S % R
slots), the two joined by log-sum-exp (`int4_pieces.join`). Same numbers as the XLA path up
to float summation order. Chunks that record prob sums (H2O) add a keys-major pass over the
bytes under the joined log-sum-exp (`flash_int4_sums`) and flash's over the residual block
and the tail.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dge_jax.kernels.attention import (
    _MASKED,
    DEFAULT_TILES,
    AttentionSpec,
    LayerCache,
    Tiles,
)
from dge_jax.kernels.flash import (
    _on_platform,
    _rows_in,
    _rows_out,
    flash_attention,
    lse_rows,
    probs_sums_under,
)
from dge_jax.kernels.flash_int4_sums import bytes_probs_sums
from dge_jax.kernels.flash_tiles import (
    _LANES,
    _NT,
    _NUM_TABLES,
    _clamp,
    _column,
    _Dims,
    _row,
    _skip_tables,
    _start_softmax,
    _Tables,
    _tile,
    _tile_needed,
    _visible,
)
from dge_jax.kernels.int4_pieces import join
from dge_jax.kernels.int4_tiles import (
    by_part,
    key_halves,
    key_lanes,
    layer_of,
    nibbles,
    packed_bytes,
    query_parts,
    residual_and_tail,
    value_scales,
)

_HIGHEST = jax.lax.Precision.HIGHEST
_BLOCK_K = 512  # KIVI's G = 32: the key block whose VMEM the query tiles are sized for


def int4_flash_attention(q: jax.Array, query_pos: jax.Array, cache: LayerCache,
                         num_slots: jax.Array | int, spec: AttentionSpec,
                         tiles: Tiles = DEFAULT_TILES,
                         ) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
    """`written_slot_attention`'s (output [B, T, Hq, D] in the residual's dtype, per-slot
    prob sums [B, Hq, S] f32 when spec.record_attn, else None) for queries q [B, T, Hq, D]
    at query_pos [B, T] over layer cache.layer of the stacked int4 k, v
    (`int4_tiles.supports`) and pos [Lg, B, Hkv, S], slots at or past num_slots unread;
    window: cache.window (0 or None: global); spec.scores: the logits' scale and soft cap;
    tiles: block_q (a multiple of 128), block_k (rounded down to a multiple of 16 G, at
    least one), interpret (`flash.flash_attention`'s)."""
    k, v, layer = cache.k, cache.v, jnp.asarray(cache.layer, jnp.int32)
    scores = spec.scores
    b, t, hq, d = q.shape
    hkv, s_len, r = k.resid.shape[2], k.shape[-2], k.residual
    m = _LANES // (d // 2)
    unit = 16 * k.group  # whole tiles of bk / G bf16 scale rows and of bk / m lanes
    bk = min(max(unit, tiles.block_k // unit * unit), -(-s_len // unit) * unit)
    s_pad = -(-s_len // bk) * bk
    # m query parts a row: products of m bq rows, as block_q rows of the plain kernel (and
    # VMEM: at block_q rows a tile, Llama-8B's 4 heads a kv head overflowed a v5e's 16 MiB).
    # Key blocks over 512 slots (groups over 32) shorten the tile alike, a step's scores as
    # at 512: G = 128's 2,048-slot blocks overflowed it at 256 rows, not at 128.
    tile_rows = tiles.block_q // m * _BLOCK_K // max(bk, _BLOCK_K)
    bq, t_pad = _tile(t, max(_LANES, tile_rows // _LANES * _LANES), "block_q")
    dims = _Dims(g=hq // hkv, nq=t_pad // bq, nk=s_pad // bk, bq=bq, bk=bk, s_len=s_len,
                 softcap=scores.softcap)  # fmt: skip
    window = jnp.asarray(0 if cache.window is None else cache.window, jnp.int32)
    num_slots = jnp.asarray(num_slots, jnp.int32)
    pos = jax.lax.dynamic_index_in_dim(cache.pos, layer, keepdims=False).astype(jnp.int32)
    start = jax.lax.dynamic_index_in_dim(k.start, layer, keepdims=False)  # [B, Hkv]
    n = s_len // r * r  # slots in whole blocks; the residual block and the tail are joined after
    slots = jnp.arange(s_len)
    in_bytes = (slots < jnp.minimum(n, num_slots)) & (
        (slots < start[..., None]) | (slots >= start[..., None] + r))
    spos = jnp.pad(jnp.where(in_bytes, pos, -1), ((0, 0), (0, 0), (0, s_pad - s_len)),
                   constant_values=-1)  # fmt: skip
    qpos = jnp.pad(query_pos.astype(jnp.int32), ((0, 0), (0, t_pad - t)), constant_values=-1)
    kq, vq, at = packed_bytes(k, v, layer)
    tables = _skip_tables(spos, qpos, num_slots, bq, bk, at, window)
    rows = _rows_in(q, hkv, dims, scores.scale_for(d))  # [B, Hkv, G T', D], scaled
    qe, qo = (x.reshape(b, hkv, dims.g, dims.nq * m * bq, _LANES) for x in
              query_parts(rows.reshape(b, hkv, dims.g, dims.nq, bq, d), m))  # fmt: skip
    ks, kz = (layer_of(x, layer) for x in (k.scale, k.zero))
    lanes, qpos_row, spos_parts = key_lanes(d), qpos[:, None, :], by_part(spos, m)
    args = (qpos_row, qe, qo, kq, ks, kz, *lanes, vq, value_scales(v, layer, m, s_pad),
            *value_lanes(d, k.group), spos_parts)
    call = functools.partial(_call, dims=dims, group=k.group)
    lo, hi, lse = _on_platform(lambda interpret: call(interpret, tables, *args), tiles.interpret)
    # even channels then odd ones -> channel order, in `_rows_in`'s rows
    out = jnp.stack([lo[..., : d // 2], hi[..., : d // 2]], axis=-1)
    out = _rows_out(out.reshape(b, hkv, -1, d), q.shape, dims)
    lse = lse.reshape(b, hkv, dims.g, t_pad)[..., :t].transpose(0, 3, 1, 2).reshape(b, t, hq)
    rest = _outside_the_bytes(cache, num_slots, (pos, start, n))
    rest_tiles = tiles._replace(block_k=_LANES)
    out, lse = join((out, lse), flash_attention(
        q, query_pos, rest, rest.k.shape[-2], AttentionSpec(scores=scores), rest_tiles,
        with_lse=True))  # fmt: skip
    if not spec.record_attn:
        return out.astype(v.dtype), None
    # H2O: each slot's probabilities under the joined softmax, the bytes' by their own kernel
    # (`flash_int4_sums`), the residual block's and the tail's by flash's, put in their slots
    packed = (qpos_row, rows, kq, ks, kz, *lanes, spos_parts)
    sums = _on_platform(lambda interpret: (bytes_probs_sums(
        tables, packed, lse_rows(lse, dims), dims, k.group, interpret),), tiles.interpret)[0]
    rest_sums = probs_sums_under(q, query_pos, rest, rest.k.shape[-2], lse, scores, rest_tiles)
    return out.astype(v.dtype), _placed(sums.reshape(b, hq, -1)[..., :s_len], rest_sums,
                                        start[0, 0], n, r)  # fmt: skip


def _outside_the_bytes(cache: LayerCache, num_slots, at) -> LayerCache:
    """The slots the kernel does not read (`int4_tiles.residual_and_tail`: the residual
    block, then the tail; those at or past num_slots hidden) as a layer of their own, which
    `flash_attention` reads."""
    pos, start, n = at
    k, v, rpos = residual_and_tail(cache, jnp.asarray(cache.layer, jnp.int32), pos, start, n)
    r = cache.k.residual
    index = jnp.concatenate([start[0, 0] + jnp.arange(r), jnp.arange(n, pos.shape[-1])])
    rpos = jnp.where(index < num_slots, rpos, -1)
    return LayerCache.one(k, v, rpos, 0, cache.window)


def _placed(sums: jax.Array, rest: jax.Array, first: jax.Array, n: int, r: int) -> jax.Array:
    """The packed slots' sums [B, Hq, S] (0 at the residual block's slots and the tail) plus
    `_outside_the_bytes`' [B, Hq, R + S - n] at their slots: the residual block's at [first,
    first + R) (past S, when it is the tail: hidden, so 0, and cut off), the tail's at [n,
    S) (0 when it is the residual block: hidden there)."""
    s_len = sums.shape[-1]
    wide = jnp.pad(sums, ((0, 0), (0, 0), (0, r)))  # room for a residual block past S
    block = jax.lax.dynamic_slice_in_dim(wide, first, r, axis=2) + rest[..., :r]
    wide = jax.lax.dynamic_update_slice_in_dim(wide, block, first, axis=2)
    return wide[..., :s_len].at[..., n:].add(rest[..., r:])


def value_lanes(d: int, group: int) -> tuple[jax.Array, jax.Array]:
    """0/1 matrices [128, 128] moving a value block's turned scale rows (`value_scales`' row
    g m + t at lane g m + t; zeros' at D / G m past it) to the lanes of part t and group g:
    lane l's part l // (D / 2), group (l mod D / 2) // (G / 2)."""
    half = d // 2
    m, ng = _LANES // half, d // group
    lane = np.arange(_LANES)
    row = (lane % half) // (group // 2) * m + lane // half
    source = np.arange(_LANES)[:, None]
    scale = (source == row[None, :]).astype(np.float32)
    zero = (source == (row + ng * m)[None, :]).astype(np.float32)
    return jnp.asarray(scale), jnp.asarray(zero)


def _value_halves(vq: jax.Array, vs: jax.Array, pick_refs, dtype) -> tuple[jax.Array, jax.Array]:
    """A value block's packed bytes [bk / m, 128] dequantized as (low, high) nibbles [bk / m,
    128] in `dtype`, q * scale + zero: its scales then zeros vs [2 D / G m, bk / m] turned
    to [bk / m, 128] (rows padded to 128, a lane-wide transpose), moved to their lanes by
    the 0/1 matrices `pick_refs` (`value_lanes`)."""
    turned = jnp.concatenate([vs.astype(jnp.float32),
                              jnp.zeros((_LANES - vs.shape[0], vs.shape[1]), jnp.float32)]).T
    scale, zero = (jnp.dot(turned, ref[...], precision=_HIGHEST,
                           preferred_element_type=jnp.float32).astype(dtype)
                   for ref in pick_refs)  # fmt: skip
    low, high = nibbles(vq, dtype)
    return low * scale + zero, high * scale + zero


def _kernel(*refs, dims: _Dims, m: int, group: int) -> None:
    """One (batch, kv head, query tile, key tile) step of the online softmax for the G query
    heads of the kv head (module docstring). Scratch: running max and normaliser [G, bq, 1],
    the even and odd channels' unnormalised outputs [G, bq, 128] (part t's slots on part
    t's lanes, folded at the end), the query tile's positions as a column [bq, 1]."""
    tab = _Tables(*refs[:_NUM_TABLES])
    (qpos_ref, qe_ref, qo_ref, kq_ref, ks_ref, kz_ref, even_ref, odd_ref, vq_ref, vs_ref,
     vscale_ref, vzero_ref, spos_ref, lo_ref, hi_ref, lse_ref, m_ref, l_ref, acc_lo_ref,
     acc_hi_ref, rowpos_ref) = refs[_NUM_TABLES:]  # fmt: skip
    b, qi, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    bq, half = dims.bq, _LANES // m

    @pl.when(j == 0)
    def _start():
        _start_softmax(m_ref, l_ref, acc_lo_ref, acc_hi_ref)
        rowpos_ref[...] = _column(qpos_ref[...])

    @pl.when(_tile_needed(tab, b, qi, j, dims))
    def _step():
        keys = key_halves(kq_ref[...], ks_ref[...], kz_ref[...], (even_ref, odd_ref), m, group)
        values = _value_halves(vq_ref[...], vs_ref[...], (vscale_ref, vzero_ref), ks_ref.dtype)
        seen = [_visible(spos_ref[t : t + 1, :], rowpos_ref[...], tab.window[0])
                for t in range(m)]  # fmt: skip  # [bq, bk / m] a part
        lane_part = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (1, _LANES), 1), half)
        for g in range(dims.g):  # static: G (1-8) heads
            s = sum(jax.lax.dot_general(q_ref[g], x.astype(q_ref.dtype), _NT,
                                        preferred_element_type=jnp.float32)
                    for q_ref, x in zip((qe_ref, qo_ref), keys, strict=True))  # fmt: skip
            s = [jnp.where(seen[t], dims.cap(s[t * bq : (t + 1) * bq]), _MASKED)
                 for t in range(m)]  # fmt: skip
            m_prev = m_ref[g]
            m_new = functools.reduce(jnp.maximum, [x.max(axis=1, keepdims=True) for x in s],
                                     m_prev)  # fmt: skip
            # Zero, not exp(0) = 1, where masked: a row that saw nothing keeps l = acc = 0.
            p = [jnp.where(seen[t], jnp.exp(s[t] - m_new), 0.0) for t in range(m)]
            alpha = jnp.exp(m_prev - m_new)
            l_ref[g] = alpha * l_ref[g] + sum(x.sum(axis=1, keepdims=True) for x in p)
            m_ref[g] = m_new
            for acc_ref, half_values in zip((acc_lo_ref, acc_hi_ref), values, strict=True):
                pv = sum(jnp.where(lane_part == t, jnp.dot(
                    p[t].astype(half_values.dtype), half_values,
                    preferred_element_type=jnp.float32), 0.0) for t in range(m))  # fmt: skip
                acc_ref[g] = alpha * acc_ref[g] + pv

    @pl.when(j == dims.nk - 1)
    def _finish():
        for g in range(dims.g):
            norm = l_ref[g]
            seen = norm > 0
            safe = jnp.where(seen, norm, 1.0)
            for out_ref, acc_ref in ((lo_ref, acc_lo_ref), (hi_ref, acc_hi_ref)):
                acc = acc_ref[g]
                folded = acc  # part t's lanes onto [0, D / 2)
                for t in range(1, m):
                    folded = folded + pltpu.roll(acc, _LANES - t * half, 1)
                out_ref[g] = jnp.where(seen, folded / safe, 0.0)
            lse_ref[g : g + 1, :] = _row(jnp.where(seen, m_ref[g] + jnp.log(safe), _MASKED))


def _call(interpret: bool, tables, qpos, qe, qo, kq, ks, kz, even, odd, vq, vs, vscale, vzero,
          spos, *, dims: _Dims, group: int):  # fmt: skip
    """The pallas_call over grid (batch, kv head, query tile, key tile) -> (even-channel out,
    odd-channel out [B, Hkv, G, T', 128], lse [B, Hkv, G, T']) f32 (`_kernel`)."""
    _, b, hkv = kq.shape[:3]
    nq, bq, bk, g = dims.nq, dims.bq, dims.bk, dims.g
    m, d = spos.shape[2], ks.shape[-1]

    def key_tile(bi, h, i, j, *refs):
        tab = _Tables(*refs)
        return _clamp(j, tab.kfirst[bi * nq + i], tab.klast[bi * nq + i])

    def packed_map(bi, h, i, j, *refs):
        return _Tables(*refs).layer[0], bi, h, key_tile(bi, h, i, j, *refs), 0

    def by_slot(bi, h, i, j, *refs):  # [.., rows, slots / m]: the key tile along the lanes
        return bi, h, 0, key_tile(bi, h, i, j, *refs)

    def groups_map(bi, h, i, j, *refs):
        return bi, h, key_tile(bi, h, i, j, *refs), 0

    def heads_map(bi, h, i, j, *refs):
        return bi, h, 0, i, 0

    def whole(*_):
        return 0, 0

    heads = pl.BlockSpec((None, None, g, bq, _LANES), heads_map)
    parts = pl.BlockSpec((None, None, g, m * bq, _LANES), heads_map)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=_NUM_TABLES,
        grid=(b, hkv, nq, dims.nk),
        in_specs=[
            pl.BlockSpec((None, 1, bq), lambda bi, h, i, j, *_: (bi, 0, i)),
            parts,
            parts,
            pl.BlockSpec((None, None, None, bk // m, _LANES), packed_map),
            pl.BlockSpec((None, None, bk // group, d), groups_map),
            pl.BlockSpec((None, None, bk // group, d), groups_map),
            pl.BlockSpec((d, _LANES), whole),
            pl.BlockSpec((d, _LANES), whole),
            pl.BlockSpec((None, None, None, bk // m, _LANES), packed_map),
            pl.BlockSpec((None, None, vs.shape[2], bk // m), by_slot),
            pl.BlockSpec((_LANES, _LANES), whole),
            pl.BlockSpec((_LANES, _LANES), whole),
            pl.BlockSpec((None, None, m, bk // m), by_slot),
        ],
        out_specs=[heads, heads,
                   pl.BlockSpec((None, None, g, bq), lambda bi, h, i, j, *_: (bi, h, 0, i))],
        scratch_shapes=[
            pltpu.VMEM((g, bq, 1), jnp.float32),
            pltpu.VMEM((g, bq, 1), jnp.float32),
            pltpu.VMEM((g, bq, _LANES), jnp.float32),
            pltpu.VMEM((g, bq, _LANES), jnp.float32),
            pltpu.VMEM((bq, 1), jnp.int32),
        ],
    )
    s_len = kq.shape[3] * m
    flops = 2 * 2 * b * hkv * g * nq * bq * s_len * _LANES * 2  # dense bound, both halves
    layer_bytes = sum(x.size * x.dtype.itemsize // x.shape[0] for x in (kq, vq)) + sum(
        x.size * x.dtype.itemsize for x in (ks, kz, vs))
    out_shape = jax.ShapeDtypeStruct((b, hkv, g, nq * bq, _LANES), jnp.float32)
    out_bytes = 4 * b * hkv * g * nq * bq * (2 * _LANES + 1)  # two halves and the lse, f32
    return pl.pallas_call(
        functools.partial(_kernel, dims=dims, m=m, group=group),
        grid_spec=grid_spec,
        out_shape=[out_shape, out_shape,
                   jax.ShapeDtypeStruct((b, hkv, g, nq * bq), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=flops, transcendentals=b * hkv * g * nq * bq * s_len,
            bytes_accessed=2 * qe.size * qe.dtype.itemsize + layer_bytes * nq + out_bytes),
        interpret=interpret,
    )(*tables, qpos, qe, qo, kq, ks, kz, even, odd, vq, vs, vscale, vzero, spos)
