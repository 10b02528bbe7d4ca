"""Loading Hugging Face checkpoint folders (config.json + safetensors) into parameter pytrees.

Conversion is a table (`KeyMap`): a regular expression from the checkpoint's tensor name to a
parameter field (or to several: a fused tensor split along its last axis), plus a transform.
Every converted tensor's shape is checked against the config; a tensor that matches no rule,
or a field no tensor filled, is an error. Only safetensors are read: pickled checkpoints can
run code and are refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
import re
import shlex
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from dge_jax.config import ConfigError, ModelConfig
from dge_jax.families import ModelFamily, get_family

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class CheckpointError(ValueError):
    """A checkpoint folder is missing, incomplete, or does not match its config."""


@dataclasses.dataclass(frozen=True)
class KeyMap:
    """rules: (name pattern, target, "keep" | "transpose" | "skip"); a captured group is the
    layer index; "skip": a tensor the model does not run (a multimodal checkpoint's vision
    tower), read past.

    target: one field, or a tuple of fields that one fused tensor fills (Phi-3's qkv_proj ->
    wq, wk, wv): the tensor, after its transform, is cut along its last axis into the fields
    in order, each as wide as the last dimension of its shape in `shapes` (so the sizes come
    from the config, and a fused tensor of another width is an error naming it).
    shapes: the field -> shape table for the config (stacked fields carry the [L] axis);
    build: turns {field: array} into the family's parameter pytree.
    """

    rules: tuple[tuple[re.Pattern, str | tuple[str, ...], str], ...]
    shapes: dict[str, tuple[int, ...]]
    build: Callable[[dict[str, Any]], Any]


def damaged(
    folder: str | pathlib.Path,
    file: pathlib.Path,
    error: Exception,
    cause: str = "the file is truncated or damaged",
) -> CheckpointError:
    """The one-line error for a file of a model folder that cannot be read: names the file,
    the first line of the reader's error, and how to get a good copy (`recovery`)."""
    lines = str(error).strip().splitlines() or [""]
    first = lines[0].split(" See full TensorStore details")[0]  # orbax appends a long spec
    detail = first[:200] + (" ..." if len(lines) > 1 or len(first) > 200 else "")
    return CheckpointError(
        f"cannot read {file} ({type(error).__name__}: {detail}); {cause}. "
        f"{recovery(pathlib.Path(folder))}"
    )


# The marker file of a folder converted by `python -m dge_jax convert` (`orbax_io.save`).
MARKER = "dge_jax.json"


def is_converted(path: str | pathlib.Path) -> bool:
    """True for a folder written by `orbax_io.save` (it holds the marker file)."""
    return (pathlib.Path(path) / MARKER).is_file()


def source_of(path: str | pathlib.Path) -> str | None:
    """The `--model` a converted folder was made from (None if unknown or unreadable)."""
    try:
        source = json.loads((pathlib.Path(path) / MARKER).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, str) else None


def recovery(folder: pathlib.Path) -> str:
    """How to replace a damaged model folder: a cached conversion (embedded model or .gguf,
    under `embedded.cache_root()`) is deleted and converted again on the next load; a folder
    written by `python -m dge_jax convert` is converted again; any other is copied again."""
    from dge_jax.checkpoints.embedded import cache_root

    folder = folder.absolute()
    quoted = shlex.quote(str(folder))
    if folder.resolve().is_relative_to(cache_root().resolve()):
        return (
            f"{folder} is dge_jax's cached conversion of a GGUF model: delete it "
            f"(rm -r {quoted}) and the next load converts it again"
        )
    if is_converted(folder):
        source = source_of(folder)
        model = shlex.quote(source) if source else "SOURCE"
        return (
            f"Delete the converted folder and convert it again: rm -r {quoted} && "
            f"python -m dge_jax convert --model {model} --out {quoted}"
        )
    return f"Download or copy the checkpoint into {folder} again"


def read_config(path: str | pathlib.Path) -> dict[str, Any]:
    """The raw config.json of a checkpoint folder, with a clear error when absent or damaged."""
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {str(folder)!r} does not exist")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{folder} has no config.json: is it a Hugging Face model folder?")
    try:
        return json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise damaged(folder, cfg_file, e) from e


def parse_config(raw: dict[str, Any]) -> tuple[ModelFamily, ModelConfig]:
    """The family and the strict `ModelConfig` for a raw config dict."""
    if not isinstance(raw, dict):
        kind = {list: "an array", str: "a string"}.get(type(raw), f"a {type(raw).__name__}")
        raise ConfigError(
            f"config.json holds {kind}, not an object of model settings; use the checkpoint's "
            "own config.json"
        )
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError("config.json has no 'model_type'")
    family = get_family(model_type)
    return family, family.parse_config(raw)


def safetensors_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a folder: the index's shards, or the single model file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{folder}: shard(s) listed in the index are missing: {missing}")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
        raise CheckpointError(
            f"{folder} holds only pickled weights (*.bin/*.pt), which can run code when "
            "loaded; convert them to safetensors first"
        )
    raise CheckpointError(f"{folder} has no model.safetensors nor model.safetensors.index.json")


def iter_tensors(files: list[pathlib.Path]):
    """Yields (name, numpy array) from safetensors files, naming a file that fails to read."""
    for file in files:
        try:
            with safe_open(file, framework="numpy") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for bad files
            raise damaged(file.parent, file, e) from e


def _match(name: str, key_map: KeyMap) -> tuple[re.Match, tuple[str, ...], str]:
    """The first rule whose pattern matches `name` in full: (match, fields, transform)."""
    for pattern, target, transform in key_map.rules:
        m = pattern.fullmatch(name)
        if m:
            return m, (target,) if isinstance(target, str) else tuple(target), transform
    raise CheckpointError(f"checkpoint tensor {name!r} matches no parameter of the model")


def _expected_match(name: str, key_map: KeyMap, cfg: ModelConfig):
    """`_match`, then: None for a tied head saved anyway (the embedding is the head) or a
    skipped tensor, and an error for a tensor of a field this config does not have."""
    m, fields, transform = _match(name, key_map)
    if transform == "skip":
        return None
    absent = [f for f in fields if f not in key_map.shapes]
    if absent:
        if fields == ("lm_head",) and cfg.tie_word_embeddings:
            return None
        raise CheckpointError(
            f"checkpoint tensor {name!r} ({', '.join(absent)}) is not expected by this config "
            "(check attention_bias, qk-norm, tie_word_embeddings)"
        )
    return m, fields, transform


def _split_points(name: str, fields: tuple[str, ...], width: int, key_map: KeyMap) -> list[int]:
    """Where a fused tensor's last axis (`width` wide, after its transform) starts each of
    `fields`, its last entry the end: the widths come from `key_map.shapes`."""
    points = [0]
    for field in fields:
        points.append(points[-1] + key_map.shapes[field][-1])
    if points[-1] != width:
        widths = ", ".join(f"{f} {key_map.shapes[f][-1]}" for f in fields)
        raise CheckpointError(
            f"tensor {name!r} is {width} wide on its split axis, but config.json implies "
            f"{points[-1]} ({widths})"
        )
    return points


def _layer_list(layers: list[int]) -> str:
    """Layer indices for a message: [2] or [2, 3], long runs as a range (layers 2-31)."""
    if len(layers) > 4 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return str(layers)


def check_layers(per_layer: dict[str, dict[int, Any]], num_layers: int) -> None:
    """Raises unless every per-layer field has exactly layers 0 .. num_layers - 1: weights
    of layers config.json does not declare (a num_hidden_layers below the checkpoint's),
    layers without any weights (one above it), or a layer one tensor lacks (files cut short)."""
    declared = set(range(num_layers))
    found = set().union(*(set(layers) for layers in per_layer.values()))
    extra = sorted(found - declared)
    if extra:
        layers = "layer 0" if num_layers == 1 else f"layers 0-{num_layers - 1}"
        raise CheckpointError(
            f"the checkpoint has weights for layer(s) {_layer_list(extra)}, which config.json "
            f"does not declare (num_hidden_layers={num_layers}: {layers}); "
            f"use the config.json saved with these weights, or set num_hidden_layers to "
            f"{max(found) + 1} if the model has that many layers"
        )
    empty = sorted(declared - found) if per_layer else []
    if empty:
        fix = "copy or download the checkpoint again"
        if found == set(range(len(found))):  # layers 0 .. n - 1: the config says more
            fix = f"set num_hidden_layers to {len(found)} if the model has that many layers"
        raise CheckpointError(
            f"the checkpoint has no weights for layer(s) {_layer_list(empty)}, but config.json "
            f"declares num_hidden_layers={num_layers}; use the config.json saved with these "
            f"weights, or {fix}"
        )
    for field, layers in per_layer.items():
        missing = sorted(declared - set(layers))
        if missing:
            raise CheckpointError(
                f"parameter {field} is missing for layer(s) {_layer_list(missing)} (its other "
                "layers are there): the checkpoint is incomplete; copy or download it again"
            )


def convert(tensors, key_map: KeyMap, cfg: ModelConfig, dtype) -> Any:
    """Applies the key table to (name, array) pairs and builds the parameter pytree."""
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    flat: dict[str, np.ndarray] = {}
    for name, array in tensors:
        matched = _expected_match(name, key_map, cfg)
        if matched is None:
            continue
        m, fields, transform = matched
        value = array.T if transform == "transpose" else array
        points = [0, value.shape[-1]]
        if len(fields) > 1:
            points = _split_points(name, fields, value.shape[-1], key_map)
        for field, start, stop in zip(fields, points, points[1:], strict=False):
            piece = value[..., start:stop] if len(fields) > 1 else value
            if m.groups():
                per_layer.setdefault(field, {})[int(m.group(1))] = piece
            else:
                flat[field] = piece
    check_layers(per_layer, cfg.num_layers)
    for field, layers in per_layer.items():
        first = layers[0].shape
        odd = [i for i, a in layers.items() if a.shape != first]
        if odd:
            raise CheckpointError(
                f"parameter {field}: layer(s) {odd} have a shape other than layer 0's {first}"
            )
        flat[field] = np.stack([layers[i] for i in range(cfg.num_layers)])
    missing = sorted(set(key_map.shapes) - set(flat))
    if missing:
        raise CheckpointError(f"checkpoint lacks tensors for parameter(s) {missing}")
    out = {}
    for field, shape in key_map.shapes.items():
        if tuple(flat[field].shape) != tuple(shape):
            raise CheckpointError(
                f"tensor for {field} has shape {tuple(flat[field].shape)}, but config.json "
                f"implies {tuple(shape)}"
            )
        out[field] = jnp.asarray(flat[field], dtype=dtype)
    return key_map.build(out)


def load_hf_checkpoint(path: str | pathlib.Path, dtype: str = "float32", mesh=None):
    """(family, config, params) from a Hugging Face folder, strictly checked.

    With a `jax.sharding.Mesh`, parameters are laid out by `dge_jax.distribution.sharding` and each
    device reads only its own slices of the files (`load_sharded`).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    folder = pathlib.Path(path)
    family, cfg = parse_config(read_config(folder))
    files = safetensors_files(folder)
    if mesh is not None:
        from dge_jax.distribution.sharding import param_shardings

        key_map = family.key_map(cfg)
        shardings = param_shardings(cfg, list(key_map.shapes), mesh)
        return family, cfg, load_sharded(files, key_map, cfg, DTYPES[dtype], shardings)
    params = convert(iter_tensors(files), family.key_map(cfg), cfg, DTYPES[dtype])
    return family, cfg, params


# --- Sharded loading: every device reads only its slices -------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Where one parameter (or one layer of a stacked one) lives in the checkpoint files;
    offset: where it starts on the last axis of a fused tensor (after the transform)."""

    file: pathlib.Path
    name: str
    transpose: bool
    offset: int = 0


def plan_tensors(
    files: list[pathlib.Path], key_map: KeyMap, cfg: ModelConfig
) -> dict[str, tuple[bool, list[TensorSource]]]:
    """{field: (stacked, sources)} from the files' headers alone, checked as strictly as
    `convert` (unknown names, missing layers and wrong shapes raise) before any data is read.

    stacked fields have one source per layer, in layer order; the others have one.
    """
    per_layer: dict[str, dict[int, TensorSource]] = {}
    plan: dict[str, tuple[bool, list[TensorSource]]] = {}
    for file in files:
        try:
            with safe_open(file, framework="numpy") as f:
                headers = [(name, tuple(f.get_slice(name).get_shape())) for name in f.keys()]
        except Exception as e:  # safetensors raises its own error types for bad files
            raise damaged(file.parent, file, e) from e
        for name, shape in headers:
            matched = _expected_match(name, key_map, cfg)
            if matched is None:
                continue
            m, fields, transform = matched
            shape = shape[::-1] if transform == "transpose" else shape
            points = [0, shape[-1] if shape else 0]
            if len(fields) > 1:
                points = _split_points(name, fields, shape[-1] if shape else 0, key_map)
            for field, start, stop in zip(fields, points, points[1:], strict=False):
                source = TensorSource(file, name, transform == "transpose", start)
                got = (*shape[:-1], stop - start) if len(fields) > 1 else shape
                want = key_map.shapes[field][1:] if m.groups() else key_map.shapes[field]
                if got != tuple(want):
                    raise CheckpointError(
                        f"tensor {name!r} for {field} has shape {got} (after {transform}), "
                        f"but config.json implies {tuple(want)}"
                    )
                if m.groups():
                    per_layer.setdefault(field, {})[int(m.group(1))] = source
                else:
                    plan[field] = (False, [source])
    check_layers(per_layer, cfg.num_layers)
    for field, layers in per_layer.items():
        plan[field] = (True, [layers[i] for i in range(cfg.num_layers)])
    missing = sorted(set(key_map.shapes) - set(plan))
    if missing:
        raise CheckpointError(f"checkpoint lacks tensors for parameter(s) {missing}")
    return plan


# safetensors dtypes its numpy reader cannot hold (numpy has no bfloat16 / float8).
_NOT_NUMPY = frozenset({"BF16", "F8_E4M3", "F8_E5M2"})


def _host_device():
    """The host CPU device when JAX has one (None: the default device)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def load_sharded(
    files: list[pathlib.Path], key_map: KeyMap, cfg: ModelConfig, dtype, shardings: dict
) -> Any:
    """The parameter pytree with each field placed by `shardings[field]`, every device
    reading only its block of each tensor (`safe_open(...).get_slice`), so no host ever
    holds a whole model it does not need."""
    plan = plan_tensors(files, key_map, cfg)
    np_dtype = np.dtype(dtype)
    with contextlib.ExitStack() as stack:
        handles: dict[tuple[pathlib.Path, str], Any] = {}

        def handle(file: pathlib.Path, framework: str):
            if (file, framework) not in handles:
                handles[file, framework] = stack.enter_context(safe_open(file, framework))
            return handles[file, framework]

        def read(source: TensorSource, index: tuple[slice, ...], width: int) -> np.ndarray:
            # index: this device's block of the converted tensor (its last axis `width` wide,
            # starting at `source.offset` of a fused one); a transposed tensor reads the
            # mirrored block of the stored one.
            if index:
                last = index[-1]
                start, stop = last.start or 0, width if last.stop is None else last.stop
                index = (*index[:-1], slice(start + source.offset, stop + source.offset))
            stored_index = index[::-1] if source.transpose else index
            stored = handle(source.file, "numpy").get_slice(source.name)
            if stored.get_dtype() in _NOT_NUMPY:  # numpy has no bfloat16: read it via jax,
                with jax.default_device(_host_device()):  # on the host, not an accelerator
                    stored = handle(source.file, "flax").get_slice(source.name)
                    block = np.asarray(stored[stored_index])
            else:
                block = stored[stored_index]
            return block.T if source.transpose else block

        def block(index, field: str) -> np.ndarray:
            stacked, sources = plan[field]
            width = key_map.shapes[field][-1]
            if not stacked:
                return np.asarray(read(sources[0], index, width), dtype=np_dtype)
            layers = range(cfg.num_layers)[index[0]]
            return np.stack([read(sources[i], index[1:], width) for i in layers]).astype(np_dtype)

        flat = {
            field: place(tuple(shape), shardings[field], functools.partial(block, field=field))
            for field, shape in key_map.shapes.items()
        }
    return key_map.build(flat)


def place(shape: tuple[int, ...], sharding, read) -> jax.Array:
    """The global array of `shape` laid out by `sharding`, its blocks from `read(index)`:
    each distinct block this process's devices hold is read once and copied to every one of
    them (`jax.make_array_from_callback` reads it once per device, so a mesh whose data
    axis replicates the weights over 2 devices read the checkpoint twice), one block at a
    time."""
    blocks: dict[tuple, tuple[tuple[slice, ...], list]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index)  # slices are not hashable
        blocks.setdefault(key, (index, []))[1].append(device)
    arrays = []
    for index, devices in blocks.values():
        data = read(index)
        arrays += [jax.device_put(data, d) for d in devices]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
