"""CriticalKV and ChunkKV (`dge_jax.rules.criticalkv`, `dge_jax.rules.chunkkv`) against NumPy
transcriptions of kvpress's
``CriticalKVPress`` and ``ChunkKVPress``, on hand-made left-padded caches with SnapKV and
KeyDiff inside; the registry's wrapper names; the scoring a grid shares."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dge_jax.eviction.budgets import adakv_budgets
from dge_jax.eviction.evict import SelectionInputs, SelectionSpec, select_for, select_for_budgets
from dge_jax.rules.chunkkv import ChunkKV
from dge_jax.rules.criticalkv import CriticalKV, projected_value_norms
from dge_jax.rules.h2o import H2O
from dge_jax.rules.keydiff import KeyDiff
from dge_jax.rules.knorm import KeyNorm
from dge_jax.rules.pyramidkv import PyramidKV
from dge_jax.rules.registry import RULES, make_rule
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation

L, HKV, G, D, E = 2, 2, 2, 8, 12
HQ = HKV * G
WINDOW = 4


def handmade(lengths, S: int, seed: int = 0):
    """Left-padded prompts (positions 0..n-1 in the last n of S slots), the last WINDOW
    prompt queries per row, and a random output projection."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    k = rng.normal(size=(L, b, HKV, S, D)).astype(np.float32)
    v = rng.normal(size=(L, b, HKV, S, D)).astype(np.float32)
    pos = np.full((L, b, HKV, S), -1, np.int32)
    for row, n in enumerate(lengths):
        pos[:, row, :, S - n :] = np.arange(n)
    q = rng.normal(size=(L, b, HQ, WINDOW, D)).astype(np.float32)
    q_pos = np.stack([np.arange(n - WINDOW, n) for n in lengths]).astype(np.int32)
    wo = rng.normal(size=(L, HQ, D, E)).astype(np.float32)
    cache = KVCache.stacked(jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos), S)
    obs = Observation(
        q=jnp.asarray(q), q_pos=jnp.asarray(q_pos), attn_sum=None,
        is_draft=jnp.zeros((WINDOW,), bool),
        prompt_end=jnp.asarray([n - 1 for n in lengths], jnp.int32), out_proj=jnp.asarray(wo),
    )  # fmt: skip
    return cache, obs, v, pos, wo


@functools.partial(jax.jit, static_argnums=0)
def scores_of(rule, cache, obs):
    return rule.score(cache, obs)


@functools.partial(jax.jit, static_argnames=("rule", "head_budget"))
def keep_of(cache, obs, budget, *, rule, head_budget="uniform"):
    return select_for(
        cache, obs, None, budget, jnp.asarray(False), rule=rule, head_budget=head_budget
    )


def top(scores: np.ndarray, positions: np.ndarray, count: int) -> set[int]:
    """Positions of the `count` best scores, equal scores to the later position."""
    order = np.lexsort((-positions, -scores))
    return set(positions[order[:count]].tolist())


def row_view(x: np.ndarray, pos: np.ndarray, layer: int, row: int):
    """One row's [H, n] values in position order, and the positions."""
    slots = np.flatnonzero(pos[layer, row, 0] >= 0)
    return x[layer, row][:, slots], pos[layer, row, 0, slots]


# ------------------------------------------------------------------------------ CriticalKV


def vwl1norm_reference(v: np.ndarray, wo: np.ndarray) -> np.ndarray:
    """kvpress CriticalKVPress.vwl1norm for one layer and row: v [Hkv, n, D], wo [Hq, D, E]."""
    per_head = [np.abs(v[h // G] @ wo[h]).sum(-1) for h in range(HQ)]  # repeat_kv, per head
    return np.stack(per_head).reshape(HKV, G, -1).mean(1)


def test_projected_value_norms_match_kvpress():
    cache, obs, v, pos, wo = handmade((10, 7), 12)
    got = np.asarray(jax.jit(projected_value_norms)(cache.v, obs.out_proj))
    for layer in range(L):
        for row in range(2):
            np.testing.assert_allclose(
                got[layer, row], vwl1norm_reference(v[layer, row], wo[layer]), rtol=1e-5
            )


@pytest.mark.parametrize("inner", [SnapKV(window=WINDOW, kernel=3), KeyNorm()])
@pytest.mark.parametrize("budget", [6, 9])
def test_criticalkv_two_stages_match_kvpress(inner, budget):
    """Stage 1 keeps floor(B/2) by the inner score (the window's +inf entries first), stage 2
    fills the budget by (score + 1e-4) · ‖v W_o‖₁; rows padded differently."""
    lengths, S = (20, 13), 24
    cache, obs, v, pos, wo = handmade(lengths, S, seed=3)
    rule = CriticalKV(inner=inner)
    inner_scores = np.asarray(scores_of(inner, cache, obs))
    keep = np.asarray(keep_of(cache, obs, jnp.int32(budget), rule=rule))
    for layer in range(L):
        for row in range(2):
            s, p = row_view(inner_scores, pos, layer, row)
            slots = np.flatnonzero(pos[layer, row, 0] >= 0)
            norms = vwl1norm_reference(v[layer, row][:, slots], wo[layer])
            for h in range(HKV):
                stage1 = top(s[h], p, budget // 2)
                rescored = np.where(np.isfinite(s[h]), (s[h] + 1e-4) * norms[h], s[h])
                rescored = np.where(np.isin(p, list(stage1)), np.inf, rescored)
                want = top(rescored, p, budget)
                got = set(pos[layer, row, h][keep[layer, row, h]].tolist())
                assert got == want, (layer, row, h)


def test_criticalkv_adakv_budgets_come_from_the_inner_scores():
    """CriticalAdaKV: head budgets from the inner scores (AdaKV's allocator), then the two
    stages within each head's budget."""
    lengths, S = (20, 13), 24
    cache, obs, *_ = handmade(lengths, S, seed=5)
    inner = SnapKV(window=WINDOW, kernel=3)
    keep = np.asarray(
        keep_of(cache, obs, jnp.int32(8), rule=CriticalKV(inner=inner), head_budget="adakv")
    )
    counts = adakv_budgets(scores_of(inner, cache, obs), jnp.int32(8), 0.2)
    np.testing.assert_array_equal(keep.sum(-1), np.asarray(counts))


def test_criticalkv_shares_its_inner_rules_scoring():
    """Same scorer: a grid scores SnapKV and CriticalKV(SnapKV) cells once; each cell equals
    its own select_for."""
    cache, obs, *_ = handmade((20, 13), 24, seed=7)
    inner = SnapKV(window=WINDOW, kernel=3)
    critical = CriticalKV(inner=inner)
    assert critical.scorer == inner.scorer
    budgets = (jnp.int32(8), jnp.int32(8))
    both = select_for_budgets(
        cache, obs, None, budgets, SelectionInputs(jnp.asarray(False)),
        spec=SelectionSpec((inner, critical)),
    )  # fmt: skip
    for rule, keep in zip((inner, critical), both, strict=True):
        alone = keep_of(cache, obs, jnp.int32(8), rule=rule)
        np.testing.assert_array_equal(np.asarray(keep), np.asarray(alone))
    assert not np.array_equal(np.asarray(both[0]), np.asarray(both[1]))


def test_criticalkv_without_out_proj_says_what_is_missing():
    cache, obs, *_ = handmade((10, 7), 12)
    obs = Observation(obs.q, obs.q_pos, None, obs.is_draft, obs.prompt_end)
    with pytest.raises(ValueError, match="obs.out_proj"):
        keep_of(cache, obs, jnp.int32(6), rule=CriticalKV(inner=KeyNorm()))


# ------------------------------------------------------------------------------ ChunkKV


def chunkkv_reference(scores: np.ndarray, chunk: int, n_kept_chunks: int) -> set[int]:
    """kvpress ChunkKVPress.compress for one row: global scores [Hkv, n] (a window already at
    kvpress's max) -> the kept positions."""
    n = scores.shape[1]
    full, rest = n // chunk, n % chunk
    summed = scores.sum(0)  # over heads
    chunk_scores = [summed[i * chunk : (i + 1) * chunk].mean() for i in range(full)]
    if rest:
        chunk_scores.append(summed[-rest:].mean())
    best = np.argsort(-np.asarray(chunk_scores), kind="stable")[:n_kept_chunks]
    kept = set()
    for c in best:
        kept |= set(range(c * chunk, min((c + 1) * chunk, n)))
    return kept


@pytest.mark.parametrize("inner", [KeyDiff(), SnapKV(window=WINDOW, kernel=3)])
@pytest.mark.parametrize("lengths, budget", [((40, 25), 10), ((37, 30), 15)])
def test_chunkkv_keeps_kvpress_chunks(inner, lengths, budget):
    """Budgets that are whole chunks (chunk 5): kvpress's whole-chunk selection, on rows of
    different padding, with a remainder chunk (37 = 7·5 + 2), and with SnapKV's window
    counted at the largest finite score + 1 as kvpress's SnapKV pads it. Where kvpress keeps the
    short last chunk (fewer entries than the budget), the budget's rest comes from the next
    best chunk."""
    S, chunk = 40, 5
    cache, obs, _, pos, _ = handmade(lengths, S, seed=11)
    rule = ChunkKV(inner=inner, chunk_length=chunk)
    inner_scores = np.asarray(scores_of(inner, cache, obs))
    keep = np.asarray(keep_of(cache, obs, jnp.int32(budget), rule=rule))
    for layer in range(L):
        for row, n in enumerate(lengths):
            s, p = row_view(inner_scores, pos, layer, row)
            s = np.where(np.isposinf(s), s[np.isfinite(s)].max() + 1, s)  # kvpress: max + 1
            want = chunkkv_reference(s, chunk, budget // chunk)
            for h in range(HKV):
                got = set(pos[layer, row, h][keep[layer, row, h]].tolist())
                if len(want) == budget:
                    assert got == want, (layer, row, h)
                else:  # kvpress kept the short last chunk whole; the budget's rest fills in
                    assert n % chunk and set(range(n - n % chunk, n)) <= want, (layer, row, h)
                    extra = got - want
                    assert want < got and len(got) == budget, (layer, row, h)
                    assert len({q // chunk for q in extra}) == 1, (layer, row, h)


def test_chunkkv_partial_chunk_follows_the_tie_rule():
    """B = 2 chunks + 2: the two best whole chunks, then the 2 latest entries of the third."""
    lengths, S, chunk = (40,), 40, 5
    cache, obs, _, pos, _ = handmade(lengths, S, seed=13)
    rule = ChunkKV(inner=KeyDiff(), chunk_length=chunk)
    s = np.asarray(scores_of(rule, cache, obs))[0, 0, 0]
    order = np.argsort(-s[::chunk], kind="stable")  # one score per chunk
    keep = np.asarray(keep_of(cache, obs, jnp.int32(12), rule=rule))[0, 0, 0]
    third = order[2] * chunk
    want = set(range(order[0] * chunk, order[0] * chunk + 5))
    want |= set(range(order[1] * chunk, order[1] * chunk + 5)) | {third + 3, third + 4}
    assert set(np.flatnonzero(keep).tolist()) == want


def test_wrappers_read_what_their_inner_rule_reads():
    assert CriticalKV(inner=H2O()).needs.attn_sum and CriticalKV(inner=H2O()).needs.window == 0
    assert ChunkKV(inner=SnapKV(window=16)).needs.window == 16
    assert CriticalKV(inner=PyramidKV()).layer_schedule == PyramidKV().layer_schedule
    assert not ChunkKV(inner=KeyDiff()).needs.attn_sum


# ------------------------------------------------------------------------------ registry


def test_registry_names_the_new_rules_and_builds_wrappers_by_name():
    assert {"keydiff", "lagkv", "criticalkv", "chunkkv"} <= set(RULES)
    assert make_rule("criticalkv", inner="h2o", window=16) == CriticalKV(inner=H2O(window=16))
    assert make_rule("chunkkv", chunk_length=10, window=8) == ChunkKV(
        inner=SnapKV(window=8), chunk_length=10
    )
    assert make_rule("criticalkv", first_stage_ratio=0.25).inner == SnapKV()
    with pytest.raises(ValueError, match="inner rule must be one of"):
        make_rule("chunkkv", inner="criticalkv")
    with pytest.raises(ValueError, match="inner rule must be one of"):
        make_rule("criticalkv", inner="full")
    with pytest.raises(ValueError, match="unknown option.*'windw'"):
        make_rule("chunkkv", windw=8)
    with pytest.raises(TypeError, match="ChunkKV.inner must be an evicting scoring rule"):
        ChunkKV(inner="snapkv")
    with pytest.raises(ValueError, match="first_stage_ratio must be in"):
        CriticalKV(first_stage_ratio=1.5)
    with pytest.raises(ValueError, match="ChunkKV.chunk_length must be an integer >= 1"):
        ChunkKV(chunk_length=0)
