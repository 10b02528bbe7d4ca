"""The stages of `generate_grid`, one function each, over what each holds per cell.

    prepare -> prefill -> reconstruct -> lookahead -> draft -> rewind -> select -> evict
        -> decode -> results

The numeric work happens in the pure jitted functions the stages call
(`dge_jax.runtime.decoding`, `dge_jax.eviction.evict`). A grid of cells (evictions, or None for
FullKV) shares one prefill and one draft to the largest k, as its `grid_plan.GridPlan` says;
each cell then goes through the later stages as `grid_plan.Rewound`, `Selected`, `Evicted`.

``hook``: every jitted step runs as ``hook(stage, fn, *args, **kwargs)`` (default: just
``fn(*args, **kwargs)``), with stage one of `STAGES`: how a benchmark times the stages without
touching the library.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.distribution.multihost import fetch
from dge_jax.eviction import decode_compression, observation
from dge_jax.eviction import lookahead as laq
from dge_jax.eviction.decode_spec import CAP_MULTIPLE
from dge_jax.eviction.evict import (
    SelectionSpec,
    apply_eviction,
    keep_masks,
    layer_capacities,
    round_up_slots,
    scoring_key,
    spreads_budget,
)
from dge_jax.eviction.grid_plan import Evicted, GridRecording, Rewound, Selected
from dge_jax.model import Model
from dge_jax.runtime import decoding, stacking, window_cache
from dge_jax.runtime.decoding import DecodeState, PrefillOutput, PrefillSpec, StepSpec
from dge_jax.runtime.records import DraftRecord
from dge_jax.runtime.selection import kept_positions
from dge_jax.text.prompts import Request, cut_at_eos
from dge_jax.text.sampling import Greedy

GREEDY = Greedy()
# The jitted steps a hook sees, in the order they first run.
STAGES = (
    "prefill", "reconstruct", "lookahead", "draft", "rewind", "keep_masks", "apply_eviction",
    "stack_states", "decode", "decode_compressed",
)  # fmt: skip
Hook = Callable[..., Any]  # hook(stage, fn, *args, **kwargs) -> fn(*args, **kwargs)


def _call(hook: Hook | None, stage: str, fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs) if hook is None else hook(stage, fn, *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """prompt_tokens: ids fed per row; tokens: generated ids per row (up to and including the
    first EOS); texts: decoded `tokens`; kept: per row, layer and kv head, the original
    positions held right after eviction (None without eviction); k: per row, the answer
    tokens generated with the full cache before eviction (None without eviction);
    compressions: per row, what each decode-time compression kept
    (`decode_compression.kept_over_time`; None unless asked for with
    ``record_compressions``)."""

    prompt_tokens: list[list[int]]
    tokens: list[list[int]]
    texts: list[str]
    kept: list[list[list[list[int]]]] | None = None
    k: list[int] | None = None
    compressions: list[list[dict]] | None = None


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """The prefill stage's output: pre (logits, cache, observation) and the decode state with
    the first answer token chosen (`start`)."""

    pre: PrefillOutput
    start: DecodeState


@dataclasses.dataclass(frozen=True)
class Drafted:
    """The draft stage's output: the state after K draft steps, what they recorded, and the
    next-token statistics of t1 (from the prefill logits) .. t_{K+1}: entropy, top1 [B, K+1]."""

    state: DecodeState
    record: DraftRecord
    entropy: np.ndarray
    top1: np.ndarray


def prefill(
    model: Model,
    request: Request,
    recording: GridRecording,
    sampler,
    seed: int,
    hook=None,
    room: int | None = None,
    bounded: bool = False,
) -> Prefilled:
    """Prefill once for every cell, recording what any cell's rule reads (the largest
    query window, attention sums, query statistics, rules' own recorders); choose the first
    answer token. room: slots after the prompt (default: the token buffer, room for every
    new token; `GridPlan.room`); bounded: sliding layers hold their window plus one prefill
    step, not the prompt (`dge_jax.runtime.window_cache`)."""
    capacity = request.tokens.shape[1] + (request.buffer if room is None else room)
    if bounded:
        capacity = window_cache.layer_capacities(
            model.config.layer_windows, capacity, request.chunk
        )
    spec = PrefillSpec(capacity, chunk=request.chunk, recording=recording.needs.recording,
                       attention=request.attention, kv_quant=request.kv_quant)  # fmt: skip
    pre = _call(
        hook, "prefill", decoding.prefill_prompt,
        model.forward, model.config, model.params,
        jnp.asarray(request.tokens), jnp.asarray(request.lengths), spec,
    )  # fmt: skip
    key, first_key = jax.random.split(jax.random.PRNGKey(seed))
    eos_ids = request.eos_ids
    first = sampler(
        decoding.suppress_eos(pre.logits, eos_ids, request.min_new_tokens > 0), first_key
    )
    start = decoding.start_state(
        pre.cache, first, jnp.asarray(request.lengths), request.max_new_tokens, eos_ids, key,
        buffer=request.buffer,
    )  # fmt: skip
    return Prefilled(pre=pre, start=start)


def reconstruct(
    model: Model, request: Request, prefilled: Prefilled, recording: GridRecording, hook=None
) -> Prefilled:
    """KVzip's extra passes, when a cell reads them: the model repeats the prompt chunk by
    chunk over prefill's cache; the attention each prompt entry got goes into `obs.recon`.
    The cache itself is unchanged (the repeat entries are written into a scratch copy)."""
    stage = recording.needs.reconstruction
    if stage is None:
        return prefilled
    pre = prefilled.pre
    scores, _ = stage.scores(
        model.forward, model.config, model.params, model.tokenizer, pre.cache,
        request.prompt_ids, bucket=request.chunk,
        call=lambda fn, *a, **k: _call(hook, "reconstruct", fn, *a, **k),
        attention=request.attention,
    )  # fmt: skip
    obs = dataclasses.replace(pre.obs, recon=scores)
    return dataclasses.replace(prefilled, pre=pre._replace(obs=obs))


def lookahead(
    model: Model,
    request: Request,
    prefilled: Prefilled,
    cells,
    recording: GridRecording,
    sampler,
    hook=None,
) -> dict[tuple, DraftRecord]:
    """Every "lookahead" cell's record, one per `laq.lookahead_key`: k steps from the first
    answer token on a compacted copy of prefill's cache (`laq.first_stage`), each row's steps
    after its EOS unobserved, attention moved onto the full cache's slots. Runs before the
    draft, which may take prefill's cache; each copy goes when its steps end."""
    records: dict[tuple, DraftRecord] = {}
    cache = prefilled.start.cache
    for ev in cells:
        if ev is None or ev.timing.kind != "lookahead":
            continue
        key = laq.lookahead_key(ev)
        if key in records:
            continue
        first, steps = key
        obs, _ = observation.for_rule(first.rule, prefilled.pre.obs, None)
        if first.rule.needs.out_proj:
            obs = dataclasses.replace(obs, out_proj=out_projection(model))
        keep = _call(hook, "keep_masks", keep_masks, cache, obs, None, [first],
                     model.config.layer_windows)[0]  # fmt: skip
        copy = _call(hook, "apply_eviction", apply_eviction, cache, keep, first, None, steps)
        state = laq.start(prefilled.start, copy, steps, request.eos_ids)
        before = jnp.copy(state.step)  # the state is donated
        spec = StepSpec(sampler, request.eos_ids, request.min_new_tokens,
                        recording.needs.recording.steps, request.attention)  # fmt: skip
        state, record = _call(
            hook, "lookahead", decoding.draft_tokens,
            model.forward, model.config, model.params, state, spec, num_steps=steps,
        )  # fmt: skip
        record = laq.observed_steps(record, before, state.step)
        if record.probs is not None:
            probs = laq.onto_slots(record.probs, state.cache.padded_pos(), cache.padded_pos())
            record = record._replace(probs=probs)
        records[key] = record
    return records


def draft(
    model: Model,
    request: Request,
    prefilled: Prefilled,
    recording: GridRecording,
    sampler,
    hook=None,
    keep_start: bool = False,
) -> Drafted | None:
    """One draft to the largest k any cell needs (None if none drafts): `rewind` replays any
    shorter draft from it, per row for adaptive k, so every k shares one draft and one
    compiled scorer.

    The draft donates prefill's state: its entries are written into prefill's cache in place,
    which is gone after (one full cache, not two). keep_start: a cell still decodes from
    prefill's state (FullKV), so the draft runs on a copy of it instead."""
    if not recording.draft_steps:
        return None
    start = jax.tree.map(jnp.copy, prefilled.start) if keep_start else prefilled.start
    spec = StepSpec(sampler, request.eos_ids, request.min_new_tokens,
                    recording.needs.recording.steps, request.attention)  # fmt: skip
    state, record = _call(
        hook, "draft", decoding.draft_tokens,
        model.forward, model.config, model.params, start, spec,
        num_steps=recording.draft_steps,
    )  # fmt: skip
    e1, p1 = decoding.next_token_stats(prefilled.pre.logits)
    entropy = np.concatenate([fetch(e1)[:, None], fetch(record.entropy)], 1)
    top1 = np.concatenate([fetch(p1)[:, None], fetch(record.top1)], 1)
    return Drafted(state=state, record=record, entropy=entropy, top1=top1)


def rewind(
    request: Request, prefilled: Prefilled, drafted, looked, cells, hook=None
) -> list[Rewound]:
    """Each cell's state at its eviction point: the draft rewound to the cell's steps per row;
    a "lookahead" cell observes its record in `looked` (`lookahead`) instead of the draft's.

    "prefill" cells rewind to 0 steps (the pre-draft cache, the draft record masked out), so
    the three timings share one compiled scorer. One rewound state per distinct steps, shared
    by the cells that need it. Rewinding rewrites only positions and the token counters, and
    `decoding.rewind_state` donates its state: each rewind gets the draft's positions and
    counters (the last one the originals, the others copies: they are small) with the keys and
    values the previous rewind returned, in place, and every rewound state then shares the
    draft's one full cache (copies per distinct steps made a grid hold one full cache each).
    """
    per_cell = [None if ev is None or drafted is None else
                ev.timing.steps_per_row(drafted.entropy, drafted.top1) for ev in cells]  # fmt: skip
    points = {tuple(map(int, s)): s for s in per_cell if s is not None}  # in the cells' order
    rewound: dict[tuple[int, ...], tuple[DecodeState, DraftRecord]] = {}
    cache = drafted.state.cache if drafted is not None else None
    for i, (key, steps) in enumerate(points.items()):
        state = drafted.state if i == len(points) - 1 else stacking.copy_but_kv(drafted.state)
        state = dataclasses.replace(state, cache=stacking.with_kv(state.cache, cache))
        rewound[key] = _call(
            hook, "rewind", decoding.rewind_state,
            state, drafted.record, jnp.asarray(request.lengths), jnp.asarray(steps),
            eos_ids=request.eos_ids,
        )  # fmt: skip
        cache = rewound[key][0].cache  # k and v donated and returned: the next rewind's
    out = []
    for ev, steps in zip(cells, per_cell, strict=True):
        state, record = prefilled.start, None
        if steps is not None:  # the rewound state, over the live k and v
            state, record = rewound[tuple(map(int, steps))]
            state = dataclasses.replace(state, cache=stacking.with_kv(state.cache, cache))
        out.append(Rewound(ev, state, steps, laq.observed_record(ev, record, looked)))
    return out


def out_projection(model: Model) -> jax.Array:
    """[L, Hq, hd, D]: the model's W_o per query head, for rules that read `obs.out_proj`."""
    if model.family.out_projection is None:
        raise ValueError(
            f"the {model.family.model_type!r} family gives no out_projection, which CriticalKV "
            "needs; add one to its ModelFamily or pick another rule"
        )
    return model.family.out_projection(model.config, model.params)


def select(
    model: Model, prefilled: Prefilled, plans: list[Rewound], hook=None, context_end=None
) -> list[Selected]:
    """Every cell's keep mask. Cells at the same eviction point with the same scoring
    (`eviction.scoring_key`: they differ by budget, or are SnapKV and PyramidKV) are scored
    once for all of them. context_end [B]: keep only positions up to it
    (`dge_jax.generation.generate_for_contexts`)."""
    sweeps: dict[tuple, list[int]] = {}
    for i, plan in enumerate(plans):
        if plan.eviction is not None and plan.eviction.timing.before_decoding:
            point = None if plan.steps is None else tuple(int(s) for s in plan.steps)
            if plan.eviction.timing.kind == "lookahead":  # its own record, not the draft's
                point = (point, laq.lookahead_key(plan.eviction))
            sweeps.setdefault((point, scoring_key(plan.eviction)), []).append(i)
    keeps: dict[int, jax.Array] = {}
    for members in sweeps.values():
        first = plans[members[0]]
        obs, drafts = observation.for_rule(first.eviction.rule, prefilled.pre.obs, first.drafts)
        if any(plans[i].eviction.rule.needs.out_proj for i in members):
            obs = dataclasses.replace(obs, out_proj=out_projection(model))
        masks = _call(
            hook, "keep_masks", keep_masks,
            first.state.cache, obs, drafts, [plans[i].eviction for i in members],
            model.config.layer_windows, context_end,
        )  # fmt: skip
        keeps.update(zip(members, masks, strict=True))
    return [Selected(p.eviction, p.state, p.steps, p.drafts, keeps.get(i))
            for i, p in enumerate(plans)]  # fmt: skip


def evict(
    request: Request, prefilled: Prefilled, plans: list[Selected], hook=None
) -> list[Evicted]:
    """Each cell's evicted state: masked, or compacted. Compacted cells without a fixed
    capacity share per-layer capacities (the most any of them keeps per layer, plus room for
    every new token, rounded up), so they share one compiled decode loop.

    Room for every new token is rounded like the kept entries (not the token buffer's chunk
    bucket: every decode step reads every slot, and a 512-token bucket for 64 new tokens made
    a budget-512 grid attend over 1,024 slots instead of 640). Capacities are per layer: a
    grid with PyramidKV cells would otherwise give every layer the bottom layer's slots.

    A cell that also compresses while decoding (`Eviction.decode`) is compacted to its decode
    loop's capacity, or, if it kept more, to what it kept plus one interval, one capacity for
    all layers (the loop compacts that to its own at the first compression).
    """
    counts = [None if p.keep is None else fetch(jnp.sum(p.keep, axis=-1)) for p in plans]
    kept = [c for c, p in zip(counts, plans, strict=True) if c is not None and not _decodes(p)]
    room = round_up_slots(request.max_new_tokens)
    shared = layer_capacities(np.max(kept, axis=0), room) if kept else None
    out = []
    for plan, count in zip(plans, counts, strict=True):
        state, ev, attn = plan.state, plan.eviction, None
        remaining = request.max_new_tokens - int(np.min(fetch(state.step)))
        capacity = shared if ev is None or ev.capacity is None else ev.capacity
        if _decodes(plan):
            spec = ev.decode
            most = 0 if count is None else int(np.max(count, initial=0))
            spread = spreads_budget(ev)
            capacity = spec.capacity(spread)  # the loop's: it starts there
            if most > spec.head_cap(spread):  # kept more: its first block runs bigger
                capacity = round_up_slots(most, CAP_MULTIPLE) + spec.interval
            remaining = min(remaining, spec.interval)  # the loop compresses after those
            if ev.rule.needs.attn_sum:
                attn = decode_compression.carried_attention(
                    prefilled.pre.obs, plan.drafts, plan.keep, state.cache.pos, capacity
                )
        if plan.keep is not None:
            cache = _call(
                hook, "apply_eviction", apply_eviction,
                state.cache, plan.keep, ev, capacity, remaining, count,
            )  # fmt: skip
            state = dataclasses.replace(state, cache=cache)
        positions = None if plan.keep is None else plan.state.cache.padded_pos()
        out.append(Evicted(ev, state, plan.keep, positions, plan.steps, attn))
    return out


def _decodes(plan: Selected | Evicted) -> bool:
    """Whether the cell compresses while decoding."""
    return plan.eviction is not None and plan.eviction.decode is not None


def decode(
    model: Model,
    request: Request,
    plans: list[Evicted],
    sampler,
    hook=None,
    record_compressions: bool = False,
):
    """Each cell's generated tokens [B, N], and per cell what its decode-time compressions
    kept (`decode_compression.Compressions` when recorded, else None).

    Cells whose caches have the same shape decode as one batch (rows interleaved by
    `stacking.stack_states`, a copy): decoding reads the weights once per step for all of
    them, so a grid costs little more than one cell. A single cell decodes its own state, no
    copy (decode donates it). A cell that compresses while decoding runs its own loop, first.

    A cache goes with the last cell that reads it (`stacking.last_reads`): a compressing cell
    then takes its keys and values (else a copy), a stack deletes what it copied.
    """
    groups: dict[tuple, list[int]] = {}
    tokens: list[np.ndarray | None] = [None] * len(plans)
    logs: list = [None] * len(plans)
    for i, plan in enumerate(plans):
        if not _decodes(plan):
            cache = plan.state.cache
            groups.setdefault((cache.capacities, cache.group_sizes, cache.dtype), []).append(i)
    order = [[i] for i, p in enumerate(plans) if _decodes(p)] + list(groups.values())
    last = stacking.last_reads([[plans[i].state.cache for i in m] for m in order])
    for n, members in enumerate(order):
        states = [plans[i].state for i in members]
        if _decodes(plans[members[0]]):
            i, owns = members[0], stacking.owns(states[0].cache, last, n)
            tokens[i], logs[i] = _decode_compressed(
                model, request, plans[i], sampler, hook, record_compressions,
                alone=len(plans) == 1, owns=owns,
            )  # fmt: skip
            stacking.release([s.cache for s in states], last, n)
            continue
        if len(plans) == 1:
            state = states[0]
        else:  # cells may share buffers, so the decode below may only donate a stack of them
            sizes = decoding.decode_groups(states[0].cache)  # stacked as decode runs them
            state = _call(hook, "stack_states", stacking.stack_states, states, sizes)
            stacking.release([s.cache for s in states], last, n)
        spec = StepSpec(sampler, request.eos_ids, request.min_new_tokens,
                        attention=request.attention)  # fmt: skip
        state = _call(
            hook, "decode", decoding.decode_loop,
            model.forward, model.config, model.params, state, spec,
        )  # fmt: skip
        # Only the tokens come back (splitting the whole state would copy every cell's final
        # cache for nothing), and the final cache goes before the next stack is made.
        parts, state = stacking.split_rows(fetch(state.tokens), len(members)), None
        for i, part in zip(members, parts, strict=True):
            tokens[i] = part
    return tokens, logs


def _decode_compressed(
    model: Model,
    request: Request,
    plan: Evicted,
    sampler,
    hook,
    record: bool,
    alone: bool,
    owns: bool = False,
):
    """One cell's decode loop with compression every interval (`decode_compression`). owns:
    no later cell reads the keys and values it starts from, so the loop takes them."""
    ev = plan.eviction
    spec, spread = ev.decode, spreads_budget(ev)
    state = plan.state
    if not alone:
        # The loop donates its state, and other cells may hold the same arrays: the rewound
        # tokens and counters, and (nothing evicted before decoding) prefill's cache or the
        # draft's, and its positions (another cell's `positions`).
        cache = state.cache
        if plan.keep is None:
            cache = stacking.copy_but_kv(cache) if owns else jax.tree.map(jnp.copy, cache)
        state = jax.tree.map(jnp.copy, dataclasses.replace(state, cache=None))
        state = dataclasses.replace(state, cache=cache)
    history = decode_compression.max_compressions(request.buffer, spec.interval) if record else 0
    selection = SelectionSpec.for_eviction(
        ev, head_cap=spec.head_cap(spread), windows=model.config.layer_windows
    )
    loop = decode_compression.CompressionLoop(
        model.forward, model.config, sampler, request.eos_ids, selection, spec.interval,
        spec.capacity(spread), min_new_tokens=request.min_new_tokens,
        attention=request.attention, history=history,
    )  # fmt: skip
    with warnings.catch_warnings():
        # A cache that enters bigger than the loop's capacity is compacted at the first
        # compression, so XLA cannot reuse its donated buffers for the (smaller) result.
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        state, _, log = _call(
            hook, "decode_compressed", decode_compression.decode_compressed, loop, model.params,
            state, jnp.asarray(spec.budget, jnp.int32), plan.attn,
            out_projection(model) if ev.rule.needs.out_proj else None,
        )  # fmt: skip
    return fetch(state.tokens), log


def results(
    model: Model, request: Request, plans: list[Evicted], tokens, logs=None
) -> list[GenerationResult]:
    """Each cell's ids cut at the first EOS, their text, and what its eviction kept (and,
    when recorded, what each decode-time compression kept)."""
    out = []
    logs = logs or [None] * len(plans)
    for plan, cell_tokens, log in zip(plans, tokens, logs, strict=True):
        ids = cut_at_eos(cell_tokens[:, : request.max_new_tokens], request.eos_ids)
        texts = [model.tokenizer.decode(row) if model.tokenizer else "" for row in ids]
        kept = k = None
        if plan.keep is not None:
            kept = kept_positions(plan.positions, plan.keep)
            steps = plan.steps if plan.steps is not None else [0] * len(ids)
            k = [1 + int(n) for n in steps]
        out.append(
            GenerationResult(
                prompt_tokens=[list(p) for p in request.prompt_ids],
                tokens=ids,
                texts=texts,
                kept=kept,
                k=k,
                compressions=None if log is None else decode_compression.kept_over_time(log),
            )
        )
    return out
