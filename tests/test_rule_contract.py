"""One contract for every registered scoring rule (wrappers with their default inner rule),
parametrised over the registry, so a rule dropped into dge_jax/rules/ is held to it unasked:

- it is defined in the file of dge_jax/rules/ named after it (the registered name equals the
  file's stem with its underscores removed: `expectedattention` in expected_attention.py);
- its scores on a hand-made left-padded cache are [L, B, Hkv, S] f32, -inf exactly on the
  empty slots, never NaN, and +inf on no more entries per head than its needs declare it
  always keeps (or observes: TOVA's last query);
- it is hashable and a jit static argument (equal rules share one compilation);
- it generates on a tiny model under every timing (prefill, dge, dge_w) x head budget
  (uniform, adakv, global), keeping the budget; one grid for all rules;
- DGE keeps what DGE-W keeps when its needs read no queries (`Needs.query_free`).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dge_jax.eviction.observation import for_rule
from dge_jax.rules.base import Needs
from dge_jax.rules.full import is_full
from dge_jax.rules.registry import RULES, WRAPPERS, make_rule, rule_fields
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation, QueryStats

NAMES = sorted(RULES)
EVICTING = [n for n in NAMES if not is_full(make_rule(n))]
QUERY_FREE = [n for n in EVICTING if make_rule(n).needs.query_free]
L, B, HKV, G, D, S, E = 2, 2, 2, 2, 8, 16, 12
HQ = HKV * G
LENGTHS = (12, 7)
HEAD_BUDGETS = ("uniform", "adakv", "global")
# Rules around other inner rules than their default, as the runner's --rules name them.
COMPOSITES = ("criticalkv_expectedattention", "chunkkv_h2o", "criticalkv_tova", "chunkkv_kvzip")


def small(name: str):
    """The rule with a window of 4 where it has one (the tiny prompts stay evictable)."""
    return make_rule(name, **({"window": 4} if "window" in rule_fields(name) else {}))


# ----------------------------------------------------------------------------- one file each


@pytest.mark.parametrize("name", NAMES)
def test_rule_lives_in_the_file_named_after_it(name):
    path = pathlib.Path(inspect.getsourcefile(RULES[name]))
    assert path.parent.name == "rules" and path.parent.parent.name == "dge_jax", path
    assert path.stem.replace("_", "") == name, f"{name} is defined in {path.name}"


# ----------------------------------------------------------------------------- needs


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_wrappers_read_what_their_inner_rule_reads(wrapper):
    """A wrapper's needs are its inner rule's, plus its own (CriticalKV's output projection;
    ChunkKV protects nothing itself)."""
    for inner in sorted(set(EVICTING) - set(WRAPPERS)):
        outer, rule = make_rule(wrapper, inner=inner), make_rule(inner)
        assert dataclasses.replace(outer.needs, out_proj=False, protected=0) == (
            dataclasses.replace(rule.needs, out_proj=False, protected=0)
        ), (wrapper, inner)
        assert outer.needs.protected in (0, rule.needs.protected)


def test_needs_union_is_what_one_recording_serves():
    a = Needs(window=4, protected=4)
    b = Needs(attn_sum=True, query_stats_from=2, protected=8)
    assert a | b == Needs(window=4, attn_sum=True, query_stats_from=2, protected=8)
    assert (a | b).queries and not Needs().queries and Needs(protected=3).query_free
    with pytest.raises(ValueError, match="one set of query statistics"):
        b | Needs(query_stats_from=3)


# ----------------------------------------------------------------------------- scores


def _cache() -> KVCache:
    """Row b: prompt positions 0..n_b-1 left-padded into S slots."""
    rng = np.random.default_rng(0)
    k = rng.normal(size=(L, B, HKV, S, D)).astype(np.float32)
    v = rng.normal(size=(L, B, HKV, S, D)).astype(np.float32)
    pos = np.full((L, B, HKV, S), -1, np.int32)
    for b, n in enumerate(LENGTHS):
        pos[:, b, :, S - n :] = np.arange(n)
    return KVCache.stacked(jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos), S)


def _observation() -> Observation:
    """Everything a rule may read: 4 window queries, attention sums, query statistics,
    reconstruction scores and output projections (for_rule cuts it to a rule's needs)."""
    rng = np.random.default_rng(1)
    w = 4
    q_pos = np.stack([np.arange(n - w, n) for n in LENGTHS]).astype(np.int32)
    queries = rng.normal(size=(L, B, HQ, 6, D)).astype(np.float32)
    stats = QueryStats(
        total=jnp.asarray(queries.sum(3)),
        outer=jnp.asarray(np.einsum("lbhkd,lbhke->lbhde", queries, queries)),
        count=jnp.full((B,), 6.0, jnp.float32),
        inv_freq=jnp.asarray(1.0 / 10000 ** (np.arange(0, D, 2) / D), jnp.float32),
    )
    return Observation(
        q=jnp.asarray(rng.normal(size=(L, B, HQ, w, D)).astype(np.float32)),
        q_pos=jnp.asarray(q_pos),
        attn_sum=jnp.asarray(rng.uniform(size=(L, B, HQ, S)).astype(np.float32)),
        is_draft=jnp.zeros((w,), bool),
        prompt_end=jnp.asarray(np.array(LENGTHS, np.int32) - 1),
        out_proj=jnp.asarray(rng.normal(size=(L, HQ, D, E)).astype(np.float32)),
        q_stats=stats,
        recon=jnp.asarray(rng.uniform(size=(L, B, HKV, S)).astype(np.float32)),
    )


TRACES: list[object] = []


def _scores(cache: KVCache, obs: Observation, budgets: jax.Array, *, rule):
    TRACES.append(rule)  # runs once per compilation
    scores = rule.scorer.score(cache, obs)
    return scores, rule.refine(scores, budgets, cache, obs)


scores_jit = jax.jit(_scores, static_argnames="rule")


@pytest.mark.parametrize("name", EVICTING)
def test_scores_shapes_and_sentinels(name):
    rule, cache = small(name), _cache()
    obs, _ = for_rule(rule, _observation(), None)
    budgets = jnp.full((L, B, HKV), 5, jnp.int32)
    scores, refined = (np.asarray(a) for a in scores_jit(cache, obs, budgets, rule=rule))
    valid = np.asarray(cache.valid())
    for got in (scores, refined):
        assert got.shape == (L, B, HKV, S) and got.dtype == np.float32
        assert not np.isnan(got).any()
        assert np.isneginf(got[~valid]).all() and not np.isneginf(got[valid]).any()
    needs = rule.needs
    most = np.sum(np.isposinf(scores), axis=-1).max()
    assert most <= max(needs.protected, needs.window), (most, needs)


@pytest.mark.parametrize("name", EVICTING)
def test_rule_is_hashable_and_a_jit_static_argument(name):
    a, b = small(name), small(name)
    assert a == b and hash(a) == hash(b) and a is not b
    cache, obs_all = _cache(), _observation()
    obs, _ = for_rule(a, obs_all, None)
    budgets = jnp.full((L, B, HKV), 5, jnp.int32)
    TRACES.clear()
    # A new function: jax caches traces per function, across jit wrappers.
    fresh = jax.jit(lambda *args, rule: _scores(*args, rule=rule), static_argnames="rule")
    first = fresh(cache, obs, budgets, rule=a)
    again = fresh(cache, obs, budgets, rule=b)
    assert len(TRACES) == 1, "an equal rule compiled again"
    np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(again[0]))


# ----------------------------------------------------------------------------- generation


@pytest.fixture(scope="module")
def grid(checkpoint):
    """One grid: every evicting rule (and the composites) x timing x head budget."""
    import dge_jax
    from dge_jax.eviction.evict import Eviction
    from dge_jax.eviction.timing import Timing
    from dge_jax.generation import generate_grid

    model = dge_jax.load(checkpoint("llama_chat"))  # KVzip encodes its repeat instruction
    n, budget = 48, 16
    prompt = [[(5 * i + 1) % model.config.vocab_size for i in range(n)]]
    cells, keys = [], []
    for name in [*EVICTING, *COMPOSITES]:
        for kind in ("prefill", "dge", "dge_w"):
            for head_budget in HEAD_BUDGETS:
                # Head-adaptive cells stay masked: compacted, each would keep its own per-layer
                # capacities and compile a decode loop of its own.
                timing = Timing(kind, 1 if kind == "prefill" else 2)
                cells.append(Eviction(small(name), budget, timing, head_budget=head_budget,
                                      compact=head_budget == "uniform"))  # fmt: skip
                keys.append((name, kind, head_budget))
    results = generate_grid(model, prompt, cells, max_new_tokens=2)
    total = budget * model.config.num_layers * model.config.num_kv_heads
    return dict(zip(keys, results, strict=True)), total


@pytest.mark.slow
@pytest.mark.parametrize("name", [*EVICTING, *COMPOSITES])
def test_generates_under_every_timing_and_head_budget(grid, name):
    results, total = grid
    for kind in ("prefill", "dge", "dge_w"):
        for head_budget in HEAD_BUDGETS:
            res = results[(name, kind, head_budget)]
            kept = [len(h) for layer in res.kept[0] for h in layer]
            # PyramidKV and AdaKV move budget between layers and heads, never the total.
            assert sum(kept) == total, (name, kind, head_budget, kept)
            assert len(res.tokens[0]) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("name", QUERY_FREE)
def test_query_free_rules_keep_the_same_under_dge_and_dge_w(grid, name):
    results, _ = grid
    for head_budget in HEAD_BUDGETS:
        dge, dge_w = results[(name, "dge", head_budget)], results[(name, "dge_w", head_budget)]
        assert dge.kept == dge_w.kept, (name, head_budget)
