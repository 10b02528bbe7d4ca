"""Rotary position embeddings, split-halves layout (Hugging Face's `rotate_half`), f32 tables.

LongRoPE (Phi-3-mini-128k, Phi-3.5) has two frequency sets. transformers picks one per forward
call from that call's sequence length, max(position_ids) + 1: the short factors while it is
at most `original_max_position_embeddings`, the long ones beyond (`longrope_frequency_update`),
and when generation first crosses that length its Phi-3 `prepare_inputs_for_generation` drops
the cache and runs the whole sequence again with the long factors. Here the caches have a
static shape and are never recomputed, so the rule is the per-call one: `rope_tables` picks by
the largest position of the call (the whole batch, as transformers' max over position_ids).
Identical to transformers whenever the prompt is prefilled in one chunk and generation stays
on one side of the boundary: a prompt longer than the original length is all long, a shorter
one all short. Differences, by design of a static cache: a prompt crossing the boundary and
prefilled in several chunks rotates its early chunks with the short factors, and a generation
that crosses it keeps the short-rotated keys it has (new tokens use the long factors).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.config import ConfigError, RopeConfig


@dataclasses.dataclass(frozen=True)
class LongRopeFrequencies:
    """LongRoPE's two sets of [head_dim // 2] f32 inverse frequencies: `short` for calls whose
    largest position is below `original`, `long` otherwise; cos and sin times `scale`."""

    short: np.ndarray
    long: np.ndarray
    original: int
    scale: float


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray | LongRopeFrequencies:
    """[head_dim // 2] f32 inverse frequencies, after the configured scaling (longrope: both
    sets, which `rope_tables` chooses between per call)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.kind == "longrope":
        # transformers: 1 / (ext_factors * base ** (arange(0, dim, 2) / dim)), in f32.
        base = (np.float32(rope.theta) ** exponents).astype(np.float32)
        for name in ("short_factor", "long_factor"):
            if len(getattr(rope, name)) != head_dim // 2:
                raise ConfigError(
                    f"longrope {name} has {len(getattr(rope, name))} entries, head_dim "
                    f"{head_dim} needs {head_dim // 2}"
                )
        short = np.asarray(rope.short_factor, np.float32) * base
        long = np.asarray(rope.long_factor, np.float32) * base
        return LongRopeFrequencies(
            short=(1.0 / short).astype(np.float32),
            long=(1.0 / long).astype(np.float32),
            original=rope.original_max_position_embeddings,
            scale=float(rope.attention_factor),
        )
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
    raise ConfigError(
        f"unsupported rope type {rope.kind!r}: use default, linear, llama3 or longrope"
    )


def fixed_frequencies(rope: RopeConfig, head_dim: int, what: str) -> np.ndarray:
    """`inverse_frequencies` for a reader that needs one fixed set (rotating recorded query
    statistics to other positions); LongRoPE, whose set depends on the call, is refused."""
    inv_freq = inverse_frequencies(rope, head_dim)
    if isinstance(inv_freq, LongRopeFrequencies):
        raise ConfigError(
            f"{what} rotates by one fixed set of RoPE frequencies, but this model's longrope "
            "switches between two by sequence length; not supported"
        )
    return inv_freq


def rope_tables(
    positions: jax.Array, inv_freq: np.ndarray | LongRopeFrequencies
) -> tuple[jax.Array, jax.Array]:
    """cos, sin: [B, T, head_dim] f32 for integer `positions` [B, T] (negative = padding).

    LongRoPE: the long set when the call's largest position + 1 exceeds the original length
    (the module docstring says why per call), and both tables times its scale."""
    scale = None
    if isinstance(inv_freq, LongRopeFrequencies):
        longer = jnp.max(positions) + 1 > inv_freq.original
        inv, scale = jnp.where(longer, inv_freq.long, inv_freq.short), inv_freq.scale
    else:
        inv = jnp.asarray(inv_freq)
    angles = positions.astype(jnp.float32)[..., None] * inv[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    if scale is None:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


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
