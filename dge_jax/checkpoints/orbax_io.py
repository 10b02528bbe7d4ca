"""Converted checkpoints: parameters saved with orbax-checkpoint, config and tokenizer alongside.

A Hugging Face folder is converted once (key table, transposes, stacking on [L]); the result
restores straight into sharded arrays on any mesh, each device reading only its own slices,
which is what makes restores fast on pod slices. Layout of a converted folder:

    DIR/config.json            the source's config.json, unchanged (the family parses it)
    DIR/tokenizer*.json, ...   the source's tokenizer files, copied when present
    DIR/dge_jax.json           marker: format, version, dtype, parameter fields and shapes,
                               and the source `convert` read (to convert it again if damaged)
    DIR/params/                the orbax checkpoint of {"embed": .., "layers": {"wq": ..}}

`dge_jax.load(DIR, mesh=...)` recognises such a folder (`is_converted`).
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import jax
import numpy as np

from dge_jax.checkpoints.hf import (
    DTYPES,
    MARKER,
    CheckpointError,
    damaged,
    is_converted,
    parse_config,
    read_config,
)
from dge_jax.distribution.sharding import DEFAULT_RULES, AxisRules, field_name, param_shardings

FORMAT = "dge_jax.orbax"
VERSION = 1
PARAMS_DIR = "params"
# Files the tokenizer, chat template and EOS ids are read from (dge_jax.checkpoints.tokenizer).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def _marker(folder: pathlib.Path) -> dict[str, Any]:
    """The folder's marker file, a one-line error (with how to convert again) if damaged."""
    try:
        return json.loads((folder / MARKER).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise damaged(folder, folder / MARKER, e) from e


def flat_params(params: Any) -> dict[str, jax.Array]:
    """{"layers.wq": array, ...}: the parameter pytree by field name (absent fields omitted)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {field_name(path): x for path, x in leaves}


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """{"layers.wq": x} -> {"layers": {"wq": x}}: plain dicts, the tree orbax stores best."""
    out: dict[str, Any] = {}
    for name, x in flat.items():
        *parents, leaf = name.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return out


def save(
    out: str | pathlib.Path,
    params: Any,
    source: str | pathlib.Path,
    dtype: str = "float32",
    origin: str | None = None,
) -> pathlib.Path:
    """Writes `params` (converted from the Hugging Face folder `source`) to a new folder
    `out` with the source's config and tokenizer files; returns `out`. origin: what the user
    converted (a name or path; default `source`), recorded to convert it again."""
    import orbax.checkpoint as ocp

    out, source = pathlib.Path(out).absolute(), pathlib.Path(source)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} already exists and is not empty; choose a new folder")
    out.mkdir(parents=True, exist_ok=True)
    flat = flat_params(params)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / PARAMS_DIR, _nested(flat))
    checkpointer.wait_until_finished()
    shutil.copy2(source / "config.json", out / "config.json")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    marker = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "fields": {name: list(np.shape(x)) for name, x in sorted(flat.items())},
        "source": origin or str(source.absolute()),
    }
    (out / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return out


def convert(
    model: str | pathlib.Path, out: str | pathlib.Path, dtype: str = "float32", mesh=None
) -> pathlib.Path:
    """Converts a Hugging Face folder or an embedded model name into a folder for `restore`.

    With a mesh the source is read sharded (each device its own slices) and saved from
    there, so a model larger than one host's memory converts too.
    """
    from dge_jax.checkpoints.embedded import resolve_model_dir
    from dge_jax.checkpoints.hf import load_hf_checkpoint

    folder = resolve_model_dir(model)
    _, _, params = load_hf_checkpoint(folder, dtype=dtype, mesh=mesh)
    given = pathlib.Path(model).expanduser()
    origin = str(given.absolute()) if given.exists() else str(model)  # a path, or a name
    return save(out, params, folder, dtype, origin=origin)


def restore(
    path: str | pathlib.Path,
    mesh=None,
    dtype: str | None = None,
    rules: AxisRules = DEFAULT_RULES,
):
    """(family, config, params) from a converted folder; sharded by `rules` on `mesh`, or
    on the default device without one. dtype None keeps the saved dtype."""
    import orbax.checkpoint as ocp

    folder = pathlib.Path(path).absolute()
    if not is_converted(folder):
        raise CheckpointError(f"{folder} has no {MARKER}: it is not a converted dge_jax folder")
    marker = _marker(folder)
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise CheckpointError(
            f"{folder / MARKER} describes format {marker.get('format')!r} version "
            f"{marker.get('version')!r}; this dge_jax reads {FORMAT!r} version {VERSION}"
        )
    dtype = dtype or marker["dtype"]
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    family, cfg = parse_config(read_config(folder))
    key_map = family.key_map(cfg)
    saved = {name: tuple(shape) for name, shape in marker["fields"].items()}
    expected = {name: tuple(shape) for name, shape in key_map.shapes.items()}
    if saved != expected:
        diff = sorted(set(saved.items()) ^ set(expected.items()))
        raise CheckpointError(
            f"{folder}: saved parameters do not match its config.json (field, shape): {diff}"
        )
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = dict.fromkeys(expected, device)
    else:
        shardings = param_shardings(cfg, list(expected), mesh, rules)
    target = {
        name: jax.ShapeDtypeStruct(shape, DTYPES[dtype], sharding=shardings[name])
        for name, shape in expected.items()
    }
    try:
        restored = ocp.StandardCheckpointer().restore(folder / PARAMS_DIR, _nested(target))
    except Exception as e:  # orbax / tensorstore raise many types for missing or cut files
        cause = "a file under it is probably truncated or missing"
        raise damaged(folder, folder / PARAMS_DIR, e, cause) from e
    flat = {field_name(path): x for path, x in jax.tree_util.tree_flatten_with_path(restored)[0]}
    return family, cfg, key_map.build(flat)
