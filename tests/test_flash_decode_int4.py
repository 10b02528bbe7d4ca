"""`kernels.flash_decode_int4`: decode attention that unpacks an int4 cache's stored bytes in
VMEM (Pallas interpret mode on CPU) equals the XLA path's attention over the dequantized layer,
and compiles through Mosaic for a v5e without one.

The layers use KIVI's defaults (groups of 32, residual blocks of 128) at head dims 128 (two
slots a stored row) and 256 (one), with the residual block in the middle of the whole blocks
or as the tail, evicted holes, left padding, sliding windows and draft steps of 3 queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kv_quant_checks import assert_pallas_is_xla

from dge_jax.kernels import int4_tiles, layer_attention
from dge_jax.kernels.attention import (
    AttentionSpec,
    LayerCache,
    NewEntries,
    ScoreSpec,
    cached_attention,
)
from dge_jax.kernels.flash_decode_int4 import int4_decode_attention
from dge_jax.kernels.int4_tiles import supports
from dge_jax.runtime.quantized import KVQuant, quantize_int4_entries

QUANT = KVQuant("int4", 32, 128)


def int4_layer(seed: int, s: int, n: int, d: int, dtype=jnp.float32, window=None):
    """Layer 1 of a 3-layer int4 cache [3, 2, 2, s, d] that wrote slots [0, n): row 0 left
    padded by 5, two evicted slots and a whole evicted block of 32 (position -1)."""
    rng = np.random.default_rng(seed)
    shape = (3, 2, 2, s, d)
    k, v = (jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.2, 4, (3, 2, 2, 1, d)), dtype)
            for _ in "kv")  # fmt: skip
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (3, 2, 2, s)).copy()
    pos[..., n:] = -1
    pos[:, 0, :, :5] = -1
    pos[:, 1, 0, [7, 40]] = -1
    pos[:, 1, 1, 64:96] = -1
    index = jnp.full((3, 1, 1), n, jnp.int32)
    ek = quantize_int4_entries(k, index, QUANT, True)
    ev = quantize_int4_entries(v, index, QUANT, False)
    return LayerCache(ek, ev, jnp.asarray(pos), 1, n, window), rng


CASES = [  # (s, n, d, t, window)
    (300, 200, 128, 1, None),  # residual block [128, 256) inside the whole blocks, a tail of 44
    (300, 290, 128, 1, None),  # the residual is the tail [256, 300)
    (512, 512, 128, 3, None),  # every block whole, full; a draft step of 3 queries
    (640, 400, 256, 1, None),  # head dim 256: one slot a stored row
    (300, 200, 128, 1, 50),  # a sliding window
]


@pytest.mark.parametrize("s,n,d,t,window", CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_the_kernel_reads_what_the_xla_path_reads(s, n, d, t, window, in_place, monkeypatch):
    """in_place: the stacked bytes read at the layer index (a large stack), else the layer
    sliced out first (a small one: `int4_tiles.SLICED_BELOW`)."""
    monkeypatch.setattr(int4_tiles, "SLICED_BELOW", 0 if in_place else 2**62)
    layer, rng = int4_layer(s + n + d, s, n, d, window=None if window is None else
                            jnp.int32(window))  # fmt: skip
    assert supports(layer.k) and supports(layer.v)
    q = jnp.asarray(rng.standard_normal((2, t, 4, d)), jnp.float32)
    query_pos = jnp.asarray(np.arange(n - t, n), jnp.int32)[None].repeat(2, axis=0)
    scores = ScoreSpec(scale=0.7 / np.sqrt(d))
    got = jax.jit(int4_decode_attention, static_argnums=3)(q, query_pos, layer, scores)
    want, _ = cached_attention(q, query_pos, layer, AttentionSpec(attention="xla", scores=scores))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)  # summation order


@pytest.mark.parametrize("n,t", [(200, 1), (255, 1), (254, 3)])
def test_a_decode_step_through_the_layer_attention(n, t):
    """`cache_layer_attention`'s decode step, attention "pallas", on an int4 layer the kernel
    reads: the step's entries written first (a residual block completed at slot 255, and
    by a draft of 3 from 254), then read, as "xla" reads them, and the same cache written."""
    layer, rng = int4_layer(n, 300, n, 128)
    k_new, v_new = (jnp.asarray(rng.standard_normal((2, 2, t, 128)), jnp.float32) for _ in "kv")
    pos_new = jnp.broadcast_to(jnp.arange(n, n + t, dtype=jnp.int32), (2, 2, t))
    q = jnp.asarray(rng.standard_normal((2, t, 4, 128)), jnp.float32)
    assert_pallas_is_xla(q, NewEntries(k_new, v_new, pos_new), layer, 0, False)


def test_a_soft_capped_bf16_layer():
    """bf16 entries and scales (the dtype they are stored in on TPU) and Gemma 2's soft cap."""
    layer, rng = int4_layer(3, 300, 230, 128, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 128)), jnp.bfloat16)
    query_pos = jnp.full((2, 1), 229, jnp.int32)
    scores = ScoreSpec(softcap=5.0)
    got = int4_decode_attention(q, query_pos, layer, scores)
    want, _ = cached_attention(q, query_pos, layer, AttentionSpec(attention="xla", scores=scores))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)  # fmt: skip


def test_which_layouts_the_kernel_reads():
    """Head dims 128 and 256 store 128-lane rows and one key group a scale row: the kernel;
    64 and 32 merge key groups into a scale row, and an odd capacity stores one slot a row
    (64 lanes at head dim 128): `int4_pieces` instead."""
    for d, s, reads in ((128, 256, True), (256, 256, True), (64, 256, False), (32, 256, False),
                        (128, 255, False)):  # fmt: skip
        layer, _ = int4_layer(0, s, 200, d)
        assert (supports(layer.k) and supports(layer.v)) == reads, (d, s)
        assert layer_attention._int4_kernel_reads(layer) == reads


@pytest.mark.parametrize("s,d", [(1024, 128), (300, 128), (640, 256)])
def test_it_compiles_for_a_v5e(s, d):
    """Mosaic lowers the kernel (the nibbles, the lane matrices, the rolls) for a v5e chip at
    bf16: key blocks of whole tiles whatever the capacity (300 slots: one block of 512), head
    dims 128 and 256 (libtpu needed: the tpu-aot extra)."""
    device = _v5e_devices()[0]
    layer, _ = int4_layer(0, s, s * 2 // 3, d, jnp.bfloat16)
    on = jax.sharding.SingleDeviceSharding(device)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on),
                            (layer.k, layer.v, layer.pos))  # fmt: skip
    q = jax.ShapeDtypeStruct((2, 1, 4, d), jnp.bfloat16, sharding=on)
    qpos = jax.ShapeDtypeStruct((2, 1), jnp.int32, sharding=on)

    def step(q, qpos, k, v, pos):
        return int4_decode_attention(q, qpos, LayerCache(k, v, pos, 1, 0, None), ScoreSpec())

    compiled = jax.jit(step).lower(q, qpos, *abstract).compile()
    assert "tpu_custom_call" in compiled.as_text()


def test_it_compiles_for_a_v5e_under_a_mesh():
    """The decode step of an int4 layer on a 1 x 2 v5e mesh (deviceless): the shard_map takes
    the int4 entries' leaves (their start [Lg, B, Hkv] split as the rows and heads) and the
    Mosaic kernel compiles once per device program."""
    import dge_jax

    devices = _v5e_devices()
    mesh = dge_jax.distribution.sharding.make_mesh(1, 2, devices=devices[:2])
    where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    layer, _ = int4_layer(0, 1024, 700, 128, jnp.bfloat16)
    layer = LayerCache(layer.k, layer.v, layer.pos, jnp.int32(1), jnp.int32(700), jnp.int32(0))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                            layer)  # fmt: skip
    new = NewEntries(*(jax.ShapeDtypeStruct(shape, dtype, sharding=where)
                       for shape, dtype in (((2, 2, 1, 128), jnp.bfloat16),
                                            ((2, 2, 1, 128), jnp.bfloat16),
                                            ((2, 2, 1), jnp.int32))))  # fmt: skip
    q = jax.ShapeDtypeStruct((2, 1, 4, 128), jnp.bfloat16, sharding=where)
    qpos = jax.ShapeDtypeStruct((2, 1), jnp.int32, sharding=where)
    with jax.set_mesh(mesh):
        hlo = jax.jit(layer_attention.cache_layer_attention, static_argnums=4).lower(
            q, qpos, new, abstract, AttentionSpec(attention="pallas")).compile().as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') == 1


def _v5e_devices():
    """The abstract devices of a v5e:2x4 slice; without libtpu a skip (CI installs it, and
    there the error is raised)."""
    import os

    from benchmarks.cost import tpu_aot

    try:
        return tpu_aot.topology_devices("v5e:2x4")
    except Exception as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"{type(e).__name__}: {str(e)[:200]}")


def test_generation_with_the_kernel_gives_the_xla_tokens(monkeypatch):
    """A tiny Llama with head dim 128 (GQA 4/2, 2 layers) on KIVI's int4 cache, 300-token
    prompts (two whole blocks, a 44-slot tail) and 12 new tokens, FullKV, DGE(3)-SnapKV and
    H2O at prefill at budget 96: attention "pallas" (prefill by `flash_int4`, H2O's prob sums
    by `flash_int4_sums`, decode and draft by this kernel, in interpret mode) decodes the
    tokens "xla" decodes."""
    from tiny_model import jax_config, jax_model

    from dge_jax import H2O, Eviction, SnapKV, Timing, generate_grid
    from dge_jax.kernels import flash_decode_int4, flash_int4

    traced = []
    for module, name in ((flash_decode_int4, "int4_decode_attention"),
                         (flash_int4, "int4_flash_attention"),
                         (flash_int4, "bytes_probs_sums")):  # fmt: skip
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, kernel=kernel, name=name, **kw: (
            traced.append(name) or kernel(*a, **kw)))  # fmt: skip
    model = jax_model(jax_config(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128))
    prompts = [np.random.default_rng(n).integers(0, 128, 300).tolist() for n in (1, 2)]
    cells = [None, Eviction(SnapKV(window=8), 96, Timing("dge", 3)),
             Eviction(H2O(window=8), 96, Timing("prefill"))]
    runs = {attention: generate_grid(model, prompts, cells, max_new_tokens=12, kv_quant="int4",
                                     attention=attention)
            for attention in ("pallas", "xla")}  # fmt: skip
    assert set(traced) == {"int4_decode_attention", "int4_flash_attention", "bytes_probs_sums"}
    for got, want in zip(runs["pallas"], runs["xla"], strict=True):
        assert got.tokens == want.tokens
