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

import jax
import jax.numpy as jnp

from dge_jax.runtime.cache import KVCache


def window_keep(
    cache: KVCache, windows: tuple[int, ...]
) -> tuple[jax.Array, jax.Array] | tuple[None, None]:
    """(keep [L, B, Hkv, S], sliding [L, 1, 1, 1]): on each sliding layer the entries a later
    query can still see; (None, None) when no layer slides. windows: the model's
    `ModelConfig.layer_windows` (0: a global layer)."""
    if not any(windows):
        return None, None
    pos = cache.pos
    window = jnp.asarray(windows, jnp.int32)[:, None, None, None]  # [L, 1, 1, 1]
    # Each row's next query position: its last written position + 1 (every layer holds it).
    next_pos = jnp.max(pos, axis=(0, 2, 3)) + 1  # [B]
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
