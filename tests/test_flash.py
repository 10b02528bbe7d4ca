"""The Pallas flash kernel (`kernels/flash.py`) gives `written_slot_attention`'s results.

On CPU the kernels run in Pallas interpret mode (which fills reads past an array's end with
NaN, so the masking of the last partial key tile is exercised). Compared against
`written_slot_attention` and `cached_attention` on hand-made caches: left padding, evicted
slots, slots past num_slots, GQA groups 1/3/4/8, several query and key tiles with T and S
multiples of neither, f32 and bf16; and the stacked cache [Lg, B, Hkv, S, D] read at a
layer in place gives that layer's results; sliding windows (a traced scalar: one compile for
all), soft caps and a logit scale as `attention.ScoreSpec` gives them to the XLA paths, with
the skip tables dropping the key tiles older than every query's window. Rows that see no
slot are finite (zero) in the kernel and
a mean of values in the XLA path, so outputs are compared on real rows only; the probs sums
are compared everywhere.

Tolerances: f32 2e-5 absolute on outputs (values ~N(0, 1)) and 2e-6 on probs sums; bf16 runs
compare against the XLA paths in bf16 at 1e-2 absolute + 1e-2 relative on outputs (one or
two bf16 ulps, 2^-7 relative: the paths round p to bf16 against different running maxima,
and cached_attention scales scores in f32 where the others scale q in bf16) and 2e-3 absolute
+ 2e-3 relative on the f32 probs sums (sums of up to ~8 here; 7e-4 relative seen).

An int8 cache (`runtime.quantized.Int8Entries`: the kernels take its int8 values and scales
and dequantize each tile in VMEM): the same comparisons over the same int8 entries (the XLA
paths read them dequantized), and the kernels' outputs and probs sums bit for bit those they
give on the dequantized arrays, as both compute `dequantize`'s one product.

The last test compiles the kernels for a TPU v5e without a TPU (deviceless AOT through
libtpu), plain and int8, and finds the Mosaic custom calls in the compiled HLO.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loose_attention import cached as cached_attention
from loose_attention import flash as flash_attention
from loose_attention import written as written_slot_attention

from dge_jax.kernels.attention import DEFAULT_SCORES, ScoreSpec, visible
from dge_jax.kernels.flash import _skip_tables
from dge_jax.runtime.quantized import Int8Entries, dequantize, quantize_int8

D = 16
# Jitted, so each shape compiles once (eager calls re-trace the interpreter every time).
STATIC = ("return_probs_sum", "block_q", "block_k", "scores_spec")
FLASH = jax.jit(flash_attention, static_argnames=STATIC)
WRITTEN = jax.jit(written_slot_attention,
                  static_argnames=("block", "return_probs_sum", "scores_spec"))  # fmt: skip
DENSE = jax.jit(cached_attention, static_argnames=("return_probs_sum", "scores_spec"))


def make_inputs(b, t, hq, hkv, s, dtype=np.float32, seed=0, d=D):
    """Random q, k, v and, per row, a plain prompt: query t at position t, slot t holding
    position t for t < T, the rest of the capacity unwritten (-1)."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=shape), dtype)
               for shape in ((b, t, hq, d), (b, hkv, s, d), (b, hkv, s, d)))  # fmt: skip
    pos = np.full((b, hkv, s), -1, np.int32)
    pos[:, :, :t] = np.arange(t)
    return q, k, v, pos, np.tile(np.arange(t, dtype=np.int32), (b, 1))


def left_pad(pos, query_pos, row, n):
    """Row `row`'s first n tokens become padding: positions -1, the rest renumbered from 0."""
    query_pos[row] = np.arange(query_pos.shape[1]) - n
    query_pos[row, :n] = -1
    pos[row, :, : query_pos.shape[1]] = query_pos[row]


# (atol, rtol) of the outputs and of the probs sums; see the module docstring.
F32 = {"out": (2e-5, 0), "sums": (2e-6, 0)}
BF16 = {"out": (1e-2, 1e-2), "sums": (2e-3, 2e-3)}


def check(q, k, v, pos, query_pos, num_slots, *, tol=F32, window=None, spec=DEFAULT_SCORES,
          **blocks):  # fmt: skip
    """flash_attention equals written_slot_attention (block 64) and cached_attention, with the
    same window (traced when given) and ScoreSpec; returns its (out, sums) as numpy."""
    pos, query_pos, num_slots = jnp.asarray(pos), jnp.asarray(query_pos), jnp.int32(num_slots)
    scores = dict(scores_spec=spec, window=None if window is None else jnp.int32(window))
    out, sums = FLASH(q, k, v, pos, query_pos, num_slots, return_probs_sum=True, **blocks,
                      **scores)  # fmt: skip
    ref, ref_sums = WRITTEN(q, k, v, pos, query_pos, num_slots, block=64, return_probs_sum=True,
                            **scores)  # fmt: skip
    dense, dense_sums = DENSE(q, k, v, pos, query_pos, return_probs_sum=True, **scores)
    assert out.shape == ref.shape and out.dtype == ref.dtype and sums.shape == ref_sums.shape
    out, ref, dense, sums = (np.asarray(x, np.float32) for x in (out, ref, dense, sums))
    assert np.isfinite(out).all() and np.isfinite(sums).all()
    seen = _sees_a_slot(pos, query_pos, num_slots, window, q.shape[2])  # [B, T, Hq]
    real = seen[..., None]
    (atol, rtol), (sum_atol, sum_rtol) = tol["out"], tol["sums"]
    np.testing.assert_allclose(out * real, ref * real, atol=atol, rtol=rtol)
    np.testing.assert_allclose(out * real, dense * real, atol=atol, rtol=rtol)
    np.testing.assert_allclose(sums, np.asarray(ref_sums), atol=sum_atol, rtol=sum_rtol)
    np.testing.assert_allclose(sums, np.asarray(dense_sums), atol=sum_atol, rtol=sum_rtol)
    # Each query that sees a slot gives attention summing to one; the others add nothing.
    np.testing.assert_allclose(sums.sum(-1), seen.sum(1), rtol=1e-3)
    return out, sums


def _sees_a_slot(pos, query_pos, num_slots, window, hq):
    """[B, T, Hq] bool: whether the query sees any slot of its kv head (padding queries, and
    with a window real ones whose window holds only evicted slots, see none: outputs differ
    there, zero in the kernel, a mean of values in the XLA paths)."""
    written = np.asarray(pos)[:, :, : int(num_slots)]
    mask = visible(written[:, :, None, :], np.asarray(query_pos)[:, None, :, None], window)
    any_slot = np.asarray(mask).any(-1).transpose(0, 2, 1)  # [B, T, Hkv]
    return np.repeat(any_slot, hq // any_slot.shape[-1], axis=-1)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (8, 2), (8, 1)])  # G = 1, 3, 4, 8
def test_gqa_groups_with_padding_and_evictions(hq, hkv):
    """One tile each way: left padding (row 0), evicted slots inside the written ones (row 1,
    one kv head only), unwritten capacity, T and S not multiples of anything."""
    q, k, v, pos, query_pos = make_inputs(2, 11, hq, hkv, 37)
    left_pad(pos, query_pos, 0, 4)
    pos[1, hkv - 1, 3:6] = -1
    out, _ = check(q, k, v, pos, query_pos, 11)
    # A padding query sees nothing: its output is zero (finite), not the XLA path's mean.
    assert not np.abs(out[0, :4]).any()


def test_several_tiles():
    """128-wide tiles over T = 300 queries and S = 700 slots (3 query x 6 key tiles, the last
    key tile partial: NaN-filled by the interpreter past S), G = 4, one compile for three
    caches:

    - a padded prompt: row 0 left-padded by 140 (its first key tile all padding), row 1 with
      a whole evicted key tile on one kv head; num_slots = 300, so the causal upper triangle
      and the tiles past num_slots are skipped;
    - a later prefill chunk: queries at positions 400..699 over the 700 written slots;
    - slots at or past num_slots holding NaN keys and values and positions that would be
      visible: the same result as empty slots (they are never read).
    """
    q, k, v, pos, query_pos = make_inputs(2, 300, 8, 2, 700)
    blocks = dict(block_q=128, block_k=128)
    padded_pos, padded_query_pos = pos.copy(), query_pos.copy()
    left_pad(padded_pos, padded_query_pos, 0, 140)
    padded_pos[1, 1, 120:270] = -1
    check(q, k, v, padded_pos, padded_query_pos, 300, **blocks)

    chunk_pos = np.tile(np.arange(700, dtype=np.int32), (2, 2, 1))
    check(q, k, v, chunk_pos, query_pos + 400, 700, **blocks)

    clean = check(q, k, v, pos, query_pos, 300, **blocks)
    pos[:, :, 300:] = 0  # visible to every query, were it read
    poisoned = [x.at[:, :, 300:].set(jnp.nan) for x in (k, v)]
    out, sums = FLASH(q, *poisoned, jnp.asarray(pos), jnp.asarray(query_pos), jnp.int32(300),
                      return_probs_sum=True, **blocks)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out), clean[0])
    np.testing.assert_array_equal(np.asarray(sums), clean[1])


def test_bf16():
    """bf16 inputs with D = 128 (as an 8B model runs), several tiles, G = 3, against the XLA
    paths in bf16."""
    q, k, v, pos, query_pos = make_inputs(2, 150, 6, 2, 300, jnp.bfloat16, seed=1, d=128)
    left_pad(pos, query_pos, 1, 20)
    pos[0, 0, 10:30] = -1
    check(q, k, v, pos, query_pos, 150, tol=BF16, block_q=128, block_k=128)


def test_without_probs_sum():
    q, k, v, pos, query_pos = make_inputs(1, 20, 4, 2, 64)
    args = (q, k, v, jnp.asarray(pos), jnp.asarray(query_pos), jnp.int32(20))
    out, sums = FLASH(*args)
    ref, _ = WRITTEN(*args, block=16)
    assert sums is None
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


@pytest.mark.parametrize("dtype,d", [(jnp.float32, D), (jnp.bfloat16, 128)])
def test_the_stacked_cache_reads_its_layer_in_place(dtype, d):
    """k, v [3, B, Hkv, S, D] and slot_pos [3, B, Hkv, S] with layer=2 (traced) give layer 2
    read alone, outputs and probs sums bit for bit: left padding (row 0), evicted slots (row 1,
    one kv head), unwritten capacity, several tiles; the other layers differ (other values,
    other evictions), so reading the wrong layer shows."""
    q, k, v, pos, query_pos = make_inputs(2, 150, 6, 2, 300, dtype, seed=2, d=d)
    left_pad(pos, query_pos, 0, 20)
    pos[1, 1, 40:170] = -1
    rng = np.random.default_rng(3)
    others = [jnp.asarray(rng.normal(size=(2, *k.shape)), dtype) for _ in "kv"]
    k3, v3 = (jnp.concatenate([x, y[None]]) for x, y in zip(others, (k, v), strict=True))
    evicted = np.where(rng.random((2, *pos.shape)) < 0.3, -1, pos)
    pos3 = jnp.asarray(np.concatenate([evicted, pos[None]]))
    args = (jnp.asarray(query_pos), jnp.int32(170))
    blocks = dict(return_probs_sum=True, block_q=128, block_k=128)
    alone = FLASH(q, k, v, jnp.asarray(pos), *args, **blocks)
    stacked = FLASH(q, k3, v3, pos3, *args, layer=jnp.int32(2), **blocks)
    for got, want in zip(stacked, alone, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    tol = F32 if dtype == jnp.float32 else BF16
    check(q, k, v, pos, query_pos, 170, tol=tol, block_q=128, block_k=128)


def test_skip_tables_of_a_causal_prompt():
    """T = S = 512 in 128-wide tiles, no padding: query tile i needs key tiles 0..i and key
    tile j query tiles j..3 (the upper triangle is skipped); past num_slots = 300 nothing."""
    pos = jnp.tile(jnp.arange(512, dtype=jnp.int32), (1, 2, 1))
    qpos = jnp.arange(512, dtype=jnp.int32)[None]
    tab = _skip_tables(pos, qpos, jnp.int32(512), 128, 128)
    np.testing.assert_array_equal(tab.kfirst, [0, 0, 0, 0])
    np.testing.assert_array_equal(tab.klast, [0, 1, 2, 3])
    np.testing.assert_array_equal(tab.qfirst, [0, 1, 2, 3])
    np.testing.assert_array_equal(tab.qlast, [3, 3, 3, 3])
    np.testing.assert_array_equal(tab.kend, [3])
    tab = _skip_tables(pos, qpos, jnp.int32(300), 128, 128)
    np.testing.assert_array_equal(tab.kmin, [0, 128, 256, np.iinfo(np.int32).max])
    np.testing.assert_array_equal(tab.klast, [0, 1, 2, 2])
    np.testing.assert_array_equal(tab.kend, [2])  # the sums kernel loads no tile past it


SLIDING = [
    ScoreSpec(),
    ScoreSpec(softcap=1.5),  # well inside the scores' range (~N(0, 1)): the cap bends them
    ScoreSpec(scale=0.4, softcap=3.0),
    ScoreSpec(scale=0.1),
]


@pytest.mark.parametrize("spec", SLIDING, ids=["plain", "softcap", "scale+softcap", "scale"])
def test_sliding_windows_softcaps_and_scales(spec):
    """Windows 1, 5 (inside one 128 tile), 128, 200 (spanning tiles) and 0 (global) on
    several tiles (T = 300, S = 700, G = 4; row 0 left-padded by 140, row 1 with an evicted
    key tile on one kv head), and on a later chunk (queries at 400..699 over 700 slots, so
    the first key tiles are older than every window), with a soft cap and / or a logit
    scale; probs sums included. The window is traced: one compile serves them all."""
    q, k, v, pos, query_pos = make_inputs(2, 300, 8, 2, 700)
    blocks = dict(block_q=128, block_k=128)
    left_pad(pos, query_pos, 0, 140)
    pos[1, 1, 120:270] = -1
    chunk_pos = np.tile(np.arange(700, dtype=np.int32), (2, 2, 1))
    chunk_pos[0, 0, 500:530] = -1
    chunk_query_pos = np.tile(np.arange(400, 700, dtype=np.int32), (2, 1))
    for window in (1, 5, 128, 200, 0):
        check(q, k, v, pos, query_pos, 300, window=window, spec=spec, **blocks)
        check(q, k, v, chunk_pos, chunk_query_pos, 700, window=window, spec=spec, **blocks)


def test_bf16_gqa_with_a_window():
    """bf16, D = 128, G = 3, window 37 and a soft cap, padding and evictions, against the XLA
    paths in bf16."""
    q, k, v, pos, query_pos = make_inputs(2, 150, 6, 2, 300, jnp.bfloat16, seed=8, d=128)
    left_pad(pos, query_pos, 1, 20)
    pos[0, 0, 10:30] = -1
    check(q, k, v, pos, query_pos, 150, tol=BF16, window=37, spec=ScoreSpec(0.1, 2.0),
          block_q=128, block_k=128)  # fmt: skip


def check_int8(q, k, v, pos, query_pos, num_slots, **kw):
    """`check` over the int8 cache of k, v (the kernels and the XLA paths reading the same
    int8 entries), and the kernels' out and probs sums on it bit for bit theirs on the
    dequantized arrays; returns (out, sums) as `check` does."""
    qk, qv = quantize_int8(k), quantize_int8(v)
    assert qk.q.dtype == jnp.int8 and qk.dtype == k.dtype
    got = check(q, qk, qv, pos, query_pos, num_slots, **kw)
    spec, window = kw.pop("spec", DEFAULT_SCORES), kw.pop("window", None)
    kw.pop("tol", None)
    args = (jnp.asarray(pos), jnp.asarray(query_pos), jnp.int32(num_slots))
    plain = FLASH(q, dequantize(qk), dequantize(qv), *args, return_probs_sum=True,
                  scores_spec=spec, window=None if window is None else jnp.int32(window), **kw)
    for x, y in zip(got, plain, strict=True):
        np.testing.assert_array_equal(x, np.asarray(y, np.float32))
    return got


@pytest.mark.parametrize("hq,hkv", [(6, 2), (8, 1)])  # G = 3, 8
def test_int8_gqa_with_padding_and_evictions(hq, hkv):
    """An int8 cache, one tile each way: left padding, evicted slots, unwritten capacity."""
    q, k, v, pos, query_pos = make_inputs(2, 11, hq, hkv, 37, seed=20)
    left_pad(pos, query_pos, 0, 4)
    pos[1, hkv - 1, 3:6] = -1
    check_int8(q, k, v, pos, query_pos, 11)


def test_int8_tiles_windows_and_softcap():
    """An int8 cache over several tiles (T = 300, S = 700 in 128-wide tiles, the last key
    tile partial: its values past S undefined, its scales zero-padded), G = 4: a padded prompt
    with an evicted key tile, then a later chunk under windows 5 and 200 with a soft cap and
    a logit scale; probs sums included."""
    q, k, v, pos, query_pos = make_inputs(2, 300, 8, 2, 700, seed=21)
    blocks = dict(block_q=128, block_k=128)
    left_pad(pos, query_pos, 0, 140)
    pos[1, 1, 120:270] = -1
    check_int8(q, k, v, pos, query_pos, 300, **blocks)
    chunk_pos = np.tile(np.arange(700, dtype=np.int32), (2, 2, 1))
    chunk_pos[0, 0, 500:530] = -1
    chunk_query_pos = np.tile(np.arange(400, 700, dtype=np.int32), (2, 1))
    for window in (5, 200):
        check_int8(q, k, v, chunk_pos, chunk_query_pos, 700, window=window,
                   spec=ScoreSpec(scale=0.4, softcap=3.0), **blocks)  # fmt: skip


def test_int8_bf16_stacked_with_a_window():
    """bf16 int8 cache (bf16 scales), D = 128, G = 3, window 37 and a soft cap, against the
    XLA paths in bf16; and its layer 1 of a stacked [3, ...] int8 cache read in place gives
    the layer alone, bit for bit."""
    q, k, v, pos, query_pos = make_inputs(2, 150, 6, 2, 300, jnp.bfloat16, seed=22, d=128)
    left_pad(pos, query_pos, 1, 20)
    pos[0, 0, 10:30] = -1
    spec = ScoreSpec(0.1, 2.0)
    out, sums = check_int8(q, k, v, pos, query_pos, 150, tol=BF16, window=37, spec=spec,
                           block_q=128, block_k=128)  # fmt: skip
    rng = np.random.default_rng(23)
    others = [quantize_int8(jnp.asarray(rng.normal(size=(3, *k.shape)), jnp.bfloat16))
              for _ in "kv"]  # fmt: skip
    k3, v3 = (jax.tree.map(lambda a, b: a.at[1].set(b), o, quantize_int8(x))
              for o, x in zip(others, (k, v), strict=True))  # fmt: skip
    assert isinstance(k3, Int8Entries)
    pos3 = jnp.asarray(np.stack([np.where(rng.random(pos.shape) < 0.3, -1, pos), pos, pos]))
    stacked = FLASH(q, k3, v3, pos3, jnp.asarray(query_pos), jnp.int32(150), layer=jnp.int32(1),
                    window=jnp.int32(37), scores_spec=spec, return_probs_sum=True, block_q=128,
                    block_k=128)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(stacked[0], np.float32), out)
    np.testing.assert_array_equal(np.asarray(stacked[1]), sums)


def test_int8_without_probs_sum():
    """The forward kernel alone (no sums call) on an int8 cache: the XLA path's output."""
    q, k, v, pos, query_pos = make_inputs(1, 20, 4, 2, 64, seed=24)
    k, v = quantize_int8(k), quantize_int8(v)
    args = (q, k, v, jnp.asarray(pos), jnp.asarray(query_pos), jnp.int32(20))
    out, sums = FLASH(*args)
    ref, _ = WRITTEN(*args, block=16)
    assert sums is None and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


def test_skip_tables_of_a_sliding_window():
    """T = S = 512 in 128-wide tiles: a window of 128 needs key tiles i - 1..i for query tile
    i (tile i - 1's last slot is 1 before tile i's first query); a window of 1 only the
    diagonal; padding queries do not widen a tile's reach."""
    pos = jnp.tile(jnp.arange(512, dtype=jnp.int32), (1, 2, 1))
    qpos = jnp.arange(512, dtype=jnp.int32)[None]
    tab = _skip_tables(pos, qpos, jnp.int32(512), 128, 128, window=128)
    np.testing.assert_array_equal(tab.kfirst, [0, 0, 1, 2])
    np.testing.assert_array_equal(tab.klast, [0, 1, 2, 3])
    np.testing.assert_array_equal(tab.qfirst, [0, 1, 2, 3])
    np.testing.assert_array_equal(tab.qlast, [1, 2, 3, 3])
    tab = _skip_tables(pos, qpos, jnp.int32(512), 128, 128, window=1)
    np.testing.assert_array_equal(tab.kfirst, [0, 1, 2, 3])
    np.testing.assert_array_equal(tab.qlast, [0, 1, 2, 3])
    padded = qpos.at[0, 256:383].set(-1)  # query tile 2: padding, then position 383 only
    tab = _skip_tables(pos, padded, jnp.int32(512), 128, 128, window=128)
    np.testing.assert_array_equal(tab.kfirst, [0, 0, 2, 2])


def test_tiles_must_be_lane_multiples():
    q, k, v, pos, query_pos = make_inputs(1, 8, 2, 2, 16)
    with pytest.raises(ValueError, match="block_k must be a positive multiple of 128"):
        flash_attention(q, k, v, jnp.asarray(pos), jnp.asarray(query_pos), 8, block_k=100)


def test_compiles_for_tpu_without_one():
    """Deviceless AOT: the kernels, with a traced window, a soft cap and a logit scale, lower
    through Mosaic for a v5e chip (interpret=None picks the compiled kernel because the
    computation is compiled for a TPU), on a bf16 cache and on an int8 one (int8 values,
    bf16 scales)."""
    # libtpu takes a machine-wide lock file by default, so a second process using it (another
    # test run, a benchmark) would make this one fail; deviceless compiling shares no chip.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies

        device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4").devices[0]
    except Exception as error:  # no libtpu, or a jax without deviceless TPU topologies
        pytest.skip(f"no deviceless TPU compilation here (pip install 'jax[tpu]'): {error}")
    where = jax.sharding.SingleDeviceSharding(device)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=where)

    def compiled_hlo(d, int8):
        b, t, hq, hkv, s = 1, 300, 8, 2, 700
        cache = (b, hkv, s, d)
        kv = spec(cache, jnp.bfloat16)
        if int8:
            kv = Int8Entries(spec(cache, jnp.int8), spec((*cache[:3], 1), jnp.bfloat16))
        args = (spec((b, t, hq, d), jnp.bfloat16), kv, kv, spec(cache[:3], jnp.int32),
                spec((b, t), jnp.int32), spec((), jnp.int32), spec((), jnp.int32))  # fmt: skip
        # a traced window (scalar-prefetched), Gemma 2's soft cap and a logit scale
        spec_of = ScoreSpec(scale=0.0625, softcap=50.0)
        fn = jax.jit(lambda *a: flash_attention(*a[:6], window=a[6], scores_spec=spec_of,
                                                return_probs_sum=True, block_k=256))  # fmt: skip
        return fn.lower(*args).compile().as_text()

    for d in (128, 64):  # an 8B model's head, and a small model's (not a lane multiple)
        for int8 in (False, True):
            hlo = compiled_hlo(d, int8)
            assert hlo.count('custom_call_target="tpu_custom_call"') == 2, (d, int8)
