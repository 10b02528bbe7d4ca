"""Decode attention over an int4 cache as a Pallas TPU kernel that unpacks the int4 blocks in VMEM.

`int4_decode_attention` gives `cached_attention`'s output for a decode or draft step over one
layer of an int4 cache (`runtime.int4_entries.Int4Entries`, KIVI: keys per channel in groups
of G slots, values per token in groups of G channels, a residual block of R slots in the
activation dtype), the step's entries already written (int4 writes first). It reads the
packed bytes where they are stored and the layer's scales and zeros, as `flash_decode` reads
an int8 cache, so a step reads about a quarter of a bf16 cache's bytes; the Pallas path
before it dequantized each piece of the layer in XLA (`int4_pieces`), writing and reading a
bf16 copy every step (benchmarks/RESULTS.md, "An int4 cache": the bytes of both).

What the kernel does with the stored layout (`int4_tiles`, which both int4 kernels share):
each key block is unpacked and dequantized in two halves (`int4_tiles.key_halves`) and scored
against the queries' even and odd parts, each part masked and exponentiated as it is. For the
values, p (q * s + z) = (p * s) q + p z takes each (group g, part t)'s probabilities times
its scales as rows of one product with the raw nibbles, of which each lane keeps its own (g,
t); the m parts are then folded onto lanes [0, D / 2) by lane rolls, and the output comes out
as even channels then odd ones, reordered outside the kernel. The residual block and the
tail are joined after it with its log-sum-exp, in XLA (R + S % R slots, as `flash_decode`
folds a step's own entries).

The grid, the block table (only key blocks holding a visible slot are read) and the online
softmax are `flash_decode`'s. Same numbers as the XLA path up to float summation order (the
values' scale is applied to the probabilities instead of the entries). `int4_tiles.supports`
says which layouts it takes (head dims 128 and 256).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dge_jax.kernels.attention import _MASKED, LayerCache, ScoreSpec, _group_queries
from dge_jax.kernels.flash_decode import _SUBLANES, _fold_new, _normalise, block_table
from dge_jax.kernels.flash_tiles import _LANES, _NT, _start_softmax, _visible
from dge_jax.kernels.int4_tiles import (
    by_part,
    key_halves,
    key_lanes,
    nibbles,
    packed_bytes,
    query_parts,
    residual_and_tail,
    value_scales,
)


def int4_decode_attention(q: jax.Array, query_pos: jax.Array, cache: LayerCache,
                          scores: ScoreSpec, block_k: int = 512,
                          interpret: bool | None = None) -> jax.Array:  # fmt: skip
    """`cached_attention`'s output [B, T, Hq, D] (the residual's dtype) for queries q
    [B, T, Hq, D] at query_pos [B, T] over layer cache.layer of the stacked int4 k, v
    (`int4_tiles.supports`) and pos [Lg, B, Hkv, S], the step's entries already written; window:
    cache.window (0 or None: global); scores: the logits' scale and soft cap."""
    k, v, layer = cache.k, cache.v, jnp.asarray(cache.layer, jnp.int32)
    b, t, hq, d = q.shape
    hkv, s_len = k.resid.shape[2], k.shape[-2]
    g, m, r = hq // hkv, _LANES // (d // 2), k.residual
    # A key block holds whole tiles of every operand: bk / G scale rows of 16 sublanes (bf16)
    # and bk / m slot lanes, so bk is a multiple of 16 G (512 for KIVI's G = 32), whatever S.
    unit = 16 * k.group
    bk = max(unit, block_k // unit * unit)
    bk = min(bk, -(-s_len // unit) * unit)
    s_pad = -(-s_len // bk) * bk
    rows = g * t
    r_pad = -(-rows // _SUBLANES) * _SUBLANES
    window = jnp.asarray(0 if cache.window is None else cache.window, jnp.int32)
    pos = jax.lax.dynamic_index_in_dim(cache.pos, layer, keepdims=False).astype(jnp.int32)
    start = jax.lax.dynamic_index_in_dim(k.start, layer, keepdims=False)  # [B, Hkv]
    n = s_len // r * r  # slots in whole blocks; the residual block and the tail are joined after
    slots = jnp.arange(s_len)
    in_bytes = (slots < n) & ((slots < start[..., None]) | (slots >= start[..., None] + r))
    spos = jnp.pad(jnp.where(in_bytes, pos, -1), ((0, 0), (0, 0), (0, s_pad - s_len)),
                   constant_values=-1)  # fmt: skip
    blocks, counts = block_table(spos, query_pos, bk, window)
    qg = jnp.pad(_group_queries(q, hkv), ((0, 0), (0, 0), (0, r_pad - rows), (0, 0)))
    row_pos = jnp.pad(jnp.tile(query_pos.astype(jnp.int32), (1, g)), ((0, 0), (0, r_pad - rows)),
                      constant_values=-1)  # fmt: skip
    row_lanes = jnp.broadcast_to(row_pos[:, :, None], (b, r_pad, _LANES))
    scores = ScoreSpec(scores.scale_for(d), scores.softcap)
    kq, vq, at = packed_bytes(k, v, layer)
    args = (jnp.reshape(jnp.asarray(at, jnp.int32), (1,)), jnp.reshape(window, (1,)),
            blocks.reshape(-1), counts.reshape(-1), row_lanes, *query_parts(qg, m), kq,
            *(jax.lax.dynamic_index_in_dim(x, layer, keepdims=False) for x in (k.scale, k.zero)),
            *key_lanes(d), vq, value_scales(v, layer, m, s_pad),
            by_part(spos, m))  # fmt: skip
    call = functools.partial(_call, bk=bk, group=k.group, scores=scores)
    if interpret is None:
        lo, hi, lse = jax.lax.platform_dependent(
            *args, tpu=functools.partial(call, False), default=functools.partial(call, True))
    else:
        lo, hi, lse = call(interpret, *args)
    # even channels then odd ones -> channel order
    out = jnp.stack([lo[..., : d // 2], hi[..., : d // 2]], axis=-1).reshape(b, hkv, r_pad, d)
    out = _fold_new(out, lse[..., 0], qg, residual_and_tail(cache, layer, pos, start, n),
                    row_pos, window, scores)  # fmt: skip
    out = out[:, :, :rows].astype(v.dtype).reshape(b, hkv, g, t, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)


def _kernel(*refs, nk, m, group, scores):
    """One (batch, kv head, step) of the online softmax over the listed key blocks.

    refs: layer, window, blocks, counts (SMEM), row positions [R, 128], query parts (even,
    odd) [m R, 128], key bytes [bk / m, 128] and scales, zeros [bk / G, D], the two lane
    matrices [D, 128], value bytes [bk / m, 128], value scales and zeros [2 D / G m, bk / m],
    slot positions [m, bk / m]; out (even channels, odd channels) [R, 128], lse [R, 128];
    scratch: running max m, normaliser l [R, 1], the two unnormalised outputs [R, 128]."""
    (_, window_ref, _, counts_ref, rowpos_ref, qe_ref, qo_ref, kq_ref, ks_ref, kz_ref, even_ref,
     odd_ref, vq_ref, vs_ref, spos_ref, lo_ref, hi_ref, lse_ref, m_ref, l_ref, acc_lo_ref,
     acc_hi_ref) = refs  # fmt: skip
    at = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)
    j = pl.program_id(2)
    rr = lo_ref.shape[0]  # query rows R

    @pl.when(j == 0)
    def _start():
        _start_softmax(m_ref, l_ref, acc_lo_ref, acc_hi_ref)

    @pl.when(j < counts_ref[at])
    def _step():
        s = _key_scores((qe_ref, qo_ref), (even_ref, odd_ref), kq_ref, ks_ref[...], kz_ref[...],
                        m, group)  # fmt: skip
        s = scores.cap(s * scores.scale)  # [m R, bk / m], rows t R .. the slots of part t
        seen = [_visible(spos_ref[t : t + 1, :], rowpos_ref[:, :1], window_ref[0])
                for t in range(m)]  # fmt: skip
        s = [jnp.where(seen[t], s[t * rr : (t + 1) * rr], _MASKED) for t in range(m)]
        m_prev = m_ref[...]
        m_new = functools.reduce(jnp.maximum, [x.max(axis=1, keepdims=True) for x in s], m_prev)
        p = [jnp.where(seen[t], jnp.exp(s[t] - m_new), 0.0) for t in range(m)]
        alpha = jnp.exp(m_prev - m_new)
        l_ref[...] = alpha * l_ref[...] + sum(x.sum(axis=1, keepdims=True) for x in p)
        m_ref[...] = m_new
        outs = _weighted_values(p, vs_ref[...], vq_ref[...], ks_ref.dtype, group)
        for acc_ref, out in zip((acc_lo_ref, acc_hi_ref), outs, strict=True):
            acc_ref[...] = alpha * acc_ref[...] + out

    @pl.when(j == nk - 1)
    def _finish():
        _normalise(l_ref, m_ref, lse_ref, ((lo_ref, acc_lo_ref), (hi_ref, acc_hi_ref)))


def _key_scores(q_refs, lane_refs, kq_ref, ks, kz, m: int, group: int) -> jax.Array:
    """A key block's scores [m R, bk / m] f32 (unscaled): each half of `key_halves` against
    its query parts."""
    s = None
    for keys, q_ref in zip(key_halves(kq_ref[...], ks, kz, lane_refs, m, group), q_refs,
                           strict=True):  # fmt: skip
        part = jax.lax.dot_general(q_ref[...], keys.astype(q_ref.dtype), _NT,
                                   preferred_element_type=jnp.float32)  # fmt: skip
        s = part if s is None else s + part
    return s


def _weighted_values(p: list[jax.Array], vs: jax.Array, vq: jax.Array, dtype,
                     group: int) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """p_t [R, bk / m] (part t's probabilities) times the block's values, as (even channels,
    odd channels) [R, 128] on lanes [0, D / 2): rows (g, t) of p_t * scale_(g, t) times the
    raw nibbles, each lane keeping its own (g, t)'s product, the parts folded by lane rolls,
    plus each group's p_t . zero_(g, t) (module docstring). vs: scales then zeros
    [2 D / G m, bk / m]; vq: the packed bytes [bk / m, 128]."""
    m, rr = len(p), p[0].shape[0]
    ng = vs.shape[0] // (2 * m)  # value groups a slot
    half = ng * group // 2  # D / 2
    # Lane l holds part l // (D / 2) and channel 2 (l mod D / 2) (+ 1), of value group
    # (l mod D / 2) // (G / 2). Truncating lax.div / rem: jnp's floor division lowers through
    # `sign`, whose Mosaic rule asks the local device for its TPU generation (see
    # `flash_tiles._head_and_tile`).
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, _LANES), 1)
    lane_part = jax.lax.div(lane, half)
    group_of = jax.lax.div(jax.lax.rem(lane, half), group // 2)
    vs = vs.astype(jnp.float32)
    scaled = jnp.concatenate([p[t] * vs[gi * m + t : gi * m + t + 1]
                              for gi in range(ng) for t in range(m)], axis=0)  # fmt: skip
    zero_terms = [sum((p[t] * vs[(ng + gi) * m + t : (ng + gi) * m + t + 1]).sum(
        axis=1, keepdims=True) for t in range(m)) for gi in range(ng)]  # [R, 1] a group
    outs = []
    for nib in nibbles(vq, dtype):
        y = jnp.dot(scaled.astype(dtype), nib, preferred_element_type=jnp.float32)
        kept = 0.0
        for gi in range(ng):
            for t in range(m):
                row = (gi * m + t) * rr
                mine = (lane_part == t) & (group_of == gi)
                kept = kept + jnp.where(mine, y[row : row + rr], 0.0)
        folded = kept  # part t's lanes onto [0, D / 2)
        for t in range(1, m):
            folded = folded + pltpu.roll(kept, _LANES - t * half, 1)
        for gi in range(ng):
            folded = folded + jnp.where((lane < half) & (group_of == gi), zero_terms[gi], 0.0)
        outs.append(folded)
    return outs[0], outs[1]


def _call(interpret, layer, window, blocks, counts, row_lanes, q_even, q_odd, kq, ks, kz, even,
          odd, vq, vs, spos, *, bk: int, group: int, scores: ScoreSpec):  # fmt: skip
    """The pallas_call over grid (batch, kv head, key block) -> (even-channel out, odd-channel
    out [B, Hkv, R, 128], lse [B, Hkv, R, 128]) f32 (`_kernel`)."""
    _, b, hkv = kq.shape[:3]
    m, d = spos.shape[2], ks.shape[-1]  # ks: the layer's key scales [B, Hkv, S / G, D]
    nk = spos.shape[-1] * m // bk
    rows = q_even.shape[2] // m

    def listed(bi, h, j, blocks_ref):
        return blocks_ref[(bi * hkv + h) * nk + j]

    def stacked(rows_a_block):
        def index(bi, h, j, layer_ref, window_ref, blocks_ref, counts_ref):
            return layer_ref[0], bi, h, listed(bi, h, j, blocks_ref), 0
        return rows_a_block, index

    def by_slot(bi, h, j, layer_ref, window_ref, blocks_ref, counts_ref):
        return bi, h, 0, listed(bi, h, j, blocks_ref)

    def fixed(bi, h, j, *_):
        return bi, h, 0, 0

    def spec(block, index):
        return pl.BlockSpec(block, index)

    kq_block, kq_index = stacked(bk // m)

    def ks_index(bi, h, j, layer_ref, window_ref, blocks_ref, counts_ref):
        return bi, h, listed(bi, h, j, blocks_ref), 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(b, hkv, nk),
        in_specs=[
            spec((None, rows, _LANES), lambda bi, h, j, *_: (bi, 0, 0)),
            spec((None, None, m * rows, _LANES), fixed),
            spec((None, None, m * rows, _LANES), fixed),
            spec((None, None, None, kq_block, _LANES), kq_index),
            spec((None, None, bk // group, d), ks_index),
            spec((None, None, bk // group, d), ks_index),
            spec((d, _LANES), lambda *_: (0, 0)),
            spec((d, _LANES), lambda *_: (0, 0)),
            spec((None, None, None, kq_block, _LANES), kq_index),
            spec((None, None, vs.shape[2], bk // m), by_slot),
            spec((None, None, m, bk // m), by_slot),
        ],
        out_specs=[spec((None, None, rows, _LANES), fixed)] * 3,
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, _LANES), jnp.float32),
                        pltpu.VMEM((rows, _LANES), jnp.float32)],  # fmt: skip
    )
    per_layer = sum(x.size * x.dtype.itemsize // x.shape[0] for x in (kq, vq)) + sum(
        x.size * x.dtype.itemsize for x in (ks, kz, vs))
    flops = 4 * b * hkv * rows * nk * bk * d
    kernel = functools.partial(_kernel, nk=nk, m=m, group=group, scores=scores)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, hkv, rows, _LANES), jnp.float32)] * 3,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=flops // (4 * d),
                                      bytes_accessed=per_layer),
        interpret=interpret,
    )(layer, window, blocks, counts, row_lanes, q_even, q_odd, kq, ks, kz, even, odd, vq, vs,
      spos)  # fmt: skip
