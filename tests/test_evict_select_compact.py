"""Selection, masking (dge_jax/runtime/selection.py) and compaction (dge_jax/runtime/cache.py)
on tiny hand-made caches."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dge_jax.runtime.cache import KVCache, regroup
from dge_jax.runtime.compaction import check_capacity, compact
from dge_jax.runtime.selection import apply_keep, select_slots, top_mask

L, B, HKV, G, S, D = 2, 2, 2, 2, 12, 4


def _cache(seed: int = 0, lengths=(12, 7), spare: int = 0) -> KVCache:
    """Left-padded cache: row b holds positions 0..n_b-1 in its last n_b slots of S."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(L, B, HKV, S + spare, D)).astype(np.float32)
    v = rng.normal(size=(L, B, HKV, S + spare, D)).astype(np.float32)
    pos = np.full((L, B, HKV, S + spare), -1, np.int32)
    for b, n in enumerate(lengths):
        pos[:, b, :, S - n : S] = np.arange(n)
    return KVCache.stacked(jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos), S)


def _scores(cache: KVCache, seed: int = 1) -> jax.Array:
    rng = np.random.default_rng(seed)
    s = rng.normal(size=cache.pos.shape).astype(np.float32)
    return jnp.where(cache.pos >= 0, s, -jnp.inf)


def _attend(q: jax.Array, q_pos: jax.Array, cache: KVCache) -> jax.Array:
    """Masked attention of one query per row: q [L, B, Hq, D], q_pos [B] -> [L, B, Hq, D]."""
    qg = q.reshape(L, B, HKV, G, D)
    logits = jnp.einsum("lbhgd,lbhsd->lbhgs", qg, cache.k) / np.sqrt(D)
    mask = (cache.pos >= 0) & (cache.pos <= q_pos[None, :, None, None])
    logits = jnp.where(mask[:, :, :, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("lbhgs,lbhsd->lbhgd", probs, cache.v).reshape(L, B, HKV * G, D)


def _ranked_keep(scores: np.ndarray, budgets: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Reference: rank each row's candidates (highest score first, equal scores later slot
    first) with a sort, keep ranks below the budget."""
    keep = np.zeros(scores.shape, bool)
    for idx in np.ndindex(scores.shape[:-1]):
        slots = np.flatnonzero(candidate[idx])
        # lexsort sorts by the last key first: score descending, then slot descending.
        order = slots[np.lexsort((-slots, -scores[idx][slots].astype(np.float64)))]
        keep[idx][order[: max(int(budgets[idx]), 0)]] = True
    return keep


def test_top_mask_breaks_ties_towards_later_slot():
    def top(scores, budget):
        s = jnp.array(scores, jnp.float32)
        return np.asarray(top_mask(s, jnp.array(budget), s > -jnp.inf)).astype(int).tolist()

    assert top([1.0, 3.0, 3.0, 0.0], 1) == [0, 0, 1, 0]
    assert top([1.0, 3.0, 3.0, 0.0], 2) == [0, 1, 1, 0]
    assert top([1.0, 3.0, 3.0, 0.0], 3) == [1, 1, 1, 0]
    assert top([jnp.inf, jnp.inf, 2.0, -jnp.inf, -jnp.inf], 1) == [0, 1, 0, 0, 0]
    assert top([jnp.inf, jnp.inf, 2.0, -jnp.inf, -jnp.inf], 9) == [1, 1, 1, 0, 0]
    assert top([0.0, -0.0, 0.0, -1.0], 2) == [0, 1, 1, 0]  # the two zeros tie
    assert top([5.0, 4.0], 0) == [0, 0]


@pytest.mark.parametrize("pool", ["normal", "ties"])
def test_top_mask_equals_ranking_by_sort(pool):
    # Many rows of random length, budgets from 0 to past the candidate count; "ties" draws
    # from a few values (signed zeros, infinities, float extremes) so most rows tie at the
    # threshold.
    # Each row's length n < 50 is its candidates' extent: slots from n on are padding (never
    # candidates), so one compiled top_mask serves every trial.
    rng = np.random.default_rng(7)
    values = np.array([0.0, -0.0, 1.0, -1.0, 2.5, np.inf, -np.inf, 1e-30, -3e38, 3e38], np.float32)
    top = jax.jit(top_mask)
    for trial in range(40):
        n, shape = int(rng.integers(1, 50)), (3, 4, 50)
        if pool == "ties":
            scores = rng.choice(values, size=shape)
        else:
            scores = rng.normal(size=shape).astype(np.float32)
        candidate = (rng.random(shape) < 0.8) & (scores > -np.inf) & (np.arange(50) < n)
        budgets = rng.integers(-1, n + 2, size=shape[:-1]).astype(np.int32)
        got = np.asarray(top(jnp.asarray(scores), jnp.asarray(budgets), jnp.asarray(candidate)))
        np.testing.assert_array_equal(got, _ranked_keep(scores, budgets, candidate), str(trial))
    assert top._cache_size() == 1


@pytest.mark.parametrize("budget", [0, 1, 3, 7, 12, 20])
def test_select_keeps_top_budget_valid_slots(budget):
    cache = _cache()
    scores = _scores(cache)
    keep = np.asarray(select_slots(scores, budget))
    s, valid = np.asarray(scores), np.asarray(cache.valid())
    assert not (keep & ~valid).any()  # never an empty slot
    for idx in np.ndindex(L, B, HKV):
        n_valid = valid[idx].sum()
        assert keep[idx].sum() == min(budget, n_valid)  # everything when the head fits
        expected = np.argsort(-s[idx], kind="stable")[: min(budget, n_valid)]
        np.testing.assert_array_equal(np.flatnonzero(keep[idx]), np.sort(expected))


def test_select_per_head_budgets_and_valid_mask():
    cache = _cache()
    scores = _scores(cache)
    budgets = jnp.asarray(np.arange(L * B * HKV).reshape(L, B, HKV) + 2, jnp.int32)
    keep = np.asarray(select_slots(scores, budgets))
    counts = keep.sum(-1)
    np.testing.assert_array_equal(counts, np.minimum(budgets, cache.num_kept()))
    # An explicit valid mask wins over finite scores in empty slots.
    finite = jnp.where(cache.pos >= 0, scores, 100.0)
    keep2 = np.asarray(select_slots(finite, budgets, valid=cache.valid()))
    np.testing.assert_array_equal(keep2, keep)


def test_select_tie_keeps_later_slots():
    scores = jnp.zeros((1, 1, 1, 6), jnp.float32).at[..., 0].set(5.0)
    keep = np.asarray(select_slots(scores, 3))[0, 0, 0]
    np.testing.assert_array_equal(keep, [True, False, False, False, True, True])


def test_select_rejects_ambiguous_budget_shapes():
    scores = _scores(_cache())
    with pytest.raises(ValueError, match="expand_budgets"):
        select_slots(scores, jnp.ones((L,), jnp.int32))
    with pytest.raises(TypeError):
        select_slots(scores, 3.0)


def test_select_compiles_once_over_budgets():
    traces = []

    def counted(scores, budget):
        traces.append(1)  # runs only while tracing
        return select_slots(scores, budget)

    fn = jax.jit(counted)
    rng = np.random.default_rng(2)
    scores = jnp.asarray(rng.normal(size=(L, B, HKV, 320)), jnp.float32)
    kept = [int(fn(scores, budget).sum()) for budget in (32, 64, 128, 256)]
    assert len(traces) == 1
    assert fn._cache_size() == 1
    assert kept == [L * B * HKV * b for b in (32, 64, 128, 256)]  # the budget is live


def test_apply_keep_masks_only_pos():
    cache = _cache()
    keep = select_slots(_scores(cache), 4)
    out = apply_keep(cache, keep)
    np.testing.assert_array_equal(out.pos, np.where(keep, cache.pos, -1))
    np.testing.assert_array_equal(out.k, cache.k)
    assert out.capacity == cache.capacity
    np.testing.assert_array_equal(out.index, cache.index)
    np.testing.assert_array_equal(out.num_kept(), np.asarray(keep).sum(-1))


def test_compact_keeps_position_order_and_sets_index():
    cache = _cache()
    budgets = jnp.asarray([[[5, 3], [2, 6]], [[4, 4], [1, 7]]], jnp.int32)
    masked = apply_keep(cache, select_slots(_scores(cache), budgets))
    out = compact(masked, 8)
    assert out.capacity == 8
    pos = np.asarray(out.pos)
    counts = np.asarray(masked.num_kept())
    for idx in np.ndindex(L, B, HKV):
        n = counts[idx]
        kept_pos = np.sort(np.asarray(masked.pos)[idx][np.asarray(masked.pos)[idx] >= 0])
        np.testing.assert_array_equal(pos[idx][:n], kept_pos)  # first n slots, ascending
        assert (pos[idx][n:] == -1).all()
        assert (np.asarray(out.k)[idx][n:] == 0).all()
    assert np.asarray(out.index).tolist() == [counts.max()] * L == [7] * L  # one shared slot
    assert check_capacity(masked, 8) == 7
    assert check_capacity(np.asarray(masked.valid()), 8, new_tokens=1) == 8
    with pytest.raises(ValueError, match="capacity is 7"):
        check_capacity(counts, 7, new_tokens=1)


def test_compact_matches_masked_attention_and_decode_append():
    cache = _cache(spare=1)  # slot S stays free for one decode step in the masked cache
    rng = np.random.default_rng(3)
    budgets = jnp.asarray(rng.integers(1, 8, size=(L, B, HKV)), jnp.int32)
    masked = apply_keep(cache, select_slots(_scores(cache), budgets))
    out = compact(masked, 9)  # 9 >= max budget (7) + 1 new token
    q = jnp.asarray(rng.normal(size=(L, B, HKV * G, D)), jnp.float32)
    last = jnp.asarray([11, 6], jnp.int32)
    np.testing.assert_allclose(_attend(q, last, masked), _attend(q, last, out), atol=1e-6)

    # One decode step at positions 12 / 7: masked writes slot S, compacted writes slot index.
    new_k = jnp.asarray(rng.normal(size=(L, B, HKV, D)), jnp.float32)
    new_v = jnp.asarray(rng.normal(size=(L, B, HKV, D)), jnp.float32)
    new_pos = jnp.broadcast_to((last + 1)[None, :, None], (L, B, HKV))

    def write(c: KVCache, slot) -> KVCache:
        return KVCache.stacked(
            c.k.at[:, :, :, slot].set(new_k),
            c.v.at[:, :, :, slot].set(new_v),
            c.pos.at[:, :, :, slot].set(new_pos),
            c.index + 1,
        )

    masked2, out2 = write(masked, S), write(out, out.index[0])
    assert int(out.index[0]) <= 8
    np.testing.assert_allclose(_attend(q, last + 1, masked2), _attend(q, last + 1, out2), atol=1e-6)
    for idx in np.ndindex(L, B, HKV):  # still sorted by position within every head
        p = np.asarray(out2.pos)[idx]
        assert (np.diff(p[p >= 0]) > 0).all()


def test_compact_grows_capacity_and_jits():
    cache = _cache()
    out = jax.jit(compact, static_argnums=1)(cache, S + 4)
    assert out.capacity == S + 4 and np.asarray(out.index).tolist() == [S] * L
    np.testing.assert_array_equal(out.num_kept(), cache.num_kept())
    q = jnp.asarray(np.random.default_rng(4).normal(size=(L, B, HKV * G, D)), jnp.float32)
    last = jnp.asarray([11, 6], jnp.int32)
    np.testing.assert_allclose(_attend(q, last, cache), _attend(q, last, out), atol=1e-6)


@pytest.mark.parametrize("shuffled", [False, True])
def test_compact_orders_by_position_with_k_v_following(shuffled):
    # The usual cache has its valid slots in position order (compact partitions it); a
    # shuffled one takes the sorting path. Either way slot j holds the j-th kept position,
    # with that entry's own key and value.
    cache = apply_keep(_cache(), select_slots(_scores(_cache()), 5))
    if shuffled:
        perm = np.random.default_rng(5).permutation(S)
        cache = KVCache.stacked(cache.k[..., perm, :], cache.v[..., perm, :],
                                cache.pos[..., perm], cache.index)  # fmt: skip
    out = jax.jit(compact, static_argnums=1)(cache, 7)
    pos, k, v = np.asarray(cache.pos), np.asarray(cache.k), np.asarray(cache.v)
    for idx in np.ndindex(L, B, HKV):
        slots = np.flatnonzero(pos[idx] >= 0)
        slots = slots[np.argsort(pos[idx][slots])]
        n = len(slots)
        np.testing.assert_array_equal(np.asarray(out.pos)[idx][:n], pos[idx][slots])
        np.testing.assert_array_equal(np.asarray(out.k)[idx][:n], k[idx][slots])
        np.testing.assert_array_equal(np.asarray(out.v)[idx][:n], v[idx][slots])
        assert (np.asarray(out.pos)[idx][n:] == -1).all()
        assert (np.asarray(out.v)[idx][n:] == 0).all()


def test_compact_to_per_layer_capacities_equals_one_capacity_cut():
    # Layer 0 keeps up to 7 per head, layer 1 up to 3: capacities (8, 4) hold each layer's
    # kept entries exactly as one capacity of 8 does, in fewer slots, with per-layer indices:
    # one layer group per capacity.
    cache = _cache()
    budgets = jnp.asarray([[[5, 7], [2, 6]], [[3, 1], [2, 3]]], jnp.int32)
    masked = apply_keep(cache, select_slots(_scores(cache), budgets))
    uniform = compact(masked, 8)
    ragged = jax.jit(compact, static_argnums=1)(masked, (8, 4))
    assert ragged.group_sizes == (1, 1) and ragged.capacities == (8, 4) and ragged.ragged
    assert not uniform.ragged and uniform.capacities == (8, 8) and uniform.group_sizes == (2,)
    np.testing.assert_array_equal(ragged.index, [7, 3])
    for i, cap in enumerate((8, 4)):
        group = ragged.groups[i]
        np.testing.assert_array_equal(group.pos[0], uniform.pos[i, ..., :cap])
        np.testing.assert_array_equal(group.k[0], uniform.k[i, ..., :cap, :])
        np.testing.assert_array_equal(group.v[0], uniform.v[i, ..., :cap, :])
    np.testing.assert_array_equal(ragged.num_kept(), masked.num_kept())
    assert ragged.nbytes() == uniform.nbytes() * 12 // 16
    assert check_capacity(masked, (8, 4)) == 7
    with pytest.raises(ValueError, match="needs 3 slots per head in layer 1 .* capacity is 2"):
        check_capacity(masked, (8, 2))
    with pytest.raises(ValueError, match="3 capacities for 2 layers"):
        check_capacity(masked, (8, 4, 4))
    with pytest.raises(ValueError, match="one per layer"):
        compact(masked, (8, 4, 4))
    valid = np.asarray(ragged.valid())  # padded to the largest layer's slots (padded_pos)
    assert valid.shape[-1] == 8 and not valid[1, ..., 4:].any()
    np.testing.assert_array_equal(valid[1, ..., :4], np.asarray(ragged.groups[1].pos[0]) >= 0)
    with pytest.raises(ValueError, match="a group needs one capacity"):
        regroup(ragged, (2,))
