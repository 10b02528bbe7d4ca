"""Prefill attention as a Pallas TPU flash kernel, with `written_slot_attention`'s contract.

`flash_attention` takes the same arguments and gives the same results as
`attention.written_slot_attention` (up to float summation order), so a forward pass can call
either. On TPU it runs two Mosaic kernels; elsewhere (CPU tests) the same kernels run in
Pallas interpret mode.

Layout. q is regrouped as `written_slot_attention` groups it: the G query heads of a kv head
become rows g * T' + t of one [G * T', D] array (T' = T padded to whole query tiles), which the
forward kernel reads as [G, T', D] (the same memory): its grid is (batch, kv head, query tile,
key tile) and each step's block holds query tile i of all G heads, so every key and value tile
a step loads serves G * bq rows. Loading them once per query head instead read a layer's keys
and values G times as often (the prefill's largest HBM cost at 8k before sequence parallelism,
compiled for a v5e-8: benchmarks/RESULTS.md). Keys and values are read in place (never padded
or copied), from the layer group's stacked cache [Lg, B, Hkv, S, D] itself: the layer index is
scalar-prefetched with the skip tables and the k / v index maps pick that layer's tiles
(`LayerCache.layer`), as `flash_decode` does. Passed k_all[i] instead, a prefill under the
layer scan materialised a copy of the layer's whole capacity for every chunk and layer before
the kernel read it (for Llama-8B at 32k, batch 24 on a v5e-8, the prefill's largest HBM cost).
A plain [B, Hkv, S, D] layer works too (read as a stack of one: `LayerCache.one`). The slot and
query positions (small; the layer's are sliced out) are padded with -1 to whole tiles, and the
last key tile's rows past S (undefined, maybe NaN) are masked, so any T and S work. The
regrouping is one transposing copy of q (and one of the output back); in a layer, XLA folds
both into the q projection and o_proj (a Llama-8B layer at 8k compiled for v5e holds 65 MiB of
temporaries this way). Reading q in its own [B, T, Hq * D] layout in D-wide column blocks was
tried: 257 MiB there, as the TPU's tiled layouts make the [B, T, Hq, D] <-> [B, T, Hq * D]
reshapes copies.

Masking is by position only: slot s is visible to row r iff 0 <= slot_pos[s] <= the row's
query position and s < num_slots, and on a sliding layer (window > 0) query position -
slot_pos[s] < window (`attention.visible`). Left padding (query or slot position -1),
evicted slots (-1 anywhere), causality and the window all follow from that one rule, with no
index arithmetic. The window is a traced scalar, scalar-prefetched with the layer index, so
one compilation serves every layer of a scanned group, sliding or global. Scores are q
scaled in q's dtype (by `ScoreSpec.scale_for(D)`) times k, in f32, soft-capped when the
model caps them, then masked: `written_slot_attention`'s order.

Skipping. A key tile whose smallest visible position exceeds a query tile's largest query
position can be seen by no row of it (the upper causal triangle, left padding, unwritten
slots past num_slots), nor, with a window, one whose largest position is window or more
below the query tile's smallest real position (older than every row's window: a sliding
layer's prefill then computes O(T * window) tiles, not O(T^2)): the kernel skips its compute
with `pl.when`, and the index maps clamp its block index into the range of needed tiles so
its DMA is not issued either (Pallas skips the copy when a block index repeats). The tables
behind this are scalar-prefetched (SMEM), per batch row (min / max over kv heads:
conservative, so exact whatever the heads hold).

Rows that see no slot at all (padding queries) get a zero output and a log-sum-exp of
-1e30; `written_slot_attention` gives them a finite mean of values instead. Both are finite
and such rows never reach a real token (their own keys are at position -1).

The probs sum (H2O) is a second, keys-major kernel over the same tiles, normalised by the
first kernel's per-row log-sum-exp: exp(s - lse) is each row's softmax without a second
online pass, and keys-major tiles let each step reduce over the rows into its key tile's
sums while that tile stays resident. Plain XLA in blocks would materialise [rows, block]
f32 score tiles in HBM per step and could not skip causal tiles.

An int8 cache (`runtime.quantized.Int8Entries`). Both kernels take the int8 values, stacked
and read in place as plain ones are, and the layer's scales as [B, Hkv, 1, S'] (sliced out
and turned lanes-wise: `flash_tiles._kv_operands`, which says what that costs); they DMA int8
[bk, D] tiles and [1, bk] scale rows, and dequantize each tile in VMEM as
q.astype(dtype) * scale in the activation dtype (`flash_tiles._read_entries`), the product
`quantized.dequantize` computes, before the products: the numbers `written_slot_attention`
reads, from about half the HBM bytes of a bf16 cache's tiles. The probs-sum kernel
dequantizes its key tile once per key tile, as every row tile reads the same one.
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
    ScoreSpec,
    Tiles,
)
from dge_jax.kernels.flash_tiles import (
    _NT,
    _NUM_TABLES,
    _clamp,
    _column,
    _Dims,
    _head_and_tile,
    _kv_operands,
    _kv_specs,
    _layer_bytes,
    _read_entries,
    _row,
    _skip_tables,
    _start_softmax,
    _Tables,
    _tile,
    _tile_needed,
    _visible,
)


def flash_attention(
    q: jax.Array,
    query_pos: jax.Array,
    cache: LayerCache,
    num_slots: jax.Array | int,
    spec: AttentionSpec,
    tiles: Tiles = DEFAULT_TILES,
    with_lse: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """`written_slot_attention` as Pallas kernels; returns (out, per-slot prob sums or None),
    or with_lse (no prob sums): (out in f32, each row's log-sum-exp [B, T, Hq] f32, -1e30
    where it saw no slot), what joins attention read in pieces (`layer_attention`).

    q: [B, T, Hq, D]; query_pos: [B, T]; cache: the stacked k, v [Lg, B, Hkv, S, D] (arrays,
    or int8 `Int8Entries`: module docstring) and slot positions [Lg, B, Hkv, S], of which
    layer cache.layer (an int32, may be traced) is read in place (a single layer:
    `LayerCache.one`), and its sliding window cache.window (an int32, may be traced; 0 or
    None: global); num_slots: slots at or past it are never read; spec: record_attn (the
    probs sums) and scores (the logits' scale and soft cap). out: [B, T, Hq, D] in v's dtype
    (an int8 cache's: its scales'); probs sum: [B, Hq, S] f32 summed over the T queries,
    padding queries contributing 0. tiles.block_q / block_k: row and key tile sizes (multiples of
    128; shrunk to the padded T / S when larger). tiles.interpret: None runs Mosaic when
    compiled for TPU and interpret mode on any other platform (decided at lowering, from
    where the computation is compiled); True / False force it.
    """
    scores_spec, return_probs_sum = spec.scores, spec.record_attn
    b, t, hq, _ = q.shape
    dims, tables, qpos, rows, k, v, spos = _prepare(q, query_pos, cache, num_slots, scores_spec,
                                                    tiles)  # fmt: skip
    out_dtype = jnp.float32 if with_lse else None

    def run(interpret_now: bool) -> tuple[jax.Array, ...]:
        out, lse = _forward_call(dims, interpret_now, out_dtype)(tables, qpos, rows, k, v, spos)
        if with_lse:
            return out, lse
        if not return_probs_sum:
            return (out,)
        return out, _sums_call(dims, interpret_now)(tables, qpos, rows, lse, k, spos)

    results = _on_platform(run, tiles.interpret)
    out = _rows_out(results[0], q.shape, dims)
    if with_lse:  # [B, Hkv, 1, G * T'] -> [B, T, Hq], as _rows_out moves the rows
        lse = results[1].reshape(b, hq // dims.g, dims.g, dims.nq * dims.bq)[..., :t]
        return out, lse.transpose(0, 3, 1, 2).reshape(b, t, hq)
    if not return_probs_sum:
        return out, None
    return out, results[1].reshape(b, hq, -1)[:, :, : dims.s_len]


def probs_sums_under(q: jax.Array, query_pos: jax.Array, cache: LayerCache,
                     num_slots: jax.Array | int, lse: jax.Array, scores: ScoreSpec,
                     tiles: Tiles = DEFAULT_TILES) -> jax.Array:  # fmt: skip
    """`flash_attention`'s per-slot prob sums [B, Hq, S] f32 (same arguments) with each
    row's softmax normalised by lse [B, T, Hq] instead of its own log-sum-exp over this
    layer: the sums of a softmax over more slots than these, as an int4 layer's residual
    block joined with its packed bytes (`flash_int4`). Rows at -1e30 see nothing."""
    b, _, hq, _ = q.shape
    dims, tables, qpos, rows, k, _, spos = _prepare(q, query_pos, cache, num_slots, scores, tiles)
    lse = lse_rows(lse, dims)

    def run(interpret_now: bool) -> tuple[jax.Array]:
        return (_sums_call(dims, interpret_now)(tables, qpos, rows, lse, k, spos),)

    sums = _on_platform(run, tiles.interpret)[0]
    return sums.reshape(b, hq, -1)[:, :, : dims.s_len]


def lse_rows(lse: jax.Array, dims: _Dims) -> jax.Array:
    """Log-sum-exps [B, T, Hq] in `_rows_in`'s rows, as the kernels give and take them: [B,
    Hkv, 1, G T'] (rows past T: 0; their queries, at position -1, see no slot)."""
    b, t, hq = lse.shape
    lse = lse.reshape(b, t, hq // dims.g, dims.g).transpose(0, 2, 3, 1)  # [B, Hkv, G, T]
    t_pad = dims.nq * dims.bq
    return jnp.pad(lse, ((0, 0), (0, 0), (0, 0), (0, t_pad - t))).reshape(b, -1, 1, dims.g * t_pad)


def _prepare(q: jax.Array, query_pos: jax.Array, cache: LayerCache, num_slots, scores: ScoreSpec,
             tiles: Tiles):  # fmt: skip
    """What both kernels read: (dims, skip tables, query positions [B, 1, T'], q's rows
    (`_rows_in`), k's and v's operands (`_kv_operands`), slot positions [B, Hkv, 1, S'])."""
    k, v, slot_pos, layer, window = cache.k, cache.v, cache.pos, cache.layer, cache.window
    layer = jnp.asarray(layer, jnp.int32)
    b, t, hq, d = q.shape
    hkv, s_len = k.shape[2], k.shape[3]
    # This layer's positions (4 bytes a slot: small) feed the tables and the kernels' masks;
    # k and v stay stacked, their index maps pick the layer.
    slot_pos = jax.lax.dynamic_index_in_dim(slot_pos, layer, keepdims=False)
    bq, t_pad = _tile(t, tiles.block_q, "block_q")
    bk, s_pad = _tile(s_len, tiles.block_k, "block_k")
    # (values,) or (int8 values, the layer's scales [B, Hkv, 1, S'])
    k, v = _kv_operands(k, layer, s_pad), _kv_operands(v, layer, s_pad)
    dims = _Dims(g=hq // hkv, nq=t_pad // bq, nk=s_pad // bk, bq=bq, bk=bk, s_len=s_len,
                 softcap=scores.softcap, kv_refs=len(k))  # fmt: skip
    qpos = jnp.pad(query_pos.astype(jnp.int32), ((0, 0), (0, t_pad - t)), constant_values=-1)
    spos = jnp.pad(
        slot_pos.astype(jnp.int32), ((0, 0), (0, 0), (0, s_pad - s_len)), constant_values=-1
    )
    window = jnp.asarray(0 if window is None else window, jnp.int32)
    tables = _skip_tables(spos, qpos, jnp.asarray(num_slots, jnp.int32), bq, bk, layer, window)
    rows = _rows_in(q, hkv, dims, scores.scale_for(d))
    # [B, 1, L] layouts: a tile's positions are a legal (1, tile) block, lanes along L.
    return dims, tables, qpos[:, None, :], rows, k, v, spos[:, :, None, :]


def _on_platform(run, interpret: bool | None) -> tuple[jax.Array, ...]:
    """run(interpret) forced, or with interpret None both traced and the one for the platform
    being compiled lowered: Mosaic on TPU, interpret mode elsewhere."""
    if interpret is None:
        return jax.lax.platform_dependent(tpu=functools.partial(run, False),
                                          default=functools.partial(run, True))  # fmt: skip
    return run(interpret)


def _rows_in(q: jax.Array, hkv: int, dims: _Dims, scale: float) -> jax.Array:
    """q [B, T, Hq, D] -> [B, Hkv, G * T', D], row g * T' + t = query head g's query t, scaled
    by `scale` in q's dtype before the product as written_slot_attention does (same rounding)."""
    b, t, hq, d = q.shape
    q = q * jnp.asarray(scale, q.dtype)
    qg = q.reshape(b, t, hkv, dims.g, d).transpose(0, 2, 3, 1, 4)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, dims.nq * dims.bq - t), (0, 0)))
    return qg.reshape(b, hkv, dims.g * dims.nq * dims.bq, d)


def _rows_out(out: jax.Array, shape: tuple[int, ...], dims: _Dims) -> jax.Array:
    """The kernel's output in `_rows_in`'s layout back to [B, T, Hq, D]."""
    b, t, hq, d = shape
    out = out.reshape(b, hq // dims.g, dims.g, dims.nq * dims.bq, d)[:, :, :, :t]
    return out.transpose(0, 3, 1, 2, 4).reshape(shape)


def _rows_spec(dims: _Dims, d: int, tile_of) -> pl.BlockSpec:
    """The BlockSpec of a row tile of q or the output in `_rows_in`'s layout;
    tile_of(*grid indices, *tables) -> (b, h, query head g of kv head h, query tile qi),
    read as rows [(g * nq + qi) * bq, (g * nq + qi + 1) * bq) of kv head h."""

    def index(*idx):
        b, h, g, qi = tile_of(*idx)
        return b, h, g * dims.nq + qi, 0

    return pl.BlockSpec((None, None, dims.bq, d), index)


def _forward_kernel(*refs, dims: _Dims) -> None:
    """One (batch, kv head, query tile, key tile) step of the online softmax, for the G query
    heads of the kv head at once: the key and value tiles a step loads serve all G heads'
    rows of the query tile (one DMA of k and v per query tile, not one per query head).

    Keys and values come as dims.kv_refs refs each (`_read_entries`: an int8 cache's tiles
    are dequantized here, in VMEM). Scratch: running max m [G, bq, 1], normaliser l [G, bq,
    1], unnormalised output acc [G, bq, D] (f32), and the query tile's positions as a column
    [bq, 1] (made once, at key tile 0).
    """
    tab = _Tables(*refs[:_NUM_TABLES])
    qpos_ref, q_ref, *kv, spos_ref, out_ref, lse_ref = refs[_NUM_TABLES:-4]
    m_ref, l_ref, acc_ref, rowpos_ref = refs[-4:]
    k_refs, v_refs = kv[: dims.kv_refs], kv[dims.kv_refs :]
    b, qi, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _start():
        _start_softmax(m_ref, l_ref, acc_ref)
        rowpos_ref[...] = _column(qpos_ref[...])

    @pl.when(_tile_needed(tab, b, qi, j, dims))
    def _step():
        # What the G heads share: the key tile's visibility to the query tile and the value
        # tile with its rows past S (the last tile's, undefined: maybe NaN) or num_slots
        # (unwritten) zeroed, as p is 0 there but 0 * NaN would still be NaN in the product.
        slot = j * dims.bk + jax.lax.broadcasted_iota(jnp.int32, (1, dims.bk), 1)
        sp = spos_ref[...]  # [1, bk] against the rows' positions [bq, 1]
        visible = _visible(sp, rowpos_ref[...], tab.window[0]) & (slot < tab.num_slots[0])
        rows = j * dims.bk + jax.lax.broadcasted_iota(jnp.int32, (dims.bk, 1), 0)
        v = _read_entries(v_refs)
        v = jnp.where(rows < jnp.minimum(tab.num_slots[0], dims.s_len), v, jnp.zeros_like(v))
        k = _read_entries(k_refs)
        for g in range(dims.g):  # static: G (1-8) heads, each a [bq, bk] score tile
            s = jax.lax.dot_general(q_ref[g], k, _NT, preferred_element_type=jnp.float32)
            s = jnp.where(visible, dims.cap(s), _MASKED)  # also drops NaN read past S
            m_prev = m_ref[g]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            # Zero, not exp(0) = 1, where masked: a row that saw nothing keeps l = acc = 0.
            p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            l_ref[g] = alpha * l_ref[g] + p.sum(axis=1, keepdims=True)
            acc_ref[g] = alpha * acc_ref[g] + pv
            m_ref[g] = m_new

    @pl.when(j == dims.nk - 1)
    def _finish():
        for g in range(dims.g):
            norm = l_ref[g]
            seen = norm > 0
            safe = jnp.where(seen, norm, 1.0)
            out_ref[g] = jnp.where(seen, acc_ref[g] / safe, 0.0).astype(out_ref.dtype)
            lse_ref[g : g + 1, :] = _row(jnp.where(seen, m_ref[g] + jnp.log(safe), _MASKED))


def _forward_call(dims: _Dims, interpret: bool, out_dtype=None):
    """The forward pallas_call: (tables, qpos [B,1,T'], q rows (`_rows_in`), k, v (each
    `_kv_operands` of the stacked [Lg,B,Hkv,S,D], layer tables.layer read), spos
    [B,Hkv,1,S']) -> (out in q's row layout, lse [B,Hkv,1,G*T'] f32, row tile order). The
    kernel sees q and out as [B, Hkv, G, T', D] and lse as [B, Hkv, G, T'] (the same
    memory): one block holds the G heads' rows of a query tile. out_dtype: the output's (None:
    v's, or an int8 cache's scales')."""
    nq, bq, bk, g = dims.nq, dims.bq, dims.bk, dims.g

    def key_tile(b, h, i, j, *refs):
        tab = _Tables(*refs)
        return _clamp(j, tab.kfirst[b * nq + i], tab.klast[b * nq + i])

    def kv_map(b, h, i, j, *refs):
        return _Tables(*refs).layer[0], b, h, key_tile(b, h, i, j, *refs), 0

    def spos_map(b, h, i, j, *refs):
        return b, h, 0, key_tile(b, h, i, j, *refs)

    def qpos_map(b, h, i, j, *refs):
        return b, 0, i

    def heads_map(b, h, i, j, *refs):
        return b, h, 0, i, 0

    def call(tables, qpos, q_rows, k, v, spos):
        _, b, hkv, s_len, d = k[0].shape
        q = q_rows.reshape(b, hkv, g, nq * bq, d)
        heads = pl.BlockSpec((None, None, g, bq, d), heads_map)
        kv_block = (None, None, None, bk, d)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(tables),
            grid=(b, hkv, nq, dims.nk),
            in_specs=[
                pl.BlockSpec((None, 1, bq), qpos_map),
                heads,
                *_kv_specs(k, kv_block, kv_map),
                *_kv_specs(v, kv_block, kv_map),
                pl.BlockSpec((None, None, 1, bk), spos_map),
            ],
            out_specs=[
                heads,
                pl.BlockSpec((None, None, g, bq), lambda b, h, i, j, *_: (b, h, 0, i)),
            ],
            scratch_shapes=[
                pltpu.VMEM((g, bq, 1), jnp.float32),
                pltpu.VMEM((g, bq, 1), jnp.float32),
                pltpu.VMEM((g, bq, d), jnp.float32),
                pltpu.VMEM((bq, 1), jnp.int32),
            ],
        )
        flops = 4 * b * hkv * g * nq * bq * s_len * d  # dense bound: skipped tiles not counted off
        # the layer's k and v (an int8 cache's scales too) once per query tile (dense)
        tile_bytes = 2 * _layer_bytes(k) * nq
        out, lse = pl.pallas_call(
            functools.partial(_forward_kernel, dims=dims),
            grid_spec=grid_spec,
            out_shape=[
                jax.ShapeDtypeStruct(q.shape, out_dtype or v[-1].dtype),  # v's, int8 scales'
                jax.ShapeDtypeStruct((b, hkv, g, nq * bq), jnp.float32),
            ],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
            ),
            cost_estimate=pl.CostEstimate(
                flops=flops, transcendentals=flops // (2 * d),
                bytes_accessed=2 * q_rows.size * q_rows.dtype.itemsize + tile_bytes,
            ),
            interpret=interpret,
        )(*tables, qpos, q, *k, *v, spos)
        return out.reshape(q_rows.shape), lse.reshape(b, hkv, 1, g * nq * bq)

    return call


def _sums_kernel(*refs, dims: _Dims) -> None:
    """One (batch, kv head, key tile, row tile) step of the probs sum, keys-major.

    Scores come as [bk, bq] (keys on sublanes), so the rows' positions and lse are [1, bq]
    rows as loaded, and summing over the rows leaves a [bk, 1] column per key tile: added
    into acc[g] (G columns, one per query head of the kv head) until the last row tile, then
    written as the G rows of the output tile. The slot positions become a column once per
    key tile (slots at or past num_slots as -1). Key tiles past kend are neither computed nor
    loaded (their index clamped to kend's): their sums stay zero.

    An int8 key tile (dims.kv_refs = 2: values and scales) is dequantized once per key tile,
    into a last scratch [bk, D] of the activation dtype: every row tile reads the same one.
    """
    tab = _Tables(*refs[:_NUM_TABLES])
    int8 = dims.kv_refs == 2
    qpos_ref, q_ref, lse_ref, *k_refs, spos_ref, out_ref, colpos_ref, acc_ref = (
        refs[_NUM_TABLES : len(refs) - int8]
    )
    b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    head, qi = _head_and_tile(i, dims.nq)
    k_ref = refs[-1] if int8 else k_refs[0]

    @pl.when(i == 0)
    def _start():
        slot = j * dims.bk + jax.lax.broadcasted_iota(jnp.int32, (1, dims.bk), 1)
        colpos_ref[...] = _column(jnp.where(slot < tab.num_slots[0], spos_ref[...], -1))
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        if int8:
            k_ref[...] = _read_entries(k_refs)

    @pl.when(_tile_needed(tab, b, qi, j, dims))
    def _step():
        st = jax.lax.dot_general(k_ref[...], q_ref[...], _NT, preferred_element_type=jnp.float32)
        # [bk, 1] slot positions against the rows' positions [1, bq]
        visible = _visible(colpos_ref[...], qpos_ref[...], tab.window[0])
        # A row that sees nothing has lse = -1e30 and no visible entry: the where keeps it 0.
        p = jnp.where(visible, jnp.exp(dims.cap(st) - lse_ref[...]), 0.0)
        acc_ref[head] += p.sum(axis=1, keepdims=True)

    @pl.when(i == dims.g * dims.nq - 1)
    def _finish():
        for g in range(dims.g):
            out_ref[g : g + 1, :] = _row(acc_ref[g])


def _sums_call(dims: _Dims, interpret: bool):
    """The probs-sum pallas_call: (tables, qpos, q, lse, k, spos) in `_forward_call`'s
    layouts (k: `_kv_operands` of the stacked cache, layer tables.layer read) -> sums
    [B, Hkv, G, S'] f32 (query head h * G + g's sums in row g)."""
    nq, nk, bq, bk, g = dims.nq, dims.nk, dims.bq, dims.bk, dims.g

    def query_tile(b, j, i, refs):
        """Row tile i's (query head, query tile), the tile clamped to key tile j's needed
        range; the row tile read is then head * nq + tile."""
        tab = _Tables(*refs)
        head, qi = _head_and_tile(i, nq)
        return head, _clamp(qi, tab.qfirst[b * nk + j], tab.qlast[b * nk + j])

    def qpos_map(b, h, j, i, *refs):
        return b, 0, query_tile(b, j, i, refs)[1]

    def row_tile(b, h, j, i, *refs):
        return b, h, *query_tile(b, j, i, refs)

    def lse_map(b, h, j, i, *refs):
        head, qi = query_tile(b, j, i, refs)
        return b, h, 0, head * nq + qi

    def k_map(b, h, j, i, *refs):
        tab = _Tables(*refs)
        return tab.layer[0], b, h, jnp.minimum(j, tab.kend[b]), 0

    def spos_map(b, h, j, i, *refs):
        return b, h, 0, jnp.minimum(j, _Tables(*refs).kend[b])

    def call(tables, qpos, q_rows, lse, k, spos):
        _, b, hkv, s_len, d = k[0].shape
        rows = g * nq * bq
        # an int8 tile's dequantized copy, in the activation dtype (the scales')
        dequantized = [pltpu.VMEM((bk, d), k[1].dtype)] if len(k) == 2 else []
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(tables),
            grid=(b, hkv, nk, rows // bq),
            in_specs=[
                pl.BlockSpec((None, 1, bq), qpos_map),
                _rows_spec(dims, d, row_tile),
                pl.BlockSpec((None, None, 1, bq), lse_map),
                *_kv_specs(k, (None, None, None, bk, d), k_map),
                pl.BlockSpec((None, None, 1, bk), spos_map),
            ],
            out_specs=pl.BlockSpec((None, None, g, bk), lambda b, h, j, i, *_: (b, h, 0, j)),
            scratch_shapes=[pltpu.VMEM((bk, 1), jnp.int32), pltpu.VMEM((g, bk, 1), jnp.float32),
                            *dequantized],  # fmt: skip
        )
        flops = 2 * b * hkv * rows * s_len * d
        return pl.pallas_call(
            functools.partial(_sums_kernel, dims=dims),
            grid_spec=grid_spec,
            out_shape=jax.ShapeDtypeStruct((b, hkv, g, nk * bk), jnp.float32),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
            ),
            cost_estimate=pl.CostEstimate(
                flops=flops, transcendentals=flops // (2 * d),
                bytes_accessed=q_rows.size * q_rows.dtype.itemsize * nk + _layer_bytes(k),
            ),
            interpret=interpret,
        )(*tables, qpos, q_rows, lse, *k, spos)

    return call
