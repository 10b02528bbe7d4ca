"""When eviction happens, and which queries the scoring rule may then observe (DESIGN §1).

A timing never knows which policy runs: it only decides how many answer tokens are drafted
with the full cache before eviction, and assembles the `Observation` handed to the policy.

| kind      | evicts after         | observation queries                        |
|-----------|----------------------|--------------------------------------------|
| "prefill" | prefill              | last w prompt queries                      |
| "dge"     | k-1 draft steps      | last w prompt queries + the k-1 draft ones |
| "dge_w"   | k-1 draft steps      | last w prompt queries only                 |

Under both DGE timings the draft entries are always kept, and count against the budget.
`slide=True` makes DGE's window slide instead: the last w queries overall (the oldest k-1
prompt queries drop out), so the policy sees as many queries as the baseline does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dge_jax.cache import Observation
from dge_jax.decoding import DraftRecord

KINDS = ("prefill", "dge", "dge_w")


@dataclasses.dataclass(frozen=True)
class Timing:
    """kind: "prefill" | "dge" | "dge_w"; k: answer tokens generated with the full cache."""

    kind: str = "dge"
    k: int = 2
    slide: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown timing {self.kind!r}; choose one of {', '.join(KINDS)}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an integer >= 1, got {self.k!r}")

    @property
    def draft_steps(self) -> int:
        """Decode steps run with the full cache before eviction (k - 1; 0 for "prefill")."""
        return 0 if self.kind == "prefill" else self.k - 1

    @property
    def observes_drafts(self) -> bool:
        return self.kind == "dge" and self.draft_steps > 0

    def observation(self, prompt_obs: Observation, drafts: DraftRecord | None) -> Observation:
        """The observation the policy scores with: the prompt's, plus drafts under "dge"."""
        return observation(prompt_obs, drafts, jnp.asarray(self.observes_drafts), self.slide)


def observation(
    prompt_obs: Observation,
    drafts: DraftRecord | None,
    observe_drafts: jax.Array,
    slide: bool = False,
) -> Observation:
    """Prompt observation plus the draft queries, which count only where `observe_drafts`.

    observe_drafts is a traced bool, so "dge" and "dge_w" (and "prefill", given the same
    draft record) share one compiled scorer: masked draft queries get q_pos -1 and their
    attention is not added. Shapes: q [L, B, Hq, W + k-1, D], q_pos [B, W + k-1].
    """
    if drafts is None:
        return prompt_obs
    q, q_pos, attn = prompt_obs.q, prompt_obs.q_pos, prompt_obs.attn_sum
    n = drafts.q_pos.shape[1]
    is_draft = None
    if q is not None and drafts.q is not None:
        if slide:
            # Slide the window: the oldest k-1 prompt queries drop out when drafts come in.
            drop = (jnp.arange(q_pos.shape[1]) < n)[None, :] & observe_drafts
            q_pos = jnp.where(drop, -1, q_pos)
        q = jnp.concatenate([q, drafts.q.astype(q.dtype)], axis=3)
        q_pos = jnp.concatenate([q_pos, jnp.where(observe_drafts, drafts.q_pos, -1)], axis=1)
        is_draft = jnp.concatenate([jnp.zeros((q.shape[3] - n,), bool), jnp.ones((n,), bool)])
    if attn is not None and drafts.probs_sum is not None:
        attn = attn + jnp.where(observe_drafts, drafts.probs_sum, 0.0)
    return Observation(
        q=q, q_pos=q_pos, attn_sum=attn, is_draft=is_draft, prompt_end=prompt_obs.prompt_end
    )


def prefill() -> Timing:
    """The baseline: evict right after prefill."""
    return Timing("prefill", k=1)


def dge(k: int = 2, slide: bool = False) -> Timing:
    """Draft-Guided Eviction: draft k-1 steps, then score with the drafted queries too."""
    return Timing("dge", k=k, slide=slide)


def dge_w(k: int = 2) -> Timing:
    """DGE-W, the timing-only control: wait k-1 steps but score with prompt queries only."""
    return Timing("dge_w", k=k)
