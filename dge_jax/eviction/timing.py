"""When eviction happens, and which queries the scoring rule may then observe.

A timing never knows which rule runs: it only decides how many answer tokens are drafted
with the full cache before eviction, and which of their queries the rule observes
(`dge_jax.eviction.observation.with_drafts` assembles them).

| kind      | evicts after         | observation queries                        |
|-----------|----------------------|--------------------------------------------|
| "prefill" | prefill              | last w prompt queries                      |
| "dge"     | k-1 draft steps      | last w prompt queries + the k-1 draft ones |
| "dge_w"   | k-1 draft steps      | last w prompt queries only                 |
| "decode"  | the first `interval` decode steps (`Eviction.decode`) | those steps' queries |

"decode" is decoding-time compression alone (kvpress's ``DecodingPress``): nothing is evicted
before decoding, and the prompt is first evicted with the rest of the cache once the first
`interval` answer tokens exist (`dge_jax.eviction.decode_compression`).

Under both DGE timings the draft entries are always kept, and count against the budget.
`slide=True` makes DGE's window slide instead: the last w queries overall (the oldest k-1
prompt queries drop out), so the rule sees as many queries as the baseline does.
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("prefill", "dge", "dge_w", "decode")


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
class Timing:
    """kind: "prefill" | "dge" | "dge_w" | "decode"; k: answer tokens generated with the full
    cache before the first eviction (1 for "prefill"; "decode" counts in decode intervals).

    adaptive: stop drafting per row by a rule (k is then k_max). draft_weight: weight of a
    draft query relative to a prompt-window query in the scores (1 = the paper's DGE).
    """

    kind: str = "dge"
    k: int = 2
    slide: bool = False
    adaptive: Adaptive | None = None
    draft_weight: float = 1.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown timing {self.kind!r}; choose one of {', '.join(KINDS)}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an integer >= 1, got {self.k!r}")
        if self.draft_weight < 0:
            raise ValueError(f"draft_weight must be >= 0, got {self.draft_weight}")
        if self.adaptive is not None and self.kind in ("prefill", "decode"):
            raise ValueError(f"an adaptive k needs timing dge or dge_w, not {self.kind}")

    @property
    def draft_steps(self) -> int:
        """Draft steps run with the full cache before the prompt's eviction (k - 1; 0 for
        "prefill", and for "decode", whose first eviction happens inside the decode loop)."""
        return 0 if self.kind in ("prefill", "decode") else self.k - 1

    @property
    def before_decoding(self) -> bool:
        """Whether the prompt is evicted before the decode loop (every kind but "decode")."""
        return self.kind != "decode"

    @property
    def observes_drafts(self) -> bool:
        """Whether the draft queries enter the scores ("dge" with k > 1)."""
        return self.kind == "dge" and self.draft_steps > 0

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
