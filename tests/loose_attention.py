"""The attention kernels called with loose per-layer arrays, as the kernel tests write their
cases: one layer's k, v [B, Hkv, S, D] and slot positions [B, Hkv, S], and the settings by
name. Each adapter packs them into the kernels' boundary (`attention.LayerCache.one`,
`AttentionSpec`, `NewEntries`, `Tiles`) and calls the kernel: the tests' cases stay as
written while the library's functions take one static spec and one layer value."""

from __future__ import annotations

from dge_jax.kernels.attention import (
    DEFAULT_SCORES,
    AttentionSpec,
    LayerCache,
    NewEntries,
    Tiles,
    cached_attention,
    written_slot_attention,
)


def _new(new):
    return None if new is None else NewEntries(*new)


def cached(q, k, v, slot_pos, query_pos, *, return_probs_sum=False, keys_major=None, new=None,
           new_slot=0, window=None, scores_spec=DEFAULT_SCORES):  # fmt: skip
    """`cached_attention` over one layer."""
    spec = AttentionSpec(record_attn=return_probs_sum, scores=scores_spec, keys_major=keys_major)
    layer = LayerCache.one(k, v, slot_pos, new_slot, window)
    return cached_attention(q, query_pos, layer, spec, _new(new))


def written(q, k, v, slot_pos, query_pos, num_slots, *, block, return_probs_sum=False,
            window=None, scores_spec=DEFAULT_SCORES):  # fmt: skip
    """`written_slot_attention` over one layer."""
    spec = AttentionSpec(key_block=block, record_attn=return_probs_sum, scores=scores_spec)
    layer = LayerCache.one(k, v, slot_pos, window=window)
    return written_slot_attention(q, query_pos, layer, num_slots, spec)


def flash(q, k, v, slot_pos, query_pos, num_slots, *, layer=None, window=None,
          scores_spec=DEFAULT_SCORES, return_probs_sum=False, block_q=512, block_k=512,
          interpret=None):  # fmt: skip
    """`flash.flash_attention` over one layer, or layer `layer` of stacked k, v, slot_pos."""
    from dge_jax.kernels.flash import flash_attention

    cache = (LayerCache.one(k, v, slot_pos, window=window) if layer is None
             else LayerCache(k, v, slot_pos, layer, 0, window))  # fmt: skip
    spec = AttentionSpec(record_attn=return_probs_sum, scores=scores_spec)
    tiles = Tiles(block_q=block_q, block_k=block_k, interpret=interpret)
    return flash_attention(q, query_pos, cache, num_slots, spec, tiles)


def decode(q, k, v, slot_pos, query_pos, *, new=None, new_slot=0, layer=None, window=None,
           scores_spec=DEFAULT_SCORES, slots_minor=False, block_k=512, interpret=None):  # fmt: skip
    """`flash_decode.decode_attention` over one layer, or layer `layer` of stacked k, v with
    that layer's slot positions [B, Hkv, S] (as the kernel reads them)."""
    from dge_jax.kernels.flash_decode import decode_attention

    if layer is None:
        cache = LayerCache.one(k, v, slot_pos, new_slot, window)
    else:  # only the layer's positions given: any stacked array holding them at `layer`
        stacked = slot_pos[None].repeat(k.shape[0], axis=0)
        cache = LayerCache(k, v, stacked, layer, new_slot, window)
    tiles = Tiles(block_k=block_k, interpret=interpret, slots_minor=slots_minor)
    return decode_attention(q, query_pos, cache, AttentionSpec(scores=scores_spec), _new(new),
                            tiles)  # fmt: skip


def cudnn(q, k, v, slot_pos, query_pos, num_slots, *, implementation="cudnn", window=None,
          scale=None):  # fmt: skip
    """`layer_attention.cudnn_attention` over one layer."""
    from dge_jax.kernels.attention import ScoreSpec
    from dge_jax.kernels.layer_attention import cudnn_attention

    layer = LayerCache.one(k, v, slot_pos, window=window)
    spec = AttentionSpec(scores=ScoreSpec(scale=scale))
    return cudnn_attention(q, query_pos, layer, num_slots, spec, implementation)
