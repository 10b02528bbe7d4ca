"""The rule interface: `Needs` (what a rule asks the generator to record), the `Rule`
protocol, the `ScoringRule` defaults, field checks and the score sentinels (`finish`), and
`PyramidSchedule`, the per-layer budgets a rule may hand out (`Rule.layer_schedule`).

A rule is one file of `dge_jax.rules` named after it, holding a frozen dataclass derived
from `ScoringRule` and decorated with `registry.register`. Shapes: cache
``k: [L, B, Hkv, S, D]``, ``pos: [L, B, Hkv, S]``; ``obs.q: [L, B, Hq, W, D]``,
``obs.q_pos: [B, W]``. GQA: query head h belongs to kv head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Hashable
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.recorders import (
    AttentionSums,
    QueryStatistics,
    QueryWindow,
    Recorder,
    Recording,
)
from dge_jax.runtime.records import Observation


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a rule reads besides the cache, declared as one value (`ScoringRule.needs`).

    window: trailing prompt queries per layer the forward records (`obs.q`; 0 = none).
    attn_sum: whether every observed query's attention to each slot is summed
    (`obs.attn_sum`, H2O's). query_stats_from: None, or the first prompt position whose
    pre-RoPE query enters `obs.q_stats` (ExpectedAttention's). recorders: recorders of the
    rule's own, for a statistic none of those is (`dge_jax.runtime.recorders.Recorder`,
    written beside the rule; read as ``obs.records[name]``). reconstruction: None, or the
    reconstruct stage whose scores (`obs.recon`) the rule reads: a hashable value whose
    ``scores(...)`` the stage calls (`kvzip.Reconstruction`). out_proj: whether the select stage
    adds each layer's output projection (`obs.out_proj`, CriticalKV's). protected: entries
    per head the rule always keeps (its window or sinks), which a budget must hold.

    What the forward records for them is `recording`: window, attn_sum and query_stats_from
    name the built-in recorders, `recorders` add the rule's own.
    """

    window: int = 0
    attn_sum: bool = False
    query_stats_from: int | None = None
    reconstruction: Hashable | None = None
    out_proj: bool = False
    protected: int = 0
    recorders: tuple[Recorder, ...] = ()

    def __post_init__(self) -> None:
        builtin = [type(r).__name__ for r in self.recorders if type(r) in _BUILTIN]
        if builtin:
            raise ValueError(
                f"Needs(recorders=...) holds a rule's own recorders; declare {builtin} with "
                "window=, attn_sum= or query_stats_from= (what Needs.recording makes of them)"
            )

    @property
    def recording(self) -> Recording:
        """What the forward records for these needs (`dge_jax.runtime.recorders`)."""
        built = (
            QueryWindow(self.window) if self.window else None,
            AttentionSums() if self.attn_sum else None,
            None if self.query_stats_from is None else QueryStatistics(self.query_stats_from),
        )
        return Recording.of(*(r for r in built if r is not None), *self.recorders)

    @property
    def queries(self) -> bool:
        """Whether recorded queries enter the scores (a window or query statistics): draft
        steps then record theirs."""
        return self.window > 0 or self.query_stats_from is not None

    @property
    def query_free(self) -> bool:
        """Whether nothing a draft step records informs the scores (no query, no attention,
        no recorder of its own that steps add to): DGE then equals DGE-W."""
        return not self.recording.steps.recorders

    def __or__(self, other: Needs) -> Needs:
        """What one recording must hold to serve both (a grid's cells, a wrapper and its
        inner rule): the larger window and protection, any flag either sets, the recorders of
        both. Query statistics and the reconstruct stage are recorded once, so both must
        agree."""
        starts = {self.query_stats_from, other.query_stats_from} - {None}
        if len(starts) > 1:
            raise ValueError(
                f"one grid records one set of query statistics, but its cells start them at "
                f"positions {sorted(starts)} (ExpectedAttention sinks): give them one value"
            )
        recs = {self.reconstruction, other.reconstruction} - {None}
        if len(recs) > 1:
            raise ValueError(
                f"one grid runs one reconstruct stage, but its KVzip cells differ in it: "
                f"{sorted(recs, key=repr)}; give them the same sinks, chunk_size and repeat_tail"
            )
        return Needs(
            window=max(self.window, other.window),
            attn_sum=self.attn_sum or other.attn_sum,
            query_stats_from=next(iter(starts), None),
            reconstruction=next(iter(recs), None),
            out_proj=self.out_proj or other.out_proj,
            protected=max(self.protected, other.protected),
            recorders=Recording.of(*self.recorders, *other.recorders).recorders,
        )


@dataclasses.dataclass(frozen=True)
class PyramidSchedule:
    """PyramidKV's per-layer budgets (arXiv 2406.02069; KVCache-Factory's PyramidKVCluster):
    falling linearly from the bottom layer to the top, each layer keeping at least the
    rule's ``window``; ``beta`` sets how steep (the top layer keeps ~(B - w) / beta).
    Here, beside the interface that names it, so rules need nothing of `dge_jax.eviction`
    (which only calls `layer_budgets`)."""

    window: int
    beta: int = 20

    def layer_budgets(self, budget: jax.Array | int, num_layers: int) -> jax.Array:
        """Per-layer budgets [L] int32, bottom layer largest, summing exactly to L·budget.

        KVCache-Factory's linear pyramid (beta 20); every layer keeps at least the window.
        """
        # KVCache-Factory, with budget B (= max_capacity_prompt, window included) and window w:
        #   min_num = (B - w) // beta,   max_num = 2 (B - w) - min_num,
        #   layer l keeps w + max_num - l * ((max_num - min_num) // (L - 1)).
        # Flooring the step makes its total exceed L·B by up to (L-1)L/2 entries. We keep both
        # ends (bottom w + max_num, top w + min_num) and round the exact line instead: with the
        # exact cumulative count C(l) = l·max_num - span·l(l-1) / (2(L-1)), span = max - min,
        # layer l gets ceil(C(l+1)) - ceil(C(l)). C(L) = L(B - w) is an integer (span is
        # even), so the total is exact and each layer is within 1 of the line. Example,
        # B = 40, w = 8, L = 4, beta 20: min 1, max 63, span 62, line 63, 42.33, 21.67, 1;
        # C = 0, 63, 105.33, 127, 128, rounded up 0, 63, 106, 127, 128 -> 63, 43, 21, 1
        # (+ w: 71, 51, 29, 9; sum 160 = 4·40). int32 is exact while 2·B·L² < 2**31.
        # When span is a multiple of L - 1 this equals KVCache-Factory's schedule exactly.
        # A budget no larger than the window cannot form a pyramid: every layer gets B.
        # Not reproduced: KVCache-Factory's prompt-length rules (no eviction for short prompts,
        # which `select` gives anyway, and a uniform fallback when q_len < 2 (B - w)).
        budget = jnp.asarray(budget, jnp.int32)
        if num_layers == 1:
            return budget[None]
        extra = jnp.maximum(budget - self.window, 0)
        min_num = extra // self.beta
        max_num = 2 * extra - min_num
        span = max_num - min_num
        layers = jnp.arange(num_layers + 1, dtype=jnp.int32)
        cumulative = layers * max_num - (span * layers * (layers - 1)) // (2 * (num_layers - 1))
        pyramid = self.window + cumulative[1:] - cumulative[:-1]
        return jnp.where(budget > self.window, pyramid, budget).astype(jnp.int32)


_BUILTIN = (QueryWindow, AttentionSums, QueryStatistics)


class Rule(Protocol):
    """What every scoring rule offers the generator (`ScoringRule` gives the defaults)."""

    name: ClassVar[str]

    @property
    def needs(self) -> Needs:
        """What the forward and the select stage must record or add for this rule."""
        ...

    @property
    def scorer(self) -> Rule:
        """The rule whose `score` this one selects from (itself, or PyramidKV's SnapKV)."""
        ...

    @property
    def layer_schedule(self) -> PyramidSchedule | None:
        """Per-layer budgets from the nominal one (PyramidKV's), or None: every layer alike."""
        ...

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: higher = keep; empty slots -inf, always-kept slots +inf."""
        ...

    def refine(
        self,
        scores: jax.Array,
        budgets: jax.Array,
        cache: KVCache,
        obs: Observation,
        ties: str = "later",
    ) -> jax.Array:
        """The scores selection ranks, once each head's budget [L, B, Hkv] is known."""
        ...


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """ValueError unless ``value`` is one of ``choices`` (the message names both)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_fields(
    obj: Any,
    ints: dict[str, int | tuple[int, int]] | None = None,
    choices: dict[str, tuple[str, ...]] | None = None,
    bools: tuple[str, ...] = (),
) -> None:
    """Checks a frozen dataclass's fields in its ``__post_init__``: one line naming the field,
    the bad value and what is allowed (TypeError for a wrong type, ValueError for a range).

    ints: field -> minimum, or (minimum, maximum) inclusive; Python and numpy integers pass
    (stored back as ``int``), bools and floats do not. choices: field -> allowed strings.
    bools: fields that must be True or False.
    """
    owner = type(obj).__name__
    for name, bounds in (ints or {}).items():
        value = getattr(obj, name)
        low, high = bounds if isinstance(bounds, tuple) else (bounds, None)
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
            raise TypeError(
                f"{owner}.{name} must be {allowed}, got {value!r} ({type(value).__name__})"
            )
        if value < low or (high is not None and value > high):
            raise ValueError(f"{owner}.{name} must be {allowed}, got {value}")
        object.__setattr__(obj, name, int(value))
    for name, allowed in (choices or {}).items():
        check_choice(f"{owner}.{name}", getattr(obj, name), allowed)
    for name in bools:
        value = getattr(obj, name)
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"{owner}.{name} must be True or False, got {value!r}")
        object.__setattr__(obj, name, bool(value))


def finish(scores: jax.Array, valid: jax.Array, protected: jax.Array | None = None) -> jax.Array:
    """Scores [L, B, Hkv, S] f32 with protected slots at +inf and empty slots at -inf.

    The one place that writes the sentinels, so every rule agrees on them (empty wins).
    """
    scores = scores.astype(jnp.float32)
    if protected is not None:
        scores = jnp.where(protected, jnp.inf, scores)
    return jnp.where(valid, scores, -jnp.inf)


def require_obs(obs: Observation, *fields: str) -> None:
    """A clear error when the forward did not record what a rule reads."""
    for field in fields:
        if getattr(obs, field) is None:
            raise ValueError(f"this rule needs obs.{field}, which the forward did not record")


class ScoringRule:
    """The defaults every rule shares: it needs nothing recorded (`Needs()`), scores with
    its own `score`, keeps the same budget in every layer, and ranks its scores as they are.
    Derive a rule from it and override what differs (WORKSPACE.md, "Add a scoring rule")."""

    @property
    def needs(self) -> Needs:
        """Nothing recorded, nothing protected."""
        return Needs()

    @property
    def scorer(self) -> Rule:
        """The rule whose `score` this one selects from: itself."""
        return self

    @property
    def layer_schedule(self) -> PyramidSchedule | None:
        """None: every layer keeps the nominal budget."""
        return None

    def refine(
        self,
        scores: jax.Array,
        budgets: jax.Array,
        cache: KVCache,
        obs: Observation,
        ties: str = "later",
    ) -> jax.Array:
        """The scores selection ranks, given each head's budget [L, B, Hkv] int32 and the tie
        rule: the `scorer`'s scores as they are. A two-stage rule (CriticalKV) re-ranks here."""
        return scores
