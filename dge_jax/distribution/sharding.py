"""Scale-out on a device mesh: logical axis rules, parameter and cache shardings.

The mesh has two axes, ``data`` and ``model``. Every array dimension that may be split has a
*logical* name (batch, heads, kv_heads, mlp, vocab, embed, layers, seq, head_dim); `AxisRules`
maps each logical name to a mesh axis, several mesh axes, or None (replicated), and a
`PartitionSpec` follows from that. The default rules:

    logical    mesh     arrays
    batch      data     tokens [B, T], cache k/v [L, B, Hkv, S, D] and pos [L, B, Hkv, S]
    heads      model    wq columns (Hq·hd), wo rows, bq; observed queries [L, B, Hq, W, D]
    kv_heads   model    wk/wv columns (Hkv·hd), bk/bv; the cache's Hkv axis
    mlp        model    w_gate/w_up columns, w_down rows (F)
    vocab      model    embedding rows, lm_head columns, logits [B, V]
    residual   model    the token axis of the residual stream [B, T, D] between a layer's
                        blocks (prefill; sequence parallelism, `constrain_residual`)
    embed, layers, seq, head_dim: never split

Attention runs head-parallel (Megatron-style: a reduction after wo and one after w_down per
layer, reduce-scatters under sequence parallelism, below) and rows data-parallel. Eviction
needs no communication for per-head budgets: scores, top-k and compaction run along the slot
axis, which is never split. AdaKV ranks a layer's scores across all its heads, so XLA exchanges
scores [L, B, Hkv, S] f32 (1/D of the keys) between the model devices; keys and values never
move.

Sequence parallelism (Megatron's, as MaxText shards activations): between a layer's two
blocks the residual stream's tokens are split over the model axis
(`constraints.constrain_residual`), so the norms and residual adds run on 1/model of the
tokens and each block's closing all-reduce becomes a reduce-scatter (XLA:TPU runs it as a ring
of collective-permutes beside the matmul that feeds it), its normed input an all-gather. Each
device then holds and rewrites its share of the stream instead of all of
it (an 8B model's prefill compiled for a v5e-8, before and after: benchmarks/RESULTS.md).
Decode and draft steps (one token a row) and token counts that do not divide the axis keep
the stream whole.

`AxisRules.fit` adapts the rules to one model, mesh and batch:

- query heads must split evenly over the model axis, else `MeshError` (a model axis wider
  than the heads, or one that would cut a head in two); put extra devices on data.
- mlp or vocab sizes that do not divide the model axis are replicated (slower, never wrong).
- **kv heads fewer than the model axis** (or not a multiple of it: MQA, 8 kv heads on a 16-way
  model axis). The scaling book (inference chapter, "sharding the KV cache") advises never to
  replicate the cache: split its heads as far as they go, then its batch. We split the batch:
  the cache's rows go over data × model, k/v [L, B_(data·model), Hkv, S, D], and attention
  becomes data-parallel over the same devices: wq/wk/wv/wo are replicated over model (they are
  the small part of a GQA model), each device computes every head for its own rows, and the
  MLP and vocab stay split over model, so only activations of one layer's width cross devices
  (the book moves q with all-to-alls instead; that needs annotations inside the model code,
  and without them XLA moves a layer of the cache to the queries, which is what we avoid).
  When the batch does not divide data × model either, rows split over data only and each
  model device holds its rows' whole cache: correct, but the memory is not split by model.
- a batch that does not divide the data axis is replicated over it (use batches that are a
  multiple of data, or of data × model in the case above, as the LongBench runner does).

Meshes use `AxisType.Auto` axes: JAX's partitioner propagates the parameter shardings;
`constraints.py` applies these rules inside jit: `constrain_rows` and (for the cache, in
`runtime/cache_layout.py`) `constrain_cache` pin the
inputs and the cache where the decoding steps create or update them, and the model's layers
carry one annotation, `constrain_residual` (all no-ops without a mesh). Errors for meshes that
cannot work (`make_mesh`, `AxisRules.fit`) come before anything compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dge_jax.config import ModelConfig
from dge_jax.families import get_family

MESH_AXES = ("data", "model")
MeshAxes = str | tuple[str, ...] | None
Logical = tuple[str | None, ...]


def as_axes(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


class MeshError(ValueError):
    """A mesh that cannot hold this model or batch (axis sizes, heads), said before compiling."""


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Logical axis -> mesh axis ("data", "model"), a tuple of them, or None (replicated)."""

    batch: MeshAxes = "data"
    heads: MeshAxes = "model"
    kv_heads: MeshAxes = "model"
    mlp: MeshAxes = "model"
    vocab: MeshAxes = "model"
    embed: MeshAxes = None
    layers: MeshAxes = None
    seq: MeshAxes = None
    residual: MeshAxes = "model"
    head_dim: MeshAxes = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            bad = [a for a in as_axes(value) if a not in MESH_AXES]
            if bad or not isinstance(value, str | tuple | type(None)):
                raise ValueError(
                    f"rule {f.name}={value!r}: use None, one of {MESH_AXES} or a tuple of them"
                )

    def spec(self, logical: Logical) -> P:
        """The PartitionSpec of an array whose dimensions have these logical names.

        None in `logical` is a dimension never split. Raises when two dimensions of the
        array land on one mesh axis (the rules collide for this array).
        """
        names = {f.name for f in dataclasses.fields(self)}
        axes = []
        for name in logical:
            if name is not None and name not in names:
                raise ValueError(f"unknown logical axis {name!r}; known: {sorted(names)}")
            axes.append(None if name is None else getattr(self, name))
        used = [a for ax in axes for a in as_axes(ax)]
        clash = sorted({a for a in used if used.count(a) > 1})
        if clash:
            raise ValueError(
                f"logical axes {logical} map to {tuple(axes)}: mesh axis {clash[0]!r} would "
                "split two dimensions of one array; give one of them another mesh axis or None"
            )
        return P(*axes)

    def fit(
        self, cfg: ModelConfig, mesh_shape: Mapping[str, int], batch_size: int | None = None
    ) -> AxisRules:
        """These rules adapted to one model, mesh (axis name -> size) and, if given, batch.

        Raises `MeshError` when query heads cannot split over their axis; replicates mlp and
        vocab that do not divide; when kv heads do not divide, makes attention data-parallel
        and, given the batch, moves its rows onto data × model (see the module docstring).
        """
        heads = axis_size(mesh_shape, self.heads)
        if heads > cfg.num_heads:
            raise MeshError(
                f"the mesh axis {self.heads!r} has {heads} devices, more than the "
                f"{cfg.num_heads} query heads it shards; use a model axis of at most "
                f"{cfg.num_heads} (a divisor of the head count) and put the other devices on "
                "the data axis"
            )
        if cfg.num_heads % heads:
            raise MeshError(
                f"{cfg.num_heads} query heads do not split evenly over the mesh axis "
                f"{self.heads!r} of {heads} devices; use a divisor of {cfg.num_heads}"
            )
        changes: dict[str, MeshAxes] = {}
        for name, n in (("mlp", cfg.intermediate_size), ("vocab", cfg.vocab_size)):
            if n % axis_size(mesh_shape, getattr(self, name)):
                changes[name] = None  # replicated: slower, never wrong
        changes |= self.heads_and_rows(cfg.num_kv_heads, mesh_shape, batch_size)
        return dataclasses.replace(self, **changes)

    def heads_and_rows(
        self, num_kv_heads: int, mesh_shape: Mapping[str, int], batch_size: int | None
    ) -> dict[str, MeshAxes]:
        """`fit`'s changes to heads, kv_heads and batch: what attention's layout depends on
        (`attention_specs` reads them without a config)."""
        changes: dict[str, MeshAxes] = {}
        kv_split = num_kv_heads % axis_size(mesh_shape, self.kv_heads) == 0
        if not kv_split:  # data-parallel attention (module docstring)
            changes["kv_heads"] = changes["heads"] = None
        if batch_size is not None:
            batch = as_axes(self.batch)
            if not kv_split:  # rows take over the mesh axes the kv heads cannot use
                wide = batch + tuple(a for a in as_axes(self.kv_heads) if a not in batch)
                if batch_size % axis_size(mesh_shape, wide) == 0:
                    batch = wide
            if batch_size % axis_size(mesh_shape, batch):
                batch = ()
            changes["batch"] = batch[0] if len(batch) == 1 else (batch or None)
        return changes


DEFAULT_RULES = AxisRules()


# ---------------------------------------------------------------------------------------------
# Meshes
# ---------------------------------------------------------------------------------------------


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, model) mesh over the first data·model devices, with Auto axes.

    The product must divide the device count (so the rest can form more meshes of the same
    shape); clear `MeshError`s otherwise. Model-size checks happen in `AxisRules.fit`.
    """
    for name, n in (("data", data), ("model", model)):
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise MeshError(f"mesh axis {name} must be a positive integer, got {n!r}")
    devices = list(jax.devices() if devices is None else devices)
    want = data * model
    if want > len(devices):
        raise MeshError(
            f"a mesh of data={data} x model={model} needs {want} devices, but only "
            f"{len(devices)} are available"
        )
    if len(devices) % want:
        raise MeshError(
            f"a mesh of data={data} x model={model} = {want} devices does not divide the "
            f"{len(devices)} available devices; choose axis sizes whose product divides "
            f"{len(devices)}"
        )
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, model), MESH_AXES, axis_types=auto, devices=devices[:want])


def parse_mesh(text: str, devices: Sequence[Any] | None = None) -> Mesh:
    """`make_mesh` from a command-line spec such as "data=2,model=4" (a missing axis is 1)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in MESH_AXES or name in sizes or not value.strip().isdigit():
            raise MeshError(
                f"bad mesh spec {text!r}: write data=D,model=M with positive integers "
                f"(axes {MESH_AXES}, each at most once)"
            )
        sizes[name] = int(value)
    if not sizes:
        raise MeshError(f"empty mesh spec {text!r}: write data=D,model=M")
    return make_mesh(sizes.get("data", 1), sizes.get("model", 1), devices=devices)


def row_multiple(cfg: ModelConfig, mesh_shape: Mapping[str, int]) -> int:
    """Batch sizes should be multiples of this to split the cache fully: data, or data ×
    model when the kv heads do not divide the model axis (data-parallel attention)."""
    fitted = DEFAULT_RULES.fit(cfg, mesh_shape)
    wide = as_axes(DEFAULT_RULES.batch)
    if fitted.kv_heads is None:
        wide += tuple(a for a in as_axes(DEFAULT_RULES.kv_heads) if a not in wide)
    return axis_size(mesh_shape, wide)


def check_mesh(mesh: Mesh) -> None:
    """Raises `MeshError` for a mesh this library cannot run on: other axis names, or
    Explicit axes (`jax.make_mesh`'s default), which the unannotated model code cannot use."""
    if tuple(mesh.axis_names) != MESH_AXES:
        raise MeshError(f"mesh axes {mesh.axis_names} must be {MESH_AXES}; use make_mesh")
    if any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
        raise MeshError(
            f"mesh axis types {mesh.axis_types} must be Auto; build the mesh with "
            "dge_jax.distribution.sharding.make_mesh (jax.make_mesh defaults to Explicit axes)"
        )


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh a pytree's arrays are laid out on (None when none is on a named mesh)."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.axis_names == MESH_AXES:
            return sharding.mesh
    return None


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


def field_name(path: tuple) -> str:
    """The "layers.wq" style name of a parameter leaf's key path (the keys of `param_axes`)."""
    return ".".join(str(getattr(k, "name", getattr(k, "key", k))) for k in path)


def param_specs(
    cfg: ModelConfig,
    fields: Sequence[str],
    mesh_shape: Mapping[str, int],
    rules: AxisRules = DEFAULT_RULES,
) -> dict[str, P]:
    """{field: PartitionSpec} for the named parameter fields under rules fitted to `cfg`."""
    fitted = rules.fit(cfg, mesh_shape)
    axes = param_axes(cfg)
    missing = [f for f in fields if f not in axes]
    if missing:
        raise ValueError(
            f"no logical axes for parameter(s) {missing} of family {cfg.family!r}; add them to "
            "its ModelFamily.param_axes (its weight table)"
        )
    return {f: fitted.spec(axes[f]) for f in fields}


def param_axes(cfg: ModelConfig) -> Mapping[str, Logical]:
    """The logical axes of every parameter field of `cfg`'s family (its weight table)."""
    return get_family(cfg.family).param_axes


def param_shardings(
    cfg: ModelConfig, fields: Sequence[str], mesh: Mesh, rules: AxisRules = DEFAULT_RULES
) -> dict[str, NamedSharding]:
    """{field: NamedSharding} on `mesh`; what sharded loading and orbax restore place into."""
    check_mesh(mesh)
    specs = param_specs(cfg, fields, mesh.shape, rules)
    return {f: NamedSharding(mesh, s) for f, s in specs.items()}


def shard_params(params: Any, cfg: ModelConfig, mesh: Mesh, rules: AxisRules = DEFAULT_RULES):
    """The parameter pytree laid out on `mesh` (each leaf sharded by its field's axes)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    names = [field_name(path) for path, _ in leaves]
    shardings = param_shardings(cfg, names, mesh, rules)
    placed = [jax.device_put(x, shardings[n]) for n, (_, x) in zip(names, leaves, strict=True)]
    return jax.tree_util.tree_unflatten(tree, placed)


# ---------------------------------------------------------------------------------------------
# Caches and batches
# ---------------------------------------------------------------------------------------------


def rows_spec(
    cfg: ModelConfig,
    batch_size: int,
    ndim: int,
    mesh_shape: Mapping[str, int],
    rules: AxisRules = DEFAULT_RULES,
) -> P:
    """Spec of a model input [B, ...] (tokens, lengths): rows where the cache's rows go, so
    activations meet the cache on the devices that hold it."""
    fitted = rules.fit(cfg, mesh_shape, batch_size)
    return fitted.spec(("batch",) + (None,) * (ndim - 1))


def mesh_context(tree: Any) -> contextlib.AbstractContextManager:
    """`jax.set_mesh` of the mesh `tree`'s arrays live on, or a null context for one device."""
    mesh = mesh_of(tree)
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def on_model_mesh(fn):
    """Decorator for fn(model, ...): runs it under `jax.set_mesh` of the model's parameters,
    so that the jitted steps inside pin caches and inputs to that mesh."""

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        if not hasattr(model, "params"):
            raise TypeError(
                f"model must be a loaded dge_jax.Model, got {type(model).__name__} "
                f"{str(model)[:40]!r}: load one with dge_jax.load(name_or_path)"
            )
        with mesh_context(model.params):
            return fn(model, *args, **kwargs)

    return wrapper


def axis_size(mesh_shape: Mapping[str, int], axes: MeshAxes) -> int:
    """Devices along `axes` (None, one mesh axis or a tuple of them) of a mesh's shape."""
    return math.prod(mesh_shape.get(a, 1) for a in as_axes(axes))
