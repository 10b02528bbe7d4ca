"""The Pallas decode kernel (`kernels/flash_decode.py`) gives `cached_attention`'s results.

On CPU the kernel runs in Pallas interpret mode (which fills reads past an array's end with
NaN, so the masking of a last partial key block is exercised). Compared against
`cached_attention` with the step's own entries passed beside the cache (``new``), on
hand-made caches:

- a compacted cache with ragged heads (`compaction.compact_heads`'s layout: head h's n_h kept
  entries in slots [0, n_h), empty slots up to the shared index max(n_h), a few decoded
  entries after it, then the step's own entries at new_slot), with stale visible junk at
  the slots the new entries will take;
- a masked (uncompacted) cache: left padding, evicted holes, whole evicted key blocks, one
  head with no visible slot at all;
- GQA groups 1, 3, 4, 8 (T = 1 and T = 3 draft steps), f32 and bf16; the stacked
  [Lg, B, Hkv, S, D] layout read at layer i equals the plain layer;
- sliding windows (traced; smaller than a draft step, inside a block, spanning blocks),
  soft caps and logit scales, on both caches, the step's own entries included.

- an int8 cache (`runtime.quantized.Int8Entries`: the kernel takes its int8 values and
  scales and dequantizes each block in VMEM, row-major and slots-minor), the step's own
  entries round-tripped as `layer_attention` passes them: equal to `cached_attention` over
  the same int8 cache, and bit for bit the kernel on the dequantized arrays.

Rows that see nothing (padding queries) are zero in the kernel and a mean of values in the
XLA path: outputs are compared on real rows only.

Tolerances: f32 2e-5 absolute (values ~N(0, 1)). bf16 against `cached_attention` in bf16:
1e-2 absolute + 1e-2 relative (a bf16 ulp is 2^-7 relative; the paths round the
probabilities to bf16 against different running maxima and sum in other orders).

Also: the block table lists exactly the key blocks holding visible slots (hand-made
positions), and deviceless TPU compiles (through libtpu; skipped with the reason when it is
missing): the kernel lowers through Mosaic, and a head-128 bf16 model's decode loop compiled
for a v5e holds the kernel and no copy of a cache-sized buffer.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loose_attention import cached as cached_attention
from loose_attention import decode as decode_attention

from dge_jax.kernels.attention import DEFAULT_SCORES, ScoreSpec
from dge_jax.kernels.flash_decode import block_table
from dge_jax.runtime.quantized import Int8Entries, dequantize, quantize_int8

D = 16
DECODE = jax.jit(decode_attention, static_argnames=("block_k", "slots_minor", "scores_spec"))
DENSE = jax.jit(cached_attention, static_argnames=("scores_spec",))
F32 = (2e-5, 0)
BF16 = (1e-2, 1e-2)


def random(rng, shape, dtype):
    return jnp.asarray(rng.normal(size=shape), dtype)


def compacted(kept, index, decoded, s):
    """Slot positions [B, Hkv, S] of a compacted cache: head (b, h) keeps kept[b][h] of the
    prompt's positions in slots [0, n), empties up to `index`, then `decoded` tokens at
    slots index.. with positions following the prompt (prompt length 1000)."""
    pos = np.full((len(kept), len(kept[0]), s), -1, np.int32)
    for b, row in enumerate(kept):
        for h, n in enumerate(row):
            pos[b, h, :n] = np.sort(np.random.default_rng(b * 31 + h).choice(1000, n, False))
            pos[b, h, index : index + decoded] = 1000 + np.arange(decoded)
    return pos


def step_inputs(b, t, hq, hkv, s, dtype, seed=0, d=D):
    """Random q, k, v [B, Hkv, S, D] and the step's own entries (k, v [B, Hkv, T, D])."""
    rng = np.random.default_rng(seed)
    q = random(rng, (b, t, hq, d), dtype)
    k, v = (random(rng, (b, hkv, s, d), dtype) for _ in range(2))
    k_new, v_new = (random(rng, (b, hkv, t, d), dtype) for _ in range(2))
    return q, k, v, k_new, v_new


def check(q, k, v, pos, query_pos, new, new_slot, *, tol=F32, block_k=128, window=None,
          spec=DEFAULT_SCORES):  # fmt: skip
    """decode_attention equals cached_attention (same window, traced when given, and
    ScoreSpec) on the rows whose query is real, reading the cache row-major and slots-minor
    (the same numbers); returns the kernel's output as f32 numpy."""
    pos, query_pos, new_slot = jnp.asarray(pos), jnp.asarray(query_pos), jnp.int32(new_slot)
    scores = dict(scores_spec=spec, window=None if window is None else jnp.int32(window))
    out, transposed = (DECODE(q, k, v, pos, query_pos, new=new, new_slot=new_slot,
                              block_k=block_k, slots_minor=minor, **scores)
                       for minor in (False, True))  # fmt: skip
    np.testing.assert_allclose(np.asarray(transposed, np.float32), np.asarray(out, np.float32),
                               atol=1e-6 if tol is F32 else 1e-2)  # fmt: skip
    ref, _ = DENSE(q, k, v, pos, query_pos, new=new, new_slot=new_slot, **scores)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    real = np.asarray(query_pos >= 0)[:, :, None, None]
    np.testing.assert_allclose(out * real, ref * real, atol=tol[0], rtol=tol[1])
    return out


GROUPS = [(2, 2), (6, 2), (8, 2), (8, 1)]  # G = 1, 3, 4, 8


@pytest.mark.parametrize("hq,hkv", GROUPS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compacted_ragged_heads(hq, hkv, dtype):
    """Heads keep 3..300 entries (S = 700: six 128-key blocks, the last partial), the shared
    index is the largest kept count, 5 decoded tokens follow it, and a T = 1 decode step and
    a T = 3 draft step attend with their own entries at slot index + 5. The slots those take
    hold junk with visible positions: ignored, as the new entries replace them."""
    b, s, index, decoded = 2, 700, 300, 5
    kept = [[3, 300, 129, 40][:hkv], [256, 0, 7, 200][:hkv]]
    kept[0][0], kept[1][-1] = 300, 128  # the shared index is row 0's largest count
    pos = compacted(kept, index, decoded, s)
    new_slot = index + decoded
    pos[:, :, new_slot : new_slot + 3] = 7  # stale junk, visible were it read
    tol = F32 if dtype == jnp.float32 else BF16
    for t in (1, 3):
        q, k, v, k_new, v_new = step_inputs(b, t, hq, hkv, s, dtype, seed=t)
        query_pos = np.tile(1000 + decoded + np.arange(t, dtype=np.int32), (b, 1))
        pos_new = jnp.asarray(np.broadcast_to(query_pos[:, None, :], (b, hkv, t)))
        check(q, k, v, pos, query_pos, (k_new, v_new, pos_new), new_slot, tol=tol)


@pytest.mark.parametrize("hq,hkv", GROUPS)
def test_masked_cache_with_holes_and_padding(hq, hkv):
    """An uncompacted cache: row 0 left-padded by 20 (positions -1), evicted holes, key block
    1 wholly evicted on every head of row 1, row 1's last kv head with nothing visible (its
    rows see only the new entry), and an S that is no block multiple; a T = 2 step whose
    first query is padding on row 0 (it sees nothing: zero output)."""
    b, t, s = 2, 2, 450
    prompt = 400
    pos = np.full((b, hkv, s), -1, np.int32)
    pos[:, :, :prompt] = np.arange(prompt)
    pos[0, :, :20] = -1
    pos[0, :, 20:prompt] = np.arange(prompt - 20)
    pos[0, 0, 50:60] = -1
    pos[1, :, 128:256] = -1
    pos[1, hkv - 1] = -1
    query_pos = np.array([[-1, prompt - 20], [prompt, prompt + 1]], np.int32)
    q, k, v, k_new, v_new = step_inputs(b, t, hq, hkv, s, jnp.float32, seed=3)
    pos_new = jnp.asarray(np.broadcast_to(query_pos[:, None, :], (b, hkv, t)))
    out = check(q, k, v, pos, query_pos, (k_new, v_new, pos_new), prompt)
    assert not np.abs(out[0, 0]).any()


SPECS = [ScoreSpec(), ScoreSpec(softcap=1.5), ScoreSpec(scale=0.4, softcap=3.0)]


def masked_positions(b: int, hkv: int, s: int) -> np.ndarray:
    """[B, Hkv, S] positions of a masked cache: prompt positions 405.. in the first 600 slots,
    with left padding (row 0's first 20), a hole (row 0, head 0, 50..59), an evicted block
    (row 1, 128..255) and an empty head (row 1's last)."""
    masked = np.full((b, hkv, s), -1, np.int32)
    masked[:, :, :600] = np.arange(600) + 405
    masked[0, :, :20] = -1
    masked[0, 0, 50:60] = -1
    masked[1, :, 128:256] = -1
    masked[1, hkv - 1] = -1
    return masked


@pytest.mark.parametrize("spec", SPECS, ids=["plain", "softcap", "scale+softcap"])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2)])
def test_sliding_windows_softcaps_and_scales(spec, hq, hkv):
    """The compacted cache with ragged heads (prompt positions scattered over 0..999, 5
    decoded tokens) and the masked cache with left padding, evicted holes and an empty head,
    T = 1 and 3 steps, under windows 2 (under a draft step: its first query sees only its
    own entries), 40 (inside a block), 300 (spanning blocks), 1000 and 0 (global)."""
    b, s = 2, 700
    kept = [[3, 300][:hkv], [256, 128][:hkv]]
    compact = compacted(kept, 300, 5, s)
    masked = masked_positions(b, hkv, s)
    for t in (1, 3):
        q, k, v, k_new, v_new = step_inputs(b, t, hq, hkv, s, jnp.float32, seed=10 + t)
        query_pos = np.tile(1005 + np.arange(t, dtype=np.int32), (b, 1))
        if t == 3:
            query_pos[0, 0] = -1  # padding: sees nothing
        pos_new = jnp.asarray(np.broadcast_to(query_pos[:, None, :], (b, hkv, t)))
        new = (k_new, v_new, pos_new)
        for window in (2, 40, 300, 1000, 0):
            check(q, k, v, compact, query_pos, new, 305, window=window, spec=spec)
            check(q, k, v, masked, query_pos, new, 600, window=window, spec=spec)


def check_int8(q, k, v, pos, query_pos, new, new_slot, **kw):
    """`check` over the int8 cache of k, v, the step's own entries (k, v, pos) read as they
    will be once written (quantized and dequantized: `quantized.round_trip`); and the
    kernel's output on it bit for bit its output on the dequantized arrays, both layouts."""
    qk, qv = quantize_int8(k), quantize_int8(v)
    k_new, v_new, pos_new = new
    new = (dequantize(quantize_int8(k_new)), dequantize(quantize_int8(v_new)), pos_new)
    out = check(q, qk, qv, pos, query_pos, new, new_slot, **kw)
    spec, window = kw.get("spec", DEFAULT_SCORES), kw.get("window")
    for minor in (False, True):
        plain = DECODE(q, dequantize(qk), dequantize(qv), jnp.asarray(pos),
                       jnp.asarray(query_pos), new=new, new_slot=jnp.int32(new_slot),
                       block_k=kw.get("block_k", 128), slots_minor=minor, scores_spec=spec,
                       window=None if window is None else jnp.int32(window))  # fmt: skip
        np.testing.assert_array_equal(np.asarray(plain, np.float32), out)
    return out


@pytest.mark.parametrize("hq,hkv", [(6, 2), (8, 1)])  # G = 3, 8
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_int8_compacted_ragged_heads(hq, hkv, dtype):
    """An int8 cache with ragged compacted heads (S = 700, the last block partial: its
    values past S undefined, its scales zero-padded), T = 1 decode and T = 3 draft steps with
    their own entries, stale visible junk at their slots."""
    b, s, index, decoded = 2, 700, 300, 5
    kept = [[3, 300][:hkv], [256, 128][:hkv]]
    pos = compacted(kept, index, decoded, s)
    new_slot = index + decoded
    pos[:, :, new_slot : new_slot + 3] = 7
    tol = F32 if dtype == jnp.float32 else BF16
    for t in (1, 3):
        q, k, v, k_new, v_new = step_inputs(b, t, hq, hkv, s, dtype, seed=30 + t)
        query_pos = np.tile(1000 + decoded + np.arange(t, dtype=np.int32), (b, 1))
        pos_new = jnp.asarray(np.broadcast_to(query_pos[:, None, :], (b, hkv, t)))
        check_int8(q, k, v, pos, query_pos, (k_new, v_new, pos_new), new_slot, tol=tol)


def test_int8_masked_cache_under_windows():
    """The masked cache (left padding, holes, an evicted block, an empty head) stored int8,
    G = 4, a T = 3 step with a padding query, windows 2, 300 and 0 with a soft cap and a
    logit scale."""
    b, t, hq, hkv, s = 2, 3, 8, 2, 700
    masked = masked_positions(b, hkv, s)
    q, k, v, k_new, v_new = step_inputs(b, t, hq, hkv, s, jnp.float32, seed=40)
    query_pos = np.tile(1005 + np.arange(t, dtype=np.int32), (b, 1))
    query_pos[0, 0] = -1
    pos_new = jnp.asarray(np.broadcast_to(query_pos[:, None, :], (b, hkv, t)))
    for window in (2, 300, 0):
        check_int8(q, k, v, masked, query_pos, (k_new, v_new, pos_new), 600, window=window,
                   spec=ScoreSpec(scale=0.4, softcap=3.0))  # fmt: skip


def test_int8_stacked_layer_in_place():
    """Layer 1 of a stacked int8 cache [3, B, Hkv, S, D] gives the int8 layer alone."""
    q, k, v, _, _ = step_inputs(2, 1, 8, 2, 300, jnp.float32, seed=41)
    rng = np.random.default_rng(42)
    # per-token scales: layer 1 of the stack quantized is the layer quantized alone
    k3, v3 = (quantize_int8(jnp.stack([random(rng, x.shape, x.dtype), x, x + 1]))
              for x in (k, v))  # fmt: skip
    assert isinstance(k3, Int8Entries)
    pos = jnp.asarray(compacted([[5, 120], [250, 17]], 250, 2, 300))
    query_pos = jnp.full((2, 1), 1002, jnp.int32)
    stacked = DECODE(q, k3, v3, pos, query_pos, layer=jnp.int32(1), block_k=128)
    alone = DECODE(q, quantize_int8(k), quantize_int8(v), pos, query_pos, block_k=128)
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(alone))


def test_the_block_table_drops_blocks_older_than_the_window():
    """Blocks of 4 slots: with queries at 11 and 12 and a window of 4, only slots at 8..12
    are visible to some query (11 - pos < 4 for the earliest); a padding query (-1) does not
    widen the reach; window 0 is global."""
    pos = np.arange(20, dtype=np.int32).reshape(1, 1, 20)
    query_pos = np.array([[-1, 11, 12]], np.int32)
    blocks, counts = block_table(jnp.asarray(pos), jnp.asarray(query_pos), 4, jnp.int32(4))
    np.testing.assert_array_equal(counts, [[2]])
    np.testing.assert_array_equal(blocks, [[[2, 3, 3, 3, 3]]])
    blocks, counts = block_table(jnp.asarray(pos), jnp.asarray(query_pos), 4, jnp.int32(0))
    np.testing.assert_array_equal(counts, [[4]])


def test_the_stacked_layout_reads_its_layer_in_place():
    """k, v [Lg, B, Hkv, S, D] with layer=1 give the plain layer 1's result; without new."""
    q, k, v, _, _ = step_inputs(2, 1, 8, 2, 300, jnp.float32, seed=5)
    rng = np.random.default_rng(9)
    k3, v3 = (jnp.stack([random(rng, x.shape, x.dtype), x, random(rng, x.shape, x.dtype)])
              for x in (k, v))  # fmt: skip
    pos = jnp.asarray(compacted([[5, 120], [250, 17]], 250, 2, 300))
    query_pos = jnp.full((2, 1), 1002, jnp.int32)
    stacked = DECODE(q, k3, v3, pos, query_pos, layer=jnp.int32(1), block_k=128)
    plain = DECODE(q, k, v, pos, query_pos, block_k=128)
    ref, _ = DENSE(q, k, v, pos, query_pos)
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(plain))
    np.testing.assert_allclose(np.asarray(plain), np.asarray(ref), atol=2e-5)


def test_the_block_table_lists_exactly_the_blocks_with_visible_slots():
    """Blocks of 4 slots, 5 blocks: per (row, kv head) the blocks holding a slot with
    0 <= pos <= the row's latest query position, in order, then the last repeated."""
    e = -1
    pos = np.array([
        [[0, 1, e, e, e, e, e, e, e, e, e, e, 9, e, e, e, e, e, e, e],  # blocks 0, 3
         [e, e, e, e, 2, e, e, e, 5, e, e, e, e, e, e, e, e, e, e, 12]],  # 1, 2, 4
        [[e, e, e, e, e, e, e, e, e, e, e, e, e, e, e, e, e, e, e, e],  # none
         [e, e, e, e, e, e, e, e, e, 40, e, e, e, e, e, 3, e, e, e, e]],  # 3 (40 too late)
    ], np.int32)  # fmt: skip
    query_pos = np.array([[11, 12], [4, 5]], np.int32)
    blocks, counts = block_table(jnp.asarray(pos), jnp.asarray(query_pos), 4)
    np.testing.assert_array_equal(counts, [[2, 3], [0, 1]])
    np.testing.assert_array_equal(
        blocks,
        [[[0, 3, 3, 3, 3], [1, 2, 4, 4, 4]], [[0, 0, 0, 0, 0], [3, 3, 3, 3, 3]]],
    )


def test_blocks_must_be_lane_multiples():
    q, k, v, _, _ = step_inputs(1, 1, 2, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="block_k must be a positive multiple of 128"):
        decode_attention(q, k, v, jnp.zeros((1, 2, 16), jnp.int32), jnp.ones((1, 1), jnp.int32),
                         block_k=100)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Compiled for a TPU, without one


@pytest.fixture(scope="module")
def tpu_devices():
    """v5e devices from libtpu's deviceless topology."""
    # libtpu takes a machine-wide lock file by default; deviceless compiling shares no chip.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies

        return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    except Exception as error:  # no libtpu, or a jax without deviceless TPU topologies
        pytest.skip(f"no deviceless TPU compilation here (pip install 'jax[tpu]'): {error}")


def test_the_kernel_compiles_for_tpu_without_one(tpu_devices):
    """The stacked layout with the step's entries, bf16, G = 3 and 8, T = 1 and 3, head
    dims 64 (read slots-minor and row-major) and 128, S no block multiple: one Mosaic kernel
    each; and each on an int8 cache (int8 values, bf16 scales)."""
    where = jax.sharding.SingleDeviceSharding(tpu_devices[0])

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=where)

    def step(q, k, v, pos, qpos, new, new_slot, layer, minor):
        return decode_attention(q, k, v, pos, qpos, new=new, new_slot=new_slot, layer=layer,
                                slots_minor=minor)  # fmt: skip

    def sliding(q, k, v, pos, qpos, new, new_slot, layer, minor, window):
        return decode_attention(q, k, v, pos, qpos, new=new, new_slot=new_slot, layer=layer,
                                slots_minor=minor, window=window,
                                scores_spec=ScoreSpec(scale=0.0625, softcap=50.0))  # fmt: skip

    cases = ((24, 8, 1, 64, True), (24, 8, 1, 64, False), (8, 1, 3, 128, False))
    for hq, hkv, t, d, minor in cases:
        b, s, lg = 2, 1000, 3
        new = (spec((b, hkv, t, d)), spec((b, hkv, t, d)), spec((b, hkv, t), jnp.int32))
        args = (spec((b, t, hq, d)), spec((lg, b, hkv, s, d)), spec((lg, b, hkv, s, d)),
                spec((b, hkv, s), jnp.int32), spec((b, t), jnp.int32), new,
                spec((), jnp.int32), spec((), jnp.int32))  # fmt: skip
        hlo = jax.jit(step, static_argnums=8).lower(*args, minor).compile().as_text()
        assert hlo.count('custom_call_target="tpu_custom_call"') == 1, (hq, hkv, t, d, minor)
        int8 = Int8Entries(spec((lg, b, hkv, s, d), jnp.int8), spec((lg, b, hkv, s, 1)))
        int8_args = (args[0], int8, int8, *args[3:])
        hlo = jax.jit(step, static_argnums=8).lower(*int8_args, minor).compile().as_text()
        assert hlo.count('custom_call_target="tpu_custom_call"') == 1, ("int8", hq, d, minor)
        # a traced window (scalar-prefetched), a soft cap and a logit scale
        window = spec((), jnp.int32)
        hlo = jax.jit(sliding, static_argnums=8).lower(*args, minor, window).compile().as_text()
        assert hlo.count('custom_call_target="tpu_custom_call"') == 1, ("window", hq, d, minor)


def compiled_decode_loop(devices, head_dim, dtype, kv_quant="none", batch=2, slots=512):
    """The compiled HLO text of a tiny Llama's decode loop (head `head_dim`, `dtype`, its
    cache stored as `kv_quant`) on a 1 x 2 v5e mesh under attention "auto", and its config."""
    from tiny_model import jax_config

    import dge_jax
    from dge_jax.runtime import decoding, platform
    from dge_jax.runtime.platform import Backend
    from models.llama_like import init_params

    cfg = jax_config(head_dim=head_dim)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), dtype))
    cache = dge_jax.runtime.cache.init_cache(
        cfg.num_layers, batch, cfg.num_kv_heads, slots, cfg.head_dim, dtype=dtype,
        kv_quant=kv_quant,
    )  # fmt: skip
    state = decoding.start_state(cache, jnp.ones((batch,), jnp.int32), jnp.full((batch,), 8), 4,
                                 (), jax.random.PRNGKey(0))  # fmt: skip
    mesh = dge_jax.distribution.sharding.make_mesh(1, 2, devices=devices[:2])
    where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    on = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), tree
    )
    family = dge_jax.families.get_family("llama")
    with jax.set_mesh(mesh):
        assert platform.current() == Backend.of("tpu")
        hlo = decoding.decode_loop.lower(
            family.forward, cfg, on(params), on(state),
            decoding.StepSpec(dge_jax.text.sampling.Greedy(), ()),
        ).compile().as_text()  # fmt: skip
    return hlo, cfg


def test_decode_loop_for_tpu_runs_the_kernel_on_the_cache_in_place(tpu_devices):
    """A head-128 bf16 tiny Llama (the layout of an 8B model's cache) decoding on a 1 x 2
    v5e mesh under attention "auto": the compiled loop holds the Mosaic decode kernel and no
    copy of a cache-sized buffer (the kernel reads the stacked cache at layer i in place,
    row-major; tests/test_platform.py's head-16 loop checks the slots-minor reads)."""
    batch, slots = 2, 512
    hlo, cfg = compiled_decode_loop(tpu_devices, 128, jnp.bfloat16, batch=batch, slots=slots)
    assert hlo.count('custom_call_target="tpu_custom_call"') >= 1
    buffer = rf"bf16\[(?:\d+,)?{batch},\d+,{slots},{cfg.head_dim}\]"
    assert re.findall(rf"{buffer}\S* copy\(", hlo) == []


@pytest.mark.parametrize("head_dim,dtype", [(128, jnp.bfloat16), (16, jnp.float32)])
def test_decode_loop_for_tpu_reads_an_int8_cache_in_place(tpu_devices, head_dim, dtype):
    """The same loop over an int8 cache, head 128 in bf16 (read row-major) and head 16 in
    f32 (slots-minor): the Mosaic kernel runs, and no copy inside the loop is larger than
    one layer's scales [B, Hkv / device, 1, S], the one pass `flash_tiles._kv_operands`
    makes per call (a reshape of the stacked scales copied every layer's per call here)."""
    batch, slots = 2, 512
    hlo, cfg = compiled_decode_loop(tpu_devices, head_dim, dtype, "int8", batch, slots)
    assert hlo.count('custom_call_target="tpu_custom_call"') >= 1
    one_layer_scales = batch * (cfg.num_kv_heads // 2) * slots
    body_copies = re.findall(r"= \w+\[([\d,]*)\]\S* copy\(.*while/body", hlo)
    sizes = [int(np.prod([int(n) for n in shape.split(",") if n])) for shape in body_copies]
    assert sizes and max(sizes) <= one_layer_scales, sizes
