"""Blockwise attention over written slots (what prefill chunks use) equals the dense version.

`written_slot_attention` visits slots [0, num_slots) in key blocks with an online softmax;
`cached_attention` reads the whole capacity. On caches with left padding, evicted holes,
unwritten tail slots and a capacity that no block size divides, both must give the same
output for every real query and the same per-slot attention sums (H2O's record).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loose_attention import cached as cached_attention
from loose_attention import written as written_slot_attention

B, T, HQ, HKV, D, S, WRITTEN = 2, 8, 6, 2, 16, 37, 30


@pytest.fixture(scope="module")
def inputs():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (B, T, HQ, D))
    k = jax.random.normal(keys[1], (B, HKV, S, D))
    v = jax.random.normal(keys[2], (B, HKV, S, D))
    pos = np.tile(np.arange(S), (B, HKV, 1))
    pos[:, :, WRITTEN:] = -1  # not yet written
    pos[0, :, :5] = -1  # row 0: left padding
    pos[1, 1, 7:9] = -1  # row 1, kv head 1: evicted slots
    # Row 1's first two queries are padding (position -1): they see nothing.
    query_pos = np.array([np.arange(22, 30), [-1, -1, 24, 25, 26, 27, 28, 29]])
    return q, k, v, jnp.asarray(pos, jnp.int32), jnp.asarray(query_pos, jnp.int32)


@pytest.mark.parametrize("block", [4, 7, 16, 64])
def test_blockwise_equals_dense(inputs, block):
    q, k, v, pos, query_pos = inputs
    dense, dense_sum = cached_attention(q, k, v, pos, query_pos, return_probs_sum=True)
    blocked, blocked_sum = written_slot_attention(
        q, k, v, pos, query_pos, jnp.int32(WRITTEN), block=block, return_probs_sum=True
    )
    real = np.asarray(query_pos >= 0)[:, :, None, None]
    np.testing.assert_allclose(np.asarray(blocked) * real, np.asarray(dense) * real, atol=2e-6)
    np.testing.assert_allclose(np.asarray(blocked_sum), np.asarray(dense_sum), atol=2e-6)
    # Each real query's attention sums to one over its visible slots; padding queries add 0.
    real_queries = np.asarray(query_pos >= 0).sum(-1)  # [8, 6]
    np.testing.assert_allclose(
        np.asarray(blocked_sum).sum(-1), np.repeat(real_queries[:, None], HQ, 1), rtol=1e-5
    )


def test_slots_past_num_slots_are_never_read(inputs):
    """Whatever the slots past the last visited block hold (here NaN) cannot reach the output
    (block 10: blocks [0, 10), [10, 20), [20, 30) cover the written slots exactly)."""
    q, k, v, pos, query_pos = inputs
    poisoned_k = k.at[:, :, WRITTEN:].set(jnp.nan)
    poisoned_v = v.at[:, :, WRITTEN:].set(jnp.nan)
    out, _ = written_slot_attention(
        q, poisoned_k, poisoned_v, pos, query_pos, jnp.int32(WRITTEN), block=10
    )
    assert np.isfinite(np.asarray(out)).all()


def reference_attention(q, k, v, pos, query_pos):
    """Per row, query and head, in numpy: softmax over the visible slots (0 <= pos <= p)."""
    q, k, v, pos, query_pos = map(np.asarray, (q, k, v, pos, query_pos))
    b, t, hq, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros_like(q)
    sums = np.zeros((b, hq, k.shape[2]))
    for r in range(b):
        for i in range(t):
            for h in range(hq):
                visible = (pos[r, h // g] >= 0) & (pos[r, h // g] <= query_pos[r, i])
                if not visible.any():
                    continue  # a padding query: output unused, contributes no attention
                s = k[r, h // g] @ q[r, i, h] / np.sqrt(d)
                p = np.where(visible, np.exp(s - s[visible].max()), 0.0)
                p /= p.sum()
                out[r, i, h] = p @ v[r, h // g]
                sums[r, h] += p
    return out, sums


@pytest.mark.parametrize("t", [1, 3, T])
@pytest.mark.parametrize("keys_major", [True, False])
def test_score_layouts_equal_reference(inputs, t, keys_major):
    """Both score layouts (keys-major for decode-sized T, rows-major for prefill) give the
    numpy reference's output and per-slot sums on padding, holes and unwritten slots."""
    q, k, v, pos, query_pos = inputs
    q, query_pos = q[:, -t:], query_pos[:, -t:]
    out, sums = cached_attention(
        q, k, v, pos, query_pos, return_probs_sum=True, keys_major=keys_major
    )
    want_out, want_sums = reference_attention(q, k, v, pos, query_pos)
    real = np.asarray(query_pos >= 0)[:, :, None, None]
    np.testing.assert_allclose(np.asarray(out) * real, want_out, atol=2e-6)
    np.testing.assert_allclose(np.asarray(sums), want_sums, atol=2e-6)


@pytest.mark.parametrize("t", [1, 3])
def test_new_entries_beside_the_cache_equal_writing_them_first(inputs, t):
    """`new=` (decode and draft steps: attend, then write) gives what writing the T new
    entries at `new_slot` and attending gives: outputs and per-slot sums, whatever the
    target slots held before (here stale entries, which must be ignored)."""
    q, k, v, pos, query_pos = inputs
    slot = WRITTEN - t  # the new entries are the last t written ones
    q, query_pos = q[:, -t:], query_pos[:, -t:]
    new = slice(slot, slot + t)
    k_new, v_new, pos_new = k[:, :, new], v[:, :, new], pos[:, :, new]
    written_out, written_sums = cached_attention(q, k, v, pos, query_pos, return_probs_sum=True)
    stale = jnp.zeros_like(k).at[:, :, new].set(7.0)  # anything but the new values
    stale_pos = pos.at[:, :, new].set(3)  # visible to every query, if it were read
    for keys_major in (True, False):
        out, sums = cached_attention(
            q, k + stale, v - stale, stale_pos, query_pos, return_probs_sum=True,
            keys_major=keys_major, new=(k_new, v_new, pos_new), new_slot=jnp.int32(slot),
        )  # fmt: skip
        real = np.asarray(query_pos >= 0)[:, :, None, None]
        np.testing.assert_allclose(np.asarray(out) * real, np.asarray(written_out) * real,
                                   atol=2e-6)  # fmt: skip
        np.testing.assert_allclose(np.asarray(sums), np.asarray(written_sums), atol=2e-6)
