"""`generate`, `generate_grid` and `generate_for_contexts`: text in, text out.

`generate_grid` runs the stages of `dge_jax.stages` in order; `GenerationConfig` holds the
settings that are not the prompts or the evictions. ``hook``: see `dge_jax.stages`.

`generate_for_contexts`: one compressed cache per context, every question answered from it.
What kvpress's default protocol and shared-context serving do: the *context* is
compressed before (or without) its questions, then each question and its answer prefix are
fed to the compressed cache and answered. Every cell ends with a cache of the context alone
(its budget, per head, spent on context positions), and every question is then fed to that
same cache, never to another question's answer:

    cell               prompt it prefills          scores with                  keeps
    FullKV             context                     -                            every entry
    prefill timing     context                     the context's own queries    budget
    DGE-W(k)           context + anchor question   the question's queries       budget
    DGE(k)             context + anchor question   ... + k-1 draft steps'       budget

So in these protocols DGE's eviction waits past the anchor question and k answer tokens
(the first from prefill, k-1 from draft steps; the cache stays full until then), and DGE-W
is the same wait without the drafted queries: query-aware compression of the context. The
anchor question's entries and the drafts are then dropped with the evicted ones, and the
anchor question is answered from the compressed context like every other question (fed
again, so its entries see only what was kept): the first question and the later ones meet
the same cache, and what anchoring costs the later ones is their score against the anchor's.

The question tokens of every row are fed in one prefill step over the compressed cache
(`dge_jax.runtime.extend`); the answer then decodes as in `generate_grid`. Decode-time
compression is refused (it compresses the answer, not the context), and sliding-window
layers use the full layout (`window_cache`'s bounded one would already have dropped context
entries the question needs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence, Sized
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.config import with_fields
from dge_jax.distribution.sharding import on_model_mesh
from dge_jax.eviction.evict import Eviction, round_up_slots
from dge_jax.eviction.grid_plan import Evicted, check_cells, plan_grid
from dge_jax.model import Model
from dge_jax.runtime import decoding, platform
from dge_jax.runtime.extend import Question, extend, with_room
from dge_jax.runtime.quantized import check_kv_quant
from dge_jax.runtime.window_cache import LAYOUTS
from dge_jax.stages import (
    GREEDY,
    STAGES,
    GenerationResult,
    Hook,
    decode,
    draft,
    evict,
    lookahead,
    prefill,
    reconstruct,
    results,
    rewind,
    select,
)
from dge_jax.text.prompts import Request, as_prompts, pad_left, prepare
from dge_jax.text.sampling import check_sampler

__all__ = [
    "STAGES", "GenerationConfig", "GenerationResult", "Hook", "generate", "generate_for_contexts",
    "generate_grid",
]


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
    the attention implementation, "auto" (the platform's: pallas on TPU, xla elsewhere), "xla",
    "pallas" (the Pallas flash kernel for prefill and KVzip's passes, a decode kernel for draft
    and decode steps; interpret mode off TPU, slow) or "cudnn" (GPU only: prefill and KVzip's
    passes; draft and decode steps run xla); sliding_cache: how prefill's cache holds
    sliding-window layers, "bounded" (their window plus one prefill step:
    `dge_jax.runtime.window_cache`), "full" (the prompt's length, like global layers) or
    "auto" (bounded unless a cell needs the full layout: `grid_plan.plan_grid`);
    kv_quant: how the cache stores keys and values, "none" (the activation dtype), "int8"
    (one scale per token per kv head) or "int4" (KIVI's: keys per channel over groups of G
    tokens, values per token over groups of G channels, a full-precision residual block of
    R slots; "int4-g<G>-r<R>", default G 32, R 128): `dge_jax.runtime.quantized`; every
    attention reads them dequantized, every rule scores what attention reads, and eviction
    moves each entry's scale with it (int4 entries requantized where they move).
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
    kv_quant: str = "none"

    def __post_init__(self) -> None:
        platform.check_attention(self.attention)
        check_kv_quant(self.kv_quant)
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


@on_model_mesh  # a model loaded with a mesh runs every step on it (dge_jax.distribution.sharding)
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
    request, plans = evicted_plans(model, prompts, cells, cfg, hook)
    tokens, logs = decode(model, request, plans, cfg.sampler, hook, cfg.record_compressions)
    return results(model, request, plans, tokens, logs)


def evicted_plans(
    model: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    cells: Sequence[Eviction | None],
    cfg: GenerationConfig,
    hook: Hook | None = None,
    context_end: Sequence[int] | None = None,
    sliding_cache: str | None = None,
) -> tuple[Request, list[Evicted]]:
    """The grid through its evict stage: the checked request and each cell's `Evicted`, its
    state ready to decode. context_end: per row, the last position a cell may keep
    (`generate_for_contexts`; None: the whole prompt); sliding_cache: over `cfg.sliding_cache`."""
    sampler = cfg.sampler
    check_sampler(sampler)
    backend = platform.current(cfg.attention)  # the model's mesh is set (on_model_mesh)
    chunk, granule = cfg.chunk, None
    if chunk is None:
        # (prepare names what is wrong with prompts that are not a sequence)
        rows = platform.rows_per_device(len(prompts) if isinstance(prompts, Sized) else 1)
        chunk, granule = backend.chunk_for(rows), backend.prompt_bucket
    request = prepare(
        model.tokenizer, model.config, prompts, max_new_tokens=cfg.max_new_tokens,
        min_new_tokens=cfg.min_new_tokens, chat=cfg.chat, chunk=chunk,
        extra_eos_ids=cfg.extra_eos_ids, granule=granule, attention=cfg.attention,
        path=model.path, kv_quant=cfg.kv_quant,
    )  # fmt: skip
    layout = sliding_cache or cfg.sliding_cache
    grid = plan_grid(cells, request, model.config.layer_windows, layout)
    cells, recording = grid.cells, grid.recording
    prefilled = prefill(model, request, recording, sampler, cfg.seed, hook, grid.room, grid.bounded)
    prefilled = reconstruct(model, request, prefilled, recording, hook)
    looked = lookahead(model, request, prefilled, cells, recording, sampler, hook)
    # The draft writes into prefill's cache in place, unless a FullKV cell decodes from it.
    keep_start = any(ev is None for ev in cells)
    drafted = draft(model, request, prefilled, recording, sampler, hook, keep_start)
    rewound = rewind(request, prefilled, drafted, looked, cells, hook)
    end = None if context_end is None else jnp.asarray(np.asarray(context_end, np.int32))
    selected = select(model, prefilled, rewound, hook, end)
    # their full caches now live only in the cells that decode in them
    return request, evict(request, prefilled, selected, hook)


def _ids(model: Model, items: Sequence, special: bool, what: str) -> list[list[int]]:
    """Token ids of text (special tokens only where `special`) or ids as given."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if model.tokenizer is None:
                raise ValueError(f"{model.path} has no tokenizer.json; pass token ids as {what}")
            item = model.tokenizer.encode(item, add_special_tokens=special)
        ids = [int(t) for t in item]
        if not ids:
            raise ValueError(f"{what} {i} is empty: give at least one token")
        out.append(ids)
    return out


def _check(contexts, questions, anchor: int) -> tuple[list, list[list], int]:
    contexts = as_prompts(contexts)
    if isinstance(questions, str) or len(questions) != len(contexts):
        raise ValueError(
            f"questions must hold one list of questions per context ({len(contexts)}), got "
            f"{questions!r:.80}"
        )
    counts = {len(q) if not isinstance(q, str) else -1 for q in questions}
    if len(counts) != 1 or min(counts) < 1:
        raise ValueError(
            "every context needs a list of the same number (>= 1) of questions; group "
            f"contexts by how many questions they have (got counts {sorted(counts)})"
        )
    n = counts.pop()
    if not 0 <= anchor < n:
        raise ValueError(f"anchor (the question DGE drafts on) must be in [0, {n}), got {anchor}")
    return contexts, list(questions), n


def _context_cells(cells, max_new_tokens: int, windows: tuple[int, ...]) -> list:
    """The cells checked as `generate_grid` checks them (`grid_plan.check_cells`, FullKV as
    None), here before they are split into grids by timing; a cell that compresses while
    decoding is refused."""
    checked = check_cells(cells, max_new_tokens, windows)
    for i, ev in enumerate(checked):
        if ev is not None and (ev.decode is not None or ev.timing.kind == "decode"):
            raise ValueError(
                f"cell {i} compresses while decoding; generate_for_contexts compresses the "
                "context once before its questions: use timing prefill, dge, dge_w, dge_d or "
                "lookahead"
            )
    return checked


@on_model_mesh  # as generate_grid
def generate_for_contexts(
    model: Model,
    contexts: Sequence[str] | Sequence[Sequence[int]],
    questions: Sequence[Sequence[str]] | Sequence[Sequence[Sequence[int]]],
    cells: Sequence[Eviction | None],
    *,
    anchor: int = 0,
    answer_lengths: Sequence[int] | None = None,
    config: GenerationConfig | None = None,
    hook: Hook | None = None,
    **options: Any,
) -> list[list[GenerationResult]]:
    """results[cell][j]: every row's answer to its question j, from the cell's compressed
    context (module docstring). contexts: text (tokenized with the tokenizer's special
    tokens) or ids; questions: per context a list of the same number of questions, each the
    text (or ids) that follows the context, answer prefix included; anchor: the question
    DGE and DGE-W cells prefill and draft on; answer_lengths: per question j, the
    max_new_tokens of its answers (None: `max_new_tokens` for every question; given, it
    replaces that option). chat templates are the caller's (render the turn, then split it
    after the context); options: `GenerationConfig` fields."""
    cfg = GenerationConfig.of(config, options)
    if cfg.chat:
        raise ValueError(
            "generate_for_contexts takes the context and questions as they are fed: render the "
            "chat template yourself and split the text after the context (experiments.protocol "
            "does), then drop chat=True"
        )
    contexts, questions, n = _check(contexts, questions, anchor)
    lengths = _answer_lengths(answer_lengths, n, cfg)
    cfg = dataclasses.replace(cfg, max_new_tokens=max(lengths))  # the longest answer's room
    checked = _context_cells(cells, cfg.max_new_tokens, model.config.layer_windows)
    ctx = _ids(model, contexts, True, "context")
    asked = [_ids(model, q, False, f"question of context {i}") for i, q in enumerate(questions)]
    _check_positions(model, ctx, asked, lengths)
    ends = [len(c) - 1 for c in ctx]
    # DGE's cells draft on the anchor question; a lookahead continues the context itself
    drafts = [i for i, ev in enumerate(checked)
              if ev is not None and ev.timing.kind not in ("prefill", "lookahead")]  # fmt: skip
    alone = [i for i in range(len(checked)) if i not in drafts]
    layout = "full" if any(model.config.layer_windows) else None
    if layout and cfg.sliding_cache == "bounded":
        raise ValueError("sliding_cache='bounded' cannot serve shared contexts: use 'auto'")
    out: list[list[GenerationResult] | None] = [None] * len(checked)
    with_anchor = [c + q[anchor] for c, q in zip(ctx, asked, strict=True)]
    for members, prompts in ((alone, ctx), (drafts, with_anchor)):
        if not members:
            continue
        request, plans = evicted_plans(
            model, prompts, [checked[i] for i in members], cfg, hook,
            context_end=ends if members is drafts else None, sliding_cache=layout,
        )  # fmt: skip
        # Room for the longest question and the answer, once per cell: every question is fed
        # to the same grown cache (one host read of the write index, one shape to compile).
        room = _bucket(max(len(q) for row in asked for q in row)) + request.buffer
        plans = [dataclasses.replace(p, state=dataclasses.replace(
            p.state, cache=with_room(p.state.cache, room))) for p in plans]  # fmt: skip
        answers = [_answer(model, cfg, dataclasses.replace(request, max_new_tokens=lengths[j]),
                           plans, ctx, [q[j] for q in asked], hook)
                   for j in range(n)]  # fmt: skip
        for m, i in enumerate(members):
            out[i] = [a[m] for a in answers]
    return out


def _answer_lengths(lengths: Sequence[int] | None, n: int, cfg: GenerationConfig) -> list[int]:
    """Each question's max_new_tokens: `lengths` (one per question, each in
    [max(1, min_new_tokens), ...]) or the config's for all."""
    if lengths is None:
        return [cfg.max_new_tokens] * n
    if isinstance(lengths, str | bytes) or not isinstance(lengths, Sequence) or len(lengths) != n:
        raise ValueError(f"answer_lengths must hold one max_new_tokens per question ({n}), got "
                         f"{lengths!r:.80}")
    for j, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int | np.integer) or (
                length < max(1, cfg.min_new_tokens)):
            raise ValueError(f"answer_lengths[{j}] must be an int >= max(1, min_new_tokens="
                             f"{cfg.min_new_tokens}), got {length!r}")
    return [int(length) for length in lengths]


def _check_positions(model: Model, ctx: list[list[int]], asked: list[list[list[int]]],
                     lengths: list[int]) -> None:
    """Refuses a context, question and answer that together pass the model's context: their
    positions would run past what its RoPE and training cover (`generate` refuses the same)."""
    limit = model.config.max_position_embeddings
    for i, (c, row) in enumerate(zip(ctx, asked, strict=True)):
        for j, (q, n) in enumerate(zip(row, lengths, strict=True)):
            if len(c) + len(q) + n > limit:
                raise ValueError(
                    f"context {i} ({len(c)} tokens), its question {j} ({len(q)} tokens) and "
                    f"max_new_tokens={n} need {len(c) + len(q) + n} positions; the model's "
                    f"context is {limit}: truncate the context or lower max_new_tokens"
                )


def _bucket(tokens: int) -> int:
    """A question's fed length: nearby lengths share a compilation."""
    return round_up_slots(tokens, 16)


def _answer(model, cfg, request: Request, plans: list[Evicted], ctx, asked, hook):
    """Every cell's answers to one question per row: the question fed to the cell's
    compressed context, then decoded."""
    q = _bucket(max(map(len, asked)))
    tokens, lengths = pad_left(asked, q)
    start = np.array([len(c) for c in ctx], np.int32)
    offset = np.arange(q, dtype=np.int32)[None, :] - (q - lengths)[:, None]
    positions = np.where(offset >= 0, start[:, None] + offset, -1).astype(np.int32)
    key, first_key = jax.random.split(jax.random.PRNGKey(cfg.seed))
    states = []
    for plan in plans:
        question = Question(jnp.asarray(tokens), jnp.asarray(positions))
        logits, cache = extend(model.forward, model.config, model.params, plan.state.cache,
                               question, attention=request.attention)  # fmt: skip
        active = request.min_new_tokens > 0
        first = cfg.sampler(decoding.suppress_eos(logits, request.eos_ids, active), first_key)
        states.append(decoding.start_state(
            cache, first, jnp.asarray(start + lengths), request.max_new_tokens,
            request.eos_ids, key, buffer=request.buffer,
        ))  # fmt: skip
    fed = dataclasses.replace(request, prompt_ids=[c + a for c, a in zip(ctx, asked, strict=True)])
    ready = [dataclasses.replace(p, state=s) for p, s in zip(plans, states, strict=True)]
    tokens_out, _ = decode(model, fed, ready, cfg.sampler, hook)
    return results(model, fed, plans, tokens_out)

