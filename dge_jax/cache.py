"""Static-shape padded KV cache and the observations that scoring rules read.

One layout for every stage (DESIGN §3):

    k, v : [L, B, Hkv, S, D]   keys stored after RoPE
    pos  : [L, B, Hkv, S]      original token position of each slot, -1 = empty
    index: []                  next slot to write (shared by all rows, layers and heads)

Compaction to per-layer capacities (`dge_jax.evict.compact` given one capacity per layer,
for budgets that differ by layer such as PyramidKV's) gives the per-layer form with layer i
holding S_i slots, and ``index`` [L]: layer i's next slot. Only the unrolled layer loop
reads that form; every forward writes layer i at ``index[i]`` when ``index`` has a layer axis.

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

    k: jax.Array  # [L, B, Hkv, S, D] (per-layer form: a tuple of L [B, Hkv, S, D])
    v: jax.Array  # [L, B, Hkv, S, D]
    pos: jax.Array  # [L, B, Hkv, S] int32, -1 = empty
    index: jax.Array  # [] int32, next slot to write; [L] with per-layer capacities

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """(B, Hkv, S, D) of one layer, static, in the stacked or per-layer form (the first
        layer's S when capacities differ by layer)."""
        return self.k[0].shape if isinstance(self.k, tuple) else self.k.shape[1:]

    @property
    def capacities(self) -> tuple[int, ...]:
        """Slots per head of each layer (S_i), static."""
        if isinstance(self.k, tuple):
            return tuple(k.shape[2] for k in self.k)
        return (self.k.shape[3],) * self.k.shape[0]

    @property
    def capacity(self) -> int:
        """Slots per head (S), static; the largest layer's when capacities differ by layer."""
        return max(self.capacities)

    @property
    def dtype(self) -> jnp.dtype:
        """dtype of the stored keys and values."""
        return (self.k[0] if isinstance(self.k, tuple) else self.k).dtype

    @property
    def ragged(self) -> bool:
        """True when layers hold different numbers of slots (per-layer form only)."""
        return len(set(self.capacities)) > 1

    @property
    def num_layers(self) -> int:
        """L, static."""
        return len(self.k) if isinstance(self.k, tuple) else self.k.shape[0]

    @property
    def batch_size(self) -> int:
        """B, static."""
        return self.layer_shape[0]

    def valid(self) -> jax.Array:
        """[L, B, Hkv, S] bool: slots holding a token (either form; not for ragged caches)."""
        if self.ragged:
            raise ValueError(
                f"valid() needs one capacity for all layers, got {self.capacities}; read the "
                "per-layer pos arrays (cache.pos[i] >= 0) of a cache with per-layer capacities"
            )
        pos = jnp.stack(self.pos) if isinstance(self.pos, tuple) else self.pos
        return pos >= 0

    def num_kept(self) -> jax.Array:
        """[L, B, Hkv] int32: occupied slots per head (either form, ragged too)."""
        if isinstance(self.pos, tuple):
            return jnp.stack([jnp.sum(p >= 0, axis=-1, dtype=jnp.int32) for p in self.pos])
        return jnp.sum(self.pos >= 0, axis=-1, dtype=jnp.int32)

    def nbytes(self) -> int:
        """Bytes held by the cache arrays (k, v and pos), in either form."""
        arrays = jax.tree.leaves((self.k, self.v, self.pos))
        return sum(int(x.size) * x.dtype.itemsize for x in arrays)


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


def split_layers(cache: KVCache) -> KVCache:
    """The cache with k, v and pos as tuples of per-layer arrays (k[i]: [B, Hkv, S, D]).

    A forward given this form runs its layers as a Python loop over separate buffers. The
    stacked layout makes XLA:CPU copy each layer's slice out of the [L, ...] array before
    attention reads it, every step; separate buffers are read in place (`decoding.decode`).
    Only forward passes take this form; `stack_layers` turns it back.
    """
    if isinstance(cache.k, tuple):
        return cache
    return KVCache(k=tuple(cache.k), v=tuple(cache.v), pos=tuple(cache.pos), index=cache.index)


def stack_layers(cache: KVCache) -> KVCache:
    """Inverse of `split_layers` (raises for a cache with per-layer capacities)."""
    if not isinstance(cache.k, tuple):
        return cache
    if cache.ragged:
        raise ValueError(
            f"cannot stack a cache whose layers hold different numbers of slots "
            f"{cache.capacities}; it stays in per-layer form (decode it with the unrolled "
            "layer loop)"
        )
    return KVCache(k=jnp.stack(cache.k), v=jnp.stack(cache.v), pos=jnp.stack(cache.pos),
                   index=cache.index)  # fmt: skip


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
