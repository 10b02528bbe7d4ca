"""The layouts the jitted steps pin inside jit, under the mesh `jax.set_mesh` sets.

`sharding` says where arrays live on a (data, model) mesh; these functions apply it to
values being traced: the cache and the model inputs where a step creates them
(`constrain_rows`; the cache's own, `runtime.cache_layout`), the residual stream between a
layer's blocks (`constrain_residual`: sequence parallelism, the one annotation in the model
code), and the per-device blocks a kernel's shard_map takes (`attention_specs`). Each is a
no-op without such a mesh (one device), so the program traced is the same either way.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from dge_jax.config import ModelConfig
from dge_jax.distribution.sharding import (
    DEFAULT_RULES,
    MESH_AXES,
    AxisRules,
    as_axes,
    axis_size,
    rows_spec,
)


def context_mesh() -> dict[str, int] | None:
    """Axis sizes of the (data, model) mesh set by `jax.set_mesh`, None when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or tuple(mesh.axis_names) != MESH_AXES:
        return None
    return dict(mesh.shape)


def constrain_rows(
    cfg: ModelConfig, *arrays: jax.Array, rules: AxisRules = DEFAULT_RULES
) -> tuple[jax.Array, ...]:
    """Inside jit: model inputs [B, ...] laid out by `rows_spec` when a mesh is set.

    A no-op without a (data, model) mesh set by `jax.set_mesh`, like
    `runtime.cache_layout.constrain_cache`.
    """
    mesh = context_mesh()
    if mesh is None:
        return arrays
    return tuple(
        jax.lax.with_sharding_constraint(a, rows_spec(cfg, a.shape[0], a.ndim, mesh, rules))
        for a in arrays
    )


def residual_spec(
    cfg: ModelConfig,
    shape: tuple[int, ...],
    mesh_shape: dict[str, int],
    *,
    split: bool = True,
    rules: AxisRules = DEFAULT_RULES,
) -> P | None:
    """The spec `constrain_residual` pins a residual stream of `shape` [B, T, D] to on a mesh
    of `mesh_shape`: tokens over the `residual` axes (split=True) or whole (split=False),
    rows where the cache's go. None where the stream cannot split, and is left alone: one
    token a row (decode and draft steps), T not dividing the axes, a one-device axis, or
    rows already on those axes (kv heads fewer than the model axis: rows over data x model)."""
    if len(shape) != 3 or rules.residual is None:
        return None
    fitted = rules.fit(cfg, mesh_shape, shape[0])
    size = axis_size(mesh_shape, fitted.residual)
    if size == 1 or shape[1] % size or set(as_axes(fitted.batch)) & set(as_axes(fitted.residual)):
        return None
    return fitted.spec(("batch", "residual" if split else None, "embed"))


def constrain_residual(
    cfg: ModelConfig, x: jax.Array, *, split: bool = True, rules: AxisRules = DEFAULT_RULES
) -> jax.Array:
    """Inside jit, under a (data, model) mesh set by `jax.set_mesh`: the residual stream x
    [B, T, D] with its tokens split over the `residual` mesh axes (split=True: between
    blocks), or a block's normed input with its tokens whole again (split=False: the
    all-gather before the block's projections, placed here rather than left to the
    partitioner, which may otherwise gather a projection's output, keys included).

    Sequence parallelism (`sharding`'s docstring). A no-op without such a mesh and where
    `residual_spec` says the stream cannot split."""
    mesh = context_mesh()
    spec = None if mesh is None else residual_spec(cfg, x.shape, mesh, split=split, rules=rules)
    return x if spec is None else jax.lax.with_sharding_constraint(x, spec)


def attention_specs(
    batch_size: int, num_kv_heads: int, rules: AxisRules = DEFAULT_RULES
) -> tuple[P, P, P, P, P] | None:
    """Inside jit under a (data, model) mesh set by `jax.set_mesh`: the specs of one layer's
    attention operands as the cache and the q projection lay them out (`AxisRules.fit`):
    (q and output [B, T, Hq, D], k and v [B, Hkv, S, D], slot positions [B, Hkv, S], query
    positions [B, T], per-slot sums [B, Hq, S]). None without such a mesh.

    Rows split over the batch axes and kv heads with their query heads over the model axis,
    so each device holds whole (row, kv head) pairs: what a kernel that knows no mesh needs
    (`layer_attention`'s shard_map)."""
    mesh = context_mesh()
    if mesh is None:
        return None
    fitted = dataclasses.replace(rules, **rules.heads_and_rows(num_kv_heads, mesh, batch_size))
    logical = (("batch", None, "heads", None), ("batch", "kv_heads", None, None),
               ("batch", "kv_heads", None), ("batch", None), ("batch", "heads", None))  # fmt: skip
    q, kv, slots, rows, sums = (fitted.spec(axes) for axes in logical)
    return q, kv, slots, rows, sums
