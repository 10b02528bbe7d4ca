"""The observation a rule scores with, assembled per timing from what the runtime recorded.

Prefill records the last W prompt queries per layer (and, for H2O, per-slot attention
sums) only when a rule asks; draft steps record theirs (the record types are
`dge_jax.runtime.records`'). `with_drafts` joins them the way the timing says
(`dge_jax.eviction.timing`), and `for_rule` cuts the shared record of a grid down to what one
rule reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dge_jax.runtime.recorders import AttentionSums, QueryWindow
from dge_jax.runtime.records import DraftRecord, Observation, QueryStats, Records
from dge_jax.runtime.rope import rotate


def with_drafts(
    prompt_obs: Observation,
    drafts: DraftRecord | None,
    observe_drafts: jax.Array,
    slide: bool = False,
    draft_weight: jax.Array | float = 1.0,
    observe_prompt: jax.Array | bool = True,
) -> Observation:
    """Prompt observation plus the draft queries, which count only where `observe_drafts`.

    observe_drafts (bool), draft_weight (f32: a draft query's weight relative to a prompt
    query; 1 = the paper's DGE) and observe_prompt (bool; False: "dge_d", the draft queries
    alone) are traced, so "dge", "dge_w", "dge_d" (and "prefill", given the same draft
    record) share one compiled scorer: unobserved queries get q_pos -1 and weight 0, and an
    unobserved prompt adds no attention sums or query statistics. Shapes: q
    [L, B, Hq, W + K, D], q_pos and q_weight [B, W + K].
    """
    if drafts is None:
        return prompt_obs
    prompt_obs = _prompt_part(prompt_obs, jnp.asarray(observe_prompt))
    q, q_pos, attn = prompt_obs.q, prompt_obs.q_pos, prompt_obs.attn_sum
    d_pos = jnp.where(observe_drafts, drafts.q_pos, -1)  # [B, K]
    seen = d_pos >= 0
    n = d_pos.shape[1]
    weight = jnp.asarray(draft_weight, jnp.float32)
    is_draft = q_weight = None
    if q is not None and drafts.q is not None:
        if slide:
            # Slide the window: row b's oldest n_b prompt queries drop out, n_b = its
            # observed drafts, so it sees as many queries as the baseline.
            n_seen = jnp.sum(seen, axis=1, dtype=jnp.int32)
            q_pos = jnp.where(jnp.arange(q_pos.shape[1])[None, :] < n_seen[:, None], -1, q_pos)
        q = jnp.concatenate([q, drafts.q.astype(q.dtype)], axis=3)
        q_pos = jnp.concatenate([q_pos, d_pos], axis=1)
        is_draft = jnp.concatenate([jnp.zeros((q.shape[3] - n,), bool), jnp.ones((n,), bool)])
        q_weight = jnp.where(is_draft[None, :], weight, 1.0) * jnp.ones(q_pos.shape, jnp.float32)
    if attn is not None and drafts.probs is not None:
        # probs [L, B, Hq, K, S]: add the observed steps' attention, weighted.
        step_weight = (seen * weight).astype(jnp.float32)[None, :, None, :, None]
        attn = attn + jnp.sum(drafts.probs * step_weight, axis=3)
    q_stats = prompt_obs.q_stats
    if q_stats is not None and drafts.q is not None:
        q_stats = _join_draft_queries(q_stats, drafts, seen * weight)
    records = prompt_obs.records
    if records is not None:  # a rule's own recorders say how drafts add (`Recorder.join`)
        records = records.join(drafts, (seen * weight).astype(jnp.float32))
    return Observation(
        q=q,
        q_pos=q_pos,
        attn_sum=attn,
        is_draft=is_draft,
        prompt_end=prompt_obs.prompt_end,
        q_weight=q_weight,
        out_proj=prompt_obs.out_proj,
        q_stats=q_stats,
        recon=prompt_obs.recon,
        records=records,
    )


def _prompt_part(obs: Observation, observed: jax.Array) -> Observation:
    """The prompt's observation, or (observed False, traced) one that adds nothing: its
    window queries at q_pos -1, its attention sums and query statistics zero. A rule's own
    records are the prompt's statistics too; `Eviction` refuses "dge_d" for rules that keep
    any, since nothing here can tell what a record of no queries is."""
    scale = observed.astype(jnp.float32)
    q_pos = None if obs.q_pos is None else jnp.where(observed, obs.q_pos, -1)
    attn = None if obs.attn_sum is None else obs.attn_sum * scale
    stats = obs.q_stats
    if stats is not None:
        stats = dataclasses.replace(
            stats, total=stats.total * scale, outer=stats.outer * scale, count=stats.count * scale
        )
    return dataclasses.replace(obs, q_pos=q_pos, attn_sum=attn, q_stats=stats)


def _join_draft_queries(stats: QueryStats, drafts: DraftRecord, weight: jax.Array) -> QueryStats:
    """`stats` with the draft queries added, each with its weight [B, K] (0 = not observed).

    The draft record holds post-RoPE queries; rotating each back by its own position gives
    the pre-RoPE query the statistics are kept in.
    """
    angles = jnp.maximum(drafts.q_pos, 0).astype(jnp.float32)[..., None] * stats.inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, K, D]
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    pre = rotate(drafts.q.astype(jnp.float32), cos, -sin)  # [L, B, Hq, K, D]: R(p)^T q
    w = weight.astype(jnp.float32)[None, :, None, :, None]
    return QueryStats(
        total=stats.total + jnp.sum(pre * w, axis=3),
        outer=stats.outer + jnp.einsum("lbhkd,lbhke->lbhde", pre * w, pre),
        count=stats.count + jnp.sum(weight, axis=-1),
        inv_freq=stats.inv_freq,
    )


def for_rule(
    rule, obs: Observation, drafts: DraftRecord | None
) -> tuple[Observation, DraftRecord | None]:
    """The shared prefill observation and draft record cut to what `rule` reads.

    Prefill recorded the largest window any cell needs; a rule with a smaller window sees
    only its own last w queries, and one that reads no queries (or no attention) sees none.
    """
    needs = rule.needs
    w = needs.window
    q = q_pos = is_draft = None
    if w:
        q, q_pos, is_draft = obs.q[:, :, :, -w:], obs.q_pos[:, -w:], obs.is_draft[-w:]
    attn = obs.attn_sum if needs.attn_sum else None
    out_proj = obs.out_proj if needs.out_proj else None
    stats = obs.q_stats if needs.query_stats_from is not None else None
    recon = obs.recon if needs.reconstruction is not None else None
    records = None if obs.records is None else obs.records.only(needs.recorders)
    obs = Observation(
        q=q, q_pos=q_pos, attn_sum=attn, is_draft=is_draft, prompt_end=obs.prompt_end,
        out_proj=out_proj, q_stats=stats, recon=recon, records=records,
    )  # fmt: skip
    if drafts is not None:
        steps = needs.recording.steps  # what the rule reads of each draft step
        drafts = drafts._replace(
            q=drafts.q if steps.has(QueryWindow) else None,
            probs=drafts.probs if steps.has(AttentionSums) else None,
            records=None if drafts.records is None else drafts.records.only(steps.recorders),
        )
    return obs, drafts


def layers_of(obs: Observation, first: int, stop: int) -> Observation:
    """What ``obs`` holds of layers [first, stop): the layer-major fields (queries,
    attention sums, output projections, query statistics, reconstruction scores, every rule
    recorder's record: `Recorder.layer` values stacked on [L]) cut there, the rest as is. How
    a rule scores one layer group of a cache whose groups differ in capacity."""

    def cut(x):
        return None if x is None else x[first:stop]

    stats = obs.q_stats
    if stats is not None:
        stats = dataclasses.replace(stats, total=stats.total[first:stop],
                                    outer=stats.outer[first:stop])  # fmt: skip
    records = obs.records
    if records is not None:
        records = Records(records.recorders, jax.tree.map(cut, records.values))
    return dataclasses.replace(
        obs, q=cut(obs.q), attn_sum=cut(obs.attn_sum), out_proj=cut(obs.out_proj),
        recon=cut(obs.recon), q_stats=stats, records=records,
    )  # fmt: skip
