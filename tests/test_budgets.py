"""Budget specs, AdaKV head budgets and the PyramidKV schedule against plain-numpy references."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dge_jax.eviction.budgets import _floor_times, adakv_budgets, expand_budgets
from dge_jax.rules.base import PyramidSchedule
from dge_jax.rules.pyramidkv import PyramidKV
from dge_jax.runtime.selection import select_slots

L, B, H = 3, 2, 4


# ----------------------------------------------------------------------------- expand_budgets


def test_expand_budgets_specs():
    np.testing.assert_array_equal(expand_budgets(5, L, B, H), np.full((L, B, H), 5))
    per_layer = np.array([7, 5, 3])
    np.testing.assert_array_equal(
        expand_budgets(per_layer, L, B, H), np.broadcast_to(per_layer[:, None, None], (L, B, H))
    )
    per_head = np.arange(L * H).reshape(L, H)
    np.testing.assert_array_equal(
        expand_budgets(per_head, L, B, H), np.broadcast_to(per_head[:, None, :], (L, B, H))
    )
    full = np.arange(L * B * H).reshape(L, B, H)
    out = expand_budgets(full, L, B, H)
    np.testing.assert_array_equal(out, full)
    assert out.dtype == jnp.int32


def test_expand_budgets_rejects_bad_specs():
    with pytest.raises(ValueError, match="none of scalar"):
        expand_budgets(np.ones(L + 1, np.int32), L, B, H)
    with pytest.raises(ValueError, match="none of scalar"):
        expand_budgets(np.ones((H, L), np.int32), L, B, H)
    with pytest.raises(TypeError):
        expand_budgets(3.5, L, B, H)


def test_expand_budgets_traced():
    fn = jax.jit(lambda spec: expand_budgets(spec, L, B, H))
    for budget in (8, 16):
        np.testing.assert_array_equal(fn(jnp.int32(budget)), np.full((L, B, H), budget))
    assert fn._cache_size() == 1


# ----------------------------------------------------------------------------- AdaKV


def _kvpress_adakv_keep(scores: np.ndarray, n_kept: int, alpha: float) -> np.ndarray:
    """kvpress AdaKVPress.compress, one layer: scores [B, H, S] -> keep mask [B, H, S]."""
    bsz, heads, k_len = scores.shape
    scores = scores.copy()
    n_safe = int(n_kept * alpha)
    # top n_safe per head -> finfo.max (torch.topk(...).indices; scatter_)
    top = np.argsort(-scores, axis=-1, kind="stable")[..., :n_safe]
    np.put_along_axis(scores, top, np.finfo(scores.dtype).max, axis=-1)
    # prune the bottom H * (k_len - n_kept) over all heads jointly
    n_pruned = heads * (k_len - n_kept)
    flat = scores.reshape(bsz, -1)
    pruned = np.argsort(flat, axis=-1, kind="stable")[:, :n_pruned]
    keep = np.ones_like(flat, bool)
    np.put_along_axis(keep, pruned, False, axis=-1)
    return keep.reshape(bsz, heads, k_len)


def _snapkv_like_scores(seed: int, S: int, window: int, spread: bool = True) -> np.ndarray:
    """[L, B, H, S] random scores, heads on different scales, last ``window`` slots protected
    (kvpress marks them max + 1, dge_jax +inf; the tests swap one for the other)."""
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.05, 3.0, size=(L, B, H, 1)) if spread else 1.0
    s = (rng.random((L, B, H, S)) * scale).astype(np.float32)
    s[..., S - window :] = np.inf
    return s


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.0])
@pytest.mark.parametrize("budget", [6, 10, 17])
def test_adakv_matches_kvpress(alpha, budget):
    S, window = 24, 4
    ours = _snapkv_like_scores(0, S, window)
    theirs = ours.copy()
    finite_max = theirs[np.isfinite(theirs)].max()
    theirs[np.isinf(theirs)] = finite_max + 1
    counts = np.asarray(adakv_budgets(jnp.asarray(ours), budget, alpha))
    keep = np.asarray(select_slots(jnp.asarray(ours), counts))
    for layer in range(L):
        expected = _kvpress_adakv_keep(theirs[layer], budget, alpha)
        np.testing.assert_array_equal(keep[layer], expected)
        np.testing.assert_array_equal(counts[layer], expected.sum(-1))
    assert (counts.sum(-1) == H * budget).all()
    assert (counts >= min(int(budget * alpha), S)).all()


def test_adakv_floor_matters():
    # The worked example of budgets.adakv_budgets: head 1 gets its floor and nothing more.
    s = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4], [0.3, 0.2, 0.1, 0.0, 0.0, 0.0]], np.float32)
    scores = jnp.asarray(s)[None, None]
    np.testing.assert_array_equal(adakv_budgets(scores, 3, alpha=0.5)[0, 0], [5, 1])
    np.testing.assert_array_equal(adakv_budgets(scores, 3, alpha=0.0)[0, 0], [6, 0])


def test_adakv_per_layer_budgets_traced_and_padding():
    S, window = 20, 3
    s = _snapkv_like_scores(1, S, window)
    s[:, 1, :, :5] = -np.inf  # row 1 is left-padded: 15 valid slots
    fn = jax.jit(adakv_budgets)
    for layer_budgets in ([8, 6, 4], [12, 9, 5]):
        counts = np.asarray(fn(jnp.asarray(s), jnp.asarray(layer_budgets, jnp.int32)))
        np.testing.assert_array_equal(
            counts.sum(-1), np.repeat(H * np.array(layer_budgets)[:, None], B, 1)
        )
    assert fn._cache_size() == 1
    # A pool larger than the valid slots gives every head all its valid slots.
    counts = np.asarray(adakv_budgets(jnp.asarray(s), 19))
    np.testing.assert_array_equal(counts[:, 0].sum(-1), H * 19)
    np.testing.assert_array_equal(counts[:, 1], 15)


@pytest.mark.parametrize("alpha", [0.1, 0.2, 0.25, 0.5])
def test_floor_times_matches_python_int(alpha):
    n = np.arange(0, 4097, dtype=np.int32)
    expected = np.array([int(x * alpha) for x in n])
    np.testing.assert_array_equal(_floor_times(jnp.asarray(n), alpha), expected)


# ----------------------------------------------------------------------------- PyramidKV


def _kvcache_factory_schedule(budget: int, window: int, num_layers: int, beta: int = 20):
    """KVCache-Factory PyramidKVCluster (prompt-length rules aside): [L] kept per layer."""
    min_num = (budget - window) // beta
    max_num = (budget - window) * 2 - min_num
    steps = (max_num - min_num) // (num_layers - 1)
    return np.array([window + max_num - i * steps for i in range(num_layers)])


def _exact_line(budget: int, window: int, num_layers: int, beta: int = 20):
    min_num = (budget - window) // beta
    max_num = (budget - window) * 2 - min_num
    step = (max_num - min_num) / (num_layers - 1)
    return window + max_num - step * np.arange(num_layers)


@pytest.mark.parametrize("num_layers", [2, 4, 7, 30])
@pytest.mark.parametrize("window", [8, 32])
def test_pyramid_schedule_against_kvcache_factory(num_layers, window):
    rule = PyramidKV(window=window)
    assert rule.layer_schedule == PyramidSchedule(window=window, beta=20)
    fn = jax.jit(rule.layer_schedule.layer_budgets, static_argnums=1)
    exact_cases = 0
    for budget in range(window + 1, window + 400, 7):
        ours = np.asarray(fn(jnp.int32(budget), num_layers))
        kvcf = _kvcache_factory_schedule(budget, window, num_layers)
        assert ours.sum() == num_layers * budget  # total preserved
        min_num = (budget - window) // 20
        # Same bottom layer; the top is KVCache-Factory's intended min_num (its floored step
        # lands above it, which is where its total overshoots L·budget).
        assert ours[0] == kvcf[0] and ours[-1] == window + min_num <= kvcf[-1]
        assert (ours >= window).all()
        assert np.abs(ours - _exact_line(budget, window, num_layers)).max() < 1
        if (2 * (budget - window - min_num)) % (num_layers - 1) == 0:
            np.testing.assert_array_equal(ours, kvcf)  # KVCache-Factory's step is exact here
            exact_cases += 1
    assert exact_cases > 0
    assert fn._cache_size() == 1  # traced budget: one compile for the whole sweep


def test_pyramid_schedule_worked_example_and_small_budgets():
    schedule = PyramidKV(window=8).layer_schedule
    np.testing.assert_array_equal(schedule.layer_budgets(40, 4), [71, 51, 29, 9])
    np.testing.assert_array_equal(schedule.layer_budgets(8, 4), [8, 8, 8, 8])  # no pyramid room
    np.testing.assert_array_equal(schedule.layer_budgets(5, 3), [5, 5, 5])
    np.testing.assert_array_equal(schedule.layer_budgets(64, 1), [64])
