"""What a forward pass records for the scoring rules, declared as values: recorders.

A recorder is a small frozen (hashable) value saying what it reads from each layer of a
forward pass (a `LayerView`: the layer's input, its queries before and after RoPE, the
positions, and the attention's per-slot probability sums if it declares `reads_probs_sum`),
how its record starts and grows chunk by chunk over a prompt, and what one-token steps
(drafts, decode) record for it. A `Recording` is the static set of recorders the forward and
the loops take as their one argument (a rule's is `Needs.recording`): they run every
recorder alike, so a rule that needs a statistic nothing records yet writes a recorder
beside it (WORKSPACE.md, "Add a scoring rule") and no loop changes.

Where the records go: the built-in recorders fill the named fields of `records.Observation`
and `records.DraftRecord` (`QueryWindow`: q, q_pos; `AttentionSums`: attn_sum, probs;
`QueryStatistics`: q_stats), which `dge_jax.eviction.observation` joins per timing; any
other recorder's record goes into `obs.records` (and `drafts.records`) under its name, and
its `join` says how draft steps add to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from dge_jax.config import ModelConfig
from dge_jax.runtime.records import DraftRecord, Observation, QueryStats, Records
from dge_jax.runtime.rope import fixed_frequencies


class LayerView(NamedTuple):
    """What one layer of a forward pass over T new tokens shows its recorders.

    hidden: [B, T, E] the layer's input; queries: [B, T, Hq, D] before RoPE (after any q
    norm); rotated: [B, T, Hq, D] after RoPE, as attention reads them; positions: [B, T]
    int32 (-1 = padding); probs_sum: [B, Hq, S] f32 the attention each cache slot received
    from these T queries (padding queries add nothing) when a recorder of the recording
    `reads_probs_sum`, else None.
    """

    hidden: jax.Array
    queries: jax.Array
    rotated: jax.Array
    positions: jax.Array
    probs_sum: jax.Array | None


class Setup(NamedTuple):
    """What a prompt's record starts from: the model's config, the prompts' lengths [B]
    int32, and the cache's slots per head and dtype."""

    cfg: ModelConfig
    lengths: jax.Array
    capacity: int
    dtype: Any


class Recorder:
    """One statistic the forward records. Derive a frozen dataclass (hashable: it is static
    under jit), give it a `name` and write `layer`, `start` and `add`; `steps` and `join`
    say what draft steps add to it (default: nothing, a statistic of the prompt).

    name: its record's name; a recording holds one recorder per name (`|` joins two).
    reads_probs_sum: whether `layer` reads `view.probs_sum` (attention then also sums its
    probabilities per slot: a second pass over the keys in a prefill chunk).
    """

    name: ClassVar[str]
    reads_probs_sum: ClassVar[bool] = False

    def layer(self, view: LayerView) -> Any:
        """This layer's value for one forward call (the forward stacks layers on [L])."""
        raise NotImplementedError

    def start(self, setup: Setup) -> Any:
        """The prompt's record before its first chunk."""
        raise NotImplementedError

    def add(self, record: Any, value: Any, positions: jax.Array) -> Any:
        """The record with one prefill chunk's value ([L, ...] per leaf) merged; positions:
        the chunk's [B, T]."""
        raise NotImplementedError

    def observe(self, obs: Observation, record: Any) -> Observation:
        """The prompt's observation holding the finished record: `obs.records[name]`."""
        return dataclasses.replace(obs, records=(obs.records or Records()).put(self, record))

    @property
    def steps(self) -> Recorder | None:
        """What each one-token step (draft or decode) records for this statistic; None:
        nothing (only the prompt's queries count)."""
        return None

    def into_drafts(self, drafts: DraftRecord, stacked: Any) -> DraftRecord:
        """The draft record holding K steps' values, stacked on a leading [K] axis:
        `drafts.records[name]`."""
        return drafts._replace(records=(drafts.records or Records()).put(self, stacked))

    def join(self, record: Any, drafts: DraftRecord, weight: jax.Array) -> Any:
        """The prompt's record joined with what the draft steps recorded (`drafts`, this
        recorder's `steps`' values), each step weighted by weight [B, K] f32 (0: not
        observed): the timing's observation. Default: the prompt's record alone."""
        return record

    def __or__(self, other: Recorder) -> Recorder:
        """The one recorder of this name serving both: equal ones are one."""
        if self != other:
            raise ValueError(f"one recording holds one {self.name!r} recorder: {self} or {other}")
        return self


@dataclasses.dataclass(frozen=True)
class QueryWindow(Recorder):
    """The last `size` queries per layer (post-RoPE) and their positions: `obs.q`,
    `obs.q_pos` [L, B, Hq, size, D], [B, size] (-1: no query there); a draft step records
    its one query (`drafts.q` [L, B, Hq, K, D])."""

    size: int
    name: ClassVar[str] = "query_window"

    def layer(self, view: LayerView) -> jax.Array:
        """[B, Hq, w, D]: the call's last w = min(size, T) queries."""
        t = view.rotated.shape[1]
        return view.rotated[:, t - min(self.size, t) :].transpose(0, 2, 1, 3)

    def start(self, setup: Setup) -> tuple[jax.Array, jax.Array]:
        cfg, b, w = setup.cfg, setup.lengths.shape[0], self.size
        shape = (cfg.num_layers, b, cfg.num_heads, w, cfg.head_dim)
        return jnp.zeros(shape, setup.dtype), jnp.full((b, w), -1, jnp.int32)

    def add(self, record, value, positions):
        """Rolling: the chunk's last queries appended, the last `size` kept."""
        q, q_pos = record
        w, c = self.size, positions.shape[1]
        q = jnp.concatenate([q, value], axis=3)[:, :, :, -w:]
        q_pos = jnp.concatenate([q_pos, positions[:, c - min(w, c) :]], axis=1)[:, -w:]
        return q, q_pos

    def observe(self, obs: Observation, record) -> Observation:
        q, q_pos = record
        return dataclasses.replace(obs, q=q, q_pos=q_pos, is_draft=jnp.zeros((self.size,), bool))

    @property
    def steps(self) -> Recorder:
        return QueryWindow(1)

    def into_drafts(self, drafts: DraftRecord, stacked: jax.Array) -> DraftRecord:
        # [K, L, B, Hq, 1, D] -> [L, B, Hq, K, D]
        return drafts._replace(q=jnp.moveaxis(stacked[..., 0, :], 0, 3))

    def __or__(self, other: Recorder) -> Recorder:
        """The larger window serves both."""
        return QueryWindow(max(self.size, other.size))


@dataclasses.dataclass(frozen=True)
class AttentionSums(Recorder):
    """Each slot's attention summed over every prompt query: `obs.attn_sum` [L, B, Hq, S]
    f32 (H2O's); a draft step records its own (`drafts.probs` [L, B, Hq, K, S])."""

    name: ClassVar[str] = "attention_sums"
    reads_probs_sum: ClassVar[bool] = True

    def layer(self, view: LayerView) -> jax.Array:
        return view.probs_sum

    def start(self, setup: Setup) -> jax.Array:
        cfg = setup.cfg
        shape = (cfg.num_layers, setup.lengths.shape[0], cfg.num_heads, setup.capacity)
        return jnp.zeros(shape, jnp.float32)

    def add(self, record, value, positions):
        return record + value

    def observe(self, obs: Observation, record) -> Observation:
        return dataclasses.replace(obs, attn_sum=record)

    @property
    def steps(self) -> Recorder:
        return self

    def into_drafts(self, drafts: DraftRecord, stacked: jax.Array) -> DraftRecord:
        return drafts._replace(probs=jnp.moveaxis(stacked, 0, 3))  # [K, L, ...] -> [L, B, Hq, K, S]


def query_statistics(q: jax.Array, positions: jax.Array, start: int) -> tuple[jax.Array, ...]:
    """Sums over the positions >= start of pre-RoPE queries q [B, T, Hq, D] and of their
    outer products: ([B, Hq, D], [B, Hq, D, D]) f32 (padding, position -1, never counts)."""
    w = (positions >= start).astype(jnp.float32)  # [B, T]
    qf = q.astype(jnp.float32)
    total = jnp.einsum("bthd,bt->bhd", qf, w)
    outer = jnp.einsum("bthd,bthe,bt->bhde", qf, qf, w)
    return total, outer


@dataclasses.dataclass(frozen=True)
class QueryStatistics(Recorder):
    """Sums of the pre-RoPE queries at prompt positions >= `first` and of their outer
    products (`obs.q_stats`, a `QueryStats`: ExpectedAttention's), [L, B, Hq, D(, D)] however
    long the prompt. A draft step records its post-RoPE query (a one-query window), which
    `eviction.observation.with_drafts` rotates back and adds."""

    first: int
    name: ClassVar[str] = "query_statistics"

    def layer(self, view: LayerView) -> tuple[jax.Array, jax.Array]:
        return query_statistics(view.queries, view.positions, self.first)

    def start(self, setup: Setup) -> QueryStats:
        """Zero sums, and the count the prompt's positions >= first will bring (per row)."""
        cfg, lengths = setup.cfg, setup.lengths
        nl, b, hq, hd = cfg.num_layers, lengths.shape[0], cfg.num_heads, cfg.head_dim
        return QueryStats(
            total=jnp.zeros((nl, b, hq, hd), jnp.float32),
            outer=jnp.zeros((nl, b, hq, hd, hd), jnp.float32),
            count=jnp.maximum(lengths - self.first, 0).astype(jnp.float32),
            inv_freq=jnp.asarray(fixed_frequencies(cfg.rope, cfg.head_dim, "ExpectedAttention")),
        )

    def add(self, record: QueryStats, value, positions) -> QueryStats:
        return record.plus(*value)

    def observe(self, obs: Observation, record: QueryStats) -> Observation:
        return dataclasses.replace(obs, q_stats=record)

    @property
    def steps(self) -> Recorder:
        return QueryWindow(1)


@dataclasses.dataclass(frozen=True)
class Recording:
    """The static set of recorders a forward pass and its loop run, one per name, in name
    order: the forward's, `prefill_prompt`'s, `draft_tokens`' and the decode loops' one
    argument of what to record. `Recording()` records nothing; `Recording.of(...)` joins
    recorders of one name (`Recorder.__or__`: the larger window)."""

    recorders: tuple[Recorder, ...] = ()

    def __post_init__(self) -> None:
        names = [r.name for r in self.recorders]
        if names != sorted(set(names)):
            raise ValueError(f"a Recording holds one recorder per name, in name order, got "
                             f"{names}: build it with Recording.of(...)")  # fmt: skip

    @classmethod
    def of(cls, *recorders: Recorder) -> Recording:
        """The recording of `recorders`, those of one name joined."""
        merged: dict[str, Recorder] = {}
        for r in recorders:
            merged[r.name] = merged[r.name] | r if r.name in merged else r
        return cls(tuple(merged[name] for name in sorted(merged)))

    def __or__(self, other: Recording) -> Recording:
        """One recording serving both."""
        return Recording.of(*self.recorders, *other.recorders)

    @property
    def reads_probs_sum(self) -> bool:
        """Whether attention must sum its probabilities per slot for a recorder."""
        return any(r.reads_probs_sum for r in self.recorders)

    @property
    def steps(self) -> Recording:
        """What each one-token step (draft or decode) records for these recorders."""
        return Recording.of(*(r.steps for r in self.recorders if r.steps is not None))

    def has(self, kind: type[Recorder]) -> bool:
        """Whether a recorder of type `kind` is in this recording."""
        return any(isinstance(r, kind) for r in self.recorders)

    def get(self, values: tuple, kind: type[Recorder]) -> Any:
        """The value of this recording's recorder of type `kind` in `values` (one per
        recorder, as the forward and the loops give them), or None."""
        found = [v for r, v in zip(self.recorders, values, strict=True) if isinstance(r, kind)]
        return found[0] if found else None

    def layer(self, view: LayerView) -> tuple:
        """Every recorder's value for one layer (what the forward stacks)."""
        return tuple(r.layer(view) for r in self.recorders)

    def start(self, setup: Setup) -> tuple:
        """Every recorder's record before a prompt's first chunk."""
        return tuple(r.start(setup) for r in self.recorders)

    def add(self, records: tuple, values: tuple, positions: jax.Array) -> tuple:
        """Every record with one prefill chunk's values merged."""
        merged = zip(self.recorders, records, values, strict=True)
        return tuple(r.add(rec, v, positions) for r, rec, v in merged)

    def observe(self, obs: Observation, records: tuple) -> Observation:
        """The prompt's observation holding every finished record."""
        for r, record in zip(self.recorders, records, strict=True):
            obs = r.observe(obs, record)
        return obs

    def into_drafts(self, drafts: DraftRecord, stacked: tuple) -> DraftRecord:
        """The draft record holding every recorder's K steps' values ([K, ...] stacked)."""
        for r, values in zip(self.recorders, stacked, strict=True):
            drafts = r.into_drafts(drafts, values)
        return drafts


NOTHING = Recording()  # what a forward or loop records when not asked
