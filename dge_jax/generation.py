"""`generate` and `generate_grid`: text in, text out.

`generate_grid` runs the stages of `dge_jax.stages` in order; `GenerationConfig` holds the
settings that are not the prompts or the evictions. ``hook``: see `dge_jax.stages`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence, Sized
from typing import Any

from dge_jax.config import with_fields
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.grid_plan import GridRecording, bounded_sliding, cache_room, check_cells
from dge_jax.model import Model
from dge_jax.runtime import platform
from dge_jax.runtime.prompts import prepare
from dge_jax.runtime.sampling import check_sampler
from dge_jax.runtime.sharding import on_model_mesh
from dge_jax.runtime.window_cache import LAYOUTS
from dge_jax.stages import (
    GREEDY,
    STAGES,
    GenerationResult,
    Hook,
    decode,
    draft,
    evict,
    prefill,
    reconstruct,
    results,
    rewind,
    select,
)

__all__ = ["STAGES", "GenerationConfig", "GenerationResult", "Hook", "generate", "generate_grid"]


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How to generate, apart from the prompts and the evictions; static per call.

    max_new_tokens / min_new_tokens: answer length bounds (EOS is banned before the minimum,
    transformers' min_length); chat: wrap text prompts in the chat template; sampler:
    `Greedy()` or `Sampling(...)`; seed: the PRNG seed of sampling; chunk: prompt tokens per
    prefill step (None: the platform's, 512 on CPU and 8192 tokens of a device's rows together
    on TPU / GPU with prompts padded to multiples of 512: `platform.Backend.chunk_for`);
    extra_eos_ids: ids that end an answer besides the tokenizer's EOS; record_compressions:
    keep what each decode-time compression kept (`GenerationResult.compressions`); attention:
    prefill's attention implementation, "auto" (the platform's: pallas on TPU, xla elsewhere),
    "xla", "pallas" (the Pallas flash kernel; interpret mode off TPU, slow) or "cudnn" (GPU
    only); sliding_cache: how prefill's cache holds sliding-window layers, "bounded" (their
    window plus one prefill step: `dge_jax.runtime.window_cache`), "full" (the prompt's
    length, like global layers) or "auto" (bounded unless a cell needs the full layout:
    `grid_plan.bounded_sliding`).
    """

    max_new_tokens: int = 64
    min_new_tokens: int = 0
    chat: bool = False
    sampler: Any = GREEDY
    seed: int = 0
    chunk: int | None = None
    extra_eos_ids: Sequence[int] = ()
    record_compressions: bool = False
    attention: str = "auto"
    sliding_cache: str = "auto"

    def __post_init__(self) -> None:
        platform.check_attention(self.attention)
        if self.sliding_cache not in LAYOUTS:
            raise ValueError(f"sliding_cache must be one of {LAYOUTS}, got {self.sliding_cache!r}")

    @classmethod
    def of(cls, config: GenerationConfig | None, options: dict[str, Any]) -> GenerationConfig:
        """`config` (default: the defaults) with `options` (fields by name) replacing fields."""
        return with_fields(cls, config, options, "config")


def generate(
    model: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    eviction: Eviction | None = None,
    config: GenerationConfig | None = None,
    hook: Hook | None = None,
    **options: Any,
) -> GenerationResult:
    """Generates for a batch of prompts (text, or lists of token ids); each row is scored and
    evicted on its own when `eviction` is given (None = FullKV). options: fields of
    `GenerationConfig` by name (``max_new_tokens=32``), over `config`'s."""
    return generate_grid(model, prompts, [eviction], config=config, hook=hook, **options)[0]


@on_model_mesh  # a model loaded with a mesh runs every step on it (dge_jax.runtime.sharding)
def generate_grid(
    model: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    cells: Sequence[Eviction | None],
    *,
    config: GenerationConfig | None = None,
    hook: Hook | None = None,
    **options: Any,
) -> list[GenerationResult]:
    """One result per cell (an `Eviction`, or None for FullKV) for the same prompts.

    The research loop: one prefill serves every cell, and one draft per k serves every DGE
    and DGE-W cell of that k (the cache is functional, so each cell evicts its own copy).
    Cells with `Eviction.decode` also compress while decoding; record_compressions keeps
    what each of their compressions kept (`GenerationResult.compressions`). options: fields
    of `GenerationConfig` by name, over `config`'s.
    """
    cfg = GenerationConfig.of(config, options)
    sampler = cfg.sampler
    check_sampler(sampler)
    backend = platform.current(cfg.attention)  # the model's mesh is set (on_model_mesh)
    chunk, granule = cfg.chunk, None
    if chunk is None:
        # (prepare names what is wrong with prompts that are not a sequence)
        rows = platform.rows_per_device(len(prompts) if isinstance(prompts, Sized) else 1)
        chunk, granule = backend.chunk_for(rows), backend.prompt_bucket
    request = prepare(
        model, prompts, max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.min_new_tokens,
        chat=cfg.chat, chunk=chunk, extra_eos_ids=cfg.extra_eos_ids, granule=granule,
        attention=cfg.attention,
    )  # fmt: skip
    cells = check_cells(cells, cfg.max_new_tokens, model.config.layer_windows)
    recording = GridRecording.of(cells)
    bounded = bounded_sliding(cells, model.config.layer_windows, cfg.sliding_cache)
    prefilled = prefill(
        model, request, recording, sampler, cfg.seed, hook, cache_room(request, cells), bounded
    )
    prefilled = reconstruct(model, request, prefilled, recording, hook)
    # The draft writes into prefill's cache in place, unless a FullKV cell decodes from it.
    keep_start = any(ev is None for ev in cells)
    drafted = draft(model, request, prefilled, recording, sampler, hook, keep_start)
    plans = rewind(request, prefilled, drafted, cells, hook)
    plans = select(model, prefilled, plans, hook)
    plans = evict(request, prefilled, plans, hook)
    del prefilled, drafted  # their full caches now live only in the plans that decode in them
    tokens, logs = decode(model, request, plans, sampler, hook, cfg.record_compressions)
    return results(model, request, plans, tokens, logs)
