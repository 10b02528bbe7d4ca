"""KeyDiff and LagKV (`dge_jax.rules.keydiff`, `dge_jax.rules.lagkv`) against NumPy
transcriptions of kvpress's
``KeyDiffPress.score`` and ``LagKVPress.score``, on hand-made left-padded caches: padding,
draft entries, prompts shorter than the budget or than the partitioning, and selection."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import jax_model

from dge_jax.eviction.evict import Eviction, select_for
from dge_jax.eviction.timing import Timing
from dge_jax.rules.keydiff import KeyDiff
from dge_jax.rules.lagkv import LagKV
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation

L, HKV, D = 2, 2, 8


def handmade(lengths, S: int, drafts: int = 0, seed: int = 0):
    """Row b: prompt positions 0..n_b-1 left-padded into slots [0, S), then `drafts` draft
    entries (positions n_b, ...) in slots S, S+1, ...; padded slots hold random junk."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    shape = (L, b, HKV, S + drafts, D)
    # The prompt part is drawn first, so a cache with drafts holds the same prompt entries.
    prompt = [rng.normal(size=(L, b, HKV, S, D)) for _ in "kv"]
    draft = [rng.normal(size=(L, b, HKV, drafts, D)) for _ in "kv"]
    k, v = (np.concatenate(pair, 3).astype(np.float32) for pair in zip(prompt, draft, strict=True))
    pos = np.full(shape[:-1], -1, np.int32)
    for row, n in enumerate(lengths):
        pos[:, row, :, S - n : S] = np.arange(n)
        pos[:, row, :, S:] = n + np.arange(drafts)
    cache = KVCache.stacked(jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos), S + drafts)
    obs = Observation(
        q=None, q_pos=None, attn_sum=None, is_draft=None,
        prompt_end=jnp.asarray([n - 1 for n in lengths], jnp.int32),
    )  # fmt: skip
    return cache, obs, k, v, pos


@functools.partial(jax.jit, static_argnums=0)
def scores_of(rule, cache, obs):
    return rule.score(cache, obs)


def prompt_slots(pos: np.ndarray, layer: int, row: int, n: int) -> np.ndarray:
    """Slots of one row's prompt entries, in position order."""
    return np.flatnonzero((pos[layer, row, 0] >= 0) & (pos[layer, row, 0] < n))


# ------------------------------------------------------------------------------ references


def keydiff_reference(keys: np.ndarray) -> np.ndarray:
    """kvpress KeyDiffPress.score: keys [H, n, D] -> [H, n]."""
    unit = keys / np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), 1e-12)
    anchor = unit.mean(axis=1, keepdims=True)
    cos = (keys * anchor).sum(-1) / np.maximum(
        np.linalg.norm(keys, axis=-1) * np.linalg.norm(anchor, axis=-1), 1e-8
    )
    return -cos


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def lagkv_reference(keys, values, n_sink, lag, cross_scoring=False) -> np.ndarray:
    """kvpress LagKVPress.score, transcribed: keys, values [H, n, D] -> [H, n]."""
    h, n, d = keys.shape
    if n < n_sink + 2 * lag:
        score = np.ones((h, n))
        if n > n_sink:
            score[:, n_sink:] = np.arange(n - n_sink) / (n - n_sink)
        return score
    end = n_sink + ((n - n_sink) // lag) * lag
    tail = lag + n - end

    def states(x):  # [H, P, lag, D]
        ref, target = x[:, 1:], x[:, :-1]
        low = ref.min(axis=-2, keepdims=True)
        high = ref.max(axis=-2, keepdims=True)
        return _softmax(((target - low) / (high - low)).std(axis=-1, ddof=1))

    part = lambda x: x[:, n_sink:end].reshape(h, -1, lag, d)  # noqa: E731
    score = (states(part(keys)) + states(part(values))) / 2
    if not cross_scoring:
        score = score.argsort(-1).argsort(-1) / lag
    return np.concatenate([np.ones((h, n_sink)), score.reshape(h, -1), np.ones((h, tail))], -1)


# ------------------------------------------------------------------------------ KeyDiff


def test_keydiff_matches_kvpress_on_padded_rows():
    lengths, S = (20, 13), 24
    cache, obs, k, _, pos = handmade(lengths, S)
    got = np.asarray(scores_of(KeyDiff(), cache, obs))
    for layer in range(L):
        for row, n in enumerate(lengths):
            slots = prompt_slots(pos, layer, row, n)
            want = keydiff_reference(k[layer, row][:, slots])
            np.testing.assert_allclose(got[layer, row][:, slots], want, rtol=1e-5, atol=1e-6)
            padded = np.setdiff1d(np.arange(S), slots)
            assert np.all(got[layer, row][:, padded] == -np.inf)  # never kept


def test_keydiff_ignores_padding_and_draft_entries():
    """Junk in padded slots and draft entries change no prompt entry's score: the anchor is
    the prompt's, so DGE's cache scores its prompt exactly as prefill's does."""
    lengths, S = (20, 13), 24
    cache, obs, *_ = handmade(lengths, S, seed=0)
    drafted, dobs, *_ = handmade(lengths, S, drafts=2, seed=0)
    junk = cache.k.at[:, 1, :, :5].set(100.0)  # row 1's padding (11 slots)
    cache_junk = KVCache.stacked(junk, cache.v, cache.pos, S)
    a = np.asarray(scores_of(KeyDiff(), cache, obs))
    b = np.asarray(scores_of(KeyDiff(), cache_junk, obs))
    c = np.asarray(scores_of(KeyDiff(), drafted, dobs))[..., :S]
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)  # summation order of S vs S + 2


def test_keydiff_keeps_the_most_distinctive_keys():
    """Hand-made: three near-copies of one key and one orthogonal key; budget 1 keeps the
    orthogonal one (least similar to the mean direction)."""
    k = np.zeros((1, 1, 1, 4, 2), np.float32)
    k[..., 0, :] = [1, 0.01]
    k[..., 1, :] = [1, -0.01]
    k[..., 2, :] = [0, 1]  # the distinctive one
    k[..., 3, :] = [1, 0]
    pos = np.arange(4, dtype=np.int32).reshape(1, 1, 1, 4)
    cache = KVCache.stacked(jnp.asarray(k), jnp.asarray(k), jnp.asarray(pos), 4)
    obs = Observation(None, None, None, None, prompt_end=jnp.asarray([3], jnp.int32))
    keep = select_for(cache, obs, None, jnp.int32(1), jnp.asarray(False), rule=KeyDiff())
    assert np.asarray(keep)[0, 0, 0].tolist() == [False, False, True, False]


# ------------------------------------------------------------------------------ LagKV


@pytest.mark.parametrize("cross_scoring", [False, True])
@pytest.mark.parametrize("lengths", [(43, 37), (28, 12)])  # partitioned; 28/12 are short
def test_lagkv_matches_kvpress_on_padded_rows(lengths, cross_scoring):
    """sinks 3, lag 8: 43 = 3 + 5·8 (no remainder), 37 = 3 + 4·8 + 2; lag 16: 28 and 12 are
    shorter than sinks + 2·lag, scored by recency."""
    S = 48
    rule = LagKV(sinks=3, lag_size=8 if lengths[0] > 30 else 16, cross_scoring=cross_scoring)
    cache, obs, k, v, pos = handmade(lengths, S, seed=2)
    got = np.asarray(scores_of(rule, cache, obs))
    for layer in range(L):
        for row, n in enumerate(lengths):
            slots = prompt_slots(pos, layer, row, n)
            want = lagkv_reference(
                k[layer, row][:, slots], v[layer, row][:, slots], rule.sinks, rule.lag_size,
                cross_scoring,
            )  # fmt: skip
            np.testing.assert_allclose(got[layer, row][:, slots], want, rtol=1e-5, atol=1e-6)


def test_lagkv_keeps_each_partitions_share_sinks_and_tail():
    """Without cross scoring every scored partition ranks its own entries 0..lag-1 / lag, so a
    budget keeps the sinks, the tail and the same number from each partition."""
    n, S, sinks, lag = 3 + 4 * 8 + 5, 48, 3, 8  # partitions 0..2 scored, 3 + remainder = tail
    cache, obs, *_ = handmade((n,), S, seed=4)
    tail = lag + 5
    budget = sinks + tail + 3 * 2  # two per scored partition
    keep = select_for(
        cache, obs, None, jnp.int32(budget), jnp.asarray(False), rule=LagKV(sinks, lag)
    )
    pos = np.asarray(cache.pos)
    for layer in range(L):
        for head in range(HKV):
            kept = pos[layer, 0, head][np.asarray(keep)[layer, 0, head]]
            assert set(range(sinks)) <= set(kept) and set(range(n - tail, n)) <= set(kept)
            for j in range(3):
                lo = sinks + j * lag
                assert np.sum((kept >= lo) & (kept < lo + lag)) == 2, (layer, head, j)


def test_lagkv_ignores_draft_entries():
    lengths, S = (43, 37), 48
    cache, obs, *_ = handmade(lengths, S, seed=2)
    drafted, dobs, *_ = handmade(lengths, S, drafts=3, seed=2)
    rule = LagKV(sinks=3, lag_size=8)
    a = np.asarray(scores_of(rule, cache, obs))
    b = np.asarray(scores_of(rule, drafted, dobs))[..., :S]
    np.testing.assert_array_equal(a, b)


def test_prompt_shorter_than_budget_keeps_everything():
    lengths, S = (20, 13), 24
    cache, obs, *_ = handmade(lengths, S)
    for rule in (KeyDiff(), LagKV(sinks=2, lag_size=4)):
        keep = select_for(cache, obs, None, jnp.int32(20), jnp.asarray(False), rule=rule)
        np.testing.assert_array_equal(np.asarray(keep), np.asarray(cache.pos) >= 0)


def test_query_free_rules_select_alike_under_every_timing(tiny_model_fixture):
    """DGE and DGE-W observe nothing these rules read: all three timings keep the same prompt
    entries (plus, after the draft, the draft entries)."""
    from dge_jax.generation import generate_grid

    model = tiny_model_fixture
    prompts = [np.random.default_rng(n).integers(0, 128, n).tolist() for n in (44, 30)]
    timings = (Timing("prefill", 1), Timing("dge", 2), Timing("dge_w", 2), Timing("dge", 3))
    for rule in (KeyDiff(), LagKV(sinks=2, lag_size=8)):
        cells = [Eviction(rule, 16, t, capacity=64) for t in timings]
        results = generate_grid(model, prompts, cells, max_new_tokens=4)
        base = results[0].kept
        for ev, res in zip(cells[1:], results[1:], strict=True):
            for row, n in enumerate((44, 30)):
                for layer, base_layer in zip(res.kept[row], base[row], strict=True):
                    for head, base_head in zip(layer, base_layer, strict=True):
                        prompt_part = [p for p in head if p < n]
                        drafts = ev.timing.draft_steps
                        assert head[len(prompt_part) :] == list(range(n, n + drafts))
                        # the budget counts drafts: DGE keeps prefill's top (16 - drafts)
                        assert set(prompt_part) <= set(base_head), (rule, ev.timing)
                        assert len(prompt_part) == 16 - drafts


@pytest.fixture(scope="module")
def tiny_model_fixture():
    return jax_model()
