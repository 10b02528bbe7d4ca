"""Scoring rules (dge_jax/rules/<rule>.py, one file each): every rule's selection against a
plain-numpy reference."""

from __future__ import annotations

import functools
import inspect
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy_reference import pool as _pool

from dge_jax.rules.full import FullKV, is_full
from dge_jax.rules.h2o import H2O
from dge_jax.rules.knorm import KeyNorm
from dge_jax.rules.ops import gqa_aggregate, pool1d
from dge_jax.rules.pyramidkv import PyramidKV
from dge_jax.rules.random import RandomScores
from dge_jax.rules.registry import RULES, make_rule
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.streamingllm import StreamingLLM
from dge_jax.rules.tova import TOVA
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation
from dge_jax.runtime.selection import select_slots as _select_eager

L, B, HKV, G, D = 2, 2, 2, 2, 8
select = jax.jit(_select_eager)
HQ = HKV * G


# ----------------------------------------------------------------------------- fixtures


def _cache(lengths, S: int, seed: int = 0, drafts: int = 0) -> KVCache:
    """Row b: prompt positions 0..n_b-1 left-padded into slots [0, S), then ``drafts`` draft
    entries (positions n_b, n_b+1, ...) in slots S, S+1, ... as the draft steps write them."""
    rng = np.random.default_rng(seed)
    shape = (L, B, HKV, S + drafts, D)
    k = rng.normal(size=shape).astype(np.float32)
    v = rng.normal(size=shape).astype(np.float32)
    pos = np.full(shape[:-1], -1, np.int32)
    for b, n in enumerate(lengths):
        pos[:, b, :, S - n : S] = np.arange(n)
        pos[:, b, :, S:] = n + np.arange(drafts)
    return KVCache.stacked(jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos), S + drafts)


def _obs(lengths, window: int, drafts: int = 0, seed: int = 1, attn_sum=None) -> Observation:
    """The last ``window`` prompt queries of each row, then ``drafts`` draft queries."""
    rng = np.random.default_rng(seed)
    w = window + drafts
    q = rng.normal(size=(L, B, HQ, w, D)).astype(np.float32)
    q_pos = np.stack([np.arange(n - window, n + drafts) for n in lengths]).astype(np.int32)
    return Observation(
        q=jnp.asarray(q),
        q_pos=jnp.asarray(q_pos),
        attn_sum=attn_sum,
        is_draft=jnp.asarray([False] * window + [True] * drafts),
        prompt_end=jnp.asarray([n - 1 for n in lengths], jnp.int32),
    )


def _row(cache: KVCache, layer: int, b: int):
    """Unpadded keys [Hkv, n, D] and positions [n] of one row (same for every head here)."""
    pos = np.asarray(cache.pos)[layer, b, 0]
    slots = np.flatnonzero(pos >= 0)
    return np.asarray(cache.k)[layer, b][:, slots], pos[slots], slots


@functools.partial(jax.jit, static_argnums=0)
def _jitted(rule, cache, obs):
    return rule.score(cache, obs)


def _score(rule, cache: KVCache, obs: Observation | None) -> np.ndarray:
    """rule.score under jit (eager dispatch of every op is what makes tests slow)."""
    return np.asarray(_jitted(rule, cache, obs))


def _kept_positions(keep: jax.Array, cache: KVCache) -> dict:
    keep, pos = np.asarray(keep), np.asarray(cache.pos)  # keep: [L, B, Hkv, S] bool
    return {idx: set(pos[idx][keep[idx]].tolist()) for idx in np.ndindex(L, B, HKV)}


def _top(scores: np.ndarray, positions: np.ndarray, count: int) -> set:
    """Positions of the ``count`` best scores, ties to the later position (select's rule;
    max-pooling makes exact ties common)."""
    order = np.lexsort((-positions, -scores))
    return set(positions[order[: max(count, 0)]].tolist())


# ----------------------------------------------------------------------------- numpy references


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def _snapkv_reference(keys, key_pos, q, q_pos, kernel, pooling, gqa):
    """One row, one layer. keys [Hkv, n, D] at key_pos, q [Hq, W, D] at q_pos (-1 = none).
    Returns (scores of the prefix keys [Hkv, P], prefix positions [P], protected positions)."""
    live = q_pos >= 0
    q, q_pos = q[:, live], q_pos[live]
    first = q_pos.min()
    krep = np.repeat(keys, G, axis=0)  # query head h reads kv head h // G
    logits = np.einsum("hwd,hsd->hws", q, krep) / np.sqrt(D)
    logits = np.where(key_pos[None, None, :] <= q_pos[None, :, None], logits, -np.inf)
    attn = _softmax(logits).mean(axis=1)  # [Hq, n]
    prefix = key_pos < first
    pooled = _pool(attn[:, prefix], kernel, pooling)  # the window is cut off before pooling
    grouped = pooled.reshape(HKV, G, -1)
    scores = grouped.mean(1) if gqa == "mean" else grouped.max(1)
    return scores, key_pos[prefix], set(key_pos[~prefix].tolist())


def _kvpress_snapkv(keys, queries, window, kernel):
    """kvpress SnapKVPress.score, transcribed: keys [Hkv, k_len, D], queries [Hq, window, D]
    (the last ``window`` positions, post-RoPE) -> scores [Hkv, k_len]."""
    k_len = keys.shape[1]
    key_states = np.repeat(keys, G, axis=0)  # repeat_kv
    attn = np.einsum("hwd,hsd->hws", queries, key_states) / np.sqrt(D)
    mask = np.triu(np.full(attn.shape, -np.inf), k=k_len - window + 1)  # torch.triu(diagonal=)
    attn = _softmax(attn + mask)
    attn = attn[..., :-window]
    scores = attn.mean(axis=-2)
    # F.avg_pool1d(kernel, padding=kernel // 2, stride=1), count_include_pad=True
    padded = np.pad(scores, ((0, 0), (kernel // 2, kernel // 2)))
    scores = np.stack(
        [padded[:, i : i + kernel].sum(-1) / kernel for i in range(k_len - window)], axis=-1
    )
    scores = scores.reshape(HKV, G, k_len - window).mean(1)
    return np.pad(scores, ((0, 0), (0, window)), constant_values=scores.max() + 1)


# ----------------------------------------------------------------------------- SnapKV


def test_numpy_pool_matches_torch_avg_pool1d():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).random((3, 11)).astype(np.float32)
    ref = torch.nn.functional.avg_pool1d(torch.from_numpy(x), 5, stride=1, padding=2).numpy()
    np.testing.assert_allclose(_pool(x, 5, "avg"), ref, rtol=1e-6)
    ref = torch.nn.functional.max_pool1d(torch.from_numpy(x), 5, stride=1, padding=2).numpy()
    np.testing.assert_allclose(_pool(x, 5, "max"), ref)


def test_pool1d_excluded_slots_are_padding():
    # Worked example of pool1d: slot 0 left padding, slot 4 the protected window.
    x = jnp.asarray([9.0, 0.2, 0.4, 0.6, 9.0])
    include = jnp.asarray([False, True, True, True, False])
    avg = np.asarray(pool1d(x, include, 3, "avg"))
    np.testing.assert_allclose(avg[1:4], [0.6 / 3, 1.2 / 3, 1.0 / 3], rtol=1e-6)
    mx = np.asarray(pool1d(x, include, 3, "max"))
    np.testing.assert_allclose(mx[1:4], [0.4, 0.6, 0.6])
    # A hole in the middle (an evicted slot) is padding too: it never lends its value.
    include = jnp.asarray([True, True, False, True, True])
    np.testing.assert_allclose(pool1d(x, include, 3, "max")[1], 9.0)
    np.testing.assert_allclose(pool1d(x, include, 3, "max")[3], 9.0)
    np.testing.assert_allclose(pool1d(x, include, 3, "avg")[1], 9.2 / 3, rtol=1e-6)
    with pytest.raises(ValueError, match="odd"):
        pool1d(x, include, 4, "avg")


@pytest.mark.parametrize("budget", [70, 76, 80])
def test_snapkv_kvpress_preset_reproduces_kvpress(budget):
    lengths, S = (96, 84), 96
    rule = SnapKV.kvpress()
    assert rule == SnapKV(window=64, kernel=5, pooling="avg", gqa="mean")
    cache, obs = _cache(lengths, S), _obs(lengths, rule.window)
    scores = _score(rule, cache, obs)
    kept = _kept_positions(select(scores, budget), cache)
    for layer in range(L):
        for b, n in enumerate(lengths):
            keys, _, slots = _row(cache, layer, b)
            theirs = _kvpress_snapkv(keys, np.asarray(obs.q[layer, b]), 64, 5)
            ours = np.asarray(scores[layer, b])[:, slots]
            np.testing.assert_allclose(ours[:, : n - 64], theirs[:, : n - 64], rtol=1e-5)
            assert np.isinf(ours[:, n - 64 :]).all()
            for h in range(HKV):
                # kvpress: scores.topk(n_kept).indices (ScorerPress.compress)
                expected = set(np.argsort(-theirs[h], kind="stable")[:budget].tolist())
                assert kept[(layer, b, h)] == expected


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("gqa", ["mean", "max"])
@pytest.mark.parametrize("drafts", [0, 2])
def test_snapkv_matches_reference(pooling, gqa, drafts):
    lengths, S, window, budget = (30, 21), 30, 6, 13
    rule = SnapKV(window=window, kernel=7, pooling=pooling, gqa=gqa)
    cache, obs = _cache(lengths, S, drafts=drafts), _obs(lengths, window, drafts=drafts)
    scores = _score(rule, cache, obs)
    kept = _kept_positions(select(scores, budget), cache)
    for layer in range(L):
        for b in range(B):
            keys, key_pos, slots = _row(cache, layer, b)
            ref, prefix_pos, protected = _snapkv_reference(
                keys, key_pos, np.asarray(obs.q[layer, b]), np.asarray(obs.q_pos[b]),
                rule.kernel, pooling, gqa,
            )  # fmt: skip
            assert len(protected) == window + drafts  # the window and every draft entry
            ours = np.asarray(scores[layer, b])[:, slots]
            np.testing.assert_allclose(ours[:, : len(prefix_pos)], ref, rtol=1e-5, atol=1e-7)
            for h in range(HKV):
                expected = protected | _top(ref[h], prefix_pos, budget - len(protected))
                assert kept[(layer, b, h)] == expected


def test_snapkv_padding_does_not_leak():
    # Row 1 scored inside a left-padded batch equals the same row scored alone, unpadded.
    lengths, S, window = (24, 15), 24, 4
    rule = SnapKV(window=window, kernel=7, pooling="avg")
    cache, obs = _cache(lengths, S), _obs(lengths, window)
    scores = _score(rule, cache, obs)
    alone = KVCache.stacked(
        cache.k[:, :, :, S - 15 :], cache.v[:, :, :, S - 15 :], cache.pos[:, :, :, S - 15 :], 15
    )
    alone_scores = _score(rule, alone, obs)
    np.testing.assert_allclose(scores[:, 1, :, S - 15 :], alone_scores[:, 1], rtol=1e-6)
    assert np.isneginf(scores[:, 1, :, : S - 15]).all()


def test_snapkv_ignores_masked_queries():
    lengths, S, window = (20, 20), 20, 5
    rule = SnapKV(window=window, kernel=3)
    cache, obs = _cache(lengths, S), _obs(lengths, window)
    # Row 0's oldest query slot holds garbage marked -1: same scores as dropping it, with
    # the protected range starting at the next query.
    q_pos = obs.q_pos.at[0, 0].set(-1)
    q = obs.q.at[:, 0, :, 0].set(1e3)
    masked = Observation(q, q_pos, None, obs.is_draft, obs.prompt_end)
    dropped = Observation(obs.q[:, :, :, 1:], obs.q_pos[:, 1:], None, None, obs.prompt_end)
    np.testing.assert_allclose(
        _score(rule, cache, masked)[:, 0], _score(rule, cache, dropped)[:, 0], rtol=1e-6
    )
    assert np.isinf(_score(rule, cache, masked)[:, 0, :, 16:]).all()
    assert np.isfinite(_score(rule, cache, masked)[:, 0, :, 15]).all()


# ----------------------------------------------------------------------------- PyramidKV


def test_pyramidkv_scores_are_snapkv_scores():
    lengths, S = (24, 18), 24
    cache, obs = _cache(lengths, S), _obs(lengths, 4)
    pyramid = PyramidKV(window=4, kernel=5, pooling="avg", gqa="max", beta=20)
    snap = SnapKV(window=4, kernel=5, pooling="avg", gqa="max")
    np.testing.assert_array_equal(_score(pyramid, cache, obs), _score(snap, cache, obs))
    budgets = pyramid.layer_schedule.layer_budgets(10, L)
    assert int(budgets.sum()) == 10 * L and budgets[0] > budgets[-1] >= 4


# ----------------------------------------------------------------------------- H2O


@pytest.mark.parametrize("gqa", ["mean", "max"])
@pytest.mark.parametrize("drafts", [0, 1])
def test_h2o_matches_reference(gqa, drafts):
    lengths, S, window, budget = (20, 14), 20, 3, 9
    cache = _cache(lengths, S, drafts=drafts)
    rng = np.random.default_rng(5)
    attn_sum = rng.random((L, B, HQ, S + drafts)).astype(np.float32)
    attn_sum = np.where(np.asarray(cache.pos)[:, :, :1] >= 0, attn_sum, 0.0)
    obs = _obs(lengths, 1, drafts=drafts, attn_sum=jnp.asarray(attn_sum))
    rule = H2O(window=window, gqa=gqa)
    assert rule.needs.attn_sum and rule.needs.window == 0
    kept = _kept_positions(select(_score(rule, cache, obs), budget), cache)
    for layer in range(L):
        for b, n in enumerate(lengths):
            _, key_pos, slots = _row(cache, layer, b)
            grouped = attn_sum[layer, b][:, slots].reshape(HKV, G, -1)
            ref = grouped.mean(1) if gqa == "mean" else grouped.max(1)
            recent = key_pos > (n - 1) - window  # last `window` prompt positions + drafts
            assert recent.sum() == window + drafts
            for h in range(HKV):
                expected = set(key_pos[recent].tolist()) | _top(
                    ref[h][~recent], key_pos[~recent], budget - recent.sum()
                )
                assert kept[(layer, b, h)] == expected


def test_gqa_mean_and_max_select_differently():
    # kv head 0's group: head a is spiky, head b flat. Slot 0: (1.0, 0.0); slot 1: (.45, .45).
    x = jnp.asarray([[1.0, 0.45, 0.1], [0.0, 0.45, 0.1]])[None, None]  # [1, 1, Hq=2, 3]
    mean, mx = gqa_aggregate(x, 1, "mean"), gqa_aggregate(x, 1, "max")
    np.testing.assert_allclose(mean[0, 0, 0], [0.5, 0.45, 0.1])
    np.testing.assert_allclose(mx[0, 0, 0], [1.0, 0.45, 0.1])
    x = jnp.asarray([[0.6, 0.45, 0.1], [0.0, 0.45, 0.1]])[None, None]
    assert int(jnp.argmax(gqa_aggregate(x, 1, "mean")[0, 0, 0])) == 1
    assert int(jnp.argmax(gqa_aggregate(x, 1, "max")[0, 0, 0])) == 0


# ----------------------------------------------------------------------------- StreamingLLM


@pytest.mark.parametrize("budget", [4, 6, 10])
def test_streamingllm_keeps_sinks_and_recent(budget):
    lengths, S = (16, 11), 16
    cache = _cache(lengths, S, drafts=1)
    kept = _kept_positions(select(_score(StreamingLLM(sinks=4), cache, None), budget), cache)
    for (_, b, _), positions in kept.items():
        total = lengths[b] + 1  # prompt + one draft entry
        recent = set(range(total - (budget - 4), total)) if budget > 4 else set()
        assert positions == set(range(4)) | recent


# ----------------------------------------------------------------------------- TOVA


@pytest.mark.parametrize("across_heads", [True, False])
@pytest.mark.parametrize("gqa", ["mean", "max"])
def test_tova_matches_reference(across_heads, gqa):
    lengths, S, budget = (18, 12), 18, 7
    cache, obs = _cache(lengths, S), _obs(lengths, 3)  # only the last query counts
    rule = TOVA(gqa=gqa, across_heads=across_heads)
    assert rule.needs.window == 1
    kept = _kept_positions(select(_score(rule, cache, obs), budget), cache)
    for layer in range(L):
        for b, n in enumerate(lengths):
            keys, key_pos, _ = _row(cache, layer, b)
            q_last = np.asarray(obs.q[layer, b, :, -1])  # [Hq, D] at position n - 1
            attn = _softmax(np.einsum("hd,hsd->hs", q_last, np.repeat(keys, G, 0)) / np.sqrt(D))
            if across_heads:  # kvpress TOVAPress: mean over all heads, repeated per kv head
                agg = attn.mean(0) if gqa == "mean" else attn.max(0)
                ref = np.repeat(agg[None], HKV, 0)
            else:
                grouped = attn.reshape(HKV, G, -1)
                ref = grouped.mean(1) if gqa == "mean" else grouped.max(1)
            for h in range(HKV):
                expected = {n - 1} | _top(ref[h][:-1], key_pos[:-1], budget - 1)
                assert kept[(layer, b, h)] == expected


# ----------------------------------------------------------------------------- controls


def test_keynorm_keeps_lowest_norms():
    lengths, S, budget = (10, 7), 10, 4
    cache = _cache(lengths, S)
    kept = _kept_positions(select(_score(KeyNorm(), cache, None), budget), cache)
    for layer in range(L):
        for b in range(B):
            keys, key_pos, _ = _row(cache, layer, b)
            for h in range(HKV):
                norms = np.linalg.norm(keys[h], axis=-1)
                assert kept[(layer, b, h)] == _top(-norms, key_pos, budget)


def test_random_is_seeded_and_deterministic():
    cache = _cache((10, 6), 10)
    a = _score(RandomScores(seed=3), cache, None)
    np.testing.assert_array_equal(a, RandomScores(seed=3).score(cache, None))  # eager == jit
    assert not np.array_equal(a, _score(RandomScores(seed=4), cache, None))
    valid = np.asarray(cache.valid())
    assert np.isneginf(a[~valid]).all() and ((a[valid] >= 0) & (a[valid] < 1)).all()
    keep = np.asarray(select(jnp.asarray(a), 3))
    assert (keep.sum(-1) == 3).all() and not (keep & ~valid).any()


def test_full_keeps_everything():
    cache = _cache((10, 6), 10, drafts=1)
    rule = FullKV()
    assert is_full(rule) and not is_full(SnapKV())
    scores = _score(rule, cache, None)
    keep = select(scores, 2)
    assert np.isposinf(np.asarray(scores)[np.asarray(cache.valid())]).all()
    # +inf everywhere: `select` would keep only the budget's most recent, hence the flag.
    assert (np.asarray(keep).sum(-1) == 2).all()


# ----------------------------------------------------------------------------- registry


def test_registry_and_make_rule():
    # Every rule file of dge_jax/rules/ registers its rule (the shared modules none), and
    # the registry holds nothing else: no list of names to keep in step.
    shared = {"__init__", "base", "ops", "registry", "wrapper"}
    folder = pathlib.Path(inspect.getsourcefile(make_rule)).parent
    stems = {p.stem for p in folder.glob("*.py")} - shared
    assert set(RULES) == {stem.replace("_", "") for stem in stems}
    assert {"full", "snapkv", "kvzip", "criticalkv"} <= set(RULES)
    assert make_rule("snapkv", window=8) == SnapKV(window=8)
    assert make_rule("PyramidKV", beta=10).beta == 10
    assert isinstance(make_rule("full"), FullKV)
    with pytest.raises(ValueError, match="known: chunkkv, .*full, h2o"):
        make_rule("snapkvv")
    with pytest.raises(ValueError, match="unknown option.*'windw'.*known"):
        make_rule("snapkv", windw=8)
    with pytest.raises(ValueError, match="kernel"):
        make_rule("snapkv", kernel=4)
    with pytest.raises(ValueError, match="gqa"):
        SnapKV(gqa="sum")


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: SnapKV(window=8.5), TypeError,
         r"SnapKV\.window must be an integer >= 1, got 8\.5"),
        (lambda: SnapKV(window=True), TypeError,
         r"SnapKV\.window must be an integer >= 1, got True"),
        (lambda: SnapKV(window=0), ValueError, r"SnapKV\.window must be an integer >= 1, got 0"),
        (lambda: SnapKV(kernel=5.0), TypeError, r"SnapKV\.kernel must be an integer >= 1"),
        (lambda: SnapKV(kernel=4), ValueError, r"SnapKV\.kernel must be a positive odd number"),
        (lambda: SnapKV(pooling="mean"), ValueError, r"SnapKV\.pooling must be one of \('max',"),
        (lambda: SnapKV(gqa=None), ValueError, r"SnapKV\.gqa must be one of \('mean', 'max'\)"),
        (lambda: PyramidKV(window="8"), TypeError, r"PyramidKV\.window must be an integer >= 1"),
        (lambda: PyramidKV(beta=0), ValueError, r"PyramidKV\.beta must be an integer >= 1"),
        (lambda: PyramidKV(beta=2.5), TypeError, r"PyramidKV\.beta must be an integer >= 1"),
        (lambda: H2O(window=-1), ValueError, r"H2O\.window must be an integer >= 0, got -1"),
        (lambda: H2O(window=np.float32(4)), TypeError, r"H2O\.window must be an integer >= 0"),
        (lambda: StreamingLLM(sinks=False), TypeError, r"StreamingLLM\.sinks must be an integer"),
        (lambda: StreamingLLM(sinks=-2), ValueError, r"StreamingLLM\.sinks must be .* >= 0"),
        (lambda: RandomScores(seed=-1), ValueError, r"seed must be an integer in \[0, 4294967295"),
        (lambda: RandomScores(seed=0.5), TypeError, r"RandomScores\.seed must be an integer in"),
        (lambda: TOVA(across_heads=1), TypeError, r"TOVA\.across_heads must be True or False"),
        (lambda: TOVA(gqa="sum"), ValueError, r"TOVA\.gqa must be one of \('mean', 'max'\)"),
    ],
)  # fmt: skip
def test_bad_rule_fields_fail_at_construction(make, error, message):
    """One line naming the field, the value and what is allowed, not a JAX trace later on."""
    with pytest.raises(error, match=message) as exc:
        make()
    assert "\n" not in str(exc.value)


def test_numpy_integer_fields_are_accepted_as_ints():
    rule = SnapKV(window=np.int64(8), kernel=np.int32(5))
    assert rule == SnapKV(window=8, kernel=5) and hash(rule) == hash(SnapKV(8, 5))
    assert type(rule.window) is int and type(rule.kernel) is int
    assert PyramidKV(beta=np.int16(10)).beta == 10
    assert H2O(window=np.uint8(0)).window == 0 and StreamingLLM(np.int64(2)).sinks == 2
    assert RandomScores(seed=np.uint32(2**32 - 1)).seed == 2**32 - 1
    assert TOVA(across_heads=np.bool_(False)).across_heads is False


def test_rules_are_static_jit_arguments():
    cache, obs = _cache((12, 9), 12), _obs((12, 9), 4)
    fn = jax.jit(lambda p, c, o: p.score(c, o), static_argnums=0)
    for name, options in [("snapkv", {"window": 4}), ("tova", {}), ("knorm", {})]:
        rule = make_rule(name, **options)
        assert hash(rule) == hash(make_rule(name, **options))
        out = fn(rule, cache, obs)
        assert out.shape == cache.pos.shape and out.dtype == jnp.float32
    fn(SnapKV(window=4), cache, obs)
    assert fn._cache_size() == 3
