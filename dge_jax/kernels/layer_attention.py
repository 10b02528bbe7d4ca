"""One layer's attention over its layer group's cache, with the step's entries written: the
cache write every family shares, and the switch between attention implementations.

Which implementation runs is the platform's choice (`platform.Backend`, overridable by the
user's ``attention``): a prefill chunk (``key_block`` > 0) runs `prefill_attention` (the XLA
blocked online softmax, the Pallas flash kernel, or cuDNN's flash attention); decode and
draft steps, a handful of queries over the cache, run `decode_step_attention`: under
"pallas" the decode kernel (`flash_decode.decode_attention`, which reads only the key blocks
holding visible slots), otherwise the XLA path (`attention.cached_attention`) in the score
layout the platform prefers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dge_jax.distribution.constraints import attention_specs
from dge_jax.kernels import int4_pieces
from dge_jax.kernels.attention import (
    AttentionSpec,
    LayerCache,
    NewEntries,
    Tiles,
    cached_attention,
    visible,
    written_slot_attention,
)
from dge_jax.runtime import platform
from dge_jax.runtime.platform import Backend
from dge_jax.runtime.quantized import read_back, store_like, write_int4, written_first


def cache_layer_attention(
    q: jax.Array,
    positions: jax.Array,
    new: NewEntries,
    cache: LayerCache,
    spec: AttentionSpec,
) -> tuple[jax.Array, jax.Array | None, LayerCache]:
    """Layer cache.layer's attention over its layer group's cache, with this step's T entries
    written.

    q [B, T, Hq, D] (post-RoPE) at positions [B, T]; new: the step's k, v [B, Hkv, T, D]
    (post-RoPE) and positions [B, Hkv, T]; cache: the group's buffers k, v [Lg, B, Hkv, S, D]
    and pos [Lg, B, Hkv, S], the layer written at slots [cache.slot, cache.slot + T), and its
    sliding window (traced; 0 = global; None when no layer of the model slides). Returns
    (attention output [B, T, Hq, D], per-slot attention sums [B, Hq, S] or None, the cache
    with the entries written). spec: the call's static settings (`AttentionSpec`): key_block,
    record_attn (the sums), attention (the implementation, `platform.ATTENTION`; "auto": the
    platform's) and scores (the model's logit scale and soft cap: every kernel takes them
    but cuDNN's, which takes no soft cap: `kernel_backend`).

    spec.key_block > 0 (a prefill chunk of that many tokens): the entries are written first
    and the chunk attends over the written slots [0, slot + T) (`prefill_attention`).
    Otherwise (decode and draft steps) attention reads the cache with this step's entries
    passed beside it, then they are written. On CPU the written values take a zero computed
    from the attention output, so the write must run after attention's reads: XLA:CPU then
    updates each buffer in place instead of copying every cache buffer of the loop several
    times per step (tests/test_generation.py checks the compiled loop for such copies). The
    zero is exact: min(|a|, 1) * 0 is 0 for every finite or infinite a. Every model family
    calls this one function, so none has to repeat the trick. An int4 cache is written first
    either way (`quantized.write_int4`): a step that completes a residual block quantizes
    entries already in the cache too, and reading the written buffers is what keeps its
    update in place; the step's own entries are then passed beside the cache as stored.
    """
    backend = kernel_backend(platform.current(spec.attention), spec)
    t = q.shape[1]
    i, slot = cache.layer, cache.slot

    def put(buf, part):
        """buf with part [B, Hkv, T(, D)] (in buf's form) at slots [slot, slot + T) of layer i
        (an int8 cache's values and scales alike)."""
        def one(b, n):
            return jax.lax.dynamic_update_slice(b, n[None], (i, 0, 0, slot) + (0,) * (n.ndim - 3))

        return jax.tree.map(one, buf, part)

    if written_first(cache.k):
        # int4: written first (O(R * D): `quantized.write_int4`), then read back as stored,
        # a step's own entries included, whether prefill chunk or decode step. Attention then
        # reads only the written buffers, so the write is in place without the CPU trick.
        k, k_read = write_int4(cache.k, i, slot, new.k)
        v, v_read = write_int4(cache.v, i, slot, new.v)
        cache = cache._replace(k=k, v=v, pos=put(cache.pos, new.pos))
        if spec.key_block:
            block = dataclasses.replace(spec, key_block=backend.key_block or spec.key_block)
            attn, probs_sum = prefill_attention(backend, q, positions, cache, slot + t, block)
        else:
            read_new = new._replace(k=k_read, v=v_read)
            attn, probs_sum = decode_step_attention(backend, q, positions, cache, read_new, spec)
        return attn, probs_sum, cache
    # Plain and int8: the step's entries in the cache's form, quantized once (the read below
    # and the write both take them).
    k_new, v_new = store_like(cache.k, new.k), store_like(cache.v, new.v)
    if spec.key_block:
        cache = cache._replace(k=put(cache.k, k_new), v=put(cache.v, v_new),
                               pos=put(cache.pos, new.pos))  # fmt: skip
        block = dataclasses.replace(spec, key_block=backend.key_block or spec.key_block)
        attn, probs_sum = prefill_attention(backend, q, positions, cache, slot + t, block)
        return attn, probs_sum, cache
    # The step's own entries as they will be read once written (an int8 cache's round trip).
    read_new = new._replace(k=read_back(k_new, new.k), v=read_back(v_new, new.v))
    attn, probs_sum = decode_step_attention(backend, q, positions, cache, read_new, spec)
    if backend.write_after_attention:
        after = jnp.minimum(jnp.abs(attn.reshape(-1)[0]), 1) * 0
        k_new, v_new = (jax.tree.map(lambda x: x + after.astype(x.dtype), part)
                        for part in (k_new, v_new))  # fmt: skip
    written = cache._replace(k=put(cache.k, k_new), v=put(cache.v, v_new),
                             pos=put(cache.pos, new.pos))  # fmt: skip
    return attn, probs_sum, written


def kernel_backend(backend: Backend, spec: AttentionSpec) -> Backend:
    """`backend`, unless its kernel cannot run this attention: cuDNN's takes no soft cap (the
    Pallas kernels and the XLA path take sliding windows, soft caps and any logit scale;
    every kernel reads an int8 cache: the Pallas kernels dequantize its blocks in VMEM,
    cuDNN's reads it dequantized; an int4 cache is read by the Pallas kernels in place at
    head dims 128 and 256, `flash_int4` and `flash_decode_int4`, a piece at a time at other
    head dims, `int4_pieces`, and dequantized one layer at a time for the others:
    `dense_layer`).
    Asked for by name (spec.attention), such a kernel is a ValueError saying what to use;
    chosen by "auto", the XLA path runs instead (it is exact for all of them)."""
    if not (backend.attention == "cudnn" and spec.scores.softcap):
        return backend
    if spec.attention != "auto":
        raise ValueError(
            f"attention={spec.attention!r} does not take this model's soft-capped logits: use "
            "attention='xla' (or 'auto', which picks it then)"
        )
    return platform.current("xla")


def decode_step_attention(
    backend: Backend,
    q: jax.Array,
    query_pos: jax.Array,
    cache: LayerCache,
    new: NewEntries,
    spec: AttentionSpec,
) -> tuple[jax.Array, jax.Array | None]:
    """`cached_attention` over layer cache.layer of the stacked k, v [Lg, B, Hkv, S, D], with
    the step's entries `new` beside the cache (to go to slots from cache.slot).

    "pallas" without probs sums: `flash_decode.decode_attention` on the stacked buffers (the
    layer picked by its index maps, so no slice of the cache is materialised; the window
    scalar-prefetched likewise), in a shard_map under a mesh; an int4 cache (its entries
    written first) by `flash_decode_int4` where it reads the layout, else in pieces
    (`int4_pieces`). Everything else, and steps that record probs sums (H2O's draft and
    decode-time steps; the kernel computes none), run the XLA path."""
    if backend.attention == "pallas" and not spec.record_attn:
        if int4_pieces.in_pieces(cache):  # the step's entries are written: read from the cache
            if _int4_kernel_reads(cache):
                return _sharded_int4(q, query_pos, cache, spec)
            out, _ = int4_pieces.attend_in_pieces(cache, q.shape, lambda piece, start: (
                _sharded_decode(q, query_pos, piece, None, spec, with_lse=True)))
            return out.astype(cache.v.dtype), None
        return _sharded_decode(q, query_pos, cache, new, spec), None
    rows = q.shape[2] // cache.k.shape[2] * q.shape[1]  # query rows per kv head
    layout = dataclasses.replace(spec, keys_major=rows <= backend.keys_major_max_rows)
    return cached_attention(q, query_pos, cache, layout, new)


def dense_layer(cache: LayerCache) -> LayerCache:
    """An int4 cache's layer cache.layer dequantized, as a group of one ([1, B, Hkv, S, D];
    what the XLA and cuDNN paths read of it, and the Pallas prefill where it records prob
    sums at a head dim the int4 kernels do not take; the Pallas kernels otherwise read it in
    place, `flash_int4` and `flash_decode_int4`, or in pieces, `int4_pieces`); plain and int8
    caches as they are."""
    if not written_first(cache.k):
        return cache
    k, v, pos = cache.read()
    return LayerCache.one(k, v, pos, cache.slot, cache.window)


def _sharded_decode(q, query_pos, cache: LayerCache, new: NewEntries | None,
                    spec: AttentionSpec, with_lse: bool = False):  # fmt: skip
    """`decode_attention` of layer cache.layer (its window: a replicated scalar, 0 when None);
    under a (data, model) mesh one call per device on its own rows and kv heads, as
    `_sharded_flash` (imported here for the same reason). A head under 128 reads the cache
    slots-minor, the layout the TPU gives such a cache (see `flash_decode`), so the kernel's
    reads need no layout copy of it. with_lse (new None): (out f32, lse), as
    `decode_attention` gives them."""
    from dge_jax.kernels.flash_decode import decode_attention

    tiles = Tiles(slots_minor=cache.k.shape[-1] < 128)

    def fn(q, k_all, v_all, pos_all, query_pos, new_slot, i, window, *new_parts):
        layer = LayerCache(k_all, v_all, pos_all, i, new_slot, window)
        return decode_attention(q, query_pos, layer, spec,
                                NewEntries(*new_parts) if new_parts else None, tiles,
                                with_lse)  # fmt: skip

    args = (q, cache.k, cache.v, cache.pos, query_pos, jnp.asarray(cache.slot, jnp.int32),
            jnp.asarray(cache.layer, jnp.int32), _window(cache.window),
            *(() if new is None else new))  # fmt: skip
    specs = attention_specs(q.shape[0], cache.k.shape[2])
    if specs is None:
        return fn(*args)
    rows, keys, slots, qpos, _ = specs
    # k's spec, a prefix of an int8 cache's (values, scales): the scales [.., S, 1] split as k
    stacked, scalar = jax.sharding.PartitionSpec(None, *keys), jax.sharding.PartitionSpec()
    return jax.shard_map(
        fn, in_specs=(rows, stacked, stacked, jax.sharding.PartitionSpec(None, *slots), qpos,
                      scalar, scalar, scalar, *(() if new is None else (keys, keys, slots))),
        out_specs=(rows, _lse_spec(rows)) if with_lse else rows, check_vma=False,
    )(*args)  # fmt: skip


def _int4_kernel_reads(cache: LayerCache) -> bool:
    """Whether the int4 kernels (`flash_decode_int4`, `flash_int4`) read this int4 layer's
    stored bytes (`int4_tiles.supports`)."""
    from dge_jax.kernels.int4_tiles import supports

    return supports(cache.k) and supports(cache.v)


def _sharded_int4(q, query_pos, cache: LayerCache, spec: AttentionSpec,
                  num_slots: jax.Array | int | None = None):  # fmt: skip
    """(out, prob sums or None) of the int4 kernels over layer cache.layer:
    `flash_int4.int4_flash_attention` for a prefill chunk (num_slots given; prob sums when
    spec.record_attn), else `flash_decode_int4.int4_decode_attention`; under a (data, model)
    mesh one call per device on its own rows and kv heads, as `_sharded_decode` (each leaf
    of the int4 entries split as the cache, their start [Lg, B, Hkv] as rows and heads)."""
    from dge_jax.kernels.flash_decode_int4 import int4_decode_attention
    from dge_jax.kernels.flash_int4 import int4_flash_attention

    probs = num_slots is not None and spec.record_attn

    def fn(q, k_all, v_all, pos_all, query_pos, i, window, slots_read):
        layer = LayerCache(k_all, v_all, pos_all, i, 0, window)
        if num_slots is None:
            return int4_decode_attention(q, query_pos, layer, spec.scores)
        out, sums = int4_flash_attention(q, query_pos, layer, slots_read, spec)
        return (out, sums) if probs else out

    args = (q, cache.k, cache.v, cache.pos, query_pos, jnp.asarray(cache.layer, jnp.int32),
            _window(cache.window), jnp.asarray(0 if num_slots is None else num_slots, jnp.int32))
    specs = attention_specs(q.shape[0], cache.k.resid.shape[2])
    if specs is None:
        result = fn(*args)
        return result if probs else (result, None)
    rows, keys, slots, qpos, sums = specs
    P = jax.sharding.PartitionSpec
    stacked, start = P(None, *keys), P(None, *tuple(slots)[:2])

    def entries(e):  # each leaf's spec: [Lg, B, Hkv, ., .], start [Lg, B, Hkv]
        return dataclasses.replace(e, q=stacked, scale=stacked, zero=stacked, resid=stacked,
                                   start=start)  # fmt: skip

    result = jax.shard_map(
        fn, in_specs=(rows, entries(cache.k), entries(cache.v), P(None, *slots), qpos, P(), P(),
                      P()),
        out_specs=(rows, sums) if probs else rows, check_vma=False,
    )(*args)  # fmt: skip
    return result if probs else (result, None)


def _lse_spec(rows: jax.sharding.PartitionSpec) -> jax.sharding.PartitionSpec:
    """The spec of a log-sum-exp [B, T, Hq] beside an output [B, T, Hq, D] of spec `rows`."""
    return jax.sharding.PartitionSpec(*tuple(rows)[:3])


def prefill_attention(
    backend: Backend,
    q: jax.Array,
    query_pos: jax.Array,
    cache: LayerCache,
    num_slots: jax.Array | int,
    spec: AttentionSpec,
) -> tuple[jax.Array, jax.Array | None]:
    """`attention.written_slot_attention`'s contract over layer cache.layer of the stacked
    k, v [Lg, B, Hkv, S, D] and pos [Lg, B, Hkv, S], run by `backend.attention`.

    "xla": `written_slot_attention` in key blocks of spec.key_block. "pallas":
    `flash_attention` (Mosaic on TPU, interpret mode elsewhere) on the stacked buffers, its
    index maps picking the layer, so no slice of the layer's capacity is materialised (under
    a layer scan it would be a copy per chunk and layer), and the window scalar-prefetched
    beside it (one compilation for the group's sliding and global layers); under a mesh
    inside a shard_map over rows and kv heads (`_sharded_flash`); an int4 cache's layer (its
    chunk written first) by `flash_int4` where it reads the layout, else in pieces
    (`int4_pieces`; dequantized when such a chunk records prob sums, which `flash_int4`
    records itself). "cudnn":
    `cudnn_attention`; its kernel returns no per-slot sums, so a chunk that records them
    (H2O) runs the XLA path.

    Rows that see no slot (padding queries) differ: zeros from the flash kernel, a mean of
    values from the others. Nothing reads them: such a row's key and value are written at
    position -1 (never visible), prefill keeps only the last position's logits (always a
    real token with left padding), and recorded queries, query statistics and KVzip's
    repeat scores all skip position -1.
    """
    if backend.attention == "pallas" and int4_pieces.in_pieces(cache) and (
            _int4_kernel_reads(cache)):  # fmt: skip
        return _sharded_int4(q, query_pos, cache, spec, num_slots)
    if backend.attention == "pallas" and not spec.record_attn and int4_pieces.in_pieces(cache):
        out, _ = int4_pieces.attend_in_pieces(cache, q.shape, lambda piece, start: (
            _sharded_flash(q, query_pos, piece, jnp.maximum(num_slots - start, 0), spec,
                           with_lse=True)))  # fmt: skip
        return out.astype(cache.v.dtype), None
    cache = dense_layer(cache)
    if backend.attention == "pallas":
        return _sharded_flash(q, query_pos, cache, num_slots, spec)
    if backend.attention == "cudnn" and not spec.record_attn:
        return cudnn_attention(q, query_pos, cache, num_slots, spec), None
    return written_slot_attention(q, query_pos, cache, num_slots, spec)


def _sharded_flash(q, query_pos, cache: LayerCache, num_slots, spec: AttentionSpec,
                   with_lse: bool = False):  # fmt: skip
    """`flash_attention` of layer cache.layer of the stacked buffers (its window: a replicated
    scalar, 0 when None); under a (data, model) mesh, one call per device on its own rows and
    kv heads (jax.shard_map with the cache's layout: `constraints.attention_specs`, the
    layer axis unsplit). Each (row, kv head) pair is independent, so nothing crosses
    devices; a Pallas call cannot be partitioned by XLA itself. Imported here: Pallas's
    modules take about a second to import, which CPU runs (xla) need not pay. with_lse (no
    prob sums): (out f32, lse), as `flash_attention` gives them."""
    from dge_jax.kernels.flash import flash_attention

    return_probs_sum = spec.record_attn and not with_lse

    def fn(q, k_all, v_all, pos_all, query_pos, num_slots, i, window):
        layer = LayerCache(k_all, v_all, pos_all, i, 0, window)
        return flash_attention(q, query_pos, layer, num_slots, spec, with_lse=with_lse)

    args = (q, cache.k, cache.v, cache.pos, query_pos, jnp.asarray(num_slots, jnp.int32),
            jnp.asarray(cache.layer, jnp.int32), _window(cache.window))  # fmt: skip
    specs = attention_specs(q.shape[0], cache.k.shape[2])
    if specs is None:
        return fn(*args)
    rows, keys, slots, qpos, sums = specs
    # k's spec, a prefix of an int8 cache's (values, scales): the scales [.., S, 1] split as k
    stacked = jax.sharding.PartitionSpec(None, *keys)
    scalar = jax.sharding.PartitionSpec()

    # a second output (the prob sums [B, Hq, S], or the lse [B, T, Hq]) and its spec
    pair = ((rows, sums) if return_probs_sum else (rows, _lse_spec(rows)) if with_lse
            else None)  # fmt: skip

    def local(*args):
        out, second = fn(*args)
        return (out, second) if pair else out

    out = jax.shard_map(
        local, in_specs=(rows, stacked, stacked, jax.sharding.PartitionSpec(None, *slots), qpos,
                         scalar, scalar, scalar),
        out_specs=pair or rows, check_vma=False,
    )(*args)  # fmt: skip
    return out if pair else (out, None)


def _window(window: jax.Array | None) -> jax.Array:
    """The layer's window as the kernels' int32 scalar (None, no sliding layer: 0, global)."""
    return jnp.asarray(0 if window is None else window, jnp.int32)


def cudnn_attention(
    q: jax.Array,
    query_pos: jax.Array,
    cache: LayerCache,
    num_slots: jax.Array | int,
    spec: AttentionSpec,
    implementation: str = "cudnn",
) -> jax.Array:
    """out [B, T, Hq, D] of `jax.nn.dot_product_attention` over the slots [0, num_slots) of
    layer cache.layer visible by position (slot s to query t iff 0 <= slot_pos[s] <=
    query_pos[t]).

    Each (row, kv head) is one batch entry of a multi-query call: q regrouped as [B * Hkv, T,
    G, D], the cache read as [B * Hkv, S, 1, D] (a reshape of [B, Hkv, S, D]: no copy), and
    the slot-position mask as its boolean ``mask`` [B * Hkv, 1, T, S] (jax turns it into an
    additive bias: B * Hkv * T * S elements per call, bounded by the prefill chunk T).
    Scores are scaled by D^-1/2 inside the kernel. cuDNN needs bf16 or f16 inputs on a GPU;
    ``implementation="xla"`` runs the same call through XLA (how CPU tests check the
    regrouping and the mask). A sliding window (cache.window) joins the mask
    (`attention.visible`); spec.scores.scale: the logits' scale (None: D^-1/2; no soft cap).
    """
    k, v, slot_pos = cache.read()
    window, scale = cache.window, spec.scores.scale
    b, t, hq, d = q.shape
    hkv, s_len = k.shape[1], k.shape[2]
    g = hq // hkv
    if implementation == "cudnn" and q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"attention='cudnn' needs bfloat16 or float16 weights (cuDNN flash attention), got "
            f"{q.dtype}: load the model with dtype='bfloat16', or use attention='xla'"
        )
    qm = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b * hkv, t, g, d)
    km, vm = (x.reshape(b * hkv, s_len, 1, d) for x in (k, v))
    sp = slot_pos[:, :, None, :]  # [B, Hkv, 1, S] against query positions [B, 1, T, 1]
    written = jnp.arange(s_len) < num_slots
    mask = visible(sp, query_pos[:, None, :, None], window) & written
    out = jax.nn.dot_product_attention(
        qm, km, vm, mask=mask.reshape(b * hkv, 1, t, s_len), scale=scale,
        implementation=implementation,
    )  # fmt: skip
    return out.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
