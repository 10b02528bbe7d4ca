"""Attention of new queries over one layer of the padded cache, masked by slot positions."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dge_jax.runtime import platform
from dge_jax.runtime.quantized import Entries, dequantize, movable

# Finite stand-in for -inf: a query whose every slot is masked (a padding query) then gets a
# uniform, finite distribution that `probs * mask` turns into zeros, instead of NaNs.
_MASKED = -1e30


class ScoreSpec(NamedTuple):
    """How a model turns q . k into attention logits (static under jit): scale (None:
    head_dim ** -0.5; Gemma's query_pre_attn_scalar ** -0.5) and Gemma 2's soft cap
    (logits -> cap * tanh(logits / cap), before the mask)."""

    scale: float | None = None
    softcap: float | None = None

    def scale_for(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scale is None else self.scale

    def cap(self, scores: jax.Array) -> jax.Array:
        """Scaled f32 scores, soft-capped if the model caps them."""
        if self.softcap is None:
            return scores
        return jnp.tanh(scores / self.softcap) * self.softcap


DEFAULT_SCORES = ScoreSpec()


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What one attention call is, fixed at trace time (hashable: a static argument).

    key_block: a prefill chunk's key block (> 0: the chunk's entries are written first and it
    attends over the written slots, in blocks of this many keys), 0 for decode and draft
    steps; record_attn: also return the per-slot attention sums (H2O); attention: the
    implementation (`platform.ATTENTION`; "auto": the platform's); scores: the model's logit
    scale and soft cap; keys_major: the XLA path's K @ Q^T score layout (None: the
    platform's `Backend.keys_major_max_rows`; same numbers either way)."""

    key_block: int = 0
    record_attn: bool = False
    attention: str = "auto"
    scores: ScoreSpec = DEFAULT_SCORES
    keys_major: bool | None = None


DEFAULT_ATTENTION = AttentionSpec()


class LayerCache(NamedTuple):
    """One layer's view of its layer group's cache (a pytree): the group's stacked buffers
    k, v [Lg, B, Hkv, S, D] (arrays, or int8 or int4 entries:
    `dge_jax.runtime.quantized`) and pos [Lg, B, Hkv, S], the layer read (an int or a traced
    int32), the slot this step's entries go to (traced or not; decode and draft steps: the
    first of their T slots, `cached_attention`'s ``new``) and the layer's sliding window
    (traced; 0: global), None when no layer of the model slides."""

    k: Entries
    v: Entries
    pos: jax.Array
    layer: jax.Array | int = 0
    slot: jax.Array | int = 0
    window: jax.Array | int | None = None

    @classmethod
    def one(cls, k, v, pos, slot=0, window=None) -> LayerCache:
        """A single layer k, v [B, Hkv, S, D] (arrays or int8 entries), pos [B, Hkv, S] as a
        group of one."""
        one = functools.partial(jax.tree.map, lambda x: x[None])
        return cls(one(k), one(v), pos[None], 0, slot, window)

    def stored(self, name: str) -> Entries:
        """Layer `layer`'s stored keys ("k") or values ("v") [B, Hkv, S, D], as stored."""
        return jax.tree.map(lambda x: x[self.layer], getattr(self, name))

    def read(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Layer `layer`'s k, v [B, Hkv, S, D] as attention reads them (dequantized) and its
        slot positions [B, Hkv, S]."""
        return dequantize(self.stored("k")), dequantize(self.stored("v")), self.pos[self.layer]


class NewEntries(NamedTuple):
    """A step's own entries, not yet in the cache: k, v [B, Hkv, T, D] (post-RoPE) and their
    positions [B, Hkv, T]."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array


class Tiles(NamedTuple):
    """The Pallas kernels' static tiling (`flash.flash_attention`, `flash_decode`): row and
    key tile sizes (multiples of 128; shrunk to the padded T / S when larger), interpret
    (None: Mosaic when compiled for TPU, interpret mode elsewhere; True / False force it),
    and slots_minor (the decode kernel reads k and v through their [.., D, S] view)."""

    block_q: int = 512
    block_k: int = 512
    interpret: bool | None = None
    slots_minor: bool = False


DEFAULT_TILES = Tiles()


def visible(slot_pos: jax.Array, query_pos: jax.Array, window: jax.Array | int | None) -> jax.Array:
    """Which slots a query sees: 0 <= slot pos <= query pos, and on a sliding layer (window >
    0) only the last `window` positions, query pos - slot pos < window (transformers'
    sliding mask: a window of 4 shows the query and the 3 keys before it). Arrays broadcast;
    window None (no layer of the model slides) or 0 (a global layer) adds nothing."""
    mask = (slot_pos >= 0) & (slot_pos <= query_pos)
    if window is None:
        return mask
    return mask & ((window <= 0) | (query_pos - slot_pos < window))


def cached_attention(
    q: jax.Array,
    query_pos: jax.Array,
    cache: LayerCache,
    spec: AttentionSpec = DEFAULT_ATTENTION,
    new: NewEntries | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Softmax attention of q over the cache layer; returns (out, per-slot prob sums or None).

    q: [B, T, Hq, D]; query_pos: [B, T]; cache: the layer read (its k, v [B, Hkv, S, D] and
    slot positions [B, Hkv, S]) and its window (`visible`). out: [B, T, Hq, D] in q's dtype.
    probs sum (spec.record_attn, else None): [B, Hq, S] f32, the attention each slot got
    summed over the T queries (H2O's accumulated attention), padding queries contributing 0.
    Scores and softmax are f32 whatever the parameter dtype. spec.keys_major: K @ Q^T scores,
    not Q @ K^T (`AttentionSpec`); spec.scores: logit scale and soft cap.

    new: (k, v [B, Hkv, T, D], pos [B, Hkv, T]), this call's own entries, not yet written:
    the attention is the one the cache would give with them written at slots
    [cache.slot, cache.slot + T) (whatever those slots hold now is ignored), and the probs sum
    counts them there. Reading the cache before the write lets the write happen in place:
    when attention read the written buffer, XLA:CPU copied every batch-1 cache buffer
    several times per decode step.
    """
    k, v, slot_pos = cache.read()
    return_probs_sum, keys_major, new_slot = spec.record_attn, spec.keys_major, cache.slot
    window, scores_spec = cache.window, spec.scores
    b, t, hq, d = q.shape
    hkv, s_len = k.shape[1], k.shape[2]
    g = hq // hkv
    if keys_major is None:
        keys_major = g * t <= platform.current().keys_major_max_rows
    # Group the G query heads of each kv head into one [G*T] row block, so both products are
    # plain 4-D batched matmuls over (B, Hkv): XLA:CPU runs those several times faster than
    # the 5-D grouped einsum (benchmarks/RESULTS.md, "Measured design choices"). Row r is
    # query head r // T, query r % T, hence the tiled positions.
    qg = _group_queries(q, hkv)
    scale = scores_spec.scale_for(d)
    if keys_major:
        # Computed as [B, Hkv, S, G*T] and scaled there, then the small score array is
        # transposed to the common layout (scaled after the transpose instead, it ran as
        # slowly as the rows-major form on XLA:CPU: RESULTS.md, "Measured design choices").
        scores = jnp.einsum("bksd,bkrd->bksr", k, qg, preferred_element_type=jnp.float32)
        scores = (scores * scale).transpose(0, 1, 3, 2)
    else:
        scores = jnp.einsum("bkrd,bksd->bkrs", qg, k, preferred_element_type=jnp.float32)
        scores = scores * scale
    # [B, Hkv, G*T, S]; slot visible iff 0 <= its pos <= the row's query pos (dge_jax.runtime.cache)
    row_pos = jnp.tile(query_pos, (1, g))[:, None, :, None]
    if new is not None:
        # The slots the new entries will take are read as empty; the new entries' scores
        # [B, Hkv, G*T, T] go after the S cached ones, so one softmax covers both.
        k_new, v_new, pos_new = new
        t_new = k_new.shape[2]
        taken = (jnp.arange(s_len) >= new_slot) & (jnp.arange(s_len) < new_slot + t_new)
        slot_pos = jnp.where(taken, -1, slot_pos)
        new_scores = jnp.einsum("bkrd,bktd->bkrt", qg, k_new, preferred_element_type=jnp.float32)
        scores = jnp.concatenate([scores, new_scores * scale], axis=-1)
        slot_pos = jnp.concatenate([slot_pos, pos_new], axis=-1)
    mask = visible(slot_pos[:, :, None, :], row_pos, window)
    scores = jnp.where(mask, scores_spec.cap(scores), _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    if return_probs_sum:
        probs = probs * mask  # padding queries (all slots masked) contribute nothing
    out = jnp.einsum("bkrs,bksd->bkrd", probs[..., :s_len].astype(v.dtype), v)
    if new is not None:
        out = out + jnp.einsum("bkrt,bktd->bkrd", probs[..., s_len:].astype(v.dtype), v_new)
    out = out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)
    if not return_probs_sum:
        return out, None
    sums = probs.reshape(b, hkv, g, t, -1).sum(axis=3).reshape(b, hq, -1)
    if new is None:
        return out, sums
    # The new entries' sums go to their slots (read as empty above, so those hold 0).
    return out, jax.lax.dynamic_update_slice_in_dim(
        sums[..., :s_len], sums[..., s_len:], new_slot, axis=2
    )


def _slots(x: Entries, start: jax.Array, size: int) -> Entries:
    """Slots [start, start + size) of stored entries [B, Hkv, S, D] (and their scales)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=2), x)


def _group_queries(q: jax.Array, hkv: int) -> jax.Array:
    """[B, T, Hq, D] -> [B, Hkv, G*T, D]: row r of a kv head's block is query head r // T,
    query r % T (the layout `cached_attention` uses; see there)."""
    b, t, hq, d = q.shape
    g = hq // hkv
    return q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)


def written_slot_attention(
    q: jax.Array,
    query_pos: jax.Array,
    cache: LayerCache,
    num_slots: jax.Array | int,
    spec: AttentionSpec,
) -> tuple[jax.Array, jax.Array | None]:
    """`cached_attention` over slots [0, num_slots) only, in key blocks with an online softmax.

    The cache is written front to back, so no slot at or past `num_slots` (the traced write
    index after this call's tokens) is visible to anyone. A prefill chunk i then reads
    (i + 1) blocks instead of the whole capacity, about half the FLOPs of a causal prompt,
    and its score tiles are [G*T, block] instead of [G*T, S] (they stay in cache memory).

    Same arguments and results as `cached_attention`, up to float summation order (no
    ``new``: the chunk's entries are written). Blocks of block = spec.key_block slots: block j
    covers slots [j*block, (j+1)*block); the last one is clamped to end at S, and its slots
    that an earlier block already covered are masked out, so any S works.
    """
    # Read block by block, each dequantized where it is used (an int8 layer is never
    # materialised whole in the activation dtype; an int4 layer is, as its key groups and
    # residual block need not align with the key blocks).
    k, v = (movable(cache.stored(name)) for name in ("k", "v"))
    slot_pos = cache.pos[cache.layer]
    block, return_probs_sum = spec.key_block, spec.record_attn
    window, scores_spec = cache.window, spec.scores
    b, t, hq, d = q.shape
    hkv, s_len, dtype = k.shape[1], k.shape[2], k.dtype
    g = hq // hkv
    block = min(block, s_len)
    qg = _group_queries(q, hkv) * jnp.asarray(scores_spec.scale_for(d), q.dtype)
    row_pos = jnp.tile(query_pos, (1, g))[:, None, :, None]  # [B, 1, G*T, 1]
    num_blocks = (num_slots + block - 1) // block

    def scores_of(j):
        """Block j's start, masked scores [B, Hkv, G*T, block] f32 and mask."""
        start = jnp.minimum(j * block, s_len - block)
        kb = dequantize(_slots(k, start, block))
        pb = jax.lax.dynamic_slice_in_dim(slot_pos, start, block, axis=2)[:, :, None, :]
        fresh = start + jnp.arange(block) >= j * block  # not already seen by block j - 1
        mask = visible(pb, row_pos, window) & fresh
        s = jnp.einsum("bkqd,bksd->bkqs", qg, kb, preferred_element_type=jnp.float32)
        return start, jnp.where(mask, scores_spec.cap(s), _MASKED), mask

    def online(j, carry):
        # Running max m, normaliser norm and unnormalised output acc: rescaled by exp(m - m_new)
        # whenever a block raises the max. A row whose blocks are all masked so far holds
        # m = _MASKED and p = 1 per slot (the dense version's uniform row); its first visible
        # slot resets it, as exp(_MASKED - m_new) = 0.
        m, norm, acc = carry
        start, s, _ = scores_of(j)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        scale = jnp.exp(m - m_new)
        vb = dequantize(_slots(v, start, block))
        pv = jnp.einsum("bkqs,bksd->bkqd", p.astype(dtype), vb,
                        preferred_element_type=jnp.float32)  # fmt: skip
        return m_new, norm * scale + p.sum(axis=-1), acc * scale[..., None] + pv

    rows = (b, hkv, g * t)
    init = (jnp.full(rows, _MASKED, jnp.float32), jnp.zeros(rows, jnp.float32),
            jnp.zeros((*rows, d), jnp.float32))  # fmt: skip
    m, norm, acc = jax.lax.fori_loop(0, num_blocks, online, init)
    out = (acc / norm[..., None]).astype(dtype)
    out = out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)
    if not return_probs_sum:
        return out, None

    def probs_sum(j, total):
        # Second pass with the final (m, norm): each block's normalised probabilities, summed
        # over the T queries; padding queries (every slot masked) contribute nothing.
        start, s, mask = scores_of(j)
        p = jnp.exp(s - m[..., None]) / norm[..., None] * mask
        part = p.reshape(b, hkv, g, t, block).sum(axis=3).reshape(b, hq, block)
        return jax.lax.dynamic_update_slice_in_dim(
            total, jax.lax.dynamic_slice_in_dim(total, start, block, axis=2) + part, start, axis=2
        )

    total = jax.lax.fori_loop(0, num_blocks, probs_sum, jnp.zeros((b, hq, s_len), jnp.float32))
    return out, total
