"""One eviction = a scoring rule + a budget (or head allocator) + a timing.

`Eviction` bundles them for `dge_jax.generate`; `select_for` is the jitted step shared by
every caller: assemble the timing's observation, score with the rule, keep draft entries,
turn the budget into per-head budgets, select. Budgets are traced arguments, so a sweep over
budgets and over the three timings at one k compiles `select_for` once per rule.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.config import with_fields
from dge_jax.distribution.multihost import fetch
from dge_jax.eviction import sliding as sliding_layers
from dge_jax.eviction.budgets import expand_budgets, head_budgets
from dge_jax.eviction.decode_spec import DecodeCompression, check_decode_rule
from dge_jax.eviction.field_checks import check_budget, check_rule, check_timing, check_timing_fits
from dge_jax.eviction.observation import with_drafts
from dge_jax.eviction.timing import Timing
from dge_jax.rules.base import Rule, check_fields
from dge_jax.rules.full import is_full
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import compaction, selection
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import DraftRecord, Observation

HEAD_BUDGETS = ("uniform", "adakv", "global")


@dataclasses.dataclass(frozen=True)
class Eviction:
    """What to evict and when.

    budget: entries per kv head kept right after eviction (window and drafts included): an
    int, or a per-layer [L] / per-head [L, Hkv] array. head_budget "adakv" re-splits each
    layer's pool Hkv·B across heads by score (floor alpha·B per head); "global" pools every
    layer's (KVzip's allocation: use alpha=0.0 for kvpress's). compact=False keeps the
    masked cache (same shape); capacity fixes the compacted cache's slots, one for all layers
    (None = derived from what each layer kept: `layer_capacities`), so that a sweep can share
    one compilation of decode.

    ties: which of equal scores is kept (`dge_jax.evict`, static: one compilation per rule).
    "later" (the default, the rule before this option existed): the later slot, which in every
    cache decoding builds is the later position (the more recent entry); "earlier": the earlier
    original position (``cache.pos``), as implementations that take the first index among equal
    scores do. Every selection honours it: uniform, per-layer (PyramidKV) and per-head budgets,
    the AdaKV allocator (equal scores across heads go to the later / earlier head) and grids.
    Worked example, one head, max-pooled scores by position ``[.2, .5, .5, .5, .1]`` (a
    plateau), budget 2: "later" keeps positions 2 and 3, "earlier" positions 1 and 2.

    sliding: on a model with sliding-window layers (`dge_jax.eviction.sliding`), "window"
    keeps on each of them what its window still shows, whatever the budget, and the budget
    is the global layers'; "evict" holds them to the budget too, chosen by the rule among the
    entries their window still shows.

    decode: compression while decoding as well (`dge_jax.eviction.decode_compression`): every
    ``decode.interval`` new tokens the same rule brings each head back to ``decode.budget``.
    With timing "decode" nothing is evicted before decoding (``budget`` must then equal
    ``decode.budget``); with the other timings the prompt is evicted at ``budget`` first.
    """

    rule: Rule = SnapKV()
    budget: int | np.ndarray = 256
    timing: Timing = Timing("dge", 2)
    head_budget: str = "uniform"
    alpha: float = 0.2
    compact: bool = True
    capacity: int | None = None
    ties: str = "later"
    decode: DecodeCompression | None = None
    sliding: str = "window"

    def __post_init__(self):
        check_rule(self.rule)
        check_timing(self.timing)
        check_budget(self.budget)
        if isinstance(self.budget, numbers.Integral):
            object.__setattr__(self, "budget", int(self.budget))
        check_fields(
            self, choices={"head_budget": HEAD_BUDGETS, "ties": selection.TIES,
                           "sliding": ("window", "evict")}, bools=("compact",)
        )  # fmt: skip
        if self.capacity is not None:
            check_fields(self, ints={"capacity": 1})
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, numbers.Real):
            raise TypeError(f"Eviction.alpha must be a number in [0, 1], got {self.alpha!r}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"Eviction.alpha must be a number in [0, 1], got {self.alpha}")
        check_timing_fits(self.timing, self.rule, self.decode)
        if self.decode is not None and not isinstance(self.decode, DecodeCompression):
            raise TypeError(
                f"Eviction.decode must be a DecodeCompression or None, got {self.decode!r}"
            )


def protected_size(rule: Rule) -> int:
    """Entries per head a rule always keeps (its window or sinks), before drafts."""
    return rule.needs.protected


def check_eviction(ev: Eviction, max_new_tokens: int) -> None:
    """Clear errors for budgets and k that cannot work, before anything is compiled."""
    budget = np.asarray(ev.budget)
    if budget.size == 0 or not np.issubdtype(budget.dtype, np.integer):
        raise ValueError(f"budget must be an integer or integer array, got {ev.budget!r}")
    if budget.min() < 1:
        raise ValueError(f"budget must be >= 1 entry per head, got {int(budget.min())}")
    need = protected_size(ev.rule) + ev.timing.draft_steps
    if not is_full(ev.rule) and budget.min() < need:
        raise ValueError(
            f"budget {int(budget.min())} is smaller than what {type(ev.rule).__name__} always "
            f"keeps ({protected_size(ev.rule)} window/sink entries + "
            f"{ev.timing.draft_steps} draft entries = {need}); raise the budget or shrink "
            "the window"
        )
    if ev.timing.k > max_new_tokens:
        raise ValueError(
            f"k={ev.timing.k} answer tokens are drafted before eviction, more "
            f"than max_new_tokens={max_new_tokens}"
        )
    if ev.decode is not None or ev.timing.kind == "decode":
        _check_decode(ev, budget)
    if ev.rule.layer_schedule is not None and budget.ndim:
        raise ValueError(
            f"{type(ev.rule).__name__} sets per-layer budgets itself; give it a scalar budget"
        )


def spreads_budget(ev: Eviction) -> bool:
    """Whether `ev` gives heads or layers unequal budgets (AdaKV, global, PyramidKV)."""
    return ev.head_budget != "uniform" or ev.rule.layer_schedule is not None


def _check_decode(ev: Eviction, budget: np.ndarray) -> None:
    """Clear errors for decode-time compression settings that cannot work."""
    spec = ev.decode
    if spec is None:
        raise ValueError(
            "timing 'decode' evicts inside the decode loop and needs Eviction.decode "
            "(a DecodeCompression with the decode budget and interval)"
        )
    if is_full(ev.rule):
        raise ValueError("decode-time compression needs a scoring rule, not FullKV")
    if not ev.compact:
        raise ValueError("decode-time compression compacts the cache; drop compact=False")
    if ev.timing.kind == "decode" and (budget.ndim or int(budget) != spec.budget):
        raise ValueError(
            f"timing 'decode' evicts only while decoding: give budget = decode budget "
            f"({spec.budget}), got {ev.budget!r}"
        )
    check_decode_rule(ev.rule, spec, protected_size(ev.rule))


@dataclasses.dataclass(frozen=True)
class SelectionSpec:
    """How a scored cache becomes keep masks, as one static value under jit.

    rule: the scoring rule, or one per budget of a sweep, all with the same `scorer`
    (SnapKV and PyramidKV cells share a scoring); head_budget / alpha: uniform budgets or an
    allocator and each head's floor (`Eviction.head_budget`, `alpha`); ties: the tie rule;
    head_cap: no head keeps more than this many entries, whatever an allocator gives it
    (decode-time compression's fixed-capacity cache); slide: DGE's sliding observation window
    (`Timing.slide`); windows: each layer's sliding window (the model's
    `ModelConfig.layer_windows`; () or 0: global), see `select_for_budgets`; evict_sliding:
    `Eviction.sliding` == "evict".
    """

    rule: Rule | tuple[Rule, ...]
    head_budget: str = "uniform"
    alpha: float = 0.2
    ties: str = "later"
    head_cap: int | None = None
    slide: bool = False
    windows: tuple[int, ...] = ()
    evict_sliding: bool = False

    @classmethod
    def of(cls, spec: SelectionSpec | None, fields: dict) -> SelectionSpec:
        """`spec` with `fields` (by name) replacing its own, or a new spec of `fields`."""
        return with_fields(cls, spec, fields, "spec")

    @classmethod
    def for_eviction(
        cls,
        ev: Eviction,
        rule: Rule | tuple[Rule, ...] | None = None,
        head_cap: int | None = None,
        windows: tuple[int, ...] = (),
    ) -> SelectionSpec:
        """The selection `ev` makes: its head budgets, alpha, ties and its timing's sliding
        window (read only where draft queries join a prompt window), with its rule (or
        ``rule``: one per budget of a sweep), ``head_cap`` and the model's layer windows."""
        return cls(
            rule=ev.rule if rule is None else rule,
            head_budget=ev.head_budget,
            alpha=ev.alpha,
            ties=ev.ties,
            head_cap=head_cap,
            slide=ev.timing.slide,
            windows=windows if any(windows) else (),
            evict_sliding=ev.sliding == "evict",
        )


def select_for(
    cache: KVCache,
    prompt_obs: Observation,
    drafts: DraftRecord | None,
    budget: jax.Array,
    observe_drafts: jax.Array,
    draft_weight: jax.Array | float = 1.0,
    *,
    spec: SelectionSpec | None = None,
    observe_prompt: jax.Array | bool = True,
    **fields,
) -> jax.Array:
    """Keep mask [L, B, Hkv, S] for `cache` (the cache at the timing's eviction point).

    budget: [] / [L] / [L, Hkv] int32, observe_drafts: [] bool, draft_weight: [] f32 and
    observe_prompt: [] bool are traced, so budgets, the four timings, every k up to the
    record's and any draft weight share one compilation (given the same draft record, see
    `decoding.rewind_state`). Draft entries (valid slots past each row's last prompt
    position) are always kept and count against the budget; the pre-draft cache has none,
    so for "prefill" this is a no-op.
    spec: the `SelectionSpec`, or its fields by name (``rule=SnapKV()``, ``ties=...``).
    """
    spec = SelectionSpec.of(spec, fields)
    inputs = SelectionInputs(observe_drafts, draft_weight, observe_prompt=observe_prompt)
    return select_for_budgets(cache, prompt_obs, drafts, (budget,), inputs, spec=spec)[0]


class SelectionInputs(NamedTuple):
    """What `select_for_budgets` reads besides the cache, its records and the budgets, traced
    (a pytree: one argument, so a sweep over its values shares one compilation).

    observe_drafts: [] bool, whether the draft queries join the observation; draft_weight:
    [] f32, their weight in it; context_end: [B] int32, only positions <= it are kept
    (`generate_for_contexts`); observe_prompt: [] bool, False scores with the draft queries
    alone ("dge_d"). The timing's fields (`Timing.observes_drafts`, ...). None (no leaf, so
    not traced): weight 1, every position, the prompt observed, as constants of the program
    (decode-time compression's selection never varies them).
    """

    observe_drafts: jax.Array | bool
    draft_weight: jax.Array | float | None = None
    context_end: jax.Array | None = None
    observe_prompt: jax.Array | bool | None = None


@functools.partial(jax.jit, static_argnames=("spec",))
def select_for_budgets(
    cache: KVCache,
    prompt_obs: Observation,
    drafts: DraftRecord | None,
    budgets: tuple[jax.Array, ...],
    inputs: SelectionInputs,
    *,
    spec: SelectionSpec,
) -> tuple[jax.Array, ...]:
    """`select_for` under several budgets at once: the cache is scored once, then each budget
    selects from those scores (what a budget sweep wants). One keep mask per budget, in
    order; each equals `select_for` with that budget. rule: one for every budget, or one
    per budget, all with the same `scorer` (SnapKV and PyramidKV cells share a scoring).
    head_cap (static): no head keeps more than this many entries, whatever an allocator
    gives it (decode-time compression's fixed-capacity cache,
    `dge_jax.eviction.decode_compression`).

    Sliding layers (spec.windows): the budget applies to the global layers; a sliding layer
    keeps what its window still shows (`dge_jax.eviction.sliding`); where those layers hold
    only their window (`dge_jax.runtime.window_cache`), each global layer group is scored
    on its own (`sliding.by_group`) and the masks span the global layers' slots.
    inputs: the traced observation switches and context end (`SelectionInputs`):
    inputs.context_end [B]: only positions <= it are kept (`generate_for_contexts`; None:
    all); inputs.observe_prompt False scores with the draft queries alone ("dge_d")."""
    observe_drafts, draft_weight, context_end, observe_prompt = inputs
    draft_weight = 1.0 if draft_weight is None else draft_weight
    observe_prompt = True if observe_prompt is None else observe_prompt
    pos = cache.padded_pos()
    nl, b, hkv, _ = pos.shape
    rules = spec.rule if isinstance(spec.rule, tuple) else (spec.rule,) * len(budgets)
    if len(rules) != len(budgets) or len({p.scorer for p in rules}) != 1:
        raise ValueError(
            "select_for_budgets: give one rule, or one per budget with the same scorer"
        )
    obs = with_drafts(prompt_obs, drafts, observe_drafts, spec.slide, draft_weight,
                      observe_prompt)  # fmt: skip
    by_group = functools.partial(sliding_layers.by_group, cache, obs, spec.windows,
                                 spec.evict_sliding)  # fmt: skip
    scores = by_group(lambda c, o, a, b: rules[0].scorer.score(c, o))
    is_draft = pos > prompt_obs.prompt_end[None, :, None, None]
    scores = jnp.where(is_draft & (pos >= 0), jnp.inf, scores)
    inside = pos >= 0  # past the context end: scored with the rest, then never kept
    if context_end is not None:
        inside = inside & (pos <= context_end[None, :, None, None])
        scores = jnp.where(inside, scores, -jnp.inf)
        is_draft = is_draft & inside
    window_keep, sliding = sliding_layers.window_keep(cache, spec.windows, context_end)
    if window_keep is not None and spec.evict_sliding:  # the rule picks within the window
        scores = jnp.where(sliding & ~window_keep, -jnp.inf, scores)
        window_keep = sliding = None
    if window_keep is not None and spec.head_budget == "global":
        # the global pool: only the global layers' entries (drafts too) compete
        scores = jnp.where(sliding, -jnp.inf, scores)
    # Only prompt entries count towards "fits" below (drafts are kept on top of a prompt).
    prompt_entries = jnp.sum(inside & ~is_draft, axis=-1, dtype=jnp.int32)
    masks = []
    for budget, rule in zip(budgets, rules, strict=True):
        schedule = rule.layer_schedule
        # A row whose every head holds no more than the nominal budget is not compressed,
        # whatever a schedule or allocator would move: a prompt <= the budget is kept whole.
        nominal = expand_budgets(budget, nl, b, hkv)
        fits = jnp.all(prompt_entries <= nominal, axis=(0, 2))  # [B]
        if schedule is not None and any(spec.windows) and not spec.evict_sliding:
            budget = sliding_layers.scheduled_over_global_layers(schedule, budget, spec.windows)
        elif schedule is not None:
            budget = schedule.layer_budgets(budget, nl)
        per_head = head_budgets(spec.head_budget, scores, budget, spec.alpha, spec.ties,
                                spec.head_cap, sliding)  # fmt: skip
        ranked = by_group(lambda c, o, a, z, r=rule, h=per_head, s=scores:
                          r.refine(s[a:z], h[a:z], c, o, spec.ties))  # two-stage re-rank
        keep = selection.select_slots(ranked, per_head, ties=spec.ties, positions=pos)
        keep = jnp.where(fits[None, :, None, None], inside, keep)
        if window_keep is not None:
            keep = jnp.where(sliding, window_keep, keep)
        masks.append(keep & inside)
    return tuple(masks)


compact = jax.jit(compaction.compact, static_argnames=("capacity",))


# Compacted capacities are rounded to this many slots, so nearby sizes share a compilation.
SLOT_MULTIPLE = 64


def round_up_slots(n: int, multiple: int = SLOT_MULTIPLE) -> int:
    """n rounded up to a multiple of `multiple` slots (nearby sizes share a compilation)."""
    return -(-int(n) // multiple) * multiple


def capacity_for(kept_counts: np.ndarray, new_tokens: int, multiple: int = SLOT_MULTIPLE) -> int:
    """Slots for a compacted cache: the most kept by any head, rounded up, plus new tokens.

    kept_counts: [L, B, Hkv] int (entries each head keeps); returns a static int capacity.
    """
    return round_up_slots(np.max(kept_counts, initial=0), multiple) + new_tokens


def layer_capacities(
    kept_counts: np.ndarray, new_tokens: int, multiple: int = SLOT_MULTIPLE
) -> int | tuple[int, ...]:
    """`capacity_for` of each layer: one int when every layer needs the same, else a tuple
    of L (for `compaction.compact`), so budgets that differ by layer (PyramidKV's, AdaKV's) pay
    for each layer's own largest head rather than the whole cache's.

    kept_counts: [L, B, Hkv] int. Example, PyramidKV at budget 512 on SmolLM2 (30 layers)
    gives the bottom layer 968 entries per head and the top one 56: one capacity would give
    every layer 1,024 slots (+ new tokens); per layer they fall with the budgets.
    """
    counts = fetch(kept_counts)
    caps = tuple(capacity_for(c, new_tokens, multiple) for c in counts)
    return caps[0] if len(set(caps)) == 1 else caps


def keep_mask(
    cache: KVCache,
    prompt_obs: Observation,
    drafts: DraftRecord | None,
    ev: Eviction,
    windows: tuple[int, ...] = (),
) -> jax.Array:
    """[L, B, Hkv, S] bool: what `ev` keeps of `cache` (the cache at its eviction point);
    windows: the model's layer windows (`ModelConfig.layer_windows`)."""
    return keep_masks(cache, prompt_obs, drafts, [ev], windows)[0]


def scoring_key(ev: Eviction) -> tuple:
    """Evictions with equal keys score a cache identically (and break ties alike): they differ
    at most by budget, or by a rule that selects from the same scores (SnapKV and PyramidKV)."""
    t = ev.timing
    return (ev.rule.scorer, t.observes_drafts, t.observes_prompt, t.draft_weight, t.slide,
            ev.head_budget, ev.alpha, ev.ties, ev.sliding)  # fmt: skip


def keep_masks(
    cache: KVCache,
    prompt_obs: Observation,
    drafts: DraftRecord | None,
    evs: list[Eviction],
    windows: tuple[int, ...] = (),
    context_end: jax.Array | None = None,
) -> list[jax.Array]:
    """`keep_mask` of each eviction in `evs`, which must share a `scoring_key` (a budget
    sweep, SnapKV and PyramidKV cells together): the cache is scored once for all of them."""
    if len({scoring_key(ev) for ev in evs}) != 1:
        raise ValueError(
            "keep_masks: the evictions must share one scoring (differ by budget, or by "
            "rules with the same scorer such as SnapKV and PyramidKV)"
        )
    ev = evs[0]
    rules = tuple(e.rule for e in evs)
    return list(
        select_for_budgets(
            cache,
            prompt_obs,
            drafts,
            tuple(jnp.asarray(e.budget, jnp.int32) for e in evs),
            SelectionInputs(
                jnp.asarray(ev.timing.observes_drafts),
                jnp.asarray(ev.timing.draft_weight, jnp.float32),
                context_end,
                jnp.asarray(ev.timing.observes_prompt),
            ),
            # one rule when all agree, so that a plain sweep shares select_for's compilation
            spec=SelectionSpec.for_eviction(
                ev, rules[0] if len(set(rules)) == 1 else rules, windows=windows
            ),
        )
    )


def apply_eviction(
    cache: KVCache,
    keep: jax.Array,
    ev: Eviction,
    capacity: int | tuple[int, ...] | None,
    new_tokens: int,
    counts: np.ndarray | None = None,
) -> KVCache:
    """The evicted cache: masked (same shape), or compacted to `capacity` slots, one for all
    layers or one per layer (None: per layer, just enough for what each layer kept plus
    `new_tokens`, rounded up: `layer_capacities`). keep: [L, B, Hkv, S] bool; counts: its
    per-head sums [L, B, Hkv] when the caller has them already."""
    masked = selection.apply_keep(cache, keep)
    if not ev.compact:
        return masked
    counts = fetch(jnp.sum(keep, axis=-1)) if counts is None else counts
    capacity = capacity or layer_capacities(counts, new_tokens)
    compaction.check_capacity(counts, capacity, new_tokens)
    return compact(masked, capacity=capacity)
