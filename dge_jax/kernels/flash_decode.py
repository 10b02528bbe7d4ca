"""Decode and draft attention as a Pallas TPU kernel that reads only the key blocks in use.

`decode_attention` gives `attention.cached_attention`'s output for a decode or draft step (T
a handful of queries, each step's own entries passed beside the cache as ``new``), up to
float summation order. On TPU it is one Mosaic kernel; elsewhere (CPU tests) the same kernel
runs in Pallas interpret mode.

Why. A decode step is bound by reading the cache. The XLA path reads every slot of the
capacity, empty or not; after compaction (`compaction.compact_heads`) head h holds its n_h kept
entries in slots [0, n_h), empty slots up to the shared index max(n_h), then the decoded
tokens: heads are ragged, and a masked (uncompacted) cache has whole evicted blocks. The
kernel reads, per (row, kv head), only the key blocks that hold a slot visible to the step.

Layout. The grid is (batch, kv head, step j). The G query heads x T queries of a kv head are
the rows of one tile (`attention._group_queries`'s order, padded to a multiple of 8 with
rows at position -1), resident across the steps. A block table, computed in XLA outside the
kernel from the slot positions (4 bytes a slot, against 2 * D * itemsize for k and v), lists
per (row, kv head) the key blocks holding at least one slot with 0 <= pos <= the row's
largest query position (and, on a sliding layer, inside the window of its smallest real
query position), in order, with their count; it is scalar-prefetched (SMEM). Step j
loads the j-th listed block; steps past the count repeat the last listed block index, so
Pallas issues no DMA for them, and `pl.when` skips their compute. An empty head repeats
block 0 and computes nothing. The online softmax is f32 across the listed blocks; scores are
scaled (`ScoreSpec.scale_for(D)`) in f32 after the product, as `cached_attention` does,
soft-capped when the model caps them, then masked by `attention.visible`'s rule with the
layer's window: a traced scalar, scalar-prefetched with the layer index, so one compilation
serves every layer of a scanned group.

The stacked cache. A decode loop holds a layer group's cache as [Lg, B, Hkv, S, D] and
layer i inside a scan is a slice of it. Passed to a custom call, that slice would be
materialised: a copy of the layer's whole capacity per step, the very read the kernel
avoids. So the kernel takes the stacked buffers and the layer index (scalar-prefetched) and
its index maps pick layer i's blocks in place (`LayerCache.layer`); a plain [B, Hkv, S, D]
layer works too (`LayerCache.one`). The TPU lays a cache whose head dim is under 128 lanes
out slots-minor (physically [.., D, S], so D is not padded to 128), and a Pallas call takes
operands row-major: read as [.., S, D] such a cache is converted (two whole-cache copies per
decode loop, around it) and held padded. ``Tiles.slots_minor`` reads k and v through a [.., D, S]
transposed view instead, which that layout makes free: blocks are [D, bk] and the products
q @ k and p @ v^T. `layer_attention` sets it for heads under 128.

The step's own entries (``new``: k, v [B, Hkv, T, D], pos [B, Hkv, T]). The contract is
`cached_attention`'s: attention as if they were written at slots [slot, slot + T)
(`LayerCache.slot`), whatever those slots hold now ignored. The kernel reads the cache with
those slots' positions set to -1 (a where on the small position array, before the table is
made), returns its normalised output and log-sum-exp per row (f32), and the T new entries,
[rows, T] scores, are folded in after it in XLA with that log-sum-exp. Reading the cache before
the write keeps the caller's write (`layer_attention.cache_layer_attention`) an in-place update
after the read, as on the XLA path; writing them first and attending over the cache would need
nothing folded, but would order the write before the kernel's reads.

An int8 cache (`runtime.quantized.Int8Entries`): the kernel takes the stacked int8 values,
read in place as plain ones, and the layer's scales as [B, Hkv, 1, S'] (sliced out and
turned lanes-wise: `flash_tiles._kv_operands`), loads a listed block's int8 values and its
[1, bk] scale row, and dequantizes the block in VMEM as q.astype(dtype) * scale in the
activation dtype, `quantized.dequantize`'s product, before the products: the numbers
`cached_attention` reads, from about half the bytes of a bf16 cache's blocks (decode is
bound by them). ``slots_minor`` reads int8 values too: XLA:TPU lays an int8 cache whose head
is under 128 out slots-minor as well, and the [1, bk] scale row then multiplies the [D, bk]
block as it is (row-major, it becomes a [bk, 1] column first). The step's own entries come
already read (`layer_attention` passes them quantized and dequantized, as written).

Probs sums (H2O's per-slot attention) are not computed here: only H2O's decode-time rule and
its draft steps record them, and those steps keep the XLA path (`cache_layer_attention`).

Rows that see nothing (padding queries, no visible slot and no visible new entry) get a zero
output; `cached_attention` gives them a mean of values. Nothing reads such rows (see
`layer_attention.prefill_attention`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dge_jax.kernels.attention import (
    _MASKED,
    DEFAULT_TILES,
    AttentionSpec,
    LayerCache,
    NewEntries,
    ScoreSpec,
    Tiles,
    _group_queries,
)
from dge_jax.kernels.flash_tiles import (
    _LANES,
    _NT,
    _kv_operands,
    _kv_specs,
    _layer_bytes,
    _read_entries,
    _start_softmax,
    _tile,
    _visible,
)

_SUBLANES = 8  # rows of a tile are padded to a multiple of it


def decode_attention(
    q: jax.Array,
    query_pos: jax.Array,
    cache: LayerCache,
    spec: AttentionSpec,
    new: NewEntries | None = None,
    tiles: Tiles = DEFAULT_TILES,
    with_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`cached_attention`'s output [B, T, Hq, D] (v's dtype), read block by block (module
    docstring); with_lse (no `new`): (the output in f32, each row's log-sum-exp [B, T, Hq],
    -1e30 where it saw no slot), what joins attention read in pieces (`layer_attention`).

    q: [B, T, Hq, D]; query_pos: [B, T]; cache: the stacked k, v [Lg, B, Hkv, S, D] (arrays,
    or int8 `Int8Entries`: module docstring) and positions [Lg, B, Hkv, S], of which layer
    cache.layer is read in place (a single layer:
    `LayerCache.one`), its sliding window cache.window (an int32, may be traced; 0 or None:
    global) and cache.slot, where `new` goes (as in `cached_attention`); spec.scores: the
    logits' scale and soft cap (static; no probs sums: spec.record_attn is not read).
    tiles.slots_minor: read k and v through their [.., D, S] view (module docstring; same
    results). tiles.block_k: keys per block (a multiple of 128, shrunk to S rounded up to 128
    when larger). tiles.interpret: None runs Mosaic when compiled for TPU and interpret mode
    elsewhere; True / False force it.
    """
    k, v, layer, new_slot, window = cache.k, cache.v, cache.layer, cache.slot, cache.window
    slot_pos = jax.lax.dynamic_index_in_dim(cache.pos, jnp.asarray(layer, jnp.int32),
                                            keepdims=False)  # fmt: skip
    scores_spec, slots_minor, block_k = spec.scores, tiles.slots_minor, tiles.block_k
    interpret = tiles.interpret
    b, t, hq, d = q.shape
    hkv, s_len = k.shape[2], k.shape[3]
    g = hq // hkv
    bk, s_pad = _tile(s_len, block_k, "block_k")
    rows = g * t
    r_pad = -(-rows // _SUBLANES) * _SUBLANES
    spos = slot_pos.astype(jnp.int32)
    if new is not None:
        slots = jnp.arange(s_len)
        spos = jnp.where((slots >= new_slot) & (slots < new_slot + new[0].shape[2]), -1, spos)
    spos = jnp.pad(spos, ((0, 0), (0, 0), (0, s_pad - s_len)), constant_values=-1)
    window = jnp.asarray(0 if window is None else window, jnp.int32)
    blocks, counts = block_table(spos, query_pos, bk, window)
    qg = jnp.pad(_group_queries(q, hkv), ((0, 0), (0, 0), (0, r_pad - rows), (0, 0)))
    row_pos = jnp.pad(jnp.tile(query_pos.astype(jnp.int32), (1, g)), ((0, 0), (0, r_pad - rows)),
                      constant_values=-1)  # fmt: skip
    # Lane-wide copies of the rows' positions: a [rows, 1] column is then a lane slice.
    row_pos = jnp.broadcast_to(row_pos[:, :, None], (b, r_pad, _LANES))
    tables = (jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), jnp.reshape(window, (1,)),
              blocks.reshape(-1), counts.reshape(-1))  # fmt: skip
    scores_spec = ScoreSpec(scores_spec.scale_for(d), scores_spec.softcap)
    call = _decode_call(bk=bk, s_len=s_len, scores_spec=scores_spec, slots_minor=slots_minor)
    # (values,) or (int8 values, the layer's scales [B, Hkv, 1, S']), values slots-minor if asked
    kv = tuple(_kv_operands(x, layer, s_pad, slots_minor) for x in (k, v))
    args = (*tables, row_pos, qg, kv, spos[:, :, None, :])
    if interpret is None:
        out, lse = jax.lax.platform_dependent(
            *args, tpu=functools.partial(call, False), default=functools.partial(call, True)
        )
    else:
        out, lse = call(interpret, *args)
    out, lse = out[:, :, :rows], lse[:, :, :rows, 0]
    if new is not None:
        out = _fold_new(out, lse, qg[:, :, :rows], new, row_pos[:, :rows, 0], window, scores_spec)
    out = out.astype(jnp.float32 if with_lse else v.dtype).reshape(b, hkv, g, t, d)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)
    if not with_lse:
        return out
    if new is not None:
        raise ValueError("with_lse reads the cache alone: pass new=None")
    return out, lse.reshape(b, hkv, g, t).transpose(0, 3, 1, 2).reshape(b, t, hq)


def block_table(
    slot_pos: jax.Array, query_pos: jax.Array, block: int, window: jax.Array | int = 0
) -> tuple[jax.Array, jax.Array]:
    """(blocks [B, Hkv, nk], counts [B, Hkv]) int32 from slot positions [B, Hkv, nk * block]
    and query positions [B, T]: per (row, kv head) the key blocks holding a slot visible to
    some query of the row (0 <= pos <= the row's largest query position and, with a window >
    0, its smallest real query position - pos < window), in order, then the last listed one
    repeated (0 when none is listed), and how many are listed."""
    b, hkv, s_pad = slot_pos.shape
    nk = s_pad // block
    latest = query_pos.max(axis=1)[:, None, None]
    earliest = jnp.where(query_pos >= 0, query_pos, latest[:, :, 0]).min(axis=1)[:, None, None]
    visible = (slot_pos >= 0) & (slot_pos <= latest)
    visible &= (window <= 0) | (earliest - slot_pos < window)
    needed = visible.reshape(b, hkv, nk, block).any(axis=-1)
    counts = needed.sum(axis=-1, dtype=jnp.int32)
    kj = jnp.arange(nk, dtype=jnp.int32)
    listed = jnp.argsort(jnp.where(needed, kj, nk + kj), axis=-1).astype(jnp.int32)
    last = jnp.maximum(counts - 1, 0)[..., None]
    return jnp.take_along_axis(listed, jnp.minimum(kj, last), axis=-1), counts


def _fold_new(out, lse, qg, new, row_pos, window, scores_spec):
    """The cache's normalised output [B, Hkv, R, D] f32 and log-sum-exp [B, Hkv, R] joined
    with the step's own entries (k, v [B, Hkv, T, D], pos [B, Hkv, T]) in one softmax, their
    scores scaled, capped and masked (window) as the kernel's.

    With m the joint max, the cache's part weighs exp(lse - m) (its normaliser) and each new
    entry exp(s - m). A row that saw no slot has lse = -1e30 (weight 0 once m is a real
    score); a row that sees nothing at all keeps the cache's zero output (weight 1, m = lse).
    """
    k_new, v_new, pos_new = new
    s = jnp.einsum("bkrd,bktd->bkrt", qg, k_new, preferred_element_type=jnp.float32)
    visible = _visible(pos_new[:, :, None, :], row_pos[:, None, :, None], window)
    s = jnp.where(visible, scores_spec.cap(s * scores_spec.scale), _MASKED)
    m = jnp.maximum(lse, s.max(axis=-1))
    cached = jnp.exp(lse - m)
    p = jnp.where(visible, jnp.exp(s - m[..., None]), 0.0)
    pv = jnp.einsum("bkrt,bktd->bkrd", p.astype(v_new.dtype), v_new,
                    preferred_element_type=jnp.float32)  # fmt: skip
    norm = cached + p.sum(axis=-1)
    return (out * cached[..., None] + pv) / norm[..., None]


def _decode_kernel(*refs, nk, bk, s_len, scores_spec, slots_minor):
    """One (batch, kv head, step) of the online softmax over the listed key blocks.

    refs: layer, window, blocks, counts (SMEM), row positions, q rows, k's and v's refs
    (one each, or int8 values and scales: `_read_entries` dequantizes them here, in VMEM),
    slot positions; out, lse; scratch: running max m [R, 1], normaliser l [R, 1],
    unnormalised output acc [R, D] (f32).
    """
    _, window_ref, blocks_ref, counts_ref, rowpos_ref, q_ref, *kv = refs[:-6]
    spos_ref, out_ref, lse_ref, m_ref, l_ref, acc_ref = refs[-6:]
    k_refs, v_refs = kv[: len(kv) // 2], kv[len(kv) // 2 :]
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    at = b * pl.num_programs(1) + h

    @pl.when(j == 0)
    def _start():
        _start_softmax(m_ref, l_ref, acc_ref)

    @pl.when(j < counts_ref[at])
    def _step():
        k = _read_entries(k_refs, slots_minor)
        if slots_minor:  # k block [D, bk]
            s = jnp.dot(q_ref[...], k, preferred_element_type=jnp.float32)
        else:  # [bk, D]
            s = jax.lax.dot_general(q_ref[...], k, _NT, preferred_element_type=jnp.float32)
        # [1, bk] slot positions against the rows' positions [R, 1]
        visible = _visible(spos_ref[...], rowpos_ref[:, :1], window_ref[0])
        # The where also drops NaN read past S in the last block.
        s = jnp.where(visible, scores_spec.cap(s * scores_spec.scale), _MASKED)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        v = _read_entries(v_refs, slots_minor)
        if s_len % bk:  # the last block's slots past S are undefined (maybe NaN): 0 * NaN = NaN
            first = blocks_ref[at * nk + j] * bk
            along = (1, bk) if slots_minor else (bk, 1)
            slot = first + jax.lax.broadcasted_iota(jnp.int32, along, 1 if slots_minor else 0)
            v = jnp.where(slot < s_len, v, jnp.zeros_like(v))
        p = p.astype(v.dtype)
        if slots_minor:  # v block [D, bk]
            pv = jax.lax.dot_general(p, v, _NT, preferred_element_type=jnp.float32)
        else:
            pv = jnp.dot(p, v, preferred_element_type=jnp.float32)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + pv
        m_ref[...] = m_new

    @pl.when(j == nk - 1)
    def _finish():
        _normalise(l_ref, m_ref, lse_ref, ((out_ref, acc_ref),))


def _normalise(l_ref, m_ref, lse_ref, outs) -> None:
    """The online softmax's end: each (out, acc) ref pair's out = acc / l (0 for a row that
    saw nothing), and the rows' log-sum-exp m + log l (-1e30 for those) across lse_ref's
    lanes."""
    norm = l_ref[...]
    seen = norm > 0
    safe = jnp.where(seen, norm, 1.0)
    for out_ref, acc_ref in outs:
        out_ref[...] = jnp.where(seen, acc_ref[...] / safe, 0.0)
    lse = jnp.where(seen, m_ref[...] + jnp.log(safe), _MASKED)
    lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def _decode_call(*, bk: int, s_len: int, scores_spec: ScoreSpec, slots_minor: bool):
    """The pallas_call: (interpret, layer [1], window [1], blocks [B*Hkv*nk], counts [B*Hkv], row
    positions [B, R, 128], q rows [B, Hkv, R, D], (k, v): each `_kv_operands` of the stacked
    [Lg, B, Hkv, S, D] (values [Lg, B, Hkv, D, S] when slots_minor), slot positions
    [B, Hkv, 1, nk * bk]) -> (out [B, Hkv, R, D] f32, lse [B, Hkv, R, 128] f32)."""

    def call(interpret, layer, window, blocks, counts, row_pos, q_rows, kv, spos):
        k, v = kv
        _, b, hkv = k[0].shape[:3]
        d = q_rows.shape[-1]
        kv_block = (None, None, None, d, bk) if slots_minor else (None, None, None, bk, d)
        r_pad = q_rows.shape[2]
        nk = spos.shape[-1] // bk

        def kv_map(bi, h, j, layer_ref, window_ref, blocks_ref, counts_ref):
            block = blocks_ref[(bi * hkv + h) * nk + j]
            return (layer_ref[0], bi, h) + ((0, block) if slots_minor else (block, 0))

        def spos_map(bi, h, j, layer_ref, window_ref, blocks_ref, counts_ref):
            return bi, h, 0, blocks_ref[(bi * hkv + h) * nk + j]

        def rows_map(bi, h, j, *_):
            return bi, h, 0, 0

        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(b, hkv, nk),
            in_specs=[
                pl.BlockSpec((None, r_pad, _LANES), lambda bi, h, j, *_: (bi, 0, 0)),
                pl.BlockSpec((None, None, r_pad, d), rows_map),
                *_kv_specs(k, kv_block, kv_map, slots_minor),
                *_kv_specs(v, kv_block, kv_map, slots_minor),
                pl.BlockSpec((None, None, 1, bk), spos_map),
            ],
            out_specs=[
                pl.BlockSpec((None, None, r_pad, d), rows_map),
                pl.BlockSpec((None, None, r_pad, _LANES), rows_map),
            ],
            scratch_shapes=[
                pltpu.VMEM((r_pad, 1), jnp.float32),
                pltpu.VMEM((r_pad, 1), jnp.float32),
                pltpu.VMEM((r_pad, d), jnp.float32),
            ],
        )
        flops = 4 * b * hkv * r_pad * nk * bk * d  # dense bound: skipped blocks not counted off
        layer_bytes = _layer_bytes(k) + _layer_bytes(v)  # an int8 cache's scales included
        kernel = functools.partial(_decode_kernel, nk=nk, bk=bk, s_len=s_len,
                                   scores_spec=scores_spec, slots_minor=slots_minor)  # fmt: skip
        return pl.pallas_call(
            kernel,
            grid_spec=grid_spec,
            out_shape=[
                jax.ShapeDtypeStruct((b, hkv, r_pad, d), jnp.float32),
                jax.ShapeDtypeStruct((b, hkv, r_pad, _LANES), jnp.float32),
            ],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary")
            ),
            cost_estimate=pl.CostEstimate(
                flops=flops, transcendentals=flops // (4 * d), bytes_accessed=layer_bytes
            ),
            interpret=interpret,
        )(layer, window, blocks, counts, row_pos, q_rows, *k, *v, spos)

    return call
