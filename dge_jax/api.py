"""`generate`: text in, text out, on the jitted pieces of `dge_jax.generate`.

This host-side layer checks inputs, tokenizes, left-pads prompts to a length bucket (so
nearby lengths share one compilation), runs prefill -> (draft -> evict) -> decode, and turns
ids back into text. Everything numeric happens in the pure functions it calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax import decoding as gen
from dge_jax.cache import Observation
from dge_jax.eviction import (
    SLOT_MULTIPLE,
    Eviction,
    apply_eviction,
    check_eviction,
    keep_masks,
    kept_positions,
    layer_capacities,
    scoring_key,
)
from dge_jax.model import Model
from dge_jax.sampling import Greedy
from dge_jax.sharding import on_model_mesh

DEFAULT_CHUNK = 512
GREEDY = Greedy()
MIN_BUCKET = 16


def bucket_length(n: int, chunk: int = DEFAULT_CHUNK) -> int:
    """Padded prompt length for n tokens: a power of two up to `chunk`, then a multiple of it.

    e.g. chunk 512: 10 -> 16, 300 -> 512, 513 -> 1024, 1500 -> 1536.
    """
    if n <= chunk:  # capped at the chunk, so prefill's "multiple of the chunk" always holds
        return min(chunk, max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length()))
    return -(-n // chunk) * chunk


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """prompt_tokens: ids fed per row; tokens: generated ids per row (up to and including the
    first EOS); texts: decoded `tokens`; kept: per row, layer and kv head, the original
    positions held right after eviction (None without eviction); k: per row, the answer
    tokens generated with the full cache before eviction (None without eviction)."""

    prompt_tokens: list[list[int]]
    tokens: list[list[int]]
    texts: list[str]
    kept: list[list[list[list[int]]]] | None = None
    k: list[int] | None = None


def encode_prompts(model: Model, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    """Token ids per prompt (through the chat template when `chat`)."""
    if model.tokenizer is None:
        raise ValueError(f"{model.path} has no tokenizer.json; pass token ids instead of text")
    if chat:
        return [model.tokenizer.encode_chat(p) for p in prompts]
    return [model.tokenizer.encode(p) for p in prompts]


def check_request(
    model: Model,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    min_new_tokens: int = 0,
) -> None:
    """Clear errors for requests that would otherwise fail deep inside XLA or silently."""
    for name, value in (("max_new_tokens", max_new_tokens), ("min_new_tokens", min_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(
            f"min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], got "
            f"{min_new_tokens} (EOS is banned until min_new_tokens tokens exist)"
        )
    if not prompt_ids:
        raise ValueError("no prompts given")
    ctx = model.config.max_position_embeddings
    for i, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token")
        if len(ids) + max_new_tokens > ctx:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it "
                f"exceeds the model's context of {ctx} positions (truncate the prompt)"
            )
        bad = [t for t in ids if not 0 <= int(t) < model.config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token ids outside [0, {model.config.vocab_size}): {bad[:5]}"
            )


def pad_left(prompt_ids: Sequence[Sequence[int]], t: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens [B, t] int32 left-padded with 0, lengths [B] int32."""
    tokens = np.zeros((len(prompt_ids), t), np.int32)
    for i, ids in enumerate(prompt_ids):
        tokens[i, t - len(ids) :] = ids
    return tokens, np.array([len(ids) for ids in prompt_ids], np.int32)


def generate(
    model: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 64,
    chat: bool = False,
    sampler=GREEDY,
    seed: int = 0,
    chunk: int = DEFAULT_CHUNK,
    extra_eos_ids: Sequence[int] = (),
    min_new_tokens: int = 0,
    eviction: Eviction | None = None,
) -> GenerationResult:
    """Generates for a batch of prompts (text, or lists of token ids); each row is scored and
    evicted on its own when `eviction` is given (None = FullKV)."""
    return generate_grid(
        model,
        prompts,
        [eviction],
        max_new_tokens=max_new_tokens,
        chat=chat,
        sampler=sampler,
        seed=seed,
        chunk=chunk,
        extra_eos_ids=extra_eos_ids,
        min_new_tokens=min_new_tokens,
    )[0]


@on_model_mesh  # a model loaded with a mesh runs every step on it (dge_jax.sharding)
def generate_grid(
    model: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    cells: Sequence[Eviction | None],
    *,
    max_new_tokens: int = 64,
    chat: bool = False,
    sampler=GREEDY,
    seed: int = 0,
    chunk: int = DEFAULT_CHUNK,
    extra_eos_ids: Sequence[int] = (),
    min_new_tokens: int = 0,
) -> list[GenerationResult]:
    """One result per cell (an `Eviction`, or None for FullKV) for the same prompts.

    The research loop: one prefill serves every cell, and one draft per k serves every DGE
    and DGE-W cell of that k (the cache is functional, so each cell evicts its own copy).
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if prompts and isinstance(prompts[0], str):
        prompt_ids = encode_prompts(model, prompts, chat)
    else:
        if chat:
            raise ValueError(
                "chat=True applies the chat template to text prompts; these prompts are token "
                "ids, which are used as given: pass the text, or drop chat=True"
            )
        prompt_ids = [list(map(int, p)) for p in prompts]
    check_request(model, prompt_ids, max_new_tokens, min_new_tokens)
    cells = [None if ev is None or ev.policy.is_full else ev for ev in cells]
    for ev in cells:
        if ev is not None:
            check_eviction(ev, max_new_tokens)
    active = [ev for ev in cells if ev is not None]
    obs_window = max((ev.policy.obs_window for ev in active), default=0)
    record_attn = any(ev.policy.needs_attn_sum for ev in active)
    eos_ids = tuple(
        sorted(set(model.tokenizer.eos_ids if model.tokenizer else ()) | set(extra_eos_ids))
    )
    t = bucket_length(max(map(len, prompt_ids)), chunk)
    buffer = bucket_length(max_new_tokens, chunk)  # token buffer; the loop stops at the limit
    tokens, lengths = pad_left(prompt_ids, t)
    fwd, cfg, params = model.forward, model.config, model.params
    pre = gen.prefill(
        fwd,
        cfg,
        params,
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        capacity=t + buffer,
        chunk=chunk,
        obs_window=obs_window,
        record_attn=record_attn,
    )
    key, first_key = jax.random.split(jax.random.PRNGKey(seed))
    first = sampler(gen.suppress_eos(pre.logits, eos_ids, min_new_tokens > 0), first_key)
    start = gen.start_state(
        pre.cache, first, jnp.asarray(lengths), max_new_tokens, eos_ids, key, buffer=buffer
    )
    # One draft to the largest k any cell needs; `rewind` replays any shorter draft from it
    # (per row, for adaptive k), so every k shares one draft and one compiled scorer.
    max_steps = max((ev.timing.draft_steps for ev in active), default=0)
    drafted = all_drafts = entropy = top1 = None
    if max_steps:
        drafted, all_drafts = gen.draft(
            fwd,
            cfg,
            params,
            start,
            sampler=sampler,
            eos_ids=eos_ids,
            num_steps=max_steps,
            record_q=obs_window > 0,
            record_attn=record_attn,
            min_new_tokens=min_new_tokens,
        )
        # Next-token statistics of t1 (prefill logits), t2, ..., for adaptive drafting.
        e1, p1 = gen.next_token_stats(pre.logits)
        entropy = np.concatenate([np.asarray(e1)[:, None], np.asarray(all_drafts.entropy)], 1)
        top1 = np.concatenate([np.asarray(p1)[:, None], np.asarray(all_drafts.top1)], 1)
    # Pass 1: every cell's keep mask (cheap), so all compacted cells can share capacities
    # and hence one compiled decode loop.
    plans = []  # (state at the eviction point, keep mask or None, draft steps per row)
    # One rewound state per distinct steps-per-row, shared by the cells that need it: each
    # rewind returns a fresh copy of the whole cache, which per cell made a 45-cell grid
    # hold 45 full caches at once.
    rewound: dict[tuple[int, ...], tuple[gen.DecodeState, gen.DraftRecord]] = {}
    # Cells with the same state and scoring that differ only by budget: scored once.
    # (rewound steps, scoring key) -> (state, draft record, cell indices)
    sweeps: dict[tuple, tuple[gen.DecodeState, gen.DraftRecord | None, list[int]]] = {}
    for i, ev in enumerate(cells):
        if ev is None:
            plans.append((start, None, None))
            continue
        state, drafts, steps, key = start, None, None, ()
        if drafted is not None:
            # "prefill" cells rewind to 0 steps: the pre-draft cache, with the draft record
            # masked out, so the three timings share one compiled scorer.
            steps = ev.timing.steps_per_row(entropy, top1)
            key = tuple(int(s) for s in steps)
            if key not in rewound:
                rewound[key] = gen.rewind(
                    drafted, all_drafts, jnp.asarray(lengths), jnp.asarray(steps), eos_ids=eos_ids
                )
            state, drafts = rewound[key]
        sweeps.setdefault((key, scoring_key(ev)), (state, drafts, []))[2].append(i)
        plans.append((state, None, steps))  # keep mask filled in below
    for state, drafts, members in sweeps.values():
        obs, drafts = observation_for(cells[members[0]].policy, pre.obs, drafts)
        masks = keep_masks(state.cache, obs, drafts, [cells[i] for i in members])
        for i, keep in zip(members, masks, strict=True):
            _, _, steps = plans[i]
            plans[i] = (state, keep, steps)
    counts = [np.asarray(jnp.sum(keep, axis=-1)) for _, keep, _ in plans if keep is not None]
    # Room for every new token, rounded up like the kept entries, so that grids with nearby
    # max_new_tokens still share a compiled decode. (Not the token buffer's chunk bucket:
    # every decode step reads every slot, and a 512-token bucket for 64 new tokens made a
    # budget-512 grid attend over 1024 slots instead of 640.)
    # Capacities are per layer: a grid with PyramidKV cells would otherwise give every layer
    # the bottom layer's slots (1,024 for all 30 layers of SmolLM2 at budget 512, where the
    # layers' largest heads need 576 to 1,024), and every decode step reads every slot.
    room = -(-max_new_tokens // SLOT_MULTIPLE) * SLOT_MULTIPLE
    shared_capacity = layer_capacities(np.max(counts, axis=0), room) if counts else None
    # Pass 2: evict each cell (mask or compact) ...
    evicted = []
    for ev, (state, keep, _) in zip(cells, plans, strict=True):
        if keep is not None:
            capacity = ev.capacity or shared_capacity
            remaining = max_new_tokens - int(np.min(np.asarray(state.step)))
            cache = apply_eviction(state.cache, keep, ev, capacity, remaining)
            state = dataclasses.replace(state, cache=cache)
        evicted.append(state)
    # ... then decode cells whose caches have the same shape as one batch: decoding reads
    # the weights once per step for all of them, so a grid costs little more than one cell.
    groups: dict[tuple, list[int]] = {}
    for i, state in enumerate(evicted):
        cache = state.cache
        groups.setdefault((cache.capacities, isinstance(cache.k, tuple), cache.dtype), []).append(i)
    tokens_of: list[np.ndarray | None] = [None] * len(cells)  # each cell's [B, N] tokens
    for members in groups.values():
        # stack_states copies, so the decode below may donate it (cells share buffers).
        stacked = gen.stack_states([evicted[i] for i in members])
        stacked = gen.decode(
            fwd,
            cfg,
            params,
            stacked,
            sampler=sampler,
            eos_ids=eos_ids,
            min_new_tokens=min_new_tokens,
        )
        # Only the tokens come back: splitting the whole state would copy every cell's
        # final cache for nothing.
        parts = gen.split_rows(np.asarray(stacked.tokens), len(members))
        for i, tokens in zip(members, parts, strict=True):
            tokens_of[i] = tokens
    results = []
    for tokens, (at_eviction, keep, steps) in zip(tokens_of, plans, strict=True):
        out_ids = cut_at_eos(tokens[:, :max_new_tokens], eos_ids)
        texts = [model.tokenizer.decode(ids) if model.tokenizer else "" for ids in out_ids]
        kept = None if keep is None else kept_positions(at_eviction.cache, keep)
        results.append(
            GenerationResult(
                prompt_tokens=[list(p) for p in prompt_ids],
                tokens=out_ids,
                texts=texts,
                kept=kept,
                k=None
                if keep is None
                else [1 + int(n) for n in (steps if steps is not None else [0] * len(prompt_ids))],
            )
        )
    return results


def observation_for(policy, obs: Observation, drafts: gen.DraftRecord | None):
    """The shared prefill observation and draft record cut to what `policy` reads.

    Prefill recorded the largest window any cell needs; a policy with a smaller window sees
    only its own last w queries, and one that reads no queries (or no attention) sees none.
    """
    w = policy.obs_window
    q = q_pos = is_draft = None
    if w:
        q, q_pos, is_draft = obs.q[:, :, :, -w:], obs.q_pos[:, -w:], obs.is_draft[-w:]
    attn = obs.attn_sum if policy.needs_attn_sum else None
    obs = Observation(q=q, q_pos=q_pos, attn_sum=attn, is_draft=is_draft, prompt_end=obs.prompt_end)
    if drafts is not None:
        drafts = drafts._replace(
            q=drafts.q if w else None, probs=drafts.probs if policy.needs_attn_sum else None
        )
    return obs, drafts


def cut_at_eos(tokens: np.ndarray, eos_ids: Sequence[int]) -> list[list[int]]:
    """Per row, the ids up to and including the first EOS (as transformers returns them).

    tokens: [B, N] int -> B lists of ints.
    """
    rows = []
    for row in tokens.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        rows.append(row[:end])
    return rows
