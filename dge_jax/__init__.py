"""dge_jax: training-free KV-cache compression in JAX, built around Draft-Guided Eviction.

The public API is what this module exports (`__all__`): loading a model, the three generate
functions, the eviction spec (`Eviction`, `Timing` and their options) and the scoring rules.
The subpackages are the implementation; their functions (the jitted stages of
`dge_jax.stages`, selection and compaction in `dge_jax.eviction`) are documented for research
code that composes them under its own `jax.jit`, but may change between minor releases.
"""

from importlib import metadata

from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import HEAD_BUDGETS, Eviction
from dge_jax.eviction.timing import KINDS as TIMINGS
from dge_jax.eviction.timing import Adaptive, Lookahead, Timing
from dge_jax.generation import (
    GenerationConfig,
    GenerationResult,
    generate,
    generate_for_contexts,
    generate_grid,
)
from dge_jax.model import DEFAULT_MODEL, Model, load
from dge_jax.rules.base import Rule
from dge_jax.rules.chunkkv import ChunkKV
from dge_jax.rules.criticalkv import CriticalKV
from dge_jax.rules.expected_attention import ExpectedAttention
from dge_jax.rules.full import FullKV
from dge_jax.rules.h2o import H2O
from dge_jax.rules.keydiff import KeyDiff
from dge_jax.rules.knorm import KeyNorm
from dge_jax.rules.kvzip import KVzip
from dge_jax.rules.lagkv import LagKV
from dge_jax.rules.pyramidkv import PyramidKV
from dge_jax.rules.random import RandomScores
from dge_jax.rules.registry import RULES, make_rule
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.streamingllm import StreamingLLM
from dge_jax.rules.tova import TOVA

try:
    __version__ = metadata.version("dge_jax")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_MODEL",
    "HEAD_BUDGETS",
    "RULES",
    "TIMINGS",
    "TOVA",
    "Adaptive",
    "ChunkKV",
    "CriticalKV",
    "DecodeCompression",
    "Eviction",
    "ExpectedAttention",
    "FullKV",
    "GenerationConfig",
    "GenerationResult",
    "H2O",
    "KVzip",
    "KeyDiff",
    "KeyNorm",
    "LagKV",
    "Lookahead",
    "Model",
    "PyramidKV",
    "RandomScores",
    "Rule",
    "SnapKV",
    "StreamingLLM",
    "Timing",
    "__version__",
    "generate",
    "generate_for_contexts",
    "generate_grid",
    "load",
    "make_rule",
]
