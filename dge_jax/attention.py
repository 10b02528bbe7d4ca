"""Attention of new queries over one layer of the padded cache, masked by slot positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite stand-in for -inf: a query whose every slot is masked (a padding query) then gets a
# uniform, finite distribution that `probs * mask` turns into zeros, instead of NaNs.
_MASKED = -1e30


def slot_mask(slot_pos: jax.Array, query_pos: jax.Array) -> jax.Array:
    """[B, Hkv, T, S] bool: slot s is visible to query t iff 0 <= pos[s] <= query_pos[t].

    slot_pos: [B, Hkv, S] int32; query_pos: [B, T] int32 (-1 for padding queries, which see
    nothing). One rule covers padding, eviction and causality (see `dge_jax.cache`).
    """
    sp = slot_pos[:, :, None, :]
    qp = query_pos[:, None, :, None]
    return (sp >= 0) & (sp <= qp)


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_pos: jax.Array,
    query_pos: jax.Array,
    *,
    return_probs_sum: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Softmax attention of q over the cache layer; returns (out, per-slot prob sums or None).

    q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; slot_pos: [B, Hkv, S]; query_pos: [B, T].
    out: [B, T, Hq, D] in q's dtype. probs sum: [B, Hq, S] f32, the attention each slot got
    summed over the T queries (H2O's accumulated attention), padding queries contributing 0.
    Scores and softmax are f32 whatever the parameter dtype.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s_len = k.shape[2]
    # Group the G query heads of each kv head into one [G*T] row block, so both products are
    # plain 4-D batched matmuls over (B, Hkv): XLA:CPU runs those ~4x faster than the 5-D
    # grouped einsum. Row r of a block is query head r // T, query r % T.
    qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    scores = jnp.einsum("bkqd,bksd->bkqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, hkv, g, t, s_len) * (d**-0.5)
    mask = slot_mask(slot_pos, query_pos)[:, :, None, :, :]  # [B, Hkv, 1, T, S]
    scores = jnp.where(mask, scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    if return_probs_sum:
        probs = probs * mask  # padding queries (all slots masked) contribute nothing
    out = jnp.einsum("bkqs,bksd->bkqd", probs.reshape(b, hkv, g * t, s_len).astype(v.dtype), v)
    out = out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)
    probs_sum = probs.sum(axis=3).reshape(b, hq, s_len) if return_probs_sum else None
    return out, probs_sum
