"""Static-shape padded KV cache and the observations that scoring rules read.

One layout for every stage (DESIGN §3):

    k, v : [L, B, Hkv, S, D]   keys stored after RoPE
    pos  : [L, B, Hkv, S]      original token position of each slot, -1 = empty
    index: []                  next slot to write (shared by all rows, layers and heads)

A query at position p may attend to slot s of its head iff ``0 <= pos[s] <= p``. That one
rule covers left padding (padded slots hold -1), eviction (evicted slots get -1) and
causality, so a masked cache, a compacted cache and a full cache all run the same code.

Worked example, 2-row batch, prompts of 3 and 5 tokens left-padded to 5 slots, then one
decode step writes slot 5 (``index`` was 5):

    slot:        0   1   2   3   4   5
    row 0 pos:  -1  -1   0   1   2   3
    row 1 pos:   0   1   2   3   4   5
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Padded per-head KV cache; see the module docstring for the layout."""

    k: jax.Array  # [L, B, Hkv, S, D]
    v: jax.Array  # [L, B, Hkv, S, D]
    pos: jax.Array  # [L, B, Hkv, S] int32, -1 = empty
    index: jax.Array  # [] int32, next slot to write

    @property
    def capacity(self) -> int:
        """Slots per head (S), static."""
        return self.k.shape[3]

    @property
    def num_layers(self) -> int:
        """L, static."""
        return self.k.shape[0]

    @property
    def batch_size(self) -> int:
        """B, static."""
        return self.k.shape[1]

    def valid(self) -> jax.Array:
        """[L, B, Hkv, S] bool: slots holding a token."""
        return self.pos >= 0

    def num_kept(self) -> jax.Array:
        """[L, B, Hkv] int32: occupied slots per head."""
        return jnp.sum(self.valid(), axis=-1, dtype=jnp.int32)

    def nbytes(self) -> int:
        """Bytes held by the cache arrays (k, v and pos)."""
        return sum(int(x.size) * x.dtype.itemsize for x in (self.k, self.v, self.pos))


def init_cache(
    num_layers: int,
    batch_size: int,
    num_kv_heads: int,
    capacity: int,
    head_dim: int,
    dtype: jnp.dtype = jnp.float32,
) -> KVCache:
    """An empty cache of static ``capacity`` slots per head.

    k, v: [L, B, Hkv, capacity, D] zeros of `dtype`; pos: [L, B, Hkv, capacity] int32 all -1;
    index: int32 scalar 0.
    """
    shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        pos=jnp.full(shape[:-1], -1, jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Observation:
    """What scoring rules may read besides the cache, recorded only when asked for.

    q      : [L, B, Hq, W, D]  the last W queries per layer (post-RoPE), oldest first; prompt
                               window first, then any draft queries appended after it.
    q_pos  : [B, W] int32      each query's position, -1 where the slot holds no query (a prompt
                               shorter than W, or a draft step masked out).
    attn_sum: [L, B, Hq, S] f32 or None  sum over every observed query of its softmax
                               attention to each slot (H2O's accumulated attention).
    is_draft: [W] bool          True for the queries appended by draft steps.
    prompt_end: [B] int32        position of each row's last prompt token, so that "recent"
                                 windows are measured in prompt positions whatever was drafted.
    q_weight: [B, W] f32 or None  each query's weight in the scores (None = all 1); DGE can
                                 weigh draft queries against prompt-window queries.
    """

    q: jax.Array | None
    q_pos: jax.Array | None
    attn_sum: jax.Array | None
    is_draft: jax.Array | None
    prompt_end: jax.Array | None = None
    q_weight: jax.Array | None = None
