"""The one cache layout: a tuple of layer groups, stacked [Lg, B, Hkv, S, ...] each.

Hand-made caches: every grouping of the same layers answers the same questions, regrouping
moves no entry, and compaction gives one group per run of layers of one capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dge_jax.runtime.cache import KVCache, group_bounds, init_cache, regroup, runs_of_equal
from dge_jax.runtime.compaction import compact

L, B, HKV, S, D = 4, 2, 2, 6, 3


def _cache() -> KVCache:
    """Layer l, row b, head h holds positions 0..n-1 with n = 2 + (l + b + h) % 4."""
    rng = np.random.default_rng(0)
    k = rng.normal(size=(L, B, HKV, S, D)).astype(np.float32)
    pos = np.full((L, B, HKV, S), -1, np.int32)
    for idx in np.ndindex(L, B, HKV):
        n = 2 + sum(idx) % 4
        pos[idx][:n] = np.arange(n)
    return KVCache.stacked(jnp.asarray(k), jnp.asarray(2 * k), jnp.asarray(pos), 5)


def test_runs_of_equal_and_group_bounds():
    assert runs_of_equal((8, 8, 4, 4, 4, 8)) == (2, 3, 1)
    assert runs_of_equal((5,)) == (1,) and runs_of_equal(()) == ()
    assert group_bounds((2, 3, 1)) == [0, 2, 5, 6]


def test_a_fresh_cache_is_one_group_with_an_index_per_layer():
    cache = init_cache(L, B, HKV, S, D)
    assert cache.group_sizes == (L,) and cache.capacities == (S,) * L and not cache.ragged
    assert (cache.num_layers, cache.batch_size, cache.capacity) == (L, B, S)
    np.testing.assert_array_equal(cache.index, np.zeros(L))
    assert cache.pos.shape == (L, B, HKV, S) and not np.asarray(cache.valid()).any()
    assert cache.nbytes() == 2 * L * B * HKV * S * D * 4 + L * B * HKV * S * 4


@pytest.mark.parametrize("sizes", [(1, 1, 1, 1), (1, 3), (2, 2), (3, 1)])
def test_every_grouping_answers_the_same_questions(sizes):
    one = _cache()
    grouped = regroup(one, sizes)
    assert grouped.group_sizes == sizes
    assert [g.k.shape[0] for g in grouped.groups] == list(sizes)
    for name in ("k", "v", "pos", "index"):
        np.testing.assert_array_equal(getattr(grouped, name), getattr(one, name))
    np.testing.assert_array_equal(grouped.num_kept(), one.num_kept())
    np.testing.assert_array_equal(grouped.valid(), one.valid())
    assert grouped.nbytes() == one.nbytes()
    back = regroup(grouped, (L,))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(one), strict=True):
        np.testing.assert_array_equal(a, b)
    again = regroup(grouped, (2, 2))  # across groups: pieces of several are concatenated
    np.testing.assert_array_equal(again.pos, one.pos)


def test_regroup_to_its_own_grouping_is_the_same_object():
    cache = regroup(_cache(), (1, 3))
    assert regroup(cache, (1, 3)) is cache


def test_per_group_and_with_pos_follow_the_groups():
    cache = regroup(_cache(), (1, 3))
    x = jnp.arange(L * 2).reshape(L, 2)
    pieces = cache.per_group(x)
    assert [p.tolist() for p in pieces] == [[[0, 1]], [[2, 3], [4, 5], [6, 7]]]
    emptied = cache.with_pos(jnp.where(cache.pos >= 1, -1, cache.pos))
    assert emptied.group_sizes == (1, 3)
    np.testing.assert_array_equal(emptied.num_kept(), np.ones((L, B, HKV)))
    np.testing.assert_array_equal(emptied.groups[1].k, cache.groups[1].k)  # k, v untouched


def test_bad_groupings_are_clear_errors():
    cache = _cache()
    with pytest.raises(ValueError, match=r"group sizes \(1, 2\) do not split the cache's 4"):
        regroup(cache, (1, 2))
    ragged = compact(cache, (8, 8, 4, 8))
    assert ragged.group_sizes == (2, 1, 1) and ragged.capacities == (8, 8, 4, 8)
    with pytest.raises(ValueError, match=r"layers 1..2 hold different numbers of slots"):
        regroup(ragged, (1, 2, 1))
    with pytest.raises(ValueError, match="cache.k stacks every layer"):
        _ = ragged.k


def test_compaction_gives_one_group_per_run_of_one_capacity():
    cache = _cache()
    ragged = compact(cache, (6, 6, 5, 8))
    assert ragged.group_sizes == (2, 1, 1) and ragged.capacities == (6, 6, 5, 8)
    counts = np.asarray(cache.num_kept())  # at most 5 per head, so every capacity fits
    np.testing.assert_array_equal(ragged.num_kept(), counts)
    np.testing.assert_array_equal(ragged.index, counts.max(axis=(1, 2)))
    uniform = compact(cache, 8)  # one capacity: one group, one shared next slot
    assert uniform.group_sizes == (L,)
    np.testing.assert_array_equal(uniform.index, [counts.max()] * L)
    for layer, (g, i) in enumerate([(0, 0), (0, 1), (1, 0), (2, 0)]):
        cap = ragged.capacities[layer]
        np.testing.assert_array_equal(ragged.groups[g].pos[i], uniform.pos[layer, ..., :cap])
        np.testing.assert_array_equal(ragged.groups[g].k[i], uniform.k[layer, ..., :cap, :])


def test_compacting_a_grouped_cache_equals_compacting_one_group():
    one = _cache()
    for sizes in ((1, 1, 1, 1), (1, 3)):
        grouped = regroup(one, sizes)
        for capacity in (5, (6, 6, 5, 8)):
            a, b = compact(grouped, capacity), compact(one, capacity)
            assert a.group_sizes == b.group_sizes
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
                np.testing.assert_array_equal(x, y)
