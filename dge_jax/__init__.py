"""dge_jax: training-free KV-cache compression in JAX, built around Draft-Guided Eviction."""

from dge_jax.api import GenerationResult, generate
from dge_jax.model import DEFAULT_MODEL, Model, load

__all__ = ["DEFAULT_MODEL", "GenerationResult", "Model", "generate", "load"]
