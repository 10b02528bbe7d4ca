"""Pure, jittable generation over the padded cache: prefill, draft steps, decode loop.

Every function here takes the family's `forward` and the `ModelConfig` as static arguments,
its other settings as one frozen spec (`PrefillSpec` for the prefill, `StepSpec` for the
decode steps) and parameters/caches as pytrees, so users can compose them under their own
`jax.jit`.

Left padding and positions, worked for a 2-row batch, prompts of 3 and 5 tokens, T = 5:

    slot:            0   1   2   3   4
    lengths = [3, 5]
    positions row 0: -1  -1   0   1   2     (pad = T - length = 2)
    positions row 1:  0   1   2   3   4

Every row's last prompt token sits in slot T - 1, so the prefill's last logits are each row's
next-token logits, and decode step s (s = 0, 1, ...) writes every row at slot T + s with
position length_b + s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dge_jax.config import ModelConfig
from dge_jax.distribution.constraints import constrain_rows
from dge_jax.families import ForwardFn
from dge_jax.runtime import platform
from dge_jax.runtime.cache import KVCache, group_layers, init_cache, regroup, runs_of_equal
from dge_jax.runtime.cache_layout import constrain_cache
from dge_jax.runtime.recorders import NOTHING, Recording, Setup
from dge_jax.runtime.records import DraftRecord, Observation


def prompt_positions(lengths: jax.Array, t: int) -> jax.Array:
    """[B, T] int32 positions of left-padded prompts, -1 on padding (see module docstring)."""
    pad = t - lengths[:, None]
    pos = jnp.arange(t, dtype=jnp.int32)[None, :] - pad
    return jnp.where(pos >= 0, pos, -1).astype(jnp.int32)


class PrefillOutput(NamedTuple):
    """logits: [B, V] f32 next-token logits; cache; obs: what the scoring rules may read."""

    logits: jax.Array
    cache: KVCache
    obs: Observation


@dataclasses.dataclass(frozen=True)
class PrefillSpec:
    """How `prefill_prompt` runs, fixed at trace time (hashable: one static argument, one
    compilation per spec), so the prefill's settings travel as one value.

    capacity: the fresh cache's slots per head, an int for every layer or a tuple of one per
    layer (`window_cache.layer_capacities`); chunk: the most tokens one step feeds;
    recording: what the prompt's observation holds (a rule's `Needs.recording`);
    cache_dtype: the cache's dtype (None: the embedding's); attention: the steps' attention
    implementation (`platform.ATTENTION`; "auto": the platform's); kv_quant: how the cache
    stores keys and values (`quantized.parse_kv_quant`: int8 with one scale per token per kv
    head, or KIVI's int4, scales of `cache_dtype`).
    """

    capacity: int | tuple[int, ...]
    chunk: int = 512
    recording: Recording = NOTHING
    cache_dtype: Any = None
    attention: str = "auto"
    kv_quant: str = "none"


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "spec"))
def prefill_prompt(
    forward: ForwardFn,
    cfg: ModelConfig,
    params,
    tokens: jax.Array,
    lengths: jax.Array,
    spec: PrefillSpec,
) -> PrefillOutput:
    """Runs left-padded prompts [B, T] through the model chunk by chunk into a fresh cache of
    `spec.capacity` slots (`PrefillSpec`).

    Steps and attention: T runs in ceil(T / chunk) equal steps of at most `spec.chunk`
    tokens, so besides the T below (one step, or steps of the chunk) any T those steps split
    evenly runs (what `prompts.bucket_length` pads to for long accelerator chunks);
    spec.attention: the steps' attention implementation (`platform.ATTENTION`; "auto": the
    platform's).

    T must be a multiple of the chunk (or smaller than it): activations stay [B, chunk, ...]
    however long the prompt. spec.recording: what the prompt's observation holds (a rule's
    `Needs.recording`: its query window, attention sums, query statistics, its own
    recorders'); each recorder's record starts empty and takes every chunk's values
    (`dge_jax.runtime.recorders`).
    """
    capacity, chunk, recording = spec.capacity, spec.chunk, spec.recording
    b, t = tokens.shape
    c = t // -(-t // chunk)  # min(chunk, t) when T is a multiple of the chunk
    if t % c:
        raise ValueError(f"prompt length {t} does not split into steps of at most {chunk}")
    _check_capacity(cfg, capacity, t, c)
    dtype = spec.cache_dtype or params.embed.dtype
    forward = functools.partial(forward, attention=spec.attention)  # every chunk's attention
    cache = init_cache(cfg.num_layers, b, cfg.num_kv_heads, capacity, cfg.head_dim, dtype,
                       spec.kv_quant)  # fmt: skip
    capacity = cache.capacity  # the global layers' (what per-slot records span)
    # Under jax.set_mesh (dge_jax.distribution.sharding): rows over data, kv heads over model;
    # else no-ops.
    tokens, lengths = constrain_rows(cfg, tokens, lengths)
    cache = constrain_cache(cache, cfg)
    positions = prompt_positions(lengths, t)
    n = t // c

    def step(carry, xs):
        cache, records, _ = carry
        tok, pos = xs
        out = forward(cfg, params, tok, pos, cache, recording=recording, key_block=c)
        records = recording.add(records, out.recorded, pos)
        cache = constrain_cache(out.cache, cfg)  # keeps its layout through the chunk loop
        return (cache, records, out.logits), None

    records = recording.start(Setup(cfg, lengths, capacity, dtype))
    logits = jnp.zeros((b, cfg.vocab_size), jnp.float32)
    xs = (tokens.reshape(b, n, c).transpose(1, 0, 2), positions.reshape(b, n, c).transpose(1, 0, 2))
    (cache, records, logits), _ = jax.lax.scan(step, (cache, records, logits), xs)
    nothing = Observation(q=None, q_pos=None, attn_sum=None, is_draft=None,
                          prompt_end=(lengths - 1).astype(jnp.int32))  # fmt: skip
    return PrefillOutput(logits, cache, recording.observe(nothing, records))


def _check_capacity(cfg: ModelConfig, capacity: int | tuple[int, ...], t: int, c: int) -> None:
    """A cache too small for the prompt: a layer of fewer than T slots is a sliding layer
    that keeps its window (`window_cache`) and needs room for one step besides it."""
    caps = (capacity,) * cfg.num_layers if isinstance(capacity, int) else tuple(capacity)
    for i, cap in enumerate(caps):
        window = cfg.window(i)
        if cap < t and not (window and cap >= window - 1 + c):
            raise ValueError(
                f"cache capacity {cap} of layer {i} is smaller than the prompt ({t})"
                + (f" and than its window + one prefill step ({window - 1} + {c})" if window
                   else "")
            )  # fmt: skip


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The decode loop's state: one dataclass, read top to bottom by `decode_body`.

    tokens: [B, N] generated ids; row b holds step[b] of them, then padding with its last id
    (its EOS once finished). N is a length bucket >= `limit`, the traced number of tokens
    wanted, so requests of nearby lengths share one compiled loop. step: [B] int32 per row
    (rows can differ after `rewind_state`). last/pos: [B] the newest token and its position (not
    yet fed to the model). done: [B] bool, EOS emitted or limit reached. key: PRNG key.
    """

    cache: KVCache
    tokens: jax.Array
    step: jax.Array
    limit: jax.Array
    last: jax.Array
    pos: jax.Array
    done: jax.Array
    key: jax.Array


def start_state(
    cache: KVCache,
    first: jax.Array,
    lengths: jax.Array,
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    key: jax.Array,
    buffer: int | None = None,
) -> DecodeState:
    """The loop state after prefill: the first answer token [B] is already chosen.

    buffer: the static token-buffer length N >= max_new_tokens (default max_new_tokens).
    The state holds copies of `first`, `lengths` and `key` (the draft and decode steps donate
    their state, which must not delete the caller's arrays); `cache` itself goes in as given.
    """
    b = first.shape[0]
    n = buffer or max_new_tokens
    if n < max_new_tokens:
        raise ValueError(f"token buffer {n} is shorter than max_new_tokens={max_new_tokens}")
    tokens = jnp.zeros((b, n), jnp.int32).at[:, 0].set(first)
    limit = jnp.asarray(max_new_tokens, jnp.int32)
    return DecodeState(
        cache=cache,
        tokens=tokens,
        step=jnp.ones((b,), jnp.int32),
        limit=limit,
        last=jnp.copy(first),
        pos=lengths.astype(jnp.int32, copy=True),
        done=is_eos(first, eos_ids) | (limit <= 1),
        key=jnp.copy(key),
    )


def suppress_eos(logits: jax.Array, eos_ids: tuple[int, ...], active) -> jax.Array:
    """logits [B, V] with the EOS ids at -inf where `active` (a bool, or [B] per row)."""
    if not eos_ids:
        return logits
    active = jnp.asarray(active)
    active = active[:, None] if active.ndim else active
    ids = jnp.asarray(eos_ids, jnp.int32)
    return jnp.where(active, logits.at[:, ids].set(-jnp.inf), logits)


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """Where `tokens` are one of `eos_ids` (bool, same shape)."""
    return jnp.isin(tokens, jnp.asarray(eos_ids or (-1,), jnp.int32))


def next_token_stats(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(entropy in nats, top-1 probability), each [B] f32, of softmax(logits [B, V])."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    return entropy, jnp.max(p, axis=-1)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """How each decode step chooses its token, fixed at trace time (hashable: one static
    argument of `draft_tokens` and `decode_loop`, and what `decode_body` takes), so a
    step's settings travel as one value.

    sampler: picks the next id from the logits (`dge_jax.text.sampling`); eos_ids: the ids
    that end a row; min_new_tokens: the EOS ids are banned until a row has this many tokens;
    recording: what each step records (`Recording.steps` of the prompt's; `decode_loop`
    records nothing); attention: the steps' implementation (`platform.ATTENTION`).
    """

    sampler: Any
    eos_ids: tuple[int, ...]
    min_new_tokens: int = 0
    recording: Recording = NOTHING
    attention: str = "auto"


def decode_body(
    forward: ForwardFn,
    cfg: ModelConfig,
    params,
    state: DecodeState,
    spec: StepSpec,
    layers=None,
):
    """One decode step: feed `last` [B], choose the next token. Returns (state, ForwardOutput).

    The token is written at slot `cache.index` of every head (position `pos`), the sampled id
    (`spec.sampler`) at tokens[b, step[b]]; ForwardOutput.logits is [B, V] f32, `recorded`
    what `spec.recording` asked of the step; layers: the weights grouped as the cache's
    layers (`until_done`; None: as the model holds them).

    EOS ids are banned while a row has fewer than `spec.min_new_tokens` tokens
    (transformers' min_length, which LongBench uses for samsum). Finished rows still run (the
    batch moves together) but keep their tokens, step and last id unchanged.
    spec.attention: the step's implementation (`platform.ATTENTION`; "pallas":
    `flash_decode`'s kernel).
    """
    eos_ids = spec.eos_ids
    out = forward(
        cfg,
        params,
        state.last[:, None],
        state.pos[:, None],
        state.cache,
        layers=layers,
        recording=spec.recording,
        attention=spec.attention,
    )
    key, sub = jax.random.split(state.key)
    logits = suppress_eos(out.logits, eos_ids, state.step < spec.min_new_tokens)
    active = ~state.done
    new = jnp.where(active, spec.sampler(logits, sub), state.last)
    rows = jnp.arange(new.shape[0])
    slot = jnp.minimum(state.step, state.tokens.shape[1] - 1)
    tokens = state.tokens.at[rows, slot].set(jnp.where(active, new, state.tokens[rows, slot]))
    step = state.step + active.astype(jnp.int32)
    state = DecodeState(
        cache=constrain_cache(out.cache, cfg),  # its mesh layout, step after step
        tokens=tokens,
        step=step,
        limit=state.limit,
        last=new,
        pos=state.pos + 1,
        done=state.done | is_eos(new, eos_ids) | (step >= state.limit),
        key=key,
    )
    return state, out


@functools.partial(
    jax.jit,
    static_argnames=("forward", "cfg", "spec", "num_steps"),
    donate_argnames=("state",),
)
def draft_tokens(
    forward: ForwardFn,
    cfg: ModelConfig,
    params,
    state: DecodeState,
    spec: StepSpec,
    *,
    num_steps: int,
) -> tuple[DecodeState, DraftRecord]:
    """Runs `num_steps` decode steps with the full cache (lax.scan), recording each step.

    These are DGE's draft steps: the tokens they produce are real answer tokens, and what
    they record (their queries, their attention) is what the scoring rule gains by waiting.
    spec: each step's sampler, EOS ids, min_new_tokens and attention (`StepSpec`), and what
    it records (spec.recording: `Recording.steps` of the prompt's: a query window of 1,
    attention sums; `dge_jax.runtime.recorders`). Returns the state after K = num_steps
    steps (cache with K more entries per head) and a `DraftRecord` (q [L, B, Hq, K, D] and
    probs [L, B, Hq, K, S] f32 if recorded, q_pos [B, K] int32, stats [B, K] f32).

    The state (and its cache) is donated, as `decode_loop`'s: the draft writes its entries
    into the cache in place. Pass a copy (``jax.tree.map(jnp.copy, state)``) to keep it.
    """

    def body(state, _):
        pos = state.pos
        state, out = decode_body(forward, cfg, params, state, spec)
        entropy, top1 = next_token_stats(out.logits)
        return state, (out.recorded, pos, entropy, top1)

    state, (recorded, pos, entropy, top1) = jax.lax.scan(body, state, None, length=num_steps)
    # scan stacks the steps on a new leading axis [K, ...]; the recorders lay them out.
    drafts = DraftRecord(q=None, q_pos=pos.T, probs=None, entropy=entropy.T, top1=top1.T)
    return state, spec.recording.into_drafts(drafts, recorded)


@functools.partial(jax.jit, static_argnames=("eos_ids",), donate_argnames=("state",))
def rewind_state(
    state: DecodeState,
    drafts: DraftRecord,
    lengths: jax.Array,
    steps: jax.Array,
    *,
    eos_ids: tuple[int, ...],
) -> tuple[DecodeState, DraftRecord]:
    """The state and record as if row b had run only steps[b] <= K of the K draft steps.

    Drafting only appends, so undoing steps is masking: the later draft slots of the row are
    emptied (pos -1), its later tokens dropped and their queries unobserved. One draft to
    k_max thus serves every k <= k_max (and per-row adaptive k), with shapes unchanged, so
    the scorer compiles once for all of them. Worked example, one row, prompt length 5,
    K = 3 draft steps, steps = 1: draft slots hold positions 5, 6, 7 (tokens t1, t2, t3 fed);
    after rewinding, only position 5 (t1) stays, tokens keep t1, t2, and t2 (position 6)
    is the next token to feed.

    The state is donated: only positions (and the token counters) are rewritten, so the keys
    and values come back in the buffers they came in (no copy of the cache).
    """
    k = drafts.q_pos.shape[1]
    steps = jnp.clip(steps.astype(jnp.int32), 0, k)
    pos = state.cache.padded_pos()
    # Draft step j wrote position length + j; keep those with j < steps.
    gone = pos >= (lengths + steps)[None, :, None, None]
    cache = state.cache.with_pos(jnp.where(gone, -1, pos))
    n = state.tokens.shape[1]
    kept = jnp.arange(n)[None, :] <= steps[:, None]  # t1 .. t_{steps+1}
    last = jnp.take_along_axis(state.tokens, steps[:, None], axis=1)[:, 0]
    tokens = jnp.where(kept, state.tokens, last[:, None])
    done = jnp.any(kept & is_eos(state.tokens, eos_ids), axis=1) | (steps + 1 >= state.limit)
    state = DecodeState(
        cache=cache,
        tokens=tokens,
        step=steps + 1,
        limit=state.limit,
        last=last,
        pos=lengths + steps,
        done=done,
        key=state.key,
    )
    observed = jnp.arange(k)[None, :] < steps[:, None]
    drafts = drafts._replace(q_pos=jnp.where(observed, drafts.q_pos, -1))
    return state, drafts


def decode_groups(cache: KVCache, layer_loop: str | None = None) -> tuple[int, ...]:
    """Layer group sizes `decode_loop` runs `cache` in: "scan" = one group per run of layers of
    one capacity (one group for a uniform cache); "unrolled" = one layer per group; None:
    the platform's (`platform.Backend.layer_loop`: unrolled on CPU and GPU, scan on TPU)."""
    layer_loop = layer_loop or platform.current().layer_loop
    if layer_loop not in ("scan", "unrolled"):
        raise ValueError(f"layer_loop must be 'scan' or 'unrolled', got {layer_loop!r}")
    if layer_loop == "unrolled":
        return (1,) * cache.num_layers
    return runs_of_equal(cache.capacities)


@functools.partial(
    jax.jit, static_argnames=("forward", "cfg", "spec", "layer_loop"), donate_argnames=("state",)
)
def decode_loop(
    forward: ForwardFn,
    cfg: ModelConfig,
    params,
    state: DecodeState,
    spec: StepSpec,
    *,
    layer_loop: str | None = None,
) -> DecodeState:
    """Decodes until `limit` tokens exist or every row has emitted an EOS (lax.while_loop).

    spec: each step's sampler, EOS ids, min_new_tokens and attention (`StepSpec`; its
    recording must be `NOTHING`: the loop keeps no record). The state (and its cache) is
    donated: decoding updates the cache in place. Returns the final state; tokens [B, N]
    int32 holds each row's ids, padded with its last id after `step[b]` (callers cut at
    `limit` and at the first EOS).

    layer_loop: how the cache's layers are grouped while decoding (`decode_groups`):
    "scan" keeps layers of one capacity in one group, scanned; "unrolled" makes every layer
    its own group. XLA:CPU copies each layer's slice of a stacked array before using it, so
    a scanned step moves the weights and cache several times; one-layer groups are read in
    place (`python -m benchmarks.decode_step` compares them; on a GPU the scan ran at half
    the speed too), for one extra copy of the layer weights while decoding and a longer
    compile. None: the platform's. The
    cache comes back in the grouping it was given. Same tokens either way.
    """
    if spec.recording != NOTHING:
        raise ValueError(
            f"decode_loop records nothing: give it a StepSpec with recording=NOTHING, got "
            f"{spec.recording!r}"
        )

    def body(s, extra, layers):
        return decode_body(forward, cfg, params, s, spec, layers)[0], extra

    return until_done(params, state, body, (), layer_loop=layer_loop)[0]


def until_done(
    params,
    state: DecodeState,
    body: Callable,
    extra,
    *,
    layer_loop: str | None,
    back_to: tuple[int, ...] | None = None,
) -> tuple[DecodeState, Any]:
    """The scaffold of every decode loop: `body(state, extra, layers) -> (state, extra)` runs
    in a `lax.while_loop` until every row is done (EOS or its limit), over the cache regrouped
    for decoding (`decode_groups`) and the weights grouped the same way (`layers`).

    The cache then goes back to `back_to` layer groups (default: the grouping it came in, so
    donated buffers hold the result, as they can only when shapes match, and a caller gets
    the layout it gave), and rows that stopped early keep their last id (their EOS) as
    padding for the steps the loop skipped. Returns (state, extra).
    """
    given = state.cache.group_sizes
    sizes = decode_groups(state.cache, layer_loop)
    state = dataclasses.replace(state, cache=regroup(state.cache, sizes))
    # The barrier keeps the weights' group slices out of the loop body, so they are made once.
    layers = jax.lax.optimization_barrier(group_layers(params.layers, sizes))
    state, extra = jax.lax.while_loop(
        lambda carry: ~jnp.all(carry[0].done),  # done includes reaching the limit
        lambda carry: body(carry[0], carry[1], layers),
        (state, extra),
    )
    state = dataclasses.replace(state, cache=regroup(state.cache, back_to or given))
    fill = jnp.arange(state.tokens.shape[1])[None, :] >= state.step[:, None]
    return dataclasses.replace(
        state, tokens=jnp.where(fill, state.last[:, None], state.tokens)
    ), extra


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "kv_quant"))
def teacher_forced_logits(
    forward: ForwardFn,
    cfg: ModelConfig,
    params,
    tokens: jax.Array,
    lengths: jax.Array,
    kv_quant: str = "none",
) -> jax.Array:
    """[B, T, V] f32 logits of one forward over left-padded sequences (the decode reference);
    kv_quant: the cache's storage, whose round trip every query then reads through."""
    b, t = tokens.shape
    cache = init_cache(cfg.num_layers, b, cfg.num_kv_heads, t, cfg.head_dim, params.embed.dtype,
                       kv_quant)  # fmt: skip
    return forward(cfg, params, tokens, prompt_positions(lengths, t), cache, logits="all").logits
