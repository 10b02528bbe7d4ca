"""KVzip (arXiv 2505.23416; kvpress ``KVzipPress``): keep what the model needs to repeat the
prompt from its cache.

Query-agnostic: after prefill, the model is asked to repeat its context, chunk by chunk,
teacher-forced over the prompt's cache (the *reconstruct* stage, extra forward passes). Each
prompt entry scores the most attention any repeating query of its kv head's group pays it,
the softmax taken over the sinks, the chunk being repeated and the repeat tokens themselves.
The repeat tokens are not kept: their entries go into a scratch copy of the cache.

Following kvpress:
- the context is the prompt after the chat template's prefix; positions before it (the
  template's system turn) score 0, except the sinks. One deliberate difference: kvpress
  skips the prefix's length on every prompt (its pipeline always applies the template),
  dge_jax only when the prompt starts with the prefix, so a raw prompt (`chat=False`) is
  repeated from position 0 instead of losing its first tokens;
- chunk 0 is fed as "Repeat the previous context exactly." + the template's turn end and
  assistant start + the chunk; chunk i > 0 as "Repeat the part of the previous context
  exactly, starting with" + the last ``repeat_tail`` tokens of chunk i - 1 + turn end + chunk;
- the first ``sinks`` positions are always kept.

kvpress's global allocation across layers and heads (its default) is
``Eviction(head_budget="global", alpha=0.0)``; per layer across heads (``layerwise=True``)
is ``head_budget="adakv", alpha=0.0``. Not ported: KVzip+ normalisation (it reads each
layer's hidden state norms during the repeat passes: a recorder of `LayerView.hidden` would
give them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.checkpoints.tokenizer import RAW_PROMPT, prompt_format
from dge_jax.config import ModelConfig
from dge_jax.families import ForwardFn
from dge_jax.rules.base import Needs, ScoringRule, check_fields, finish, require_obs
from dge_jax.rules.ops import prompt_entries
from dge_jax.rules.registry import register
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.quantized import pad_slots, read_slots
from dge_jax.runtime.recorders import QueryWindow, Recording
from dge_jax.runtime.records import Observation
from dge_jax.text.prompts import bucket_length, pad_left

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
_MASKED = -1e30  # as dge_jax.kernels.attention: a fully masked row stays finite


@dataclasses.dataclass(frozen=True)
class Reconstruction:
    """What the reconstruct stage runs, one per grid: the sinks every repeating query also
    sees, the context tokens each pass repeats, and the previous chunk's tail quoted."""

    sinks: int
    chunk_size: int
    repeat_tail: int

    def scores(
        self,
        forward: ForwardFn,
        cfg: ModelConfig,
        params,
        tokenizer,
        cache: KVCache,
        prompt_ids: Sequence[Sequence[int]],
        *,
        bucket: int = 512,
        call=None,
        attention: str = "auto",
    ) -> tuple[jax.Array, int]:
        """This stage run over prefill's cache: `reconstruction_scores` (`obs.recon`)."""
        return reconstruction_scores(
            forward, cfg, params, tokenizer, cache, prompt_ids, self, bucket=bucket, call=call,
            attention=attention,
        )


@register
@dataclasses.dataclass(frozen=True)
class KVzip(ScoringRule):
    """KVzip: score = max over the repeating queries (and the kv head's query group) of the
    attention a prompt entry receives while the model repeats the prompt; sinks kept.

    Reads `obs.recon` (the reconstruct stage's scores, recorded only for this rule). No
    answer query enters the scores, so DGE and DGE-W keep exactly prefill's prompt entries
    (the draft entries on top, as for every rule).
    """

    sinks: int = 4
    chunk_size: int = 2048
    repeat_tail: int = 8

    name: ClassVar[str] = "kvzip"

    def __post_init__(self) -> None:
        check_fields(self, ints={"sinks": 0, "chunk_size": 1, "repeat_tail": 0})

    @property
    def needs(self) -> Needs:
        """The reconstruct stage's scores; the sinks are always kept."""
        return Needs(
            reconstruction=Reconstruction(self.sinks, self.chunk_size, self.repeat_tail),
            protected=self.sinks,
        )

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: the reconstruction attention of each prompt entry."""
        require_obs(obs, "recon")
        if obs.recon.shape != cache.pos.shape:
            raise ValueError(
                f"obs.recon has shape {obs.recon.shape}, the cache {cache.pos.shape}: KVzip "
                "scores the cache its reconstruct stage ran on (prefill's, or a draft of it)"
            )
        prompt = prompt_entries(cache, obs)
        sinks = prompt & (cache.pos < self.sinks)
        return finish(jnp.where(prompt, obs.recon, 0.0), cache.valid(), sinks)


def template_parts(tokenizer) -> tuple[list[int], list[int]]:
    """(prefix ids, suffix ids): what the tokenizer's chat template puts before a user turn's
    content and after it (turn end, assistant start), derived as kvpress does from a dummy
    turn; a model prompted with the raw prompt (no template: `prompt_format`) has no prefix
    and a newline for suffix, kvpress's default for such models."""
    if prompt_format(tokenizer) == RAW_PROMPT:
        return [], tokenizer.encode("\n", add_special_tokens=False)
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}])
    context, suffix = rendered.split(separator)
    prefix = context.split(dummy)[0]
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    return encode(prefix), encode(suffix)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RepeatChunk:
    """One reconstruct pass for the whole batch: tokens [B, T] int32 left-padded repeat ids
    (a row with nothing left to repeat has length 0), lengths [B], and the prompt positions
    [lo, hi) [B] each row repeats."""

    tokens: np.ndarray
    lengths: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


@dataclasses.dataclass(frozen=True)
class RepeatPass:
    """The static settings of a reconstruct pass (one compilation each): the model's
    forward and config, the sinks every repeating query sees, the widest chunk (width >=
    every hi - lo), the key block the repeat tokens attend in and the attention
    implementation."""

    forward: ForwardFn
    cfg: ModelConfig
    sinks: int
    width: int
    key_block: int = 512
    attention: str = "auto"


def repeat_chunks(
    tokenizer, prompt_ids: Sequence[Sequence[int]], rec: Reconstruction, bucket: int
) -> list[RepeatChunk]:
    """The reconstruct passes of a batch, chunk i of every row in pass i (host side).

    bucket: repeat lengths are padded like prompts (`prompts.bucket_length`), so nearby
    lengths share a compilation.
    """
    prefix, suffix = template_parts(tokenizer)
    first = tokenizer.encode(REPEAT_FIRST, add_special_tokens=False)
    later = tokenizer.encode(REPEAT_NEXT, add_special_tokens=False)
    size = rec.chunk_size
    rows = []
    for ids in prompt_ids:
        ids = list(ids)
        start = len(prefix) if prefix and ids[: len(prefix)] == prefix else 0
        pieces = [ids[i : i + size] for i in range(start, len(ids), size)]
        row = []
        for i, piece in enumerate(pieces):
            tail = pieces[i - 1][max(len(pieces[i - 1]) - rec.repeat_tail, 0) :] if i else []
            lead = first if i == 0 else later + tail
            lo = start + i * size
            row.append((lo, lo + len(piece), lead + suffix + piece))
        rows.append(row)
    chunks = []
    for c in range(max(map(len, rows), default=0)):
        parts = [row[c] if c < len(row) else (0, 0, []) for row in rows]
        t = bucket_length(max(len(p[2]) for p in parts), bucket)
        tokens, lengths = pad_left([p[2] for p in parts], t)
        lo = np.array([p[0] for p in parts], np.int32)
        hi = np.array([p[1] for p in parts], np.int32)
        chunks.append(RepeatChunk(tokens, lengths, lo, hi))
    return chunks


@functools.partial(jax.jit, static_argnames=("spec",))
def chunk_scores(
    spec: RepeatPass,
    params,
    cache: KVCache,
    scores: jax.Array,
    chunk: RepeatChunk,
    prompt_lengths: jax.Array,
) -> jax.Array:
    """`scores` [L, B, Hkv, S] f32 with the slots of positions [lo, hi) set by one pass.

    cache: prefill's cache (one layer group, prompts left-padded to its write index T, so
    row b's position p sits at slot T - len_b + p in every head); chunk: the pass's repeat
    ids [B, Tr], lengths [B] and prompt ranges (`RepeatChunk`); prompt_lengths [B]. The
    repeat tokens follow each row's prompt (positions len_b, len_b + 1, ...); their entries
    are written into a grown copy of the cache, which is dropped; spec.attention: the
    passes' attention implementation (`platform.ATTENTION`), as prefill's.
    """
    if len(cache.groups) != 1:
        raise ValueError("the reconstruct stage runs on prefill's cache (one layer group)")
    cfg, sinks, width = spec.cfg, spec.sinks, spec.width
    tokens, lengths, lo, hi = chunk.tokens, chunk.lengths, chunk.lo, chunk.hi
    b, tr = tokens.shape
    pad = ((0, 0), (0, 0), (0, 0), (0, tr))
    group = cache.groups[0]  # padded as stored: a quantized cache's repeat entries are too
    k, v = pad_slots(group.k, tr), pad_slots(group.v, tr)
    grown = KVCache.stacked(k, v, jnp.pad(group.pos, pad, constant_values=-1), group.index)
    offset = jnp.arange(tr, dtype=jnp.int32)[None, :] - (tr - lengths)[:, None]
    positions = jnp.where(offset >= 0, prompt_lengths[:, None] + offset, -1)
    every_query = Recording.of(QueryWindow(tr))  # the repeat tokens' queries, post-RoPE
    out = spec.forward(cfg, params, tokens, positions, grown, recording=every_query,
                       logits="none", key_block=spec.key_block,
                       attention=spec.attention)  # fmt: skip
    # The keys each repeating query is scored over, in kvpress's order, as slots [B, Wk]:
    #   sinks   positions 0 .. ns - 1, ns = min(sinks, lo) (none when the chunk starts there)
    #   chunk   positions lo .. hi - 1 (width slots, the ones past hi masked)
    #   repeat  this pass's own entries, causal by position
    # Worked example, sinks 4, a 10-token prompt in a 16-slot bucket (first slot 6), lo = 3,
    # hi = 10, width 8: sink slots 6..9 (ns = 3: the 4th masked), chunk slots 9..16 (slot 16
    # masked), repeat slots 16 .. 16 + Tr - 1 (the repeat ids' write slots).
    first = cache.index[0] - prompt_lengths  # [B] slot of position 0
    ns = jnp.minimum(sinks, lo)
    j_s = jnp.arange(sinks, dtype=jnp.int32)[None, :]
    j_c = jnp.arange(width, dtype=jnp.int32)[None, :]
    slots = jnp.concatenate(
        [first[:, None] + j_s, first[:, None] + lo[:, None] + j_c,
         cache.index[0] + jnp.arange(tr, dtype=jnp.int32)[None, :].repeat(b, 0)], axis=1,
    )  # fmt: skip
    key_ok = jnp.concatenate([j_s < ns[:, None], j_c < (hi - lo)[:, None], positions >= 0], 1)
    key_pos = jnp.concatenate([jnp.full((b, sinks + width), -1, jnp.int32), positions], 1)
    slots = jnp.clip(slots, 0, grown.capacity - 1)
    # query i sees key w iff the key is valid and, for repeat keys, not after it
    visible = key_ok[:, None, :] & (key_pos[:, None, :] <= positions[:, :, None])  # [B, Tr, Wk]
    g = cfg.num_heads // cfg.num_kv_heads

    def layer(args):
        q, k = args  # [B, Hq, Tr, D] post-RoPE, [B, Hkv, S + Tr, D]
        k_sub = read_slots(k, slots[:, None, :])  # [B, Hkv, Wk, D]; int8: picked slots only
        qg = q.reshape(b, cfg.num_kv_heads, g, tr, -1)
        logits = jnp.einsum("bkgtd,bkwd->bkgtw", qg, k_sub, preferred_element_type=jnp.float32)
        logits = jnp.where(visible[:, None, None], logits * cfg.head_dim**-0.5, _MASKED)
        probs = jax.nn.softmax(logits, axis=-1)[..., sinks : sinks + width]
        probs = jnp.where((positions >= 0)[:, None, None, :, None], probs, 0.0)
        return jnp.max(probs, axis=(2, 3))  # [B, Hkv, width]

    queries = every_query.get(out.recorded, QueryWindow)
    best = jax.lax.map(layer, (queries, out.cache.stored_k))  # [L, B, Hkv, width]
    # Back to the prompt slots; slots past hi go to a dump column S, dropped.
    s = scores.shape[-1]
    target = jnp.where(j_c < (hi - lo)[:, None], first[:, None] + lo[:, None] + j_c, s)
    target = jnp.broadcast_to(target[None, :, None, :], best.shape)
    ls, bs, hs = jnp.meshgrid(*(jnp.arange(n) for n in best.shape[:3]), indexing="ij")
    return scores.at[ls[..., None], bs[..., None], hs[..., None], target].set(best, mode="drop")


def reconstruction_scores(
    forward: ForwardFn,
    cfg: ModelConfig,
    params,
    tokenizer,
    cache: KVCache,
    prompt_ids: Sequence[Sequence[int]],
    rec: Reconstruction,
    *,
    bucket: int = 512,
    call=None,
    attention: str = "auto",
) -> tuple[jax.Array, int]:
    """KVzip's scores [L, B, Hkv, S] f32 of prefill's cache (0 where nothing was repeated),
    and how many reconstruct passes ran. call(fn, *args, **kwargs) runs each jitted pass
    (generation's hook); attention: their attention implementation (`platform.ATTENTION`)."""
    if tokenizer is None:
        raise ValueError(
            "KVzip repeats the prompt with an instruction its tokenizer encodes, and this "
            "model has no tokenizer: load one with tokenizer.json, or pick another rule"
        )
    chunks = repeat_chunks(tokenizer, prompt_ids, rec, bucket)
    lengths = jnp.asarray([len(p) for p in prompt_ids], jnp.int32)
    scores = jnp.zeros(cache.pos.shape, jnp.float32)
    width = min(rec.chunk_size, cache.capacity)
    run = call or (lambda fn, *a, **k: fn(*a, **k))
    for ch in chunks:
        spec = RepeatPass(forward, cfg, rec.sinks, width, min(bucket, ch.tokens.shape[1]),
                          attention)
        scores = run(chunk_scores, spec, params, cache, scores, ch, lengths)
    return scores, len(chunks)
