"""When eviction happens, and which queries the scoring rule may then observe.

A timing never knows which rule runs: it only decides how many answer tokens are drafted
with the full cache before eviction, and which of their queries the rule observes
(`dge_jax.eviction.observation.with_drafts` assembles them).

| kind      | evicts after         | observation queries                        |
|-----------|----------------------|--------------------------------------------|
| "prefill" | prefill              | last w prompt queries                      |
| "dge"     | k-1 draft steps      | last w prompt queries + the k-1 draft ones |
| "dge_w"   | k-1 draft steps      | last w prompt queries only                 |
| "dge_d"   | k-1 draft steps      | the k-1 draft queries only                 |
| "decode"  | the first `interval` decode steps (`Eviction.decode`) | those steps' queries |
| "lookahead" | prefill (the lookahead is thrown away) | last w prompt queries + k lookahead ones |

"lookahead" is Lookahead Q-Cache (LAQ, arXiv 2505.20334): a copy of the prefill cache is
first compressed by the rule at a looser budget (`Lookahead`), k tokens are generated from
that copy after the first answer token, and their queries join the prompt window when the
rule selects from the full prefill cache; the lookahead tokens are discarded, and the
answer decodes from the first token (FullKV's) with that selection
(`dge_jax.eviction.lookahead`). Unlike DGE's drafts, the lookahead is cheap (a compressed
cache) and not kept.

"decode" is decoding-time compression alone (kvpress's ``DecodingPress``): nothing is evicted
before decoding, and the prompt is first evicted with the rest of the cache once the first
`interval` answer tokens exist (`dge_jax.eviction.decode_compression`).

With "dge" and "dge_w", "dge_d" completes the decomposition of DGE's observation (window,
drafts, both); against "decode" at interval k (drafted queries alone, repeated every k
tokens) it separates which queries observe from how often the cache is compressed.

Under the three DGE timings the draft entries are always kept, and count against the budget.
`slide=True` makes DGE's window slide instead: the last w queries overall (the oldest k-1
prompt queries drop out), so the rule sees as many queries as the baseline does.
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("prefill", "dge", "dge_w", "dge_d", "decode", "lookahead")
# The kinds that draft k - 1 answer tokens with the full cache before evicting.
DRAFTING = ("dge", "dge_w", "dge_d")
# The kinds whose k is part of what they are (a cell's id names it).
WITH_K = (*DRAFTING, "lookahead")
# The kinds whose scores read drafted queries (draft_weight weighs them).
OBSERVES_DRAFTS = ("dge", "dge_d", "lookahead")


ADAPTIVE_RULES = ("entropy", "top1")


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """Draft until the model starts to need the context, at most k_max - 1 steps.

    rule "entropy": stop at the first answer token whose next-token distribution has entropy
    (nats) above `threshold`; "top1": whose top-1 probability is below it. That token is
    the last one generated with the full cache, so its query is observed (k = its index).
    """

    rule: str = "entropy"
    threshold: float = 1.0

    def __post_init__(self):
        if self.rule not in ADAPTIVE_RULES:
            raise ValueError(f"unknown adaptive rule {self.rule!r}; choose from {ADAPTIVE_RULES}")

    def steps(self, entropy: np.ndarray, top1: np.ndarray, max_steps: int) -> np.ndarray:
        """Draft steps per row [B] from per-token stats [B, >= max_steps + 1] (t1 first).

        Worked example, entropy [0.1, 0.2, 2.5, 0.3], threshold 1.0, max_steps 3: the rule
        fires on t3 (index 2), so t1..t3 come from the full cache: 2 draft steps, k = 3.
        """
        fires = (entropy > self.threshold) if self.rule == "entropy" else (top1 < self.threshold)
        fires = fires[:, : max_steps + 1]
        first = np.where(fires.any(axis=1), fires.argmax(axis=1), max_steps)
        return np.minimum(first, max_steps).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Lookahead:
    """LAQ's first stage: the looser budget (entries per kv head) and the query window the
    rule compresses the lookahead's copy of the cache with (LAQ's defaults: 512, 32). A rule
    without a window scores as it always does."""

    budget: int = 512
    window: int = 32

    def __post_init__(self):
        for name in ("budget", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Lookahead.{name} must be an integer >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Timing:
    """kind: one of `KINDS`; k: answer tokens generated with the full cache before the first
    eviction (1 for "prefill"; "decode" counts in decode intervals; "lookahead": its
    lookahead tokens, generated on a compressed copy).

    adaptive: stop drafting per row by a rule (k is then k_max). draft_weight: weight of a
    draft query relative to a prompt-window query in the scores (1 = the paper's DGE).
    lookahead: the first stage of "lookahead" (k = L lookahead tokens; default `Lookahead()`).
    """

    kind: str = "dge"
    k: int = 2
    slide: bool = False
    adaptive: Adaptive | None = None
    draft_weight: float = 1.0
    lookahead: Lookahead | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown timing {self.kind!r}; choose one of {', '.join(KINDS)}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an integer >= 1, got {self.k!r}")
        if self.draft_weight < 0:
            raise ValueError(f"draft_weight must be >= 0, got {self.draft_weight}")
        if self.adaptive is not None and self.kind not in ("dge", "dge_w"):
            raise ValueError(f"an adaptive k needs timing dge or dge_w, not {self.kind}")
        if self.kind == "dge_d" and self.k < 2:
            raise ValueError(
                f"timing dge_d observes only the k - 1 drafted queries, so k must be >= 2 "
                f"(got k = {self.k}); k = 1 would leave the rule nothing to observe"
            )
        if self.slide and self.kind != "dge":
            raise ValueError(f"slide=True slides DGE's window (timing dge), not {self.kind}")
        if self.kind == "lookahead" and self.lookahead is None:
            object.__setattr__(self, "lookahead", Lookahead())
        if self.lookahead is not None and self.kind != "lookahead":
            raise ValueError(f"Timing.lookahead sets timing lookahead's first stage, not "
                             f"{self.kind}'s")  # fmt: skip
        if self.lookahead is not None and not isinstance(self.lookahead, Lookahead):
            raise TypeError(f"Timing.lookahead must be a Lookahead, got {self.lookahead!r}")

    @property
    def draft_steps(self) -> int:
        """Draft steps run with the full cache before the prompt's eviction (k - 1 for the
        `DRAFTING` kinds; 0 for "prefill", for "decode", whose first eviction happens inside
        the decode loop, and for "lookahead", whose k steps run on a compressed copy)."""
        return self.k - 1 if self.kind in DRAFTING else 0

    @property
    def before_decoding(self) -> bool:
        """Whether the prompt is evicted before the decode loop (every kind but "decode")."""
        return self.kind != "decode"

    @property
    def observes_drafts(self) -> bool:
        """Whether drafted queries enter the scores ("dge" and "dge_d" with k > 1; the
        lookahead's under "lookahead")."""
        return self.kind in OBSERVES_DRAFTS and (self.kind == "lookahead" or self.k > 1)

    @property
    def observes_prompt(self) -> bool:
        """Whether the prompt's observation (its window of queries, its attention sums and
        query statistics) enters the scores: every kind but "dge_d"."""
        return self.kind != "dge_d"

    def steps_per_row(self, entropy: np.ndarray, top1: np.ndarray) -> np.ndarray:
        """Draft steps each row runs [B]: k-1, or the adaptive rule's choice (<= k-1)."""
        if self.adaptive is None:
            return np.full(entropy.shape[0], self.draft_steps, np.int32)
        return self.adaptive.steps(entropy, top1, self.draft_steps)


def prefill() -> Timing:
    """The baseline: evict right after prefill."""
    return Timing("prefill", k=1)


def dge(k: int = 2, slide: bool = False) -> Timing:
    """Draft-Guided Eviction: draft k-1 steps, then score with the drafted queries too."""
    return Timing("dge", k=k, slide=slide)


def dge_w(k: int = 2) -> Timing:
    """DGE-W, the timing-only control: wait k-1 steps but score with prompt queries only."""
    return Timing("dge_w", k=k)


def lookahead(k: int = 8, budget: int = 512, window: int = 32) -> Timing:
    """LAQ: k lookahead tokens from a copy compressed at `budget` with a `window`-query rule,
    their queries observed when selecting from the full cache, then discarded."""
    return Timing("lookahead", k=k, lookahead=Lookahead(budget, window))


def dge_d(k: int = 2) -> Timing:
    """DGE-D: draft k-1 steps, then score with the drafted queries alone (no prompt window)."""
    return Timing("dge_d", k=k)
