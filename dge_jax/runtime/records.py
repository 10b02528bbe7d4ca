"""What the forward records for the scoring rules, as the runtime hands it over.

`Observation`: what a prefill recorded (the last prompt queries, attention sums, query
statistics, and the records of a rule's own recorders), read by the rules besides the cache;
`DraftRecord`: what draft steps recorded, per step; `QueryStats`: the running sums of pre-RoPE
queries; `Records`: records by recorder. The loops of `dge_jax.runtime.decoding` fill them
through the recorders (`dge_jax.runtime.recorders`); `dge_jax.eviction.observation` joins
them the way a timing says.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Records:
    """The records of recorders that have no field of their own in `Observation` or
    `DraftRecord`, each under its recorder (`dge_jax.runtime.recorders.Recorder`; static
    under jit, so a joined observation can ask it how). ``records[key]``: key a recorder or
    its name."""

    recorders: tuple = ()
    values: tuple = ()

    def __getitem__(self, key) -> Any:
        name = key if isinstance(key, str) else key.name
        for recorder, value in zip(self.recorders, self.values, strict=True):
            if recorder.name == name:
                return value
        raise KeyError(f"nothing recorded under {name!r} (recorded: "
                       f"{[r.name for r in self.recorders]}): does the rule's Needs name "
                       "its recorder?")  # fmt: skip

    def __contains__(self, key) -> bool:
        name = key if isinstance(key, str) else key.name
        return any(r.name == name for r in self.recorders)

    def put(self, recorder, value) -> Records:
        """These records with `recorder`'s value (replacing one of its name)."""
        kept = [(r, v) for r, v in zip(self.recorders, self.values, strict=True)
                if r.name != recorder.name]  # fmt: skip
        kept.append((recorder, value))
        return Records(tuple(r for r, _ in kept), tuple(v for _, v in kept))

    def only(self, recorders) -> Records | None:
        """The records of these recorders' names (None when none is left)."""
        names = {r.name for r in recorders}
        kept = [(r, v) for r, v in zip(self.recorders, self.values, strict=True)
                if r.name in names]  # fmt: skip
        return Records(*map(tuple, zip(*kept, strict=True))) if kept else None

    def join(self, drafts: DraftRecord, weight: jax.Array) -> Records:
        """Each record joined with the draft steps' (`Recorder.join`), weight [B, K]."""
        values = tuple(r.join(v, drafts, weight)
                       for r, v in zip(self.recorders, self.values, strict=True))  # fmt: skip
        return Records(self.recorders, values)


jax.tree_util.register_dataclass(Records, data_fields=["values"], meta_fields=["recorders"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryStats:
    """Running statistics of the pre-RoPE queries a rule may read (ExpectedAttention's).

    total: [L, B, Hq, D] f32 sum of the queries, outer: [L, B, Hq, D, D] f32 sum of their
    outer products, count: [B] f32 how many queries (prompt positions >= the rule's sinks,
    plus observed drafts), inv_freq: [D / 2] f32 the model's RoPE inverse frequencies (to
    un-rotate draft queries and to rotate the statistics to future positions).
    """

    total: jax.Array
    outer: jax.Array
    count: jax.Array
    inv_freq: jax.Array

    def plus(self, total: jax.Array, outer: jax.Array) -> QueryStats:
        """These statistics with more queries' sums added (the count is set up front)."""
        return dataclasses.replace(self, total=self.total + total, outer=self.outer + outer)

    def mean_and_covariance(self) -> tuple[jax.Array, jax.Array]:
        """Mean [L, B, Hq, D] and population covariance [L, B, Hq, D, D] of the queries."""
        n = jnp.maximum(self.count, 1.0)[None, :, None, None]
        mean = self.total / n
        cov = self.outer / n[..., None] - mean[..., :, None] * mean[..., None, :]
        return mean, cov


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Observation:
    """What scoring rules may read besides the cache, recorded only when asked for.

    q      : [L, B, Hq, W, D]  the last W queries per layer (post-RoPE), oldest first; prompt
                               window first, then any draft queries appended after it.
    q_pos  : [B, W] int32      each query's position, -1 where the slot holds no query (a prompt
                               shorter than W, or a draft step masked out).
    attn_sum: [L, B, Hq, S] f32 or None  sum over every observed query of its softmax
                               attention to each slot (H2O's accumulated attention).
    is_draft: [W] bool          True for the queries appended by draft steps.
    prompt_end: [B] int32        position of each row's last prompt token, so that "recent"
                                 windows are measured in prompt positions whatever was drafted.
    q_weight: [B, W] f32 or None  each query's weight in the scores (None = all 1); DGE can
                                 weigh draft queries against prompt-window queries.
    out_proj: [L, Hq, D, E] or None  each layer's attention output projection, per query
                                 head (CriticalKV's ‖W_o v‖); not recorded: the select stage
                                 adds it from the weights when a rule asks.
    q_stats: QueryStats or None  statistics of the pre-RoPE prompt queries (and, under DGE,
                                 the observed drafts'), when a rule asks.
    recon: [L, B, Hkv, S] f32 or None  the attention each slot got while the model repeated
                                 the prompt (KVzip's reconstruct stage), when a rule asks.
    records: Records or None     what recorders of a rule's own recorded (`Needs.recorders`),
                                 by name: ``obs.records[MyRecorder.name]``.
    """

    q: jax.Array | None
    q_pos: jax.Array | None
    attn_sum: jax.Array | None
    is_draft: jax.Array | None
    prompt_end: jax.Array | None = None
    q_weight: jax.Array | None = None
    out_proj: jax.Array | None = None
    q_stats: QueryStats | None = None
    recon: jax.Array | None = None
    records: Records | None = None


class DraftRecord(NamedTuple):
    """What K draft steps observed, per step (so any prefix of them can be replayed).

    q: [L, B, Hq, K, D] the queries of the fed tokens, or None; q_pos: [B, K] their positions
    (-1 = step not observed); probs: [L, B, Hq, K, S] f32 per-step attention, or None;
    entropy, top1: [B, K] statistics of the next-token distribution each step produced;
    records: what the steps recorded for a rule's own recorders ([K, ...] stacked), or None.
    """

    q: jax.Array | None
    q_pos: jax.Array
    probs: jax.Array | None
    entropy: jax.Array
    top1: jax.Array
    records: Records | None = None
