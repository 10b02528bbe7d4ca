"""DGE beyond k=2: one draft serves every k, adaptive k, draft-query weighting.

A tiny random Llama with peaked attention (weights N(0, 0.3²)), two prompts of different
lengths, SnapKV window 8. Every grid below drafts once to the largest k; `rewind` replays
shorter drafts, so the scorer compiles once for all k, thresholds and weights.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dge_jax.config import ModelConfig
from dge_jax.eviction.evict import Eviction, select_for_budgets
from dge_jax.eviction.timing import Adaptive, Timing
from dge_jax.families import get_family
from dge_jax.generation import generate_grid
from dge_jax.model import Model
from dge_jax.rules.h2o import H2O
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import decoding as gen

LENGTHS = (52, 37)
N_NEW = 10
CAP = 64
BUDGET = 20
SNAP = SnapKV(window=8)


@pytest.fixture(scope="module")
def model() -> Model:
    cfg = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=512)
    family = get_family("llama")
    params = family.init_params(cfg, jax.random.PRNGKey(7), scale=0.3)
    return Model(family=family, config=cfg, params=params, tokenizer=None)


def prompts() -> list[list[int]]:
    return [np.random.RandomState(i).randint(3, 128, n).tolist() for i, n in enumerate(LENGTHS)]


def cell(timing: Timing, budget: int = BUDGET, rule=SNAP) -> Eviction:
    return Eviction(rule, budget, timing, capacity=CAP)


def test_a_k_list_drafts_once(model):
    """k in {2, 3, 4, 8} under dge and dge_w: one draft call of 7 steps serves all cells."""
    calls = []

    def hook(stage, fn, *args, **kwargs):  # the pipeline's stage hook sees every jitted step
        if stage == "draft":
            calls.append(kwargs["num_steps"])
        return fn(*args, **kwargs)

    cells = [cell(Timing(kind, k)) for kind in ("dge", "dge_w") for k in (2, 3, 4, 8)]
    results = generate_grid(model, prompts(), cells, max_new_tokens=N_NEW, hook=hook)
    assert calls == [7]
    assert [r.k for r in results] == [[k, k] for _ in range(2) for k in (2, 3, 4, 8)]


def test_replayed_draft_equals_a_draft_of_that_length(model):
    """A k=3 cell cut from the k=8 draft equals a grid that only ever drafted to k=3."""
    alone = generate_grid(model, prompts(), [cell(Timing("dge", 3))], max_new_tokens=N_NEW)[0]
    shared = generate_grid(model, prompts(), [cell(Timing("dge", 3)), cell(Timing("dge", 8))],
                           max_new_tokens=N_NEW)[0]
    assert shared.tokens == alone.tokens
    assert shared.kept == alone.kept


def test_dge_w_at_k_is_baseline_at_smaller_budget_plus_drafts(model):
    """DGE-W at k keeps the prefill baseline's selection at budget B-(k-1) plus the k-1
    draft positions P, ..., P+k-2, for every k of one draft."""
    ks = (2, 3, 4)
    cells = [cell(Timing("dge_w", k)) for k in ks]
    cells += [cell(Timing("prefill", 1), BUDGET - (k - 1)) for k in ks]
    results = generate_grid(model, prompts(), cells, max_new_tokens=N_NEW)
    for i, k in enumerate(ks):
        dge_w, base = results[i], results[len(ks) + i]
        for row, n in enumerate(LENGTHS):
            drafts = set(range(n, n + k - 1))
            for layer_w, layer_b in zip(dge_w.kept[row], base.kept[row], strict=True):
                for head_w, head_b in zip(layer_w, layer_b, strict=True):
                    assert set(head_w) == set(head_b) | drafts


def test_draft_weight_one_is_plain_dge_and_zero_is_dge_w(model):
    """weight 1 gives exactly the paper's DGE; weight 0 makes draft queries count for nothing,
    which is DGE-W's selection (draft entries are kept either way)."""
    for rule in (SNAP, H2O(window=8)):
        cells = [cell(Timing("dge", 3), rule=rule),
                 cell(Timing("dge", 3, draft_weight=1.0), rule=rule),
                 cell(Timing("dge", 3, draft_weight=0.0), rule=rule),
                 cell(Timing("dge_w", 3), rule=rule),
                 cell(Timing("dge", 3, draft_weight=4.0), rule=rule)]
        plain, one, zero, control, heavy = generate_grid(model, prompts(), cells,
                                                         max_new_tokens=N_NEW)
        assert one.kept == plain.kept and one.tokens == plain.tokens
        assert zero.kept == control.kept
        assert plain.kept != control.kept, "drafts should change the selection here"
        assert heavy.kept != plain.kept, "a heavier draft weight should change the selection"


def test_next_token_stats_on_hand_made_logits():
    """Entropy (nats) and top-1 probability of known distributions."""
    uniform = jnp.zeros((1, 8))
    peaked = jnp.array([[10.0, 0, 0, 0, 0, 0, 0, 0]])
    entropy, top1 = gen.next_token_stats(jnp.concatenate([uniform, peaked]))
    np.testing.assert_allclose(entropy[0], np.log(8), rtol=1e-6)
    np.testing.assert_allclose(top1[0], 1 / 8, rtol=1e-6)
    p = np.exp(10) / (np.exp(10) + 7)
    np.testing.assert_allclose(top1[1], p, rtol=1e-5)
    np.testing.assert_allclose(entropy[1], -(p * np.log(p) + (1 - p) * np.log((1 - p) / 7)),
                               rtol=1e-4)


def test_adaptive_rule_stops_where_it_fires_and_respects_k_max():
    """Rows: fires on t3, never fires, fires on t1, fires only after k_max."""
    entropy = np.array([[0.1, 0.2, 2.5, 0.3, 0.1, 0.1, 0.1, 0.1],
                        [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1],
                        [3.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1],
                        [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 5.0]])
    top1 = np.exp(-entropy)
    t = Timing("dge", 5, adaptive=Adaptive("entropy", 1.0))  # at most 4 draft steps
    np.testing.assert_array_equal(t.steps_per_row(entropy, top1), [2, 4, 0, 4])
    t = Timing("dge", 5, adaptive=Adaptive("top1", 0.5))
    np.testing.assert_array_equal(t.steps_per_row(entropy, top1), [2, 4, 0, 4])


def test_adaptive_k_in_generation_compiles_once_across_thresholds(model):
    """Per-row k within [1, k_max]; thresholds, like k and the weight, are not static."""
    thresholds = (0.0, 3.0, 1e9)
    def run(th):
        timing = Timing("dge", 4, adaptive=Adaptive("entropy", th))
        return generate_grid(model, prompts(), [cell(timing)], max_new_tokens=N_NEW)[0]

    run(1.0)
    def sizes():
        jitted = (select_for_budgets, gen.rewind_state, gen.draft_tokens)
        return tuple(f._cache_size() for f in jitted)

    before = sizes()
    results = {th: run(th) for th in thresholds}
    after = sizes()
    assert after == before
    assert results[0.0].k == [1, 1]  # fires on t1: the prefill baseline
    assert results[1e9].k == [4, 4]  # never fires: k_max
    assert all(1 <= k <= 4 for k in results[3.0].k)
    baseline = generate_grid(model, prompts(), [cell(Timing("prefill", 1))],
                             max_new_tokens=N_NEW)[0]
    assert results[0.0].tokens == baseline.tokens and results[0.0].kept == baseline.kept
