"""Score operations rules share: GQA aggregation, window attention, pooling, and which
slots hold prompt entries.

Shapes: cache ``k: [L, B, Hkv, S, D]``, ``pos: [L, B, Hkv, S]``; ``obs.q: [L, B, Hq, W, D]``,
``obs.q_pos: [B, W]``. GQA: query head h belongs to kv head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dge_jax.rules.base import check_choice, require_obs
from dge_jax.runtime import platform
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.compaction import INT32_MAX
from dge_jax.runtime.quantized import (
    Entries,
    Int4Entries,
    dequantize,
    dequantize_slots,
    int4_tail,
    over_pieces,
)
from dge_jax.runtime.records import Observation

GQA = ("mean", "max")
POOLING = ("max", "avg")


def group_heads(x: jax.Array, num_kv_heads: int, axis: int) -> jax.Array:
    """Split query-head axis ``axis`` (size Hq) into [Hkv, G]: head h -> (h // G, h % G)."""
    hq = x.shape[axis]
    if hq % num_kv_heads:
        raise ValueError(f"{hq} query heads do not split into {num_kv_heads} kv heads")
    return x.reshape(x.shape[:axis] + (num_kv_heads, hq // num_kv_heads) + x.shape[axis + 1 :])


def reduce(x: jax.Array, axis: int, how: str) -> jax.Array:
    """Mean or max of ``x`` over ``axis`` (``how``: "mean" or "max")."""
    return jnp.mean(x, axis=axis) if how == "mean" else jnp.max(x, axis=axis)


def gqa_aggregate(x: jax.Array, num_kv_heads: int, how: str = "mean") -> jax.Array:
    """Per-kv-head scores [L, B, Hkv, S] from per-query-head ones [L, B, Hq, S].

    A kv head's entries serve its whole query group, so its score is the group's mean or max.
    """
    check_choice("gqa", how, GQA)
    return reduce(group_heads(x, num_kv_heads, axis=2), axis=3, how=how)


def first_query_pos(q_pos: jax.Array) -> jax.Array:
    """[B] int32: each row's earliest observed query position (int32 max if none)."""
    return jnp.min(jnp.where(q_pos >= 0, q_pos, INT32_MAX), axis=-1)


def window_attention_sum(
    k: Entries, pos: jax.Array, q: jax.Array, q_pos: jax.Array, weight: jax.Array,
    pieces: int | None = None,
) -> jax.Array:
    """Weighted sum over observed queries of their softmax attention to one layer's cache.

    k: [B, Hkv, S, D] as stored (read dequantized), pos: [B, Hkv, S], q: [B, Hq, W, D], q_pos:
    [B, W], weight: [B, W] f32 -> [B, Hkv, G, S] f32, sum_w weight[w] * softmax_s(q[w] . k[s]
    / sqrt(D)). Causal per query (``0 <= pos <= q_pos``); a query slot with q_pos = -1 adds
    nothing. An int4 layer is read in `pieces` pieces of slots (None: the platform's,
    `Backend.int4_pieces`; `_int4_window_sum`), else whole.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[-1]
    qg = group_heads(q.astype(jnp.float32), num_kv_heads, axis=1)  # [B, Hkv, G, W, D]
    query_pos = q_pos[:, None, None, :, None]

    def logits(keys: jax.Array, key_pos: jax.Array) -> jax.Array:
        """[B, Hkv, G, W, S'] f32 over keys [B, Hkv, S', D] at key_pos [B, Hkv, S'], -inf
        where the slot holds no token at or before the (existing) query."""
        x = jnp.einsum("bhgwd,bhsd->bhgws", qg, keys.astype(jnp.float32)) / math.sqrt(head_dim)
        kp = key_pos[:, :, None, None, :]
        return jnp.where((kp >= 0) & (kp <= query_pos) & (query_pos >= 0), x, -jnp.inf)

    pieces = platform.current().int4_pieces if pieces is None else pieces
    if isinstance(k, Int4Entries) and pieces > 1:
        return _int4_window_sum(k, pos, logits, weight, qg.shape[:-1], pieces)
    scores = logits(dequantize(k), pos)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)  # fully masked rows: avoid inf - inf
    unnormalised = jnp.exp(scores - peak)  # masked slots: exp(-inf) = 0
    total = jnp.sum(unnormalised, axis=-1)  # [B, Hkv, G, W]
    # Each query's 1 / total folds into its weight, so the [.., W, S] probabilities are never
    # written out: one pass fewer over the largest array of a scoring (faster on CPU:
    # benchmarks/RESULTS.md, "Measured design choices").
    coef = jnp.where(total > 0, weight[:, None, None, :] / jnp.where(total > 0, total, 1.0), 0.0)
    return jnp.einsum("bhgws,bhgw->bhgs", unnormalised, coef)


def _int4_window_sum(k: Int4Entries, pos: jax.Array, logits, weight: jax.Array,
                     shape: tuple[int, ...], pieces: int) -> jax.Array:  # fmt: skip
    """`window_attention_sum` over an int4 layer, read a piece of slots at a time
    (`quantized.over_pieces`, as the kernels read it) in two passes: each query's max and
    normaliser (online, as the kernels join key tiles), then each piece's weighted
    probabilities into the [B, Hkv, G, S] result (shape: [B, Hkv, G, W]). Neither the
    dequantized layer nor its [B, Hkv, G, W, S] logits are ever whole: dequantized whole,
    the layer's unpacking left whole-layer temporaries, and the logits were a selection's
    largest one (compiled for v5e, benchmarks/RESULTS.md, "An int4 cache"). Equal to the
    whole computation up to the normaliser's summation order."""
    slots = k.shape[-2]

    def stats(keys, key_pos, carry):
        m, total = carry  # running max (finite: -1e30 until a slot is seen) and normaliser
        s = logits(keys, key_pos)
        m_new = jnp.maximum(m, s.max(axis=-1))
        return m_new, total * jnp.exp(m - m_new) + jnp.exp(s - m_new[..., None]).sum(axis=-1)

    def stats_piece(start, size, seen, carry):  # slots the piece before read: hidden (-1)
        key_pos = jax.lax.dynamic_slice_in_dim(pos, start, size, axis=2)
        return stats(dequantize_slots(k, start, size), jnp.where(seen, -1, key_pos), carry)

    carry = (jnp.full(shape, -1e30, jnp.float32), jnp.zeros(shape, jnp.float32))
    m, total = over_pieces(slots, k.residual, pieces, stats_piece,
                           lambda n, c: stats(int4_tail(k), pos[..., n:], c), carry)  # fmt: skip
    coef = jnp.where(total > 0, weight[:, None, None, :] / jnp.where(total > 0, total, 1.0), 0.0)

    def write(keys, key_pos, start, out):  # [B, Hkv, G, S'] written at its slots
        weighted = jnp.einsum("bhgws,bhgw->bhgs",
                              jnp.exp(logits(keys, key_pos) - m[..., None]), coef)  # fmt: skip
        return jax.lax.dynamic_update_slice_in_dim(out, weighted, start, axis=3)

    def write_piece(start, size, seen, out):  # a slot read twice is rewritten with its value
        key_pos = jax.lax.dynamic_slice_in_dim(pos, start, size, axis=2)
        return write(dequantize_slots(k, start, size), key_pos, start, out)

    out = jnp.zeros((*shape[:-1], slots), jnp.float32)
    return over_pieces(slots, k.residual, pieces, write_piece,
                       lambda n, o: write(int4_tail(k), pos[..., n:], n, o), out)  # fmt: skip


def pool1d(x: jax.Array, include: jax.Array, kernel: int, how: str) -> jax.Array:
    """Same-length 1-D pooling along the last axis where only ``include``d slots carry values.

    x: [..., S] f32, include: [..., S] bool -> [..., S] f32.

    Excluded slots (empty, protected) and the borders act as padding: zeros counted in the
    divisor for ``avg`` (torch ``avg_pool1d`` with count_include_pad), absent for ``max``.
    """
    # x: [..., S] f32, include: [..., S] bool -> [..., S]. kernel odd, half = kernel // 2.
    # Worked example, avg, kernel 3, slots [pad, 0, 1, 2, win] with attention [-, .2, .4, .6, -]
    # (slot 0 left padding, slot 4 the protected window): slot 1 -> (0 + .2 + .4) / 3,
    # slot 3 -> (.4 + .6 + 0) / 3. The window's own (large) attention never leaks into slot 3,
    # matching kvpress/KVCache-Factory, which cut the window off before pooling.
    check_choice("pooling", how, POOLING)
    if kernel % 2 != 1:
        raise ValueError(f"pooling kernel must be odd, got {kernel}")
    if kernel == 1:
        return jnp.where(include, x, 0.0 if how == "avg" else -jnp.inf)
    half = kernel // 2
    fill = 0.0 if how == "avg" else -jnp.inf
    padded = jnp.pad(
        jnp.where(include, x, fill), [(0, 0)] * (x.ndim - 1) + [(half, half)], constant_values=fill
    )
    length = x.shape[-1]
    windows = [padded[..., o : o + length] for o in range(kernel)]
    if how == "avg":
        return sum(windows[1:], windows[0]) / kernel
    return jnp.max(jnp.stack(windows), axis=0)


def prompt_entries(cache: KVCache, obs: Observation) -> jax.Array:
    """[L, B, Hkv, S] bool: valid slots holding a prompt token (not a draft)."""
    require_obs(obs, "prompt_end")
    return (cache.pos >= 0) & (cache.pos <= obs.prompt_end[None, :, None, None])
