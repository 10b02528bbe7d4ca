"""Decode attention over an int4 cache as a Pallas TPU kernel that unpacks the int4 blocks in VMEM.

`int4_decode_attention` gives `cached_attention`'s output for a decode or draft step over one
layer of an int4 cache (`runtime.int4_entries.Int4Entries`, KIVI: keys per channel in groups
of G slots, values per token in groups of G channels, a residual block of R slots in the
activation dtype), the step's entries already written (int4 writes first). It reads the
packed bytes where they are stored and the layer's scales and zeros, as `flash_decode` reads
an int8 cache, so a step reads about a quarter of a bf16 cache's bytes; the Pallas path
before it dequantized each piece of the layer in XLA (`int4_pieces`), writing and reading a
bf16 copy every step (benchmarks/RESULTS.md, "An int4 cache": the bytes of both).

The stored layout, and what the kernel does with it. Slot s's D channels are D / 2 bytes,
byte i holding channel 2i (low nibble) and 2i + 1 (high); m = 128 / (D / 2) slots share a
stored row of 128 lanes (slot m r + t at lanes [t D / 2, (t + 1) D / 2) of row r, "part
t"). A key block of bk slots is then [bk / m, 128] bytes, unpacked into its low and high
nibbles, two [bk / m, 128] arrays whose lane l holds channel 2 (l mod D / 2) (low) or that
plus 1 (high) of slot m r + l // (D / 2). No relayout of the bytes is needed:

- Keys. A group's scales and zeros are one stored row of D channels ([bk / G, D] a block of
  the layer's, sliced out of the stack first: passed stacked, XLA relaid the whole stack
  around the layer loop, whose layout of it puts the batch second-minor, as the int8 scales'
  note in `flash_tiles._kv_operands` found for those); a 0/1 matrix product moves channel 2
  (l mod D / 2) to lane l (and + 1 for the high nibbles: exact, one term a lane), and each
  row is repeated over its G / m stored rows. So the block is dequantized as `dequantize`
  does (q * scale + zero), in two halves. The queries are split outside the kernel into
  their even and odd channels, placed at part t's lanes for each t ([m R, 128], zeros
  elsewhere: R query rows): two products against the two halves give [m R, bk / m] scores,
  rows t R .. (t + 1) R those of slots m r + t. Softmax does not care about slot order, so
  the positions come in the same order ([m, S / m], a reshape outside the kernel) and each
  part is masked and exponentiated as it is.
- Values. Their scales and zeros are per slot and group of G channels; outside the kernel the
  layer's are laid out as rows (group g, part t) over slots ([2 D / G m, S / m], 16 bytes a
  slot for D = 128 against the 128 bytes of k and v), so p (q * s + z) = (p * s) q + p z
  takes each (g, t)'s probabilities times its scales as rows of one product with the raw
  nibbles, of which each lane keeps its own (g, t); the m parts are then folded onto lanes
  [0, D / 2) by lane rolls. The output comes out as even channels then odd ones, reordered
  outside the kernel.
- The residual block and the tail (slots past the whole blocks) are not in the bytes: the
  kernel masks them, and they are joined after it with its log-sum-exp, in XLA (R + S % R
  slots, as `flash_decode` folds a step's own entries).

The grid, the block table (only key blocks holding a visible slot are read) and the online
softmax are `flash_decode`'s. Same numbers as the XLA path up to float summation order (the
values' scale is applied to the probabilities instead of the entries). `supports` says which
layouts it takes: 128-lane packed rows and one key group a stored scale row (head dims 64 and
under merge key groups; those keep `int4_pieces`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dge_jax.kernels.attention import _MASKED, LayerCache, ScoreSpec, _group_queries
from dge_jax.kernels.flash_decode import _SUBLANES, _fold_new, _normalise, block_table
from dge_jax.kernels.flash_tiles import _LANES, _NT, _visible
from dge_jax.runtime.quantized import Int4Entries, int4_tail

_HIGHEST = jax.lax.Precision.HIGHEST
# A stack of packed bytes under this many bytes (per device) is passed one layer at a time:
# given a small stack, XLA:TPU streamed 8-layer slices of it into VMEM for every layer's call
# (a compacted DGE cell's decode, Llama-8B at batch 24 on a v5e: 53 MB a leaf, 5.1 GB a step
# of such copies; benchmarks/RESULTS.md, "An int4 cache"). Slicing costs at most twice the
# stack's bytes a step; a larger stack (a 32k FullKV cache) is read in place.
_SLICED_BELOW = 64 * 2**20


def supports(entries) -> bool:
    """Whether the kernel reads these stacked int4 entries: packed rows of 128 lanes (m slots
    each) and, for keys, one group per stored scale row (module docstring)."""
    if not isinstance(entries, Int4Entries):
        return False
    d = entries.resid.shape[-1]
    rows_ok = entries.q.shape[-1] == _LANES and _LANES % (d // 2) == 0
    return rows_ok and (not entries.keys or entries.scale.shape[-1] == d)


def int4_decode_attention(q: jax.Array, query_pos: jax.Array, cache: LayerCache,
                          scores: ScoreSpec, block_k: int = 512,
                          interpret: bool | None = None) -> jax.Array:  # fmt: skip
    """`cached_attention`'s output [B, T, Hq, D] (the residual's dtype) for queries q
    [B, T, Hq, D] at query_pos [B, T] over layer cache.layer of the stacked int4 k, v
    (`supports`) and pos [Lg, B, Hkv, S], the step's entries already written; window:
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
    kq, vq, at = k.q, v.q, layer
    if k.q.size * k.q.dtype.itemsize < _SLICED_BELOW:  # a stack of one layer, read at 0
        kq, vq, at = (*(jax.lax.dynamic_slice_in_dim(x, layer, 1) for x in (k.q, v.q)), 0)
    args = (jnp.reshape(jnp.asarray(at, jnp.int32), (1,)), jnp.reshape(window, (1,)),
            blocks.reshape(-1), counts.reshape(-1), row_lanes, *_query_parts(qg, m), kq,
            *(jax.lax.dynamic_index_in_dim(x, layer, keepdims=False) for x in (k.scale, k.zero)),
            *_key_lanes(d), vq, _value_scales(v, layer, m, s_pad),
            _by_part(spos, m))  # fmt: skip
    call = functools.partial(_call, bk=bk, group=k.group, scores=scores)
    if interpret is None:
        lo, hi, lse = jax.lax.platform_dependent(
            *args, tpu=functools.partial(call, False), default=functools.partial(call, True))
    else:
        lo, hi, lse = call(interpret, *args)
    # even channels then odd ones -> channel order
    out = jnp.stack([lo[..., : d // 2], hi[..., : d // 2]], axis=-1).reshape(b, hkv, r_pad, d)
    out = _fold_new(out, lse[..., 0], qg, _residual_and_tail(cache, layer, pos, start, n),
                    row_pos, window, scores)  # fmt: skip
    out = out[:, :, :rows].astype(v.dtype).reshape(b, hkv, g, t, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)


def _query_parts(qg: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Grouped queries [B, Hkv, R, D] as the kernel's two [B, Hkv, m R, 128] operands: their
    even (then odd) channels at part t's lanes in rows t R .. (t + 1) R, zeros elsewhere."""
    half = qg.shape[-1] // 2

    def parts(x):
        return jnp.concatenate([jnp.pad(x, ((0, 0),) * 3 + ((p * half, _LANES - (p + 1) * half),))
                                for p in range(m)], axis=2)  # fmt: skip

    return parts(qg[..., 0::2]), parts(qg[..., 1::2])


def _key_lanes(d: int) -> tuple[jax.Array, jax.Array]:
    """0/1 matrices [D, 128] moving a key scale row's channel 2 (l mod D / 2) (even), or
    that plus 1 (odd), to lane l: the channel the low (high) nibble at lane l holds."""
    lane = np.arange(_LANES) % (d // 2)
    even = (np.arange(d)[:, None] == 2 * lane[None, :]).astype(np.float32)
    return jnp.asarray(even), jnp.asarray(np.roll(even, 1, axis=0))


def _value_scales(v: Int4Entries, layer: jax.Array, m: int, s_pad: int) -> jax.Array:
    """Layer `layer`'s value scales then zeros [B, Hkv, S, D / G] as rows (group g, part t)
    over slots: [B, Hkv, 2 D / G m, s_pad / m], row g m + t (zeros: + D / G m) slot r holding
    slot m r + t's; zero past S."""
    v = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, layer, keepdims=False), v)

    def rows(name):  # the layer sliced first: the stacked leaves are never relaid
        x = v.logical(name)
        b, h, s, ng = x.shape
        x = x.reshape(b, h, s // m, m, ng).transpose(0, 1, 4, 3, 2).reshape(b, h, ng * m, s // m)
        return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, (s_pad - s) // m)))

    return jnp.concatenate([rows("scale"), rows("zero")], axis=2)


def _by_part(spos: jax.Array, m: int) -> jax.Array:
    """Slot positions [B, Hkv, S'] as [B, Hkv, m, S' / m]: row t slot r is slot m r + t."""
    b, h, s = spos.shape
    return spos.reshape(b, h, s // m, m).swapaxes(-1, -2)


def _residual_and_tail(cache: LayerCache, layer, pos, start, n: int):
    """The entries the kernel does not read, as `_fold_new`'s (k, v, pos) [B, Hkv, R + S - n,
    D]: the residual block at `start` (positions past S: -1), then the tail (`int4_tail`:
    zeros unless it is the residual block, whose slots it then hides)."""
    k, v = (jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, layer, keepdims=False), e)
            for e in (cache.k, cache.v))  # fmt: skip
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
        m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_lo_ref[...] = jnp.zeros(acc_lo_ref.shape, jnp.float32)
        acc_hi_ref[...] = jnp.zeros(acc_hi_ref.shape, jnp.float32)

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
    """A key block's scores [m R, bk / m] f32 (unscaled): its nibbles dequantized with the
    group rows' scales and zeros [bk / G, D] moved to their lanes (module docstring), each
    half against its query parts."""
    dtype = ks.dtype
    s = None
    for nibbles, q_ref, lanes_ref in zip(_nibbles(kq_ref[...], dtype), q_refs, lane_refs,
                                         strict=True):  # fmt: skip
        def lanes(x, lanes_ref=lanes_ref):  # a group row [bk / G, D] -> [bk / m, 128]
            moved = jnp.dot(x.astype(jnp.float32), lanes_ref[...], precision=_HIGHEST,
                            preferred_element_type=jnp.float32)  # fmt: skip
            per = group // m  # stored rows a group
            wide = jnp.broadcast_to(moved[:, None, :], (moved.shape[0], per, _LANES))
            return wide.reshape(moved.shape[0] * per, _LANES).astype(dtype)

        keys = nibbles * lanes(ks) + lanes(kz)
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
    for nib in _nibbles(vq, dtype):
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


def _nibbles(packed: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Packed bytes [n, 128] -> (low, high) nibbles [n, 128] in `dtype`."""
    x = packed.astype(jnp.int32)
    return (x & 0xF).astype(dtype), ((x >> 4) & 0xF).astype(dtype)


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
