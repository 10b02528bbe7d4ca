"""Quantized cache entries: what an int8 KV cache stores, and how attention reads it back.

A layer group's keys or values ([Lg, B, Hkv, S, D]) are either a plain array of the
activation dtype ("none") or an `Int8Entries` ("int8"): symmetric int8 values with one scale
per token per kv head, the scheme of MaxText's int8 KV cache,

    scale[..., s, 0] = max_d |x[..., s, d]| * (1 / 127)  (f32, then the activation dtype)
    q[..., s, d]     = round(x[..., s, d] / scale)        (int8 in [-127, 127])
    x'[..., s, d]    = q[..., s, d] * scale[..., s, 0]    (`dequantize`)

so |x - x'| <= scale / 2 per element, plus the activation dtype's rounding of the product.

Both leaves keep the slot axis second to last (the scale's last axis has size 1), so every
operation that moves whole slots (a write at a slot, padding, a gather along the slots,
`jnp.where` on a per-slot mask, slicing, concatenation) is the same function of both leaves:
``jax.tree.map(f, entries)``, which for a plain array is ``f(entries)``. Selection and
compaction therefore move each entry's scale with it, and an entry is quantized exactly once,
when it is written: no eviction ever requantizes (kvpress's `QuantizedCache` does, after
every compression, because it rebuilds the cache from the kept dense values).

Every attention path reads the dequantized entries, its own step's new entries included (a
decode step's own key goes through the same round trip before it meets its query), so a
decode step equals a teacher-forced forward over the same quantized cache.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# The cache's storage choices (`GenerationConfig.kv_quant`, the CLI's and runner's --kv_quant).
KV_QUANTS = ("none", "int8")
INT8_MAX = 127


class Int8Entries(NamedTuple):
    """Keys or values stored as int8 with one scale per token per kv head (module docstring):
    q [..., S, D] int8, scale [..., S, 1] in the activation dtype."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The entries' shape [..., S, D] (what a plain array of them would have)."""
        return self.q.shape

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype the entries are read in (the activation dtype)."""
        return self.scale.dtype


Entries = jax.Array | Int8Entries


def quantize_int8(x: jax.Array, dtype: jnp.dtype | None = None) -> Int8Entries:
    """x [..., D] -> `Int8Entries` with scales [..., 1] of `dtype` (default x's).

    The scale is rounded to its dtype before dividing, so `dequantize` multiplies by the very
    scale the values were divided by; an all-zero row gets scale 0 and q 0."""
    dtype = jnp.dtype(dtype or x.dtype)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    # times the f32 reciprocal, as XLA computes a division by a constant anyway
    scale = (amax * jnp.float32(1 / INT8_MAX)).astype(dtype)
    safe = jnp.where(scale == 0, 1, scale).astype(jnp.float32)
    q = jnp.clip(jnp.round(x32 / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return Int8Entries(q=q, scale=scale)


def dequantize(entries: Entries) -> jax.Array:
    """What attention reads: a plain array as it is, int8 entries as q * scale in the
    activation dtype (the one product every path computes, so they agree to the bit)."""
    if isinstance(entries, Int8Entries):
        return entries.q.astype(entries.scale.dtype) * entries.scale
    return entries


def store_like(stored: Entries, new: jax.Array) -> Entries:
    """`new` [..., D] in the form of `stored` (cast to its dtype, or quantized like it): what
    a write puts into a cache holding `stored`."""
    if isinstance(stored, Int8Entries):
        return quantize_int8(new, stored.dtype)
    return new.astype(stored.dtype)


def round_trip(stored: Entries, new: jax.Array) -> jax.Array:
    """`new` as attention will read it once written into a cache holding `stored`: itself
    for a plain cache, quantized and dequantized for an int8 one."""
    if isinstance(stored, Int8Entries):
        return dequantize(quantize_int8(new, stored.dtype)).astype(new.dtype)
    return new


def empty_entries(shape: tuple[int, ...], dtype: jnp.dtype, kv_quant: str) -> Entries:
    """Zeros of `shape` [..., S, D] stored as `kv_quant` asks, read in `dtype`."""
    check_kv_quant(kv_quant)
    if kv_quant == "int8":
        return Int8Entries(q=jnp.zeros(shape, jnp.int8), scale=jnp.zeros((*shape[:-1], 1), dtype))
    return jnp.zeros(shape, dtype)


def kv_quant_of(entries: Entries) -> str:
    """Which of `KV_QUANTS` `entries` are stored as."""
    return "int8" if isinstance(entries, Int8Entries) else "none"


def check_kv_quant(kv_quant: str) -> str:
    """`kv_quant` if it is one of `KV_QUANTS`, else a ValueError naming the choices."""
    if kv_quant not in KV_QUANTS:
        raise ValueError(f"kv_quant must be one of {KV_QUANTS}, got {kv_quant!r}")
    return kv_quant


def entries_nbytes(entries: Entries) -> int:
    """Bytes the stored entries hold (values and scales)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(entries))
