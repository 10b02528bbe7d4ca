"""Eviction inside generation: timings, budgets, masking vs compaction, batching,
compilation counts and the CLI, on a tiny random Llama whose attention is far from uniform.

Weights are N(0, 0.3²) (not the usual 0.02) so attention is peaked, selections differ between
rules and timings, and greedy argmaxes are far from ties. Where a test's point depends on two
selections differing, it asserts that they do.

Most tests run `generate_grid` on the same two prompts (`PROMPTS`, 44 and 30 tokens, one bucket
of 64) with the same answer length, window, k_max = 3 and compacted capacity, so the jitted
prefill, draft, decode and compaction compile once for the whole module (two shared cores).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import jax_config, jax_model

from dge_jax.config import ModelConfig
from dge_jax.eviction import evict as eviction_mod
from dge_jax.eviction.evict import Eviction, keep_masks, select_for, select_for_budgets
from dge_jax.eviction.timing import Timing
from dge_jax.generation import generate, generate_grid
from dge_jax.model import Model
from dge_jax.rules.h2o import H2O
from dge_jax.rules.knorm import KeyNorm
from dge_jax.rules.pyramidkv import PyramidKV
from dge_jax.rules.random import RandomScores
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.streamingllm import StreamingLLM
from dge_jax.rules.tova import TOVA
from dge_jax.runtime import decoding as gen
from dge_jax.runtime.compaction import compact
from dge_jax.runtime.recorders import QueryWindow, Recording
from dge_jax.runtime.selection import apply_keep
from dge_jax.text.prompts import pad_left
from dge_jax.text.sampling import Greedy

L, HQ, HKV, HD, VOCAB = 2, 4, 2, 16, 128
WINDOW = 8
WINDOWED = Recording.of(QueryWindow(WINDOW))  # the prefill records SnapKV's window
N_NEW = 6  # answer tokens everywhere: shared shapes keep compilations (and test time) down
CAP = 64  # compacted capacity shared by the tests (>= max kept per head + N_NEW), same reason
GREEDY = Greedy()
PREFILL, DGE2, DGE_W2 = Timing("prefill", 1), Timing("dge", 2), Timing("dge_w", 2)
DGE3, DGE_W3 = Timing("dge", 3), Timing("dge_w", 3)
TIMINGS = (PREFILL, DGE2, DGE_W2)
ALL_TIMINGS = (PREFILL, DGE2, DGE_W2, DGE3, DGE_W3)
# Every scoring rule, with windows small enough for budgets of a dozen entries.
RULES = (
    SnapKV(window=WINDOW),
    PyramidKV(window=WINDOW),
    H2O(window=WINDOW),
    StreamingLLM(),
    RandomScores(seed=3),
    KeyNorm(),
    TOVA(),
)


def tiny_config(**overrides) -> ModelConfig:
    """Llama with GQA 4/2, hidden 64, 2 layers; overrides make a config no other test compiled."""
    return jax_config(**overrides)


def tiny_model(cfg: ModelConfig | None = None, seed: int = 0, scale: float = 0.3) -> Model:
    return jax_model(cfg, seed, scale)


@pytest.fixture(scope="module")
def model() -> Model:
    return tiny_model()


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


LENGTHS = (44, 30)
PROMPTS = [prompt(n, seed=n) for n in LENGTHS]


def ev_(rule, budget, timing, **options) -> Eviction:
    """An `Eviction` compacted to the shared capacity `CAP`."""
    return Eviction(rule, budget, timing, capacity=CAP, **options)


def drafts_of(n_prompt: int, timing: Timing) -> set[int]:
    """Positions of the draft entries at eviction time: P .. P + k - 2."""
    return set(range(n_prompt, n_prompt + timing.draft_steps))


# ---------------------------------------------------------------------------------------------
# Budget >= prompt: nothing is evicted, whatever the rule or timing


def _no_eviction_cells(budget: int) -> list[Eviction]:
    cells = [ev_(pol, budget, t) for pol in RULES for t in ALL_TIMINGS]
    cells += [ev_(SnapKV(window=WINDOW), budget, t, head_budget="adakv") for t in ALL_TIMINGS]
    return cells + [ev_(H2O(window=WINDOW), budget, t, compact=False) for t in ALL_TIMINGS]


def _assert_fullkv(model: Model, cells: list[Eviction]) -> None:
    full = generate(model, PROMPTS, max_new_tokens=N_NEW)
    results = generate_grid(model, PROMPTS, cells, max_new_tokens=N_NEW)
    for ev, res in zip(cells, results, strict=True):
        assert res.tokens == full.tokens, ev
        for row, n in enumerate(LENGTHS):
            everything = set(range(n)) | drafts_of(n, ev.timing)
            for layer in res.kept[row]:
                for head in layer:
                    assert set(head) == everything, (ev, row)


def test_budget_above_prompt_is_fullkv(model):
    """Budget 50 > P = 44, 30: every rule (and AdaKV, and masking) under every timing keeps
    every entry and gives FullKV's tokens."""
    _assert_fullkv(model, _no_eviction_cells(50))


def test_budget_equal_to_prompt_is_fullkv_under_every_timing(model):
    """Budget == P of the longer row: its prompt is not compressed, drafts on top or not."""
    _assert_fullkv(model, _no_eviction_cells(max(LENGTHS)))


# ---------------------------------------------------------------------------------------------
# Timings


def test_dge_k1_is_prefill(model):
    """Timing("dge", k=1) drafts nothing and observes nothing more: it is the baseline."""
    configs = [
        (SnapKV(window=WINDOW), "uniform"),
        (H2O(window=WINDOW), "uniform"),
        (TOVA(), "uniform"),
        (SnapKV(window=WINDOW), "adakv"),
    ]
    timings = (PREFILL, Timing("dge", 1), DGE2, DGE3)
    cells = [ev_(pol, 12, t, head_budget=hb) for pol, hb in configs for t in timings]
    results = generate_grid(model, PROMPTS, cells, max_new_tokens=N_NEW)
    for i in range(0, len(cells), len(timings)):
        base, dge1, dge2, _ = results[i : i + len(timings)]
        assert dge1.tokens == base.tokens, cells[i]
        assert dge1.kept == base.kept, cells[i]
        if cells[i].head_budget == "uniform":  # it did evict
            assert {len(h) for row in dge1.kept for layer in row for h in layer} == {12}
        if not isinstance(cells[i].rule, H2O):  # the draft query changes the prompt selection
            prompt_part = [[[h[:-1] for h in layer] for layer in row] for row in dge2.kept]
            assert prompt_part != base.kept, cells[i]
    # Alone (no draft record to borrow), dge(1) is prefill too.
    alone = generate(model, PROMPTS, max_new_tokens=N_NEW, eviction=cells[1])
    assert alone.tokens == results[0].tokens and alone.kept == results[0].kept


def test_first_k_tokens_are_fullkvs(model):
    """DGE drafts with the full cache: its first k answer tokens are FullKV's."""
    full = generate(model, PROMPTS, max_new_tokens=N_NEW).tokens
    rules = (SnapKV(window=WINDOW), H2O(window=WINDOW), StreamingLLM())
    cells = [ev_(pol, 12, t) for pol in rules for t in ALL_TIMINGS[1:]]
    results = generate_grid(model, PROMPTS, cells, max_new_tokens=N_NEW)
    for ev, res in zip(cells, results, strict=True):
        k = ev.timing.k
        assert [row[:k] for row in res.tokens] == [row[:k] for row in full], ev
    # Eviction at budget 12 does change the answer later on (else this proves nothing).
    assert any(res.tokens != full for res in results)


def test_dge_w_is_baseline_at_smaller_budget_plus_drafts(model):
    """DGE-W(k) at budget B keeps exactly prefill's selection at B - (k-1), plus the k-1 draft
    entries (SnapKV, H2O, TOVA, StreamingLLM; k = 2 and 3)."""
    budget = 14
    rules = (SnapKV(window=WINDOW), H2O(window=WINDOW), TOVA(), StreamingLLM())
    plan = ((budget - 1, PREFILL), (budget - 2, PREFILL), (budget, DGE_W2), (budget, DGE_W3))
    plan += ((budget, DGE2),)
    cells = [ev_(pol, b, t) for pol in rules for b, t in plan]
    results = generate_grid(model, PROMPTS, cells, max_new_tokens=N_NEW)
    for i, rule in zip(range(0, len(cells), len(plan)), rules, strict=True):
        base1, base2, dge_w2, dge_w3, dge2 = results[i : i + len(plan)]
        for base, dge_w, timing in ((base1, dge_w2, DGE_W2), (base2, dge_w3, DGE_W3)):
            for row, n in enumerate(LENGTHS):
                for layer in range(L):
                    for head in range(HKV):
                        expected = sorted(
                            base.kept[row][layer][head] + sorted(drafts_of(n, timing))
                        )
                        got = dge_w.kept[row][layer][head]
                        assert got == expected, (rule, timing, row, layer, head)
        if isinstance(rule, SnapKV | TOVA):  # (H2O's sum over 44 queries barely moves)
            assert dge2.kept != dge_w2.kept, rule  # DGE's draft query changes the selection


def test_kept_sets_hold_drafts_and_respect_budgets(model):
    """Every timing keeps every draft entry (P .. P+k-2) and at most `budget` per head."""
    budget = 16
    timings = (PREFILL, DGE3, DGE_W3)
    cells = [ev_(pol, budget, t) for pol in RULES for t in timings]
    cells += [ev_(SnapKV(window=WINDOW), budget, t, head_budget="adakv") for t in timings]
    results = generate_grid(model, PROMPTS, cells, max_new_tokens=N_NEW)
    for ev, res in zip(cells, results, strict=True):
        pyramid, adakv = isinstance(ev.rule, PyramidKV), ev.head_budget == "adakv"
        for row, n in enumerate(LENGTHS):
            drafts = drafts_of(n, ev.timing)
            kept = res.kept[row]
            for layer in kept:
                for head in layer:
                    assert drafts <= set(head), (ev, row)
                    assert all(0 <= q < n + ev.timing.draft_steps for q in head), (ev, row)
                    if not (pyramid or adakv):  # the prompt is longer than the budget
                        assert len(head) == budget, (ev, row)
                if adakv:  # AdaKV moves entries between heads; the layer's pool is Hkv·B
                    assert sum(map(len, layer)) <= HKV * budget, (ev, row)
            sizes = [len(h) for layer in kept for h in layer]
            if pyramid:  # PyramidKV moves entries between layers; the pool is L·Hkv·B
                assert sum(sizes) <= L * HKV * budget, (ev, row)
            if pyramid or adakv:  # budgets really differ between heads or layers
                assert len(set(sizes)) > 1, (ev, row)
    # Rules choose differently on this model, and the draft query changes SnapKV's choice.
    pairs = list(zip(cells, results, strict=True))
    prefill_kept = [json.dumps(res.kept) for ev, res in pairs if ev.timing == PREFILL]
    assert len(set(prefill_kept)) == len(prefill_kept)
    snap = [res.kept for ev, res in pairs if ev.rule == SnapKV(window=WINDOW)]
    assert snap[1] != snap[2]  # dge(3) vs dge_w(3)


# ---------------------------------------------------------------------------------------------
# Masked vs compacted caches


def test_masked_and_compacted_generate_the_same(model):
    cells = []
    for pol in (SnapKV(window=WINDOW), H2O(window=WINDOW), StreamingLLM()):
        for t in (PREFILL, DGE2, DGE3):
            cells += [ev_(pol, 16, t, compact=c) for c in (False, True)]
    cells += [
        ev_(SnapKV(window=WINDOW), 16, DGE2, head_budget="adakv", compact=c) for c in (False, True)
    ]
    results = generate_grid(model, PROMPTS, cells, max_new_tokens=N_NEW)
    for i in range(0, len(cells), 2):
        masked, compacted = results[i], results[i + 1]
        assert masked.tokens == compacted.tokens, cells[i]
        assert masked.kept == compacted.kept, cells[i]


@pytest.fixture(scope="module")
def step(model: Model):
    """decode_body under jit (one object, so both parametrizations share its compilations)."""
    return jax.jit(
        functools.partial(gen.decode_body, model.forward, model.config, model.params,
                          spec=gen.StepSpec(GREEDY, ()))
    )


@pytest.mark.parametrize("timing", [PREFILL, DGE2], ids=["prefill", "dge"])
def test_decode_body_logits_masked_vs_compacted(model, step, timing):
    """One decode step (then four more) on apply_keep(cache) and on compact(apply_keep(cache))
    gives the same logits to 1e-5 in f32: compaction only moves slots."""
    fwd, cfg, params = model.forward, model.config, model.params
    n_new = N_NEW
    tokens, lengths = pad_left([prompt(50, seed=7), prompt(23, seed=8)], 64)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    pre = gen.prefill_prompt(
        fwd, cfg, params, tokens, lengths, gen.PrefillSpec(64 + n_new, 512, WINDOWED)
    )
    key = jax.random.PRNGKey(0)
    state = gen.start_state(pre.cache, GREEDY(pre.logits, key), lengths, n_new, (), key)
    drafts = None
    if timing.draft_steps:
        state, drafts = gen.draft_tokens(
            fwd, cfg, params, state, gen.StepSpec(GREEDY, (), recording=WINDOWED.steps),
            num_steps=timing.draft_steps,
        )  # fmt: skip
    rule = SnapKV(window=WINDOW)
    keep = select_for(
        state.cache,
        pre.obs,
        drafts,
        jnp.int32(12),
        jnp.asarray(timing.observes_drafts),
        rule=rule,
    )
    masked = apply_keep(state.cache, keep)
    compacted = compact(masked, 12 + n_new)
    assert compacted.capacity < masked.capacity
    assert (np.asarray(masked.num_kept()) == 12).all()
    np.testing.assert_array_equal(compacted.num_kept(), masked.num_kept())
    a = dataclasses.replace(state, cache=masked)
    b = dataclasses.replace(state, cache=compacted)
    for _ in range(n_new - int(state.step[0])):
        a, out_a = step(a)
        b, out_b = step(b)
        np.testing.assert_allclose(out_a.logits, out_b.logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(a.last, b.last)
    # Full-cache logits differ: the eviction mattered for these logits.
    full = dataclasses.replace(state)
    full, out_full = step(full)
    a0 = dataclasses.replace(state, cache=masked)
    _, out_a0 = step(a0)
    assert np.max(np.abs(np.asarray(out_full.logits) - np.asarray(out_a0.logits))) > 1e-2


# ---------------------------------------------------------------------------------------------
# Batching


@pytest.mark.parametrize(
    "rule, head_budget",
    [(SnapKV(window=WINDOW), "uniform"), (SnapKV(window=WINDOW), "adakv"),
     (PyramidKV(window=WINDOW), "uniform"), (H2O(window=WINDOW), "uniform")],
    ids=["snapkv", "snapkv-adakv", "pyramidkv", "h2o"],
)  # fmt: skip
def test_one_scoring_for_many_budgets_equals_one_selection_each(model, rule, head_budget):
    """keep_masks (score once, select per budget: the grid's budget sweeps) gives each
    budget exactly `select_for`'s mask, per-layer and per-head budgets included."""
    fwd, cfg, params = model.forward, model.config, model.params
    tokens, lengths = pad_left([prompt(50, seed=7), prompt(23, seed=8)], 64)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    recording = WINDOWED | rule.needs.recording
    pre = gen.prefill_prompt(fwd, cfg, params, tokens, lengths,
                             gen.PrefillSpec(64 + N_NEW, 512, recording))  # fmt: skip
    key = jax.random.PRNGKey(0)
    state = gen.start_state(pre.cache, GREEDY(pre.logits, key), lengths, N_NEW, (), key)
    state, drafts = gen.draft_tokens(fwd, cfg, params, state,
                                     gen.StepSpec(GREEDY, (), recording=recording.steps),
                                     num_steps=1)  # fmt: skip
    budgets = [12, 20, 30] if isinstance(rule, PyramidKV) else [12, np.array([20, 16]), 30]
    if type(rule) is SnapKV and head_budget == "uniform":
        budgets.append(np.array([[12, 14], [16, 18]]))  # per head
    evs = [Eviction(rule, b, DGE2, head_budget=head_budget) for b in budgets]
    masks = keep_masks(state.cache, pre.obs, drafts, evs)
    for ev, got in zip(evs, masks, strict=True):
        want = select_for(
            state.cache, pre.obs, drafts, jnp.asarray(ev.budget, jnp.int32),
            jnp.asarray(True), rule=rule, head_budget=head_budget,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len({np.asarray(m).sum() for m in masks}) == len(masks)  # the budgets are live
    with pytest.raises(ValueError, match="share one scoring"):
        keep_masks(state.cache, pre.obs, drafts, [evs[0], Eviction(rule, 12, DGE_W2)])


def test_snapkv_and_pyramidkv_share_one_scoring(model):
    """PyramidKV selects from SnapKV's scores: a sweep mixing them scores once and still
    gives each cell its own `select_for` mask; a different SnapKV setting is refused."""
    fwd, cfg, params = model.forward, model.config, model.params
    tokens, lengths = pad_left([prompt(50, seed=7), prompt(23, seed=8)], 64)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    pre = gen.prefill_prompt(fwd, cfg, params, tokens, lengths,
                             gen.PrefillSpec(64 + N_NEW, 512, WINDOWED))  # fmt: skip
    key = jax.random.PRNGKey(0)
    state = gen.start_state(pre.cache, GREEDY(pre.logits, key), lengths, N_NEW, (), key)
    state, drafts = gen.draft_tokens(
        fwd, cfg, params, state, gen.StepSpec(GREEDY, (), recording=WINDOWED.steps),
        num_steps=1,
    )  # fmt: skip
    snap, pyramid = SnapKV(window=WINDOW), PyramidKV(window=WINDOW)
    assert pyramid.scorer == snap
    evs = [Eviction(p, b, DGE2) for p in (snap, pyramid) for b in (12, 20)]
    masks = keep_masks(state.cache, pre.obs, drafts, evs)
    for ev, got in zip(evs, masks, strict=True):
        want = select_for(
            state.cache, pre.obs, drafts, jnp.asarray(ev.budget, jnp.int32),
            jnp.asarray(True), rule=ev.rule,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Same budget, different layer schedules: the pyramid moves entries between layers.
    assert not np.array_equal(np.asarray(masks[0]), np.asarray(masks[2]))
    with pytest.raises(ValueError, match="share one scoring"):
        keep_masks(state.cache, pre.obs, drafts, [evs[0], Eviction(SnapKV(window=4), 12, DGE2)])


def test_batch_rows_get_what_they_get_alone(model):
    """Left-padded rows of different lengths (buckets 64 vs 32 alone) are evicted per row."""
    p_long, p_short = PROMPTS
    cells = [
        ev_(pol, 14, t, head_budget=hb)
        for pol, hb in (
            (SnapKV(window=WINDOW), "uniform"),
            (H2O(window=WINDOW), "uniform"),
            (StreamingLLM(), "uniform"),
            (SnapKV(window=WINDOW), "adakv"),
        )
        for t in (PREFILL, DGE2, DGE3)
    ]
    n_new = N_NEW
    batch = generate_grid(model, [p_long, p_short], cells, max_new_tokens=n_new)
    alone_long = generate_grid(model, [p_long], cells, max_new_tokens=n_new)
    alone_short = generate_grid(model, [p_short], cells, max_new_tokens=n_new)
    for ev, both, one, two in zip(cells, batch, alone_long, alone_short, strict=True):
        assert both.tokens == one.tokens + two.tokens, ev
        assert both.kept == one.kept + two.kept, ev
    assert len({json.dumps(res.kept) for res in batch}) == len(cells)  # all cells differ


# ---------------------------------------------------------------------------------------------
# Compile once


def test_budget_and_timing_sweep_compiles_once():
    """Budgets {32, 64, 128, 256} x {prefill, dge(2), dge_w(2)} at one capacity: one compile of
    the selection (each timing scores once for its four budgets), prefill, draft, decode and
    compaction each."""
    # A config and rule no other test uses, so each jitted function compiles exactly once here.
    model = tiny_model(tiny_config(rms_norm_eps=1.25e-6), seed=4)
    rule = SnapKV(window=WINDOW, kernel=5)
    p, n_new, capacity = prompt(300, seed=40), 4, 264
    cells = [Eviction(rule, b, t, capacity=capacity) for b in (32, 64, 128, 256) for t in TIMINGS]
    fns = {
        "select_for_budgets": select_for_budgets,
        "prefill": gen.prefill_prompt,
        "draft": gen.draft_tokens,
        "decode": gen.decode_loop,
        "compact": eviction_mod.compact,
    }
    before = {name: fn._cache_size() for name, fn in fns.items()}
    results = generate_grid(model, [p], cells, max_new_tokens=n_new)
    grown = {name: fn._cache_size() - before[name] for name, fn in fns.items()}
    assert grown == dict.fromkeys(fns, 1)
    for ev, res in zip(cells, results, strict=True):  # budgets are live: all compress
        assert {len(h) for layer in res.kept[0] for h in layer} == {ev.budget}
    assert len({json.dumps(res.kept) for res in results}) == len(cells)


# ---------------------------------------------------------------------------------------------
# generate_grid == generate


def test_generate_grid_equals_generate(model):
    """One prefill (largest window, attention recorded) and one draft per k serve every cell;
    each cell still gets what it gets alone (own window, no borrowed record, own capacity)."""
    cells = [
        None,
        Eviction(SnapKV(window=WINDOW), 14, PREFILL),
        Eviction(SnapKV(window=16), 20, DGE2, head_budget="adakv"),
        Eviction(H2O(window=4), 12, DGE_W2, compact=False),
        Eviction(StreamingLLM(), 12, DGE3),
    ]
    grid = generate_grid(model, PROMPTS, cells, max_new_tokens=N_NEW)
    for ev, res in zip(cells, grid, strict=True):
        alone = generate(model, PROMPTS, max_new_tokens=N_NEW, eviction=ev)
        assert res.tokens == alone.tokens, ev
        assert res.kept == alone.kept, ev
    assert grid[0].kept is None
    assert len({json.dumps(res.kept) for res in grid[1:]}) == len(cells) - 1


# ---------------------------------------------------------------------------------------------
# Per-layer capacities


LONG_PROMPTS = [prompt(150, seed=150), prompt(121, seed=121)]


def test_pyramidkv_compacts_to_per_layer_capacities(model):
    """PyramidKV's budgets fall by layer (here about 115 and 13 entries per head): compaction
    gives each layer its own capacity, and decoding that ragged cache gives the tokens a
    cache of one capacity gives, for fewer bytes."""
    fwd, cfg, params = model.forward, model.config, model.params
    tokens, lengths = pad_left(LONG_PROMPTS, 256)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    pre = gen.prefill_prompt(fwd, cfg, params, tokens, lengths,
                             gen.PrefillSpec(256 + 64, 512, WINDOWED))  # fmt: skip
    key = jax.random.PRNGKey(0)
    state = gen.start_state(pre.cache, GREEDY(pre.logits, key), lengths, N_NEW, (), key)
    ev = Eviction(PyramidKV(window=WINDOW), 64, PREFILL)
    keep = eviction_mod.keep_mask(state.cache, pre.obs, None, ev)
    counts = np.asarray(jnp.sum(keep, axis=-1))
    assert counts[0].max() > 64 > counts[1].max()  # the layers need 128 and 64 slots + N_NEW
    ragged = eviction_mod.apply_eviction(state.cache, keep, ev, None, N_NEW)
    uniform = eviction_mod.apply_eviction(state.cache, keep, ev, 128 + N_NEW, N_NEW)
    assert ragged.capacities == (128 + N_NEW, 64 + N_NEW) and ragged.ragged
    assert uniform.capacities == (128 + N_NEW,) * L
    assert ragged.nbytes() < uniform.nbytes()
    np.testing.assert_array_equal(ragged.num_kept(), counts)

    def decode(cache, **loop):  # decode donates its state: each call gets its own copy
        fresh = jax.tree.map(jnp.copy, dataclasses.replace(state, cache=cache))
        return gen.decode_loop(fwd, cfg, params, fresh, gen.StepSpec(GREEDY, ()), **loop)

    assert ragged.group_sizes == (1, 1) and uniform.group_sizes == (L,)
    ref = decode(uniform, layer_loop="scan")
    for loop in ("scan", "unrolled"):  # scan: one scanned group per capacity
        out = decode(ragged, layer_loop=loop)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        assert out.cache.capacities == ragged.capacities
        np.testing.assert_array_equal(out.cache.index, np.asarray(ragged.index) + N_NEW - 1)


def test_grid_with_per_layer_capacities_equals_one_capacity(model):
    """A grid's compacted cells share per-layer capacities (PyramidKV's and SnapKV's cells in
    one decode batch); they generate and keep what they do at one fixed capacity, and alone."""
    pyramid, snap = PyramidKV(window=WINDOW), SnapKV(window=WINDOW)
    cells = [Eviction(pol, 64, t) for pol in (pyramid, snap) for t in (PREFILL, DGE2)]
    fixed = [dataclasses.replace(ev, capacity=256) for ev in cells]
    grid = generate_grid(model, LONG_PROMPTS, cells + fixed, max_new_tokens=N_NEW)
    for ev, res, ref in zip(cells, grid[: len(cells)], grid[len(cells) :], strict=True):
        assert res.tokens == ref.tokens, ev
        assert res.kept == ref.kept, ev
    alone = generate(model, LONG_PROMPTS, max_new_tokens=N_NEW, eviction=cells[1])
    assert alone.tokens == grid[1].tokens and alone.kept == grid[1].kept


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_json_prints_kept_positions(checkpoint, capsys):
    from conftest import WORDS  # the fixture tokenizer's vocabulary

    from dge_jax.cli import main

    text = " ".join(WORDS[i % len(WORDS)] for i in range(0, 90, 3))  # 30 words, 30 tokens
    argv = [
        "generate",
        "--model",
        str(checkpoint("llama_chat")),
        "--prompt",
        text,
        "--rule",
        "snapkv",
        "--budget",
        "16",
        "--window",
        "8",
        "--json",
        "--max_new_tokens",
        "4",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    n = len(out["prompt_tokens"][0])
    assert n > 16
    kept = out["kept"]
    assert len(kept) == 2 and all(len(layer) == 2 for layer in kept)  # L lists of Hkv lists
    for layer in kept:
        for head in layer:
            assert len(head) == 16 and head == sorted(head)
            assert n in head  # the draft entry (default timing dge, k=2)
            assert all(0 <= q <= n for q in head)
