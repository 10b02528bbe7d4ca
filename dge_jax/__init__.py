"""dge_jax: training-free KV-cache compression in JAX, built around Draft-Guided Eviction."""

from importlib import metadata

from dge_jax.generation import (
    GenerationConfig,
    GenerationResult,
    generate,
    generate_for_contexts,
    generate_grid,
)
from dge_jax.model import DEFAULT_MODEL, Model, load

try:
    __version__ = metadata.version("dge_jax")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_MODEL",
    "GenerationConfig",
    "GenerationResult",
    "Model",
    "__version__",
    "generate",
    "generate_for_contexts",
    "generate_grid",
    "load",
]
