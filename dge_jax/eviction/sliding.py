"""What eviction does on a model's sliding-window layers (Gemma 2/3, Mistral v0.1, Phi-3).

The rule's budget applies to the global layers only. A sliding layer keeps exactly the
entries its window will still show a later query, whatever the budget: the next query is at
each row's last written position + 1, so an entry at position p stays visible iff
p >= next - window + 1. Older entries no query can see again (keeping them only costs
memory); evicting a newer one would change the model's answer. So a budget smaller than the
window does not shrink a sliding layer, and compacted (`evict.apply_eviction`) its capacity
follows its window. The global head-budget allocator pools over the global layers' heads
only; AdaKV pools within each layer, so its global layers are unchanged; a layer schedule
(PyramidKV's budgets falling with depth) runs over the global layers, bottom to top.

`Eviction(sliding="evict")` holds the sliding layers to the budget too: the rule ranks the
entries their window still shows (older ones are never candidates), every allocator and
schedule then spans every layer as on a model without windows.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from dge_jax.eviction.observation import layers_of
from dge_jax.runtime.cache import KVCache, group_bounds
from dge_jax.runtime.records import Observation


def window_keep(
    cache: KVCache, windows: tuple[int, ...], context_end: jax.Array | None = None
) -> tuple[jax.Array, jax.Array] | tuple[None, None]:
    """(keep [L, B, Hkv, S], sliding [L, 1, 1, 1]): on each sliding layer the entries a later
    query can still see; (None, None) when no layer slides. windows: the model's
    `ModelConfig.layer_windows` (0: a global layer). S: the largest layer's slots
    (`KVCache.padded_pos`). context_end [B]: the next query follows it (a shared context's
    question is fed after eviction), not the last written position."""
    if not any(windows):
        return None, None
    pos = cache.padded_pos()
    window = jnp.asarray(windows, jnp.int32)[:, None, None, None]  # [L, 1, 1, 1]
    # Each row's next query position: its last written position + 1 (every layer holds it).
    next_pos = jnp.max(pos, axis=(0, 2, 3)) + 1 if context_end is None else context_end + 1
    keep = (pos >= 0) & (pos >= next_pos[None, :, None, None] - window + 1)
    return keep, window > 0


def global_pool(budget: jax.Array | int, sliding: jax.Array, num_layers: int) -> jax.Array:
    """`budget` ([], [L] or [L, Hkv]) with the sliding layers' budgets 0: the global
    allocator's pool is then the global layers' budgets only."""
    budget = jnp.asarray(budget)
    shape = (num_layers, *budget.shape[1:]) if budget.ndim else (num_layers,)
    budget = jnp.broadcast_to(budget, shape)
    return jnp.where(sliding.reshape(num_layers, *(1,) * (budget.ndim - 1)), 0, budget)


def scheduled_over_global_layers(schedule, budget: jax.Array | int, windows: tuple[int, ...]):
    """[L] budgets: `schedule.layer_budgets` over the global layers only, in their order (a
    sliding layer's entry is the plain budget, unused: it keeps its window)."""
    global_layers = [i for i, w in enumerate(windows) if not w]
    budget = jnp.asarray(budget, jnp.int32)
    per_layer = jnp.broadcast_to(budget, (len(windows),))
    if not global_layers:
        return per_layer
    on_global = schedule.layer_budgets(budget, len(global_layers))
    return per_layer.at[jnp.asarray(global_layers)].set(on_global)


def by_group(
    cache: KVCache, obs: Observation, windows: tuple[int, ...], evict_sliding: bool, fn
) -> jax.Array:
    """[L, B, Hkv, S] f32: ``fn(cache, obs, first, stop)`` (a rule's scores, or its re-ranked
    scores, of layers [first, stop)). On a cache whose sliding layers hold only their window
    (`dge_jax.runtime.window_cache`), fn sees each group of full-length layers on its own
    (with its layers of ``obs``), and a bounded sliding group scores -inf: it keeps its
    window whatever it scores (`window_keep`). windows: the model's layer windows;
    evict_sliding: `Eviction.sliding` == "evict", which needs one capacity."""
    if not cache.ragged:
        return fn(cache, obs, 0, cache.num_layers)
    if not any(windows) or evict_sliding:
        raise ValueError(
            f"a cache whose layers differ in capacity ({cache.capacities}) is scored only in "
            "the bounded layout of sliding layers under Eviction(sliding='window'); score a "
            "cache of one capacity (GenerationConfig(sliding_cache='full'))"
        )
    full, parts = cache.capacity, []
    bounds = itertools.pairwise(group_bounds(cache.group_sizes))
    for group, (a, b) in zip(cache.groups, bounds, strict=True):
        if group.capacity == full:
            parts.append(fn(KVCache((group,)), layers_of(obs, a, b), a, b))
            continue
        if not all(windows[a:b]):
            raise ValueError(f"layers {a}..{b - 1} hold fewer slots ({group.capacity}) than "
                             f"the cache ({full}) but do not all slide: {windows[a:b]}")
        parts.append(jnp.full((b - a, *group.pos.shape[1:-1], full), -jnp.inf, jnp.float32))
    return jnp.concatenate(parts)
