"""Lookahead Q-Cache (LAQ, arXiv 2505.20334), timing "lookahead": the pieces between the
shared prefill and the cell's one selection.

LAQ, as its code runs it (`select_KV_lookahead_stage`, then `select_KV_decoding_stage`):

1. the first answer token comes from the full cache (it is FullKV's);
2. a copy of the prefill cache is compressed by the rule at a looser budget, scoring with a
   wider query window (`Lookahead`: 512 entries, 32 queries);
3. k lookahead tokens are generated from that copy, fed from the first answer token on (a
   row stops at its EOS: its later steps observe nothing);
4. the rule selects from the full prefill cache observing its own prompt window plus the k
   lookahead queries; the lookahead tokens are thrown away, and the answer decodes from the
   first token with that selection.

Cells whose first stage and k agree share one lookahead (`lookahead_key`). Steps 2 and 3
live here as pure pieces; `dge_jax.stages.lookahead` runs them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Timing
from dge_jax.runtime.decoding import DecodeState, is_eos
from dge_jax.runtime.records import DraftRecord


def first_stage(ev: Eviction) -> Eviction:
    """The eviction that compresses the lookahead's copy: `ev`'s rule with the first stage's
    query window (a rule without a window as it is), at the first stage's budget, evicting
    right after prefill, compacted; head budgets, ties and sliding layers as `ev`'s."""
    stage = ev.timing.lookahead
    rule = ev.rule
    if "window" in {f.name for f in dataclasses.fields(rule)}:
        rule = dataclasses.replace(rule, window=stage.window)
    return dataclasses.replace(
        ev, rule=rule, budget=stage.budget, timing=Timing("prefill", 1), compact=True,
        capacity=None, decode=None,
    )  # fmt: skip


def lookahead_key(ev: Eviction) -> tuple:
    """Cells with equal keys share one lookahead: the same first stage, the same k."""
    return (first_stage(ev), ev.timing.k)


def start(state: DecodeState, cache, steps: int, eos_ids: tuple[int, ...]) -> DecodeState:
    """The lookahead's own state: prefill's (the first answer token chosen) over the
    compressed copy `cache`, with room for `steps` tokens whatever the answer's limit (the
    tokens are thrown away). Every array is a copy: the lookahead donates its state, and
    the cells decode from prefill's."""
    copy = jax.tree.map(jnp.copy, dataclasses.replace(state, cache=None))
    limit = jnp.maximum(copy.limit, copy.step + steps)
    return dataclasses.replace(copy, cache=cache, limit=limit, done=is_eos(copy.last, eos_ids))


def observed_steps(record: DraftRecord, before: jax.Array, after: jax.Array) -> DraftRecord:
    """The record with each row's steps after its EOS unobserved (q_pos -1): a row that
    finished at its j-th step (its step counter moved j times, from `before` to `after`
    [B]) observes its first j queries, the last of which produced the EOS."""
    k = record.q_pos.shape[1]
    ran = after - before  # [B]: the steps the row was active for
    observed = jnp.arange(k)[None, :] < ran[:, None]
    return record._replace(q_pos=jnp.where(observed, record.q_pos, -1))


def observed_record(
    ev: Eviction | None, drafts: DraftRecord | None, records: dict[tuple, DraftRecord]
) -> DraftRecord | None:
    """The record `ev`'s rule observes: for a "lookahead" cell its lookahead's (`records`, by
    `lookahead_key`), in place of any draft's; for any other cell `drafts`, the draft
    rewound to its steps (None: no draft)."""
    if ev is None or ev.timing.kind != "lookahead":
        return drafts
    return records[lookahead_key(ev)]


def onto_slots(probs: jax.Array, seen_pos: jax.Array, full_pos: jax.Array) -> jax.Array:
    """Attention the lookahead's queries paid over the compressed copy's slots, moved onto
    the full cache's slots by position: probs [L, B, Hq, K, S1] over slots holding seen_pos
    [L, B, Hkv, S1] -> [L, B, Hq, K, S] over slots holding full_pos [L, B, Hkv, S] (-1:
    empty). An entry the first stage evicted got no attention (0); the lookahead's own
    entries are not in the full cache and drop out."""
    nl, b, hq, k, _ = probs.shape
    hkv, s = full_pos.shape[2], full_pos.shape[3]
    group = hq // hkv

    def one_head(p, seen, full):  # [G, K, S1], [S1], [S] -> [G, K, S]
        # Where does each copy slot's position sit in the full cache? Sort the full cache's
        # positions once, look each seen position up, and check it is really there.
        order = jnp.argsort(full)
        at = jnp.clip(jnp.searchsorted(full[order], seen), 0, s - 1)
        slot = order[at]
        found = (seen >= 0) & (full[slot] == seen)
        target = jnp.where(found, slot, s)  # s: dropped below
        out = jnp.zeros((*p.shape[:-1], s + 1), p.dtype)
        return out.at[..., target].add(p)[..., :s]

    grouped = probs.reshape(nl, b, hkv, group, k, probs.shape[-1])
    fn = jax.vmap(jax.vmap(jax.vmap(one_head)))
    return fn(grouped, seen_pos, full_pos).reshape(nl, b, hq, k, s)
