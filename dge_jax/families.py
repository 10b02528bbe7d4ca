"""The small protocol between `dge_jax` and the model families that live in `models/`.

A family says how to read a Hugging Face config (`parse_config`), how checkpoint tensor names
map onto its parameters (`key_map`), and how to run a forward pass over the padded cache
(`forward`). `dge_jax` never imports a family: a family package registers its families here
when it is imported, and declares itself as an entry point of the group "dge_jax.families"
(setup.cfg: `builtin = models`), which `get_family` loads on first use, as plugins are found.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from dge_jax.config import ConfigError, ModelConfig

if TYPE_CHECKING:  # named in ForwardOutput's annotation only: runtime/ is the layer above
    from dge_jax.runtime.cache import KVCache


class ForwardOutput(NamedTuple):
    """What a forward pass returns.

    logits: [B, V] f32 (last position) or [B, T, V] f32 (every position), or None.
    cache: the cache with the T new entries written at slots [index, index + T).
    recorded: one value per recorder of the call's `recording` (in its order), each stacked
    over the layers [L, ...] (`dge_jax.runtime.recorders`; `Recording.get` finds one by type).
    """

    logits: jax.Array | None
    cache: KVCache
    recorded: tuple = ()


# forward(config, params, tokens [B, T], positions [B, T], cache, *, layers, recording,
#         logits, key_block, attention) -> ForwardOutput. The layers run group by group over the
# cache's layer groups (`dge_jax.runtime.cache`); `layers` gives the layer weights grouped like
# the cache (`cache.group_layers`, made once outside a decode loop), None groups them per call;
# `recording` (a `dge_jax.runtime.recorders.Recording`) says what each layer records: the
# family builds a `LayerView` per layer and calls `recording.layer(view)`, and asks its
# attention for per-slot probability sums when `recording.reads_probs_sum`; `attention` names
# a prefill chunk's attention implementation (`dge_jax.runtime.platform.ATTENTION`).
ForwardFn = Callable[..., ForwardOutput]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One ported architecture: config parser, checkpoint key map, forward pass, random
    init and the logical axes of its parameters (one weight table in the family gives them
    all: `models.llama_like.WEIGHTS`)."""

    model_type: str
    parse_config: Callable[[dict[str, Any]], ModelConfig]
    key_map: Callable[[ModelConfig], Any]
    forward: ForwardFn
    init_params: Callable[..., Any]
    # field ("layers.wq") -> logical axes ("layers", "embed", "heads"): how
    # `dge_jax.distribution.sharding` lays each parameter out on a mesh.
    param_axes: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # (cfg, params) -> [L, Hq, hd, D], each query head's rows of W_o; None if not provided
    # (rules that need it, CriticalKV, then raise).
    out_projection: Callable[[ModelConfig, Any], jax.Array] | None = None


_FAMILIES: dict[str, ModelFamily] = {}
ENTRY_POINT_GROUP = "dge_jax.families"
_DISCOVERED = False


def register_family(family: ModelFamily) -> None:
    """Makes `family` loadable by its Hugging Face `model_type`."""
    _FAMILIES[family.model_type] = family


def _discover() -> None:
    """Imports every installed family package (entry points of `ENTRY_POINT_GROUP`, such as
    this project's `models`); importing one registers its families."""
    global _DISCOVERED
    if not _DISCOVERED:
        for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
            _load(entry)
        _DISCOVERED = True


def _load(entry: metadata.EntryPoint) -> None:
    """Imports one family package, past a same-named folder that shadows it.

    A folder without `__init__.py` on `sys.path` (a `./models/` of checkpoints, with the
    working directory first on the path under `python -m` and in notebooks) is a namespace
    package to Python's path finder, which is asked before the finder of an editable install:
    `import models` would then give that folder and register nothing. Such a namespace module
    is dropped and the package imported again with the folders holding it off the path.
    """
    top = entry.module.partition(".")[0]
    module = importlib.import_module(top)
    if getattr(module, "__file__", None) is not None:  # a real package (or module)
        entry.load()
        return
    shadows = {os.path.dirname(os.path.abspath(p)) for p in module.__path__}
    for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
        del sys.modules[name]
    kept, sys.path[:] = list(sys.path), [
        p for p in sys.path if os.path.abspath(p or os.curdir) not in shadows]
    try:
        module = importlib.import_module(top)
    except ImportError:
        module = None
    finally:
        sys.path[:] = kept
    if module is None or getattr(module, "__file__", None) is None:
        sys.modules.pop(top, None)
        raise ConfigError(
            f"the model families' package {top!r} (entry point {entry.name!r} of "
            f"{ENTRY_POINT_GROUP!r}) is not installed; only the folder(s) "
            f"{sorted(shadows)} carry that name: install dge_jax (pip install -e . in a "
            "checkout)"
        )
    entry.load()


def get_family(model_type: str) -> ModelFamily:
    """The family registered for `model_type`; a clear error for an unknown one."""
    _discover()  # the installed families, even if a user registered one first
    if model_type not in _FAMILIES:
        if not _FAMILIES:
            raise ConfigError(
                f"no model family is registered (entry points {ENTRY_POINT_GROUP!r}): install "
                "dge_jax (pip install -e . in a checkout), or import models before loading"
            )
        raise ConfigError(
            f"unknown model_type {model_type!r} in config.json; supported: "
            f"{', '.join(sorted(_FAMILIES))}"
        )
    return _FAMILIES[model_type]
