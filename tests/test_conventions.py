"""Conventions another SnapKV implementation may use, as options that match it:
the order of GQA aggregation and pooling (`SnapKV.gqa_before_pool`) and which of equal scores
is kept (`Eviction.ties`).

Every kept set is checked against a plain-NumPy reference written here from the definitions
(group the query heads' window attention, then pool; rank by score, equal scores to the
earlier position), on hand-made caches with exact ties (duplicated keys, max-pool plateaus) and
on a tiny random Llama under every timing, with uniform, AdaKV and PyramidKV budgets.
"""

from __future__ import annotations

import dataclasses
import math
import os
from fractions import Fraction

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy_reference import pool as ref_pool

from dge_jax import cli
from dge_jax.eviction.evict import Eviction, keep_masks, select_for, select_for_budgets
from dge_jax.eviction.timing import Timing
from dge_jax.generation import generate_grid
from dge_jax.rules.h2o import H2O
from dge_jax.rules.ops import pool1d, reduce
from dge_jax.rules.pyramidkv import PyramidKV
from dge_jax.rules.registry import make_rule
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import decoding as gen
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.recorders import QueryWindow, Recording
from dge_jax.runtime.records import Observation
from dge_jax.runtime.selection import select_slots, top_mask
from dge_jax.text.prompts import bucket_length, pad_left
from dge_jax.text.sampling import Greedy

L, B, HKV, G, D = 2, 2, 2, 2, 8
HQ = HKV * G
BETA = 20  # PyramidKV's default


# ---------------------------------------------------------------------------------------------
# NumPy references (independent of dge_jax)


def ref_rank(scores: np.ndarray, positions: np.ndarray, ties: str) -> np.ndarray:
    """Indices of `scores` best first; equal scores by position, earlier or later first."""
    tie_key = positions if ties == "earlier" else -positions
    return np.lexsort((tie_key, -scores.astype(np.float64)))  # the last key sorts first


def ref_snapkv_scores(keys, key_pos, q, q_pos, rule) -> np.ndarray:
    """One layer and row. keys [Hkv, n, D] at positions key_pos [n] (increasing), q [Hq, W, D]
    at q_pos [W] (-1 = no query) -> scores [Hkv, n], +inf for the protected entries (at or
    after the first observed query: the window, and drafts)."""
    live = q_pos >= 0
    q, q_pos = q[:, live].astype(np.float64), q_pos[live]
    keys = keys.astype(np.float64)
    # Elementwise product and a sum over D: equal keys give bitwise-equal logits.
    logits = np.stack(
        [np.sum(q[h][:, None, :] * keys[h // G][None, :, :], axis=-1) for h in range(HQ)]
    ) / np.sqrt(keys.shape[-1])  # [Hq, W, n]
    logits = np.where(key_pos[None, None, :] <= q_pos[None, :, None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    attn = (probs / probs.sum(-1, keepdims=True)).mean(axis=1)  # [Hq, n]
    prefix = key_pos < q_pos.min()
    a = attn[:, prefix].reshape(HKV, G, -1)

    def agg(x):
        return x.mean(axis=1) if rule.gqa == "mean" else x.max(axis=1)

    if rule.gqa_before_pool:
        pooled = ref_pool(agg(a), rule.kernel, rule.pooling)
    else:
        pooled = agg(ref_pool(a, rule.kernel, rule.pooling))
    scores = np.full((HKV, len(key_pos)), np.inf)
    scores[:, prefix] = pooled
    return scores


def ref_pyramid_budgets(budget: int, window: int, num_layers: int) -> list[int]:
    """PyramidKV's linear schedule, rounded so the layers sum to num_layers * budget."""
    if num_layers == 1 or budget <= window:
        return [budget] * num_layers
    extra = budget - window
    low = extra // BETA
    high = 2 * extra - low
    span = high - low

    def cumulative(layer):
        return math.ceil(
            Fraction(layer * high) - Fraction(span * layer * (layer - 1), 2 * (num_layers - 1))
        )

    return [window + cumulative(i + 1) - cumulative(i) for i in range(num_layers)]


def ref_adakv_counts(scores, key_pos, budget: int, alpha: float, ties: str) -> list[int]:
    """AdaKV, one layer and row: scores [Hkv, n]. Each head's top floor(alpha * budget) are
    raised to +inf, then the Hkv * budget best of all heads jointly are counted per head
    (equal scores: by head, then by position, earlier or later first)."""
    n_safe = math.floor(budget * alpha)
    raised = scores.copy()
    for h in range(HKV):
        raised[h, ref_rank(scores[h], key_pos, ties)[:n_safe]] = np.inf
    entries = [(raised[h, i], h, key_pos[i]) for h in range(HKV) for i in range(len(key_pos))]
    sign = 1 if ties == "earlier" else -1
    entries.sort(key=lambda e: (-e[0], sign * e[1], sign * e[2]))
    counts = [0] * HKV
    for _, h, _ in entries[: HKV * budget]:
        counts[h] += 1
    return counts


def ref_kept(scores, key_pos, n_prompt, budget, ties, head_budget="uniform", layer=0,
             rule=None, alpha=0.2):  # fmt: skip
    """Kept positions of each kv head (one layer and row), scores [Hkv, n]: draft entries
    (past the prompt) always kept; a row whose prompt fits the budget keeps everything."""
    scores = np.where(key_pos[None] >= n_prompt, np.inf, scores)
    if n_prompt <= budget:
        return [set(key_pos.tolist())] * HKV
    layer_budget = budget
    if isinstance(rule, PyramidKV):
        layer_budget = ref_pyramid_budgets(budget, rule.window, L)[layer]
    if head_budget == "adakv":
        counts = ref_adakv_counts(scores, key_pos, layer_budget, alpha, ties)
    else:
        counts = [layer_budget] * HKV
    return [set(key_pos[ref_rank(scores[h], key_pos, ties)[: counts[h]]].tolist())
            for h in range(HKV)]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Worked examples of the docstrings


def test_worked_example_pool_then_mean_vs_mean_then_pool():
    """SnapKV's docstring: 2 query heads of one group, 5 keys, max-pool, kernel 3."""
    attn = jnp.asarray([[0.0, 0.6, 0.0, 0.0, 0.4], [0.0, 0.0, 0.6, 0.0, 0.4]], jnp.float32)
    include = jnp.ones((5,), bool)
    pool_then_mean = reduce(pool1d(attn, include, 3, "max"), axis=0, how="mean")
    mean_then_pool = pool1d(reduce(attn, axis=0, how="mean"), include, 3, "max")
    np.testing.assert_allclose(pool_then_mean, [0.3, 0.6, 0.6, 0.5, 0.4], rtol=1e-6)
    np.testing.assert_allclose(mean_then_pool, [0.3, 0.3, 0.3, 0.4, 0.4], rtol=1e-6)

    def kept(scores, budget, ties):
        keep = select_slots(scores[None, None, None], budget, ties=ties)
        return np.flatnonzero(np.asarray(keep)).tolist()

    assert kept(pool_then_mean, 2, "later") == [1, 2]
    assert kept(mean_then_pool, 2, "later") == [3, 4]
    assert [kept(pool_then_mean, 1, t) for t in ("later", "earlier")] == [[2], [1]]
    assert [kept(mean_then_pool, 1, t) for t in ("later", "earlier")] == [[4], [3]]


def test_worked_example_plateau():
    """evict's / Eviction's docstring: a plateau of 3 equal scores, budget 2."""
    scores = jnp.asarray([0.2, 0.5, 0.5, 0.5, 0.1], jnp.float32)[None, None, None]
    later = np.asarray(select_slots(scores, 2))[0, 0, 0]
    assert np.flatnonzero(later).tolist() == [2, 3]
    earlier = np.asarray(select_slots(scores, 2, ties="earlier", positions=jnp.arange(5)))[0, 0, 0]
    assert np.flatnonzero(earlier).tolist() == [1, 2]
    # The top_mask worked example: [1, 3, 3, 0], budget 1.
    s = jnp.asarray([1.0, 3.0, 3.0, 0.0])
    assert np.asarray(top_mask(s, jnp.asarray(1), s > -jnp.inf, "earlier")).tolist() == [
        False, True, False, False,
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The tie rule of the selection itself


@pytest.mark.parametrize("ties", ["later", "earlier"])
@pytest.mark.parametrize("order", ["slots", "shuffled"])
def test_select_equals_ranking_by_sort(ties, order):
    """Rows drawn from a few values (most rows tie at the threshold), budgets from 0 to past
    the candidate count. "earlier" follows positions even when slots are out of position
    order (a hand-made cache); "later" is the slot rule (positions are not read)."""
    rng = np.random.default_rng(11)
    values = np.array([0.0, -0.0, 1.0, 2.5, np.inf, -np.inf, 1e-30, 3e38], np.float32)
    fn = jax.jit(select_slots, static_argnames=("ties",))
    shape = (2, 3, 2, 40)  # one shape, one compilation; row lengths vary through `valid`
    for trial in range(30):
        scores = rng.choice(values, size=shape)
        length = rng.integers(0, shape[-1] + 1, size=shape[:-1])[..., None]
        valid = (rng.random(shape) < 0.8) & (scores > -np.inf) & (np.arange(40) < length)
        positions = np.broadcast_to(np.arange(shape[-1]) * 3, shape).copy()
        if order == "shuffled":
            positions = rng.permuted(positions, axis=-1)
        budgets = rng.integers(-1, shape[-1] + 2, size=shape[:-1]).astype(np.int32)
        got = np.asarray(fn(jnp.asarray(np.where(valid, scores, -np.inf)), jnp.asarray(budgets),
                            ties=ties, positions=jnp.asarray(positions)))  # fmt: skip
        want = np.zeros(shape, bool)
        for idx in np.ndindex(shape[:-1]):
            slots = np.flatnonzero(valid[idx])
            tie_key = positions[idx][slots] if ties == "earlier" else slots
            ranked = ref_rank(scores[idx][slots], tie_key, ties)
            want[idx][slots[ranked[: max(int(budgets[idx]), 0)]]] = True
        np.testing.assert_array_equal(got, want, f"trial {trial}")


def test_earlier_ties_compile_once_over_budgets():
    traces = []

    def counted(scores, budget, positions):
        traces.append(1)  # runs only while tracing
        return select_slots(scores, budget, ties="earlier", positions=positions)

    fn = jax.jit(counted)
    scores = jnp.round(jax.random.uniform(jax.random.key(0), (L, B, HKV, 64)) * 4)  # ties
    positions = jnp.broadcast_to(jnp.arange(64), scores.shape)
    kept = [int(fn(scores, jnp.int32(b), positions).sum()) for b in (8, 16, 32)]
    assert len(traces) == 1 and kept == [L * B * HKV * b for b in (8, 16, 32)]


# ---------------------------------------------------------------------------------------------
# SnapKV / PyramidKV / AdaKV on hand-made caches with exact ties


def _cache(lengths, S, drafts, seed=0) -> KVCache:
    """Row b: prompt positions 0..n_b-1 left-padded into slots [0, S), then the drafts. Keys
    repeat in runs (key i = key of i - i % 3 in every head), so attention has exact ties."""
    rng = np.random.default_rng(seed)
    shape = (L, B, HKV, S + drafts, D)
    k = rng.normal(size=shape).astype(np.float32)
    pos = np.full(shape[:-1], -1, np.int32)
    for b, n in enumerate(lengths):
        pos[:, b, :, S - n : S] = np.arange(n)
        pos[:, b, :, S:] = n + np.arange(drafts)
        for i in range(n):
            k[:, b, :, S - n + i] = k[:, b, :, S - n + i - i % 3]
    v = rng.normal(size=shape).astype(np.float32)
    return KVCache.stacked(jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos), S + drafts)


def _obs(lengths, window, drafts, seed=1) -> Observation:
    """The last `window` prompt queries of each row, then `drafts` draft queries."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(L, B, HQ, window + drafts, D)).astype(np.float32)
    q_pos = np.stack([np.arange(n - window, n + drafts) for n in lengths]).astype(np.int32)
    return Observation(
        q=jnp.asarray(q), q_pos=jnp.asarray(q_pos), attn_sum=None,
        is_draft=jnp.asarray([False] * window + [True] * drafts),
        prompt_end=jnp.asarray([n - 1 for n in lengths], jnp.int32),
    )  # fmt: skip


def _kept(cache: KVCache, keep) -> dict:
    pos, keep = np.asarray(cache.pos), np.asarray(keep)
    return {idx: set(pos[idx][keep[idx]].tolist()) for idx in np.ndindex(L, B, HKV)}


def _reference(cache, obs, lengths, rule, budget, ties, head_budget, drafts=0) -> dict:
    out = {}
    for layer in range(L):
        for b, n in enumerate(lengths):
            pos = np.asarray(cache.pos)[layer, b, 0]
            slots = np.flatnonzero(pos >= 0)
            keys = np.asarray(cache.k)[layer, b][:, slots]
            q, q_pos = np.asarray(obs.q)[layer, b], np.asarray(obs.q_pos)[b]
            scores = ref_snapkv_scores(keys, pos[slots], q, q_pos, rule)
            heads = ref_kept(scores, pos[slots], n, budget, ties, head_budget, layer, rule)
            for h in range(HKV):
                out[(layer, b, h)] = heads[h]
    return out


HAND_CASES = [
    # (rule, head budget, budget)
    (SnapKV(window=5, kernel=7, gqa_before_pool=True), "uniform", 11),
    (SnapKV(window=5, kernel=7, gqa_before_pool=True, gqa="max"), "uniform", 11),
    (SnapKV(window=5, kernel=5, gqa_before_pool=True, pooling="avg"), "uniform", 12),
    (SnapKV(window=5, kernel=7, gqa_before_pool=True), "adakv", 11),
    (PyramidKV(window=5, kernel=7, gqa_before_pool=True), "uniform", 12),
    (SnapKV(window=5, kernel=7), "uniform", 11),  # the default order, with either tie rule
    (PyramidKV(window=5, kernel=7), "adakv", 12),
]


@pytest.mark.parametrize("drafts, ties", [(0, "earlier"), (2, "earlier"), (2, "later")])
@pytest.mark.parametrize("rule, head_budget, budget", HAND_CASES)
def test_hand_made_kept_sets_match_reference(rule, head_budget, budget, drafts, ties):
    lengths, S = (30, 22), 30
    cache, obs = _cache(lengths, S, drafts), _obs(lengths, rule.window, drafts)
    keep = select_for(cache, obs, None, jnp.int32(budget), jnp.asarray(False), rule=rule,
                      head_budget=head_budget, ties=ties)  # fmt: skip
    want = _reference(cache, obs, lengths, rule, budget, ties, head_budget)
    assert _kept(cache, keep) == want
    if rule.pooling == "avg":
        return  # avg-pool seldom makes exact ties, and commutes with the group mean
    # The conventions decide kept sets here (the test has power): the other tie rule, and for
    # max-pool with the group mean the other order, keep something else.
    other = "later" if ties == "earlier" else "earlier"
    assert _reference(cache, obs, lengths, rule, budget, other, head_budget) != want
    if rule.gqa == "mean" and type(rule) is SnapKV:
        flipped = dataclasses.replace(rule, gqa_before_pool=not rule.gqa_before_pool)
        assert _reference(cache, obs, lengths, flipped, budget, ties, head_budget) != want


def test_gqa_before_pool_is_a_static_branch_and_default_unchanged():
    """False traces the same computation as a SnapKV without the field set (the default is
    today's code path); True scores the group's aggregate, pooled."""
    lengths, S = (30, 22), 30
    cache, obs = _cache(lengths, S, 0), _obs(lengths, 5, 0)
    default = jax.make_jaxpr(SnapKV(window=5).score)(cache, obs)
    explicit = jax.make_jaxpr(SnapKV(window=5, gqa_before_pool=False).score)(cache, obs)
    assert str(default) == str(explicit)
    before = jax.make_jaxpr(SnapKV(window=5, gqa_before_pool=True).score)(cache, obs)
    assert str(before) != str(default)
    # avg-pool commutes with the group mean (up to rounding).
    avg = [SnapKV(window=5, kernel=5, pooling="avg", gqa_before_pool=f) for f in (False, True)]
    a, b = (np.asarray(jax.jit(p.score)(cache, obs)) for p in avg)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_select_earlier_on_out_of_order_slots_follows_positions():
    """A hand-made cache whose slots are not in position order: "earlier" still means the
    earlier position, not the earlier slot."""
    scores = jnp.asarray([0.5, 0.5, 0.5, 0.5, 0.1])[None, None, None]
    positions = jnp.asarray([3, 1, 4, 0, 2])[None, None, None]
    keep = np.asarray(select_slots(scores, 2, ties="earlier", positions=positions))[0, 0, 0]
    assert np.flatnonzero(keep).tolist() == [1, 3]  # positions 1 and 0
    keep = np.asarray(select_slots(scores, 2, ties="earlier"))[0, 0, 0]  # no positions: slots
    assert np.flatnonzero(keep).tolist() == [0, 1]
    keep = np.asarray(select_slots(scores, 2, ties="later", positions=positions))[0, 0, 0]
    assert np.flatnonzero(keep).tolist() == [2, 3]  # the slot rule, positions unread


# ---------------------------------------------------------------------------------------------
# A tiny random Llama: generate_grid under every timing (the grid path: select_for_budgets)

WINDOW, N_NEW = 8, 2
PROMPT_LENGTHS = (44, 30)


@pytest.fixture(scope="module")
def llama():
    from dge_jax.config import ModelConfig
    from dge_jax.families import get_family
    from dge_jax.model import Model
    from models.llama_like import init_params

    cfg = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_layers=L, num_heads=HQ, num_kv_heads=HKV, head_dim=16,
                      max_position_embeddings=1024)  # fmt: skip
    params = init_params(cfg, jax.random.PRNGKey(0), scale=0.3)  # peaked attention
    model = Model(get_family("llama"), cfg, params, tokenizer=None)
    prompts = [np.random.default_rng(n).integers(0, 128, n).tolist() for n in PROMPT_LENGTHS]
    # What generate_grid does up to eviction, to read the arrays the reference needs.
    t, buffer = bucket_length(max(PROMPT_LENGTHS)), bucket_length(N_NEW)
    tokens, lengths = pad_left(prompts, t)
    pre = gen.prefill_prompt(model.forward, cfg, params, jnp.asarray(tokens), jnp.asarray(lengths),
                             gen.PrefillSpec(t + buffer, 512, Recording.of(QueryWindow(WINDOW))))
    key = jax.random.PRNGKey(0)
    start = gen.start_state(pre.cache, Greedy()(pre.logits, key), jnp.asarray(lengths), N_NEW,
                            (), key, buffer=buffer)  # fmt: skip
    # the draft donates its state: a copy, so that prefill's cache stays for the reference
    steps = Recording.of(QueryWindow(WINDOW)).steps
    drafted, drafts = gen.draft_tokens(model.forward, cfg, params, jax.tree.map(jnp.copy, start),
                                       gen.StepSpec(Greedy(), (), recording=steps),
                                       num_steps=1)  # fmt: skip
    return model, prompts, pre, drafted, drafts


GRID_TIMINGS = (Timing("prefill", 1), Timing("dge", 2), Timing("dge_w", 2))
GRID_CELLS = (  # (rule, head budget, budget)
    (SnapKV(window=WINDOW, gqa_before_pool=True), "uniform", 16),
    (SnapKV(window=WINDOW, gqa_before_pool=True), "uniform", 22),
    (SnapKV(window=WINDOW, gqa_before_pool=True), "adakv", 16),
    (PyramidKV(window=WINDOW, gqa_before_pool=True), "uniform", 16),
    (SnapKV(window=WINDOW), "uniform", 16),  # the defaults: today's kept sets
)


def _grid_reference(llama, timing, rule, head_budget, budget, ties) -> list:
    """result.kept's layout [row][layer][kv head] -> sorted positions, from the reference."""
    _, _, pre, drafted, drafts = llama
    if timing.kind == "prefill":
        cache, q, q_pos = pre.cache, pre.obs.q, pre.obs.q_pos
    else:
        cache, q, q_pos = drafted.cache, pre.obs.q, pre.obs.q_pos
        if timing.kind == "dge":  # the draft queries are observed too
            q = np.concatenate([np.asarray(q), np.asarray(drafts.q)], axis=3)
            q_pos = np.concatenate([np.asarray(q_pos), np.asarray(drafts.q_pos)], axis=1)
    out = []
    for b, n in enumerate(PROMPT_LENGTHS):
        rows = []
        for layer in range(L):
            pos = np.asarray(cache.pos)[layer, b, 0]
            slots = np.flatnonzero(pos >= 0)
            keys = np.asarray(cache.k)[layer, b][:, slots]
            scores = ref_snapkv_scores(keys, pos[slots], np.asarray(q)[layer, b],
                                       np.asarray(q_pos)[b], rule)  # fmt: skip
            heads = ref_kept(scores, pos[slots], n, budget, ties, head_budget, layer, rule)
            rows.append([sorted(h) for h in heads])
        out.append(rows)
    return out


@pytest.mark.parametrize("ties", ["earlier", "later"])
def test_generate_grid_kept_sets_match_reference(llama, ties):
    model, prompts, *_ = llama
    cells = [Eviction(rule, budget, timing, head_budget=head_budget, ties=ties)
             for timing in GRID_TIMINGS for rule, head_budget, budget in GRID_CELLS]  # fmt: skip
    results = generate_grid(model, prompts, cells, max_new_tokens=N_NEW)
    differ = 0
    for ev, res in zip(cells, results, strict=True):
        spec = (ev.timing, ev.rule, ev.head_budget, ev.budget)
        want = _grid_reference(llama, *spec, ties)
        assert res.kept == want, spec
        other = _grid_reference(llama, *spec, "later" if ties == "earlier" else "earlier")
        differ += other != want
    assert differ >= len(cells) // 2  # the tie rule decides kept sets on this model


def test_keep_masks_sweep_equals_select_for_with_earlier_ties(llama):
    """One scoring, one selection per budget (the grid path) == one select_for each, and
    evictions with different tie rules are not mixed into one scoring."""
    _, _, pre, drafted, drafts = llama
    rule = SnapKV(window=WINDOW, gqa_before_pool=True)
    evs = [Eviction(rule, b, Timing("dge", 2), ties="earlier") for b in (12, 16, 22)]
    masks = keep_masks(drafted.cache, pre.obs, drafts, evs)
    before = select_for_budgets._cache_size()
    for ev, got in zip(evs, masks, strict=True):
        want = select_for(drafted.cache, pre.obs, drafts, jnp.int32(ev.budget),
                          jnp.asarray(True), rule=rule, ties="earlier")  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert select_for_budgets._cache_size() - before <= 1  # one compilation for the budgets
    with pytest.raises(ValueError, match="share one scoring"):
        keep_masks(drafted.cache, pre.obs, drafts, [evs[0], Eviction(rule, 12, evs[0].timing)])


# ---------------------------------------------------------------------------------------------
# Validation and the command line


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: Eviction(ties="first"), ValueError,
         "Eviction.ties must be one of ('later', 'earlier'), got 'first'"),
        (lambda: Eviction(ties=None), ValueError, "Eviction.ties must be one of"),
        (lambda: SnapKV(gqa_before_pool=1), TypeError,
         "SnapKV.gqa_before_pool must be True or False, got 1"),
        (lambda: PyramidKV(gqa_before_pool="yes"), TypeError,
         "PyramidKV.gqa_before_pool must be True or False, got 'yes'"),
        (lambda: select_slots(jnp.zeros((1, 1, 1, 3)), 1, ties="first"), ValueError,
         "ties must be one of ('later', 'earlier'), got 'first'"),
        (lambda: make_rule("h2o", gqa_before_pool=True), ValueError,
         "unknown option(s) ['gqa_before_pool'] for rule 'h2o'"),
    ],
)  # fmt: skip
def test_bad_values_raise_one_line(build, error, message):
    with pytest.raises(error) as exc:
        build()
    text = str(exc.value)
    assert text.startswith(message) and "\n" not in text


def test_fields_and_presets():
    assert SnapKV.kvpress() == SnapKV(window=64, kernel=5, pooling="avg", gqa="mean")
    assert not SnapKV.kvpress().gqa_before_pool and Eviction().ties == "later"
    assert SnapKV(gqa_before_pool=np.bool_(True)).gqa_before_pool is True
    pyramid = PyramidKV(window=4, gqa_before_pool=True)
    assert pyramid.scorer == SnapKV(window=4, gqa_before_pool=True)
    assert make_rule("pyramidkv", gqa_before_pool=True) == PyramidKV(gqa_before_pool=True)
    hash(Eviction(ties="earlier"))  # static under jit


def _cli_error(capsys, *flags: str) -> str:
    assert cli.main(["generate", "--model", "/no/such/model", "--prompt", "hi", *flags]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, lines
    return lines[0]


def test_cli_flags(capsys):
    parse = cli.build_parser().parse_args
    base = ["generate", "--prompt", "hi"]
    ev = cli.eviction_from_args(parse(base + ["--rule", "pyramidkv", "--gqa_before_pool",
                                              "--ties", "earlier"]))  # fmt: skip
    assert ev.rule == PyramidKV(gqa_before_pool=True) and ev.ties == "earlier"
    ev = cli.eviction_from_args(parse(base + ["--rule", "snapkv"]))
    assert ev.rule == SnapKV() and ev.ties == "later"
    # Refused where it would do nothing: no eviction, or a rule that does not pool.
    line = _cli_error(capsys, "--gqa_before_pool", "--ties", "earlier")
    assert line.startswith("error: --ties, --gqa_before_pool only apply with an evicting")
    line = _cli_error(capsys, "--rule", "h2o", "--gqa_before_pool")
    assert line.startswith("error: unknown option(s) ['gqa_before_pool'] for rule 'h2o'")
    assert isinstance(cli.eviction_from_args(parse(base + ["--rule", "h2o"])).rule, H2O)
    with pytest.raises(SystemExit):
        cli.main(base + ["--rule", "snapkv", "--ties", "first"])
    assert "invalid choice: 'first'" in capsys.readouterr().err


def test_cli_wrapped_rules_and_rule_options(capsys):
    """--rule names a wrapper around a rule; --rule_option sets any field (typed), and is
    refused, naming the field, by a rule without it (or with --rule full)."""
    from dge_jax.rules.criticalkv import CriticalKV
    from dge_jax.rules.expected_attention import ExpectedAttention
    from dge_jax.rules.lagkv import LagKV

    parse = cli.build_parser().parse_args
    base = ["generate", "--prompt", "hi"]
    ev = cli.eviction_from_args(parse(base + [
        "--rule", "criticalkv_expectedattention", "--rule_option", "first_stage_ratio=0.25",
        "--rule_option", "use_vnorm=false", "--rule_option", "sinks=2",
    ]))  # fmt: skip
    inner = ExpectedAttention(use_vnorm=False, sinks=2)
    assert ev.rule == CriticalKV(inner=inner, first_stage_ratio=0.25)
    lag = ["--rule", "lagkv", "--rule_option", "lag_size=64"]
    ev = cli.eviction_from_args(parse(base + lag))
    assert ev.rule == LagKV(lag_size=64)
    line = _cli_error(capsys, "--rule", "keydiff", "--rule_option", "lag_size=64")
    assert line.startswith("error: unknown option(s) ['lag_size'] for rule 'keydiff'")
    line = _cli_error(capsys, "--rule_option", "lag_size=64")
    assert line.startswith("error: --rule_option only apply with an evicting")
    line = _cli_error(capsys, "--rule", "lagkv", "--rule_option", "lag_size")
    assert line.startswith("error: --rule_option takes NAME=VALUE")
    with pytest.raises(SystemExit) as exc:  # argparse's own usage error, exit status 2
        cli.main(base + ["--rule", "chunkkv_full"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --rule: invalid choice: 'chunkkv_full'" in err
    assert "inner rule must be one of" in err


def test_cli_kvzip_with_global_budgets_and_alpha(capsys):
    """--head_budget global --alpha 0 is kvpress's KVzip allocation; --alpha is refused with
    uniform budgets, where it would do nothing."""
    from dge_jax.rules.kvzip import KVzip

    parse = cli.build_parser().parse_args
    base = ["generate", "--prompt", "hi", "--rule", "kvzip"]
    ev = cli.eviction_from_args(parse(base + ["--head_budget", "global", "--alpha", "0"]))
    assert ev.rule == KVzip() and ev.head_budget == "global" and ev.alpha == 0.0
    assert cli.eviction_from_args(parse(base + ["--head_budget", "adakv"])).alpha == 0.2
    line = _cli_error(capsys, "--rule", "kvzip", "--alpha", "0")
    assert line.startswith("error: --alpha applies to --head_budget adakv / global")
