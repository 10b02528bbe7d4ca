"""The cache's layout on a (data, model) mesh: rows over data, kv heads over model.

`distribution.sharding` holds the axis rules every array follows; this module applies them to
the cache type of `runtime.cache` (its specs and shardings, placing or creating a cache on a
mesh, and pinning it inside jit), so that `distribution/` never needs the cache's type.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dge_jax.config import ModelConfig
from dge_jax.distribution.constraints import context_mesh
from dge_jax.distribution.sharding import DEFAULT_RULES, AxisRules
from dge_jax.runtime.cache import KVCache, LayerGroup, init_cache
from dge_jax.runtime.quantized import Int4Entries, Int8Entries, KVQuant, parse_kv_quant

# One layer group of the cache (dge_jax.runtime.cache.LayerGroup): k, v [Lg, B, Hkv, S, D],
# pos [Lg, B, Hkv, S], index [Lg] (replicated). An int8 cache's values and scales [.., S, 1]
# both take k's (or v's) axes; so do an int4 cache's leaves (the residual's start: the first
# three).
GROUP_AXES = LayerGroup(
    k=("layers", "batch", "kv_heads", "seq", "head_dim"),
    v=("layers", "batch", "kv_heads", "seq", "head_dim"),
    pos=("layers", "batch", "kv_heads", "seq"),
    index=(),
)


def cache_specs(
    cfg: ModelConfig,
    batch_size: int,
    mesh_shape: Mapping[str, int],
    rules: AxisRules = DEFAULT_RULES,
    num_groups: int = 1,
    kv_quant: str = "none",
) -> KVCache:
    """A KVCache of PartitionSpecs with `num_groups` layer groups: rows over data, kv heads
    over model (see module docstring); the same spec for every group; kv_quant "int8" or
    "int4...": k and v as `Int8Entries` or `Int4Entries` of specs (every leaf split alike)."""
    fitted = rules.fit(cfg, mesh_shape, batch_size)
    group = jax.tree.map(fitted.spec, GROUP_AXES, is_leaf=lambda x: isinstance(x, tuple))
    quant = parse_kv_quant(kv_quant)
    if quant.kind == "int8":
        group = LayerGroup(k=Int8Entries(group.k, group.k), v=Int8Entries(group.v, group.v),
                           pos=group.pos, index=group.index)  # fmt: skip
    elif quant.kind == "int4":
        group = LayerGroup(k=_int4_specs(group.k, quant, keys=True),
                           v=_int4_specs(group.v, quant, keys=False),
                           pos=group.pos, index=group.index)  # fmt: skip
    return KVCache((group,) * num_groups)


def _int4_specs(spec: PartitionSpec, quant: KVQuant, keys: bool) -> Int4Entries:
    """`Int4Entries` of specs: packed values, scales, zeros and the residual [.., X, Y] split
    as k, the residual's start [Lg, B, Hkv] as k's leading axes."""
    lead = PartitionSpec(*tuple(spec)[:3])
    return Int4Entries(spec, spec, spec, spec, lead, keys=keys, group=quant.group,
                       residual=quant.residual)  # fmt: skip


def cache_shardings(
    cfg: ModelConfig,
    batch_size: int,
    mesh: Mesh,
    rules: AxisRules = DEFAULT_RULES,
    num_groups: int = 1,
    kv_quant: str = "none",
) -> KVCache:
    """A KVCache of NamedShardings on `mesh` for a batch of `batch_size` rows."""
    specs = cache_specs(cfg, batch_size, mesh.shape, rules, num_groups, kv_quant)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def shard_cache(
    cache: KVCache, cfg: ModelConfig, mesh: Mesh, rules: AxisRules = DEFAULT_RULES
) -> KVCache:
    """An existing cache laid out on `mesh`: rows over data, kv heads over model."""
    shardings = cache_shardings(cfg, cache.batch_size, mesh, rules, len(cache.groups),
                                cache.kv_quant)  # fmt: skip
    return jax.tree.map(jax.device_put, cache, shardings)


def init_sharded_cache(
    cfg: ModelConfig,
    batch_size: int,
    capacity: int,
    mesh: Mesh,
    dtype=jnp.float32,
    rules: AxisRules = DEFAULT_RULES,
    kv_quant: str = "none",
) -> KVCache:
    """An empty cache created in place on `mesh`: each device allocates only its block (no
    whole cache is ever built on one device, unlike `shard_cache(init_cache(...))`)."""
    shardings = cache_shardings(cfg, batch_size, mesh, rules, kv_quant=kv_quant)
    dims = (cfg.num_layers, batch_size, cfg.num_kv_heads, capacity, cfg.head_dim, dtype,
            kv_quant)  # fmt: skip
    return jax.jit(lambda: init_cache(*dims), out_shardings=shardings)()


def constrain_cache(cache: KVCache, cfg: ModelConfig, rules: AxisRules = DEFAULT_RULES):
    """Inside jit: pins the cache to its mesh layout when a (data, model) mesh is set.

    A no-op without `jax.set_mesh` (one device), so the jitted code is the same either way;
    called where a cache is created, so that no step has to guess its layout.
    """
    mesh = context_mesh()
    if mesh is None:
        return cache
    specs = cache_specs(cfg, cache.batch_size, mesh, rules, len(cache.groups), cache.kv_quant)
    return jax.tree.map(jax.lax.with_sharding_constraint, cache, specs)
