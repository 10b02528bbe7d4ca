"""An int4 layer read by the Pallas kernels a piece of slots at a time, the pieces joined in one
softmax.

The Pallas kernels unpack int8 blocks in VMEM, and int4 ones at head dims 128 and 256
(`flash_int4`, `flash_decode_int4`), so the kernels at other head dims read an int4 layer
dequantized. Dequantized whole, a layer left whole-layer temporaries of the activation dtype
(the unpacked nibbles, their relayout, the product), the largest of prefill, draft and
FullKV's decode when compiled for a v5e chip, which decided the largest batch
(benchmarks/RESULTS.md, "An int4 cache"). Here each piece of `size` slots
is dequantized alone (`quantized.dequantize_slots`), read by the kernel, which also gives
each row's log-sum-exp, and joined with the pieces before it (`join`: the running output
reweighted by exp(lse - m), as the kernels' own online softmax joins key tiles), so the
temporary is one piece. The same numbers up to float summation order, as the kernels against
the XLA path.

Pieces are whole residual blocks (R slots, so every key group and the residual block is all
in one piece), walked by `quantized.over_pieces`: the last one moved back to end at the last
whole block, its slots that the piece before it read hidden (position -1), then the tail
(S % R slots, always residual) as one more piece.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dge_jax.kernels.attention import _MASKED, LayerCache
from dge_jax.runtime.quantized import (
    PIECES,
    dequantize_slots,
    int4_tail,
    over_pieces,
    written_first,
)

# attend(a piece as a layer of its own, its first slot) -> (out f32 [B, T, Hq, D], lse [B, T, Hq])
Attend = Callable[[LayerCache, jax.Array | int], tuple[jax.Array, jax.Array]]


def in_pieces(cache: LayerCache) -> bool:
    """Whether the kernels read this layer in pieces: an int4 cache (plain and int8 ones are
    read in place)."""
    return written_first(cache.k)


def join(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]):
    """Two normalised outputs [..., D] f32 over disjoint slots and their log-sum-exps [...] as
    one softmax over both: weights exp(lse - m), m the larger. A row that saw nothing in one
    (lse -1e30) takes the other's; in neither, it stays 0 at -1e30."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    m = jnp.maximum(lse_a, lse_b)
    wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    norm = wa + wb
    return (out_a * wa[..., None] + out_b * wb[..., None]) / norm[..., None], m + jnp.log(norm)


def attend_in_pieces(cache: LayerCache, out_shape: tuple[int, ...], attend: Attend):
    """Layer cache.layer of an int4 cache read piece by piece (module docstring): each
    piece's k and v dequantized and its positions (slots the piece before covered: -1) handed
    to `attend`, the results joined. Returns (out f32 `out_shape` [B, T, Hq, D], lse)."""
    k_all, v_all, layer = cache.k, cache.v, jnp.asarray(cache.layer, jnp.int32)
    pos = jax.lax.dynamic_index_in_dim(cache.pos, layer, keepdims=False)  # [B, Hkv, S]

    def of_layer(entries):
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, layer, keepdims=False),
                            entries)  # fmt: skip

    def piece(start, size, seen, acc):  # slots the piece before read: hidden (-1)
        k, v = (dequantize_slots(of_layer(x), start, size) for x in (k_all, v_all))
        slot_pos = jnp.where(seen, -1, jax.lax.dynamic_slice_in_dim(pos, start, size, axis=2))
        return join(acc, attend(LayerCache.one(k, v, slot_pos, 0, cache.window), start))

    def tail(n, acc):
        k, v = (int4_tail(of_layer(x)) for x in (k_all, v_all))
        return join(acc, attend(LayerCache.one(k, v, pos[..., n:], 0, cache.window), n))

    acc = (jnp.zeros(out_shape, jnp.float32), jnp.full(out_shape[:-1], _MASKED, jnp.float32))
    return over_pieces(k_all.shape[-2], k_all.residual, PIECES, piece, tail, acc)
