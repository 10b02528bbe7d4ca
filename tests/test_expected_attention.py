"""ExpectedAttention (`dge_jax.rules.expected_attention`): its scores against a NumPy transcription
of kvpress's ``ExpectedAttentionPress`` (explicit averaged rotation matrices), the query
statistics the forward records (against the layer-0 queries computed by hand, across chunk
sizes and padding), draft queries joining the statistics, and a grid's one recording."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import jax_model

from dge_jax.config import RopeConfig
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.observation import with_drafts
from dge_jax.eviction.timing import Timing
from dge_jax.rules.expected_attention import ExpectedAttention
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.recorders import QueryStatistics, Recording
from dge_jax.runtime.records import DraftRecord, Observation, QueryStats
from dge_jax.runtime.rope import inverse_frequencies

L, HKV, G, D = 2, 2, 2, 8
HQ = HKV * G
INV_FREQ = inverse_frequencies(RopeConfig(theta=10000.0), D)


def rope_matrix(p: float) -> np.ndarray:
    """R(p) [D, D] with R(p) x = x cos + rotate_half(x) sin (Hugging Face's layout)."""
    angles = np.concatenate([p * INV_FREQ, p * INV_FREQ])
    rot = np.zeros((D, D))
    rot[D // 2 :, : D // 2], rot[: D // 2, D // 2 :] = np.eye(D // 2), -np.eye(D // 2)
    return np.diag(np.cos(angles)) + np.diag(np.sin(angles)) @ rot


def handmade(lengths, S: int, sinks: int, seed: int = 0):
    """Left-padded cache, pre-RoPE queries qpre [L, B, Hq, S, D] at the same slots, and the
    QueryStats of the queries at positions >= sinks."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    k = rng.normal(size=(L, b, HKV, S, D)).astype(np.float32)
    v = rng.normal(size=(L, b, HKV, S, D)).astype(np.float32)
    qpre = (rng.normal(size=(L, b, HQ, S, D)) * 0.7 + 0.3).astype(np.float32)
    pos = np.full((L, b, HKV, S), -1, np.int32)
    for row, n in enumerate(lengths):
        pos[:, row, :, S - n :] = np.arange(n)
    counted = (pos[0, :, 0] >= sinks).astype(np.float32)  # [B, S]
    stats = QueryStats(
        total=jnp.asarray(np.einsum("lbhsd,bs->lbhd", qpre, counted)),
        outer=jnp.asarray(np.einsum("lbhsd,lbhse,bs->lbhde", qpre, qpre, counted)),
        count=jnp.asarray(counted.sum(-1)),
        inv_freq=jnp.asarray(INV_FREQ),
    )
    cache = KVCache.stacked(jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos), S)
    obs = Observation(
        q=None, q_pos=None, attn_sum=None, is_draft=None,
        prompt_end=jnp.asarray([n - 1 for n in lengths], jnp.int32), q_stats=stats,
    )  # fmt: skip
    return cache, obs, k, v, qpre, pos


@functools.partial(jax.jit, static_argnums=0)
def scores_of(rule, cache, obs):
    return rule.score(cache, obs)


def kvpress_reference(keys, values, qpre, n_sink, n_future, use_cov=True, use_vnorm=True):
    """ExpectedAttentionPress.score for one layer and row: keys, values [Hkv, n, D] (post-RoPE
    keys), qpre [Hq, n, D] pre-RoPE queries -> [Hkv, n] (sinks at max + 1)."""
    n = keys.shape[1]
    q = qpre[:, n_sink:].astype(np.float64)
    mu = q.mean(axis=1)  # [Hq, D]
    centred = q - mu[:, None]
    cov = np.einsum("hsi,hsj->hij", centred, centred) / q.shape[1]
    rot = np.mean([rope_matrix(p) for p in range(n, n + n_future)], axis=0)
    mu = mu @ rot.T
    cov = rot @ cov @ rot.T
    k = np.repeat(keys[:, n_sink:], G, axis=0).astype(np.float64)  # repeat_kv: [Hq, n', D]
    scores = np.einsum("hd,hsd->hs", mu, k) / np.sqrt(D)
    if use_cov:
        scores += np.einsum("hsi,hij,hsj->hs", k, cov, k) / D / 2
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    scores = scores.reshape(HKV, G, -1).mean(1)
    if use_vnorm:
        scores = scores * np.linalg.norm(values[:, n_sink:], axis=-1)
    return np.pad(scores, ((0, 0), (n_sink, 0)), constant_values=scores.max() + 1)


@pytest.mark.parametrize("use_cov, use_vnorm", [(True, True), (False, True), (True, False)])
def test_scores_match_kvpress_on_padded_rows(use_cov, use_vnorm):
    lengths, S, sinks = (20, 13), 24, 3
    rule = ExpectedAttention(
        n_future_positions=16, sinks=sinks, use_covariance=use_cov, use_vnorm=use_vnorm
    )
    cache, obs, k, v, qpre, pos = handmade(lengths, S, sinks)
    got = np.asarray(scores_of(rule, cache, obs))
    for layer in range(L):
        for row in range(len(lengths)):
            slots = np.flatnonzero(pos[layer, row, 0] >= 0)
            want = kvpress_reference(
                k[layer, row][:, slots], v[layer, row][:, slots], qpre[layer, row][:, slots],
                sinks, 16, use_cov, use_vnorm,
            )  # fmt: skip
            mine = got[layer, row][:, slots]
            assert np.all(mine[:, :sinks] == np.inf)  # kvpress: max + 1, kept first alike
            np.testing.assert_allclose(mine[:, sinks:], want[:, sinks:], rtol=2e-4, atol=1e-7)
            assert np.all(got[layer, row][:, pos[layer, row, 0] < 0] == -np.inf)


def test_draft_queries_join_the_statistics():
    """A draft query, post-RoPE in the record, enters the statistics as its pre-RoPE self,
    with its weight; unobserved steps (dge_w) add nothing."""
    lengths, S, sinks = (20, 13), 24, 3
    cache, obs, *_ = handmade(lengths, S, sinks)
    rng = np.random.default_rng(9)
    kd = 2
    pre = rng.normal(size=(L, 2, HQ, kd, D)).astype(np.float32)
    q_pos = np.array([[n, n + 1] for n in lengths], np.int32)
    rotations = np.stack([[rope_matrix(p) for p in r] for r in q_pos])  # [B, K, D, D]
    post = np.einsum("bkij,lbhkj->lbhki", rotations, pre)
    record = DraftRecord(
        q=jnp.asarray(post, jnp.float32), q_pos=jnp.asarray(q_pos), probs=None,
        entropy=jnp.zeros((2, kd)), top1=jnp.zeros((2, kd)),
    )  # fmt: skip
    joined = with_drafts(obs, record, jnp.asarray(True)).q_stats
    s = obs.q_stats
    np.testing.assert_allclose(joined.total, s.total + pre.sum(3), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        joined.outer, s.outer + np.einsum("lbhkd,lbhke->lbhde", pre, pre), rtol=1e-5, atol=1e-4
    )
    np.testing.assert_allclose(joined.count, s.count + kd)
    unobserved = with_drafts(obs, record, jnp.asarray(False)).q_stats
    np.testing.assert_array_equal(unobserved.total, s.total)
    np.testing.assert_array_equal(unobserved.count, s.count)


# ------------------------------------------------------------------------------ the forward


@pytest.fixture(scope="module")
def model():
    return jax_model()


def _prefill_stats(model, rows, width, chunk, sinks):
    from dge_jax.runtime import decoding

    tokens = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, width - len(r) :] = r
    lengths = np.array([len(r) for r in rows], np.int32)
    pre = decoding.prefill_prompt(
        model.forward, model.config, model.params, jnp.asarray(tokens), jnp.asarray(lengths),
        decoding.PrefillSpec(width, chunk, Recording.of(QueryStatistics(sinks))),
    )  # fmt: skip
    return pre.obs.q_stats


def test_prefill_records_pre_rope_query_statistics(model):
    """Layer 0's statistics equal those of its queries computed by hand (embedding, RMSNorm,
    W_q); every layer's are the same in one chunk or four, and for a row padded or alone."""
    cfg, params = model.config, model.params
    rng = np.random.default_rng(0)
    row = rng.integers(0, 128, 48).tolist()
    short = rng.integers(0, 128, 30).tolist()
    sinks = 4
    one = _prefill_stats(model, [row, short], 64, 64, sinks)
    four = _prefill_stats(model, [row, short], 64, 16, sinks)
    alone = _prefill_stats(model, [short], 32, 32, sinks)
    np.testing.assert_allclose(one.total, four.total, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(one.outer, four.outer, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(one.total[:, 1], alone.total[:, 0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(one.count, [48 - sinks, 30 - sinks])
    # Layer 0 by hand.
    x = np.asarray(params.embed)[row]
    w = np.asarray(params.layers.attn_norm[0])
    h = x / np.sqrt((x**2).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w
    q = (h @ np.asarray(params.layers.wq[0])).reshape(48, cfg.num_heads, cfg.head_dim)[sinks:]
    np.testing.assert_allclose(one.total[0, 0], q.sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        one.outer[0, 0], np.einsum("shd,she->hde", q, q), rtol=1e-4, atol=1e-3
    )


def test_a_grid_records_one_set_of_statistics(model):
    from dge_jax.eviction.grid_plan import GridRecording
    from dge_jax.generation import generate_grid

    cells = [Eviction(ExpectedAttention(sinks=4), 16, Timing("dge", 2)),
             Eviction(ExpectedAttention(sinks=2), 16, Timing("dge", 2))]  # fmt: skip
    with pytest.raises(ValueError, match="start them at positions \\[2, 4\\]"):
        GridRecording.of(cells)
    rec = GridRecording.of(cells[:1])
    assert rec.needs.query_stats_from == 4 and rec.needs.queries and rec.needs.window == 0
    prompts = [np.random.default_rng(n).integers(0, 128, n).tolist() for n in (44, 30)]
    out = generate_grid(model, prompts, cells[:1], max_new_tokens=3)
    assert all(len(h) == 16 for layer in out[0].kept[0] for h in layer)
