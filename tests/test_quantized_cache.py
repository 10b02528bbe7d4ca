"""The int8 KV cache's pieces: the scheme against a NumPy reference, and every cache operation
moving each entry's scale with it (`dge_jax.runtime.quantized`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kv_quant_checks import assert_pallas_is_xla

from dge_jax.kernels.attention import AttentionSpec, LayerCache, NewEntries, ScoreSpec
from dge_jax.kernels.layer_attention import cache_layer_attention, kernel_backend
from dge_jax.runtime import platform
from dge_jax.runtime.cache import KVCache, LayerGroup, init_cache, regroup
from dge_jax.runtime.cache_layout import cache_specs
from dge_jax.runtime.compaction import compact
from dge_jax.runtime.extend import with_room
from dge_jax.runtime.quantized import (
    Int8Entries,
    check_kv_quant,
    dequantize,
    quantize_int8,
    read_back,
    store_like,
)
from dge_jax.runtime.window_cache import make_room


def reference_int8(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """The scheme in NumPy: scale = max |x| * (1 / 127) per token (rounded to the activation dtype),
    q = round-half-even(x / scale) clipped to [-127, 127]; an all-zero token gets 0 and 0."""
    x = x.astype(np.float32)
    scale = (np.abs(x).max(axis=-1, keepdims=True) * np.float32(1 / 127)).astype(dtype)
    safe = np.where(scale == 0, 1, scale).astype(np.float32)
    q = np.clip(np.round(x / safe), -127, 127).astype(np.int8)
    return q, scale


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_int8_matches_the_numpy_reference_and_its_bound(dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 3, 17, 8)) * rng.uniform(0.01, 30, (2, 3, 17, 1))).astype(dtype)
    x[0, 0, 4] = 0  # an all-zero token
    got = quantize_int8(jnp.asarray(x))
    q, scale = reference_int8(x, dtype)
    np.testing.assert_array_equal(np.asarray(got.q), q)
    np.testing.assert_array_equal(np.asarray(got.scale), scale)
    assert got.q.dtype == jnp.int8 and got.scale.dtype == x.dtype and got.shape == x.shape
    back = np.asarray(dequantize(got), np.float32)
    # |x - x'| <= scale / 2, plus the rounding of q * scale to the activation dtype.
    eps = np.finfo(dtype).eps
    bound = scale.astype(np.float32) / 2 + np.abs(x.astype(np.float32)) * eps + 1e-30
    assert np.all(np.abs(back - x.astype(np.float32)) <= bound)
    np.testing.assert_array_equal(back[0, 0, 4], 0)
    # the largest entry of each token maps to +-127 (the scale is used in full)
    assert np.all(np.abs(q[..., :]).max(axis=-1)[scale[..., 0] > 0] >= 126)


def test_round_trip_and_check():
    x = jnp.linspace(-3, 3, 40, dtype=jnp.float32).reshape(1, 1, 5, 8)
    stored = init_cache(1, 1, 1, 5, 8, jnp.float32, kv_quant="int8").groups[0].k
    np.testing.assert_array_equal(read_back(store_like(stored, x), x),
                                  dequantize(quantize_int8(x)))  # fmt: skip
    plain = jnp.zeros((1, 1, 5, 8))
    np.testing.assert_array_equal(read_back(store_like(plain, x), x), x)
    with pytest.raises(ValueError, match="kv_quant must be 'none', 'int8' or 'int4"):
        check_kv_quant("fp8")
    with pytest.raises(ValueError, match="kv_quant must be 'none', 'int8' or 'int4"):
        init_cache(1, 1, 1, 4, 8, kv_quant="int3")


def int8_cache(seed=0, layers=3, b=2, h=2, s=12, d=8, dtype=jnp.float32):
    """A filled int8 cache (positions 0 .. s-1, a few slots empty) and its plain twin holding
    exactly the values the int8 one reads."""
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((layers, b, h, s, d)), dtype)
    v = jnp.asarray(rng.standard_normal((layers, b, h, s, d)), dtype)
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (layers, b, h, s)).copy()
    pos[:, 0, :, :3] = -1  # left padding of row 0
    qk, qv = quantize_int8(k), quantize_int8(v)
    quant = KVCache((LayerGroup(qk, qv, jnp.asarray(pos), jnp.full((layers,), s, jnp.int32)),))
    plain = KVCache.stacked(dequantize(qk), dequantize(qv), jnp.asarray(pos), s)
    return quant, plain


def assert_same_reads(quant: KVCache, plain: KVCache):
    """The int8 cache reads exactly as the plain one, group by group."""
    assert quant.kv_quant == "int8" and plain.kv_quant == "none"
    assert quant.group_sizes == plain.group_sizes and quant.capacities == plain.capacities
    for gq, gp in zip(quant.groups, plain.groups, strict=True):
        assert isinstance(gq.k, Int8Entries) and gq.k.q.dtype == jnp.int8
        np.testing.assert_array_equal(dequantize(gq.k), gp.k)
        np.testing.assert_array_equal(dequantize(gq.v), gp.v)
        np.testing.assert_array_equal(gq.pos, gp.pos)
        np.testing.assert_array_equal(gq.index, gp.index)


def test_compaction_moves_each_entry_with_its_scale():
    quant, plain = int8_cache()
    rng = np.random.default_rng(1)
    keep = jnp.asarray(rng.random(quant.pos.shape) < 0.4) & (quant.pos >= 0)
    masked_q, masked_p = (c.with_pos(jnp.where(keep, c.pos, -1)) for c in (quant, plain))
    assert_same_reads(compact(masked_q, 8), compact(masked_p, 8))
    # per-layer capacities: one group per run of one capacity
    assert_same_reads(compact(masked_q, (8, 8, 10)), compact(masked_p, (8, 8, 10)))
    np.testing.assert_array_equal(quant.k, plain.k)  # the stacked view reads dequantized
    assert quant.nbytes() < plain.nbytes() / 2


def test_regroup_room_and_sliding_moves_keep_scales():
    quant, plain = int8_cache()
    assert_same_reads(regroup(quant, (1, 1, 1)), regroup(plain, (1, 1, 1)))
    assert_same_reads(regroup(regroup(quant, (1, 2)), (3,)), plain)
    assert_same_reads(with_room(quant, 5), with_room(plain, 5))
    g_q, g_p = quant.groups[0], plain.groups[0]
    moved_q, moved_p = make_room(g_q, 4, 3), make_room(g_p, 4, 3)
    assert_same_reads(KVCache((moved_q,)), KVCache((moved_p,)))


def test_specs_follow_the_int8_structure():
    from dge_jax.config import ModelConfig

    cfg = ModelConfig(family="llama", vocab_size=16, hidden_size=16, intermediate_size=32,
                      num_layers=3, num_heads=2, num_kv_heads=2, head_dim=8)  # fmt: skip
    quant, _ = int8_cache()
    specs = cache_specs(cfg, 2, {"data": 1, "model": 1}, kv_quant="int8")
    assert jax.tree.structure(specs) == jax.tree.structure(quant)


@pytest.mark.parametrize("key_block", [0, 4])
def test_the_layer_writes_int8_and_attends_over_what_it_reads(key_block):
    """A step's entries are stored quantized, and its attention (prefill chunk or decode
    step, own entries included) equals the plain cache's over the round-tripped values."""
    quant, plain = int8_cache(s=16)
    rng = np.random.default_rng(2)
    b, h, t, d, hq = 2, 2, 4 if key_block else 1, 8, 4
    # Slots 12 .. 12 + t are empty, to be written at positions 12 .. 12 + t.
    empty = jnp.arange(16) >= 12
    quant, plain = (c.with_pos(jnp.where(empty, -1, c.pos)) for c in (quant, plain))
    k_new = jnp.asarray(rng.standard_normal((b, h, t, d)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((b, h, t, d)), jnp.float32)
    pos_new = jnp.broadcast_to(jnp.arange(12, 12 + t, dtype=jnp.int32), (b, h, t))
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    spec = AttentionSpec(key_block=key_block, attention="xla")

    def layer(cache):
        g = cache.groups[0]
        return LayerCache(g.k, g.v, g.pos, 1, 12)

    got, _, written = cache_layer_attention(q, pos_new[:, 0], NewEntries(k_new, v_new, pos_new),
                                            layer(quant), spec)  # fmt: skip
    rt = NewEntries(dequantize(quantize_int8(k_new)), dequantize(quantize_int8(v_new)), pos_new)
    want, _, plain_written = cache_layer_attention(q, pos_new[:, 0], rt, layer(plain), spec)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    stored = jax.tree.map(lambda x: x[1, :, :, 12 : 12 + t], written.k)
    want_stored = quantize_int8(k_new)
    np.testing.assert_array_equal(stored.q, want_stored.q)
    np.testing.assert_array_equal(stored.scale, want_stored.scale)
    np.testing.assert_array_equal(dequantize(written.v), plain_written.v)


@pytest.mark.parametrize("key_block,record_attn", [(0, False), (4, False), (4, True)])
def test_pallas_reads_int8_as_xla_does(key_block, record_attn):
    """attention="pallas" on an int8 cache (the kernels in interpret mode, through
    layer_attention's wrappers): a decode step with its own entries, a prefill chunk with
    and without probs sums give "xla"'s output and sums and write the same cache."""
    quant, _ = int8_cache(s=16)
    quant = quant.with_pos(jnp.where(jnp.arange(16) >= 12, -1, quant.pos))
    rng = np.random.default_rng(3)
    b, h, t, d, hq = 2, 2, 4 if key_block else 1, 8, 4
    k_new, v_new = (jnp.asarray(rng.standard_normal((b, h, t, d)), jnp.float32) for _ in "kv")
    pos_new = jnp.broadcast_to(jnp.arange(12, 12 + t, dtype=jnp.int32), (b, h, t))
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    g = quant.groups[0]
    layer = LayerCache(g.k, g.v, g.pos, 1, 12, jnp.int32(3 if key_block else 0))

    assert_pallas_is_xla(q, NewEntries(k_new, v_new, pos_new), layer, key_block, record_attn)


def test_kernel_backend_keeps_pallas_for_int8_and_refuses_cudnn_soft_caps():
    """Nothing refuses an int8 cache any more; cuDNN still refuses a soft cap by name."""
    pallas = AttentionSpec(attention="pallas")
    assert kernel_backend(platform.current("pallas"), pallas).attention == "pallas"
    capped = AttentionSpec(attention="cudnn", scores=ScoreSpec(softcap=50.0))
    with pytest.raises(ValueError, match="soft-capped logits: use attention='xla'"):
        kernel_backend(platform.Backend.of("gpu", "cudnn"), capped)
    auto = dataclasses.replace(capped, attention="auto")
    assert kernel_backend(platform.Backend.of("gpu", "cudnn"), auto).attention == "xla"


def test_the_pallas_prefill_on_an_int8_cache_compiles_for_tpu_under_a_mesh():
    """cache_layer_attention of a prefill chunk recording probs sums, attention "pallas",
    over an int8 cache on a 1 x 2 v5e mesh (deviceless): `_sharded_flash`'s shard_map takes
    the Int8Entries under k's specs, and both Mosaic kernels (forward, probs sums) compile.
    (Run under a 2 x 2 CPU mesh in interpret mode, it gave "xla"'s outputs, sums and cache:
    the issue's report.)"""
    import os

    import dge_jax

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies

        devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    except Exception as error:  # no libtpu, or a jax without deviceless TPU topologies
        pytest.skip(f"no deviceless TPU compilation here (pip install 'jax[tpu]'): {error}")
    mesh = dge_jax.distribution.sharding.make_mesh(1, 2, devices=devices[:2])
    where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    lg, b, h, s, d, t, hq = 2, 2, 2, 256, 128, 128, 8

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=where)

    int8 = Int8Entries(spec((lg, b, h, s, d), jnp.int8), spec((lg, b, h, s, 1)))
    layer = LayerCache(int8, int8, spec((lg, b, h, s), jnp.int32), spec((), jnp.int32),
                       spec((), jnp.int32), spec((), jnp.int32))  # fmt: skip
    new = NewEntries(spec((b, h, t, d)), spec((b, h, t, d)), spec((b, h, t), jnp.int32))
    chunk = AttentionSpec(key_block=t, record_attn=True, attention="pallas")
    with jax.set_mesh(mesh):
        hlo = jax.jit(cache_layer_attention, static_argnums=4).lower(
            spec((b, t, hq, d)), spec((b, t), jnp.int32), new, layer, chunk
        ).compile().as_text()  # fmt: skip
    assert hlo.count('custom_call_target="tpu_custom_call"') == 2


@pytest.mark.parametrize("name", ["snapkv", "tova", "lagkv", "keydiff", "knorm"])
def test_rules_score_an_int8_cache_as_its_dequantized_twin(name):
    """Rules that scan the layers dequantize one layer at a time (`KVCache.stored_k`): their
    scores equal the ones of a plain cache holding the values the int8 one reads."""
    from dge_jax.rules.registry import make_rule
    from dge_jax.runtime.records import Observation

    quant, plain = int8_cache(s=16)
    rng = np.random.default_rng(4)
    w = 4
    q = jnp.asarray(rng.standard_normal((3, 2, 4, w, 8)), jnp.float32)
    q_pos = jnp.broadcast_to(jnp.arange(12, 16, dtype=jnp.int32), (2, w))
    obs = Observation(q=q, q_pos=q_pos, attn_sum=None, is_draft=jnp.zeros(w, bool),
                      prompt_end=jnp.full((2,), 15, jnp.int32))  # fmt: skip
    options = {"lagkv": dict(lag_size=4, sinks=2)}.get(name, {})
    rule = make_rule(name, **options)
    np.testing.assert_array_equal(rule.score(quant, obs), rule.score(plain, obs))
