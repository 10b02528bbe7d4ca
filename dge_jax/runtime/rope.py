"""Rotary position embeddings, split-halves layout (Hugging Face's `rotate_half`), f32 tables."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.config import ConfigError, RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """[head_dim // 2] f32 inverse frequencies, after the configured scaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.kind == "default":
        return inv_freq
    if rope.kind == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones untouched, and the
        # band between is interpolated smoothly in 1/wavelength.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ConfigError(f"unsupported rope type {rope.kind!r}: use default, linear or llama3")


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin: [B, T, head_dim] f32 for integer `positions` [B, T] (negative = padding)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE's rotation in the split-halves layout on the last axis: x * cos +
    rotate_half(x) * sin, with cos, sin broadcast against x ([..., D]), in x's dtype.

    Also what rotates query statistics to future positions (ExpectedAttention) and draft
    queries back to pre-RoPE (``sin`` negated: R(p)^T)."""
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x: [B, T, H, D] by cos/sin [B, T, D]; math in f32, result in x's dtype."""
    out = rotate(x.astype(jnp.float32), cos[:, :, None, :], sin[:, :, None, :])
    return out.astype(x.dtype)
