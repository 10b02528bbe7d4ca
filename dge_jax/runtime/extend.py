"""Feeding tokens to a cache that already holds others: a shared context's questions.

`extend` writes a question (any number of tokens per row, left-padded among the batch with
position -1, so no query sees the padding) after what a compressed context cache holds, in
one prefill step, and returns the next-token logits; `with_room` appends the empty slots it
and the answer need. `dge_jax.generation.generate_for_contexts` is their user.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.distribution.multihost import fetch
from dge_jax.runtime.cache import KVCache, LayerGroup
from dge_jax.runtime.quantized import pad_slots

# Slots appended at a time (nearby question lengths share compilations).
ROOM_MULTIPLE = 64


class Question(NamedTuple):
    """What `extend` feeds (a pytree: one argument): tokens [B, Q] int32, left-padded among
    the batch, and their positions [B, Q] int32 (-1 on the padding)."""

    tokens: jax.Array
    positions: jax.Array


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "attention"))
def extend(
    forward, cfg, params, cache: KVCache, question: Question, *, attention: str = "auto"
) -> tuple[jax.Array, KVCache]:
    """(next-token logits [B, V] f32, the cache with the question's tokens written): its
    tokens [B, Q] fed in one prefill step after what the cache holds, at its positions
    [B, Q] (-1 on left padding). The cache needs Q free slots after each layer's write
    index (`with_room`). attention: the step's implementation (`platform.ATTENTION`)."""
    tokens, positions = question
    out = forward(cfg, params, tokens, positions, cache, key_block=tokens.shape[1],
                  attention=attention)  # fmt: skip
    return out.logits, out.cache


def with_room(cache: KVCache, slots: int) -> KVCache:
    """`cache` with at least `slots` free slots after each group's write index (empty slots
    appended, a multiple of `ROOM_MULTIPLE`, so nearby sizes share compilations)."""
    groups = []
    for g in cache.groups:
        short = int(np.max(fetch(g.index))) + slots - g.capacity
        if short <= 0:
            groups.append(g)
            continue
        pad = -(-short // ROOM_MULTIPLE) * ROOM_MULTIPLE
        widths = ((0, 0),) * 3 + ((0, pad),)
        k, v = pad_slots(g.k, pad), pad_slots(g.v, pad)
        pos = jnp.pad(g.pos, widths, constant_values=-1)
        groups.append(LayerGroup(k=k, v=v, pos=pos, index=g.index))
    return KVCache(tuple(groups))
