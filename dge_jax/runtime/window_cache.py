"""Sliding-window layers that hold their window, not the prompt: the bounded layout.

A sliding layer (window W: a query at position p sees positions p - W + 1 .. p) never needs
more than the last W - 1 entries before a step's T new tokens. In the bounded layout its layer
group gets ``W + chunk`` slots (`layer_capacities`), not the prompt's length, so a 32k-token
Gemma 3 prompt holds 32k entries only in its global layers. Before a step writes its T tokens
into a sliding group that has no room left, `make_room` moves the group's last W - 1 written
slots to the front and empties the rest: slots stay in position order (compaction, rewinding
and every rule read them as in any other cache) and the entries dropped are exactly the ones
no later query can see. Worked example, W = 4, 7 slots, a 3-token step at index 7:

    slot:       0  1  2  3  4  5  6          slot:  0  1  2  3  4  5  6
    pos:        0  1  2  3  4  5  6    ->    pos:   4  5  6  7  8  9 -1    index 3 -> 6
                                                    (kept)  (new step)

The queries at 7, 8, 9 see 4..7, 5..8, 6..9: all still there. A step needs
``T <= capacity - (W - 1)``; prefill steps of at most ``chunk`` tokens and one-token draft and
decode steps meet it by construction. The move copies the group once every
``capacity - W + 1`` steps at most, under a `lax.cond`, so decoding pays it rarely.

An int4 cache's moved entries are requantized in their new key groups and residual block
(`quantized.map_slots`), so any capacity works, at the price of requantizing the window at
each move (rare while decoding, once per prefill step past the first W + chunk tokens).

In the full layout (every layer of prompt length, `GenerationConfig(sliding_cache="full")`)
`make_room` never fires: no step outgrows a cache sized for the prompt and every new token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dge_jax.runtime.cache import LayerGroup
from dge_jax.runtime.quantized import map_slots

LAYOUTS = ("auto", "bounded", "full")


def layer_capacities(windows: tuple[int, ...], capacity: int, chunk: int) -> int | tuple[int, ...]:
    """Each layer's slots in the bounded layout: a global layer (window 0) ``capacity``, a
    sliding one ``min(capacity, window + chunk)``; one int when all are equal."""
    caps = tuple(capacity if not w else min(capacity, int(w) + int(chunk)) for w in windows)
    return caps if len(set(caps)) > 1 else capacity


def make_room(group: LayerGroup, window: int, t: int) -> LayerGroup:
    """``group`` (sliding layers of one window) ready for a step of ``t`` tokens: where a
    layer's next slot + t would pass its capacity, its last ``window - 1`` written slots move
    to the front and the rest are emptied (module docstring). A no-op otherwise."""
    cap, keep = group.capacity, window - 1
    if keep + t > cap:  # only a full-layout cache is this small, and it never overflows
        return group

    def move(group: LayerGroup) -> LayerGroup:
        full = group.index + t > cap  # [Lg]
        shift = jnp.where(full, group.index - keep, 0)  # [Lg] slots dropped at the front
        # Slot s takes slot s + shift (clamped; those past the kept ones are emptied below).
        src = jnp.minimum(jnp.arange(cap)[None, :] + shift[:, None], cap - 1)  # [Lg, S]
        index = group.index - shift
        emptied = jnp.arange(cap)[None, :] >= index[:, None]  # [Lg, S]

        def take(x):
            at = src.reshape(src.shape[0], 1, 1, cap, *(1,) * (x.ndim - 4))
            return jnp.take_along_axis(x, at, axis=3)

        pos = jnp.where(emptied[:, None, None, :], -1, take(group.pos))
        # an int8 cache's scales move alike; an int4 cache's entries requantized (`map_slots`)
        k, v = (map_slots(take, x, index) for x in (group.k, group.v))
        return dataclasses.replace(group, k=k, v=v, pos=pos, index=index)

    return jax.lax.cond(jnp.any(group.index + t > cap), move, lambda g: g, group)


def join_layers(*parts: jax.Array) -> jax.Array:
    """Per-group values [Lg, ...] joined on the layer axis; a group's value with fewer slots
    than another's (per-slot attention sums of a bounded sliding group) is padded with zeros
    at the end of each shorter axis. Never read: a bounded sliding layer keeps its window
    whatever its scores (`dge_jax.eviction.sliding`)."""
    if len({p.shape[1:] for p in parts}) == 1:
        return jnp.concatenate(parts)
    tail = tuple(max(sizes) for sizes in zip(*(p.shape[1:] for p in parts), strict=True))
    padded = [jnp.pad(p, ((0, 0),) + tuple((0, n - m) for n, m in zip(tail, p.shape[1:],
              strict=True))) for p in parts]  # fmt: skip
    return jnp.concatenate(padded)
